"""Continuous Task Batching (CTB): task-level admission, pausing and resumption on rollout ranks.

ONE policy: the simulator, the benchmarks and the real system all build this `CTBScheduler`;
the paper's rules are its core, and the refinements real runs need are `CTBConfig` options.

Paper rules ("Continuous Task Batching") and how they map to this file:

- Token-aware admission. Every rollout DP rank is a KV token budget pool. A task is admitted
  only if the rank's remaining headroom holds its footprint. The footprint of a not-yet-started
  task is *probed*: the first task submitted for a GRPO group is its probe; until the probe's
  first turn has been measured, no other task of that group is admitted (the group's tasks
  share the prompt, so the probe's first-turn usage estimates all of them). Once running, a
  task's footprint is its actual context, updated at every turn.
- Admission constraints: environment concurrency (tasks holding an environment, running or
  paused, never exceed the env fleet's capacity); staleness throttling (outstanding training
  trajectories, i.e. the unfinished tasks of every started group + finished-but-unconsumed
  ones, stay within what the trainer consumes inside the staleness bound,
  (max_staleness + 1) * B_ideal, so dispatched work does not go stale before it is trained on;
  the throttle gates the *start* of a group and books all G of its tasks at once, because
  throttling inside a group would leave partial groups that can never be trained); task
  diversity (a rank that already holds many tasks of the same type from *other* groups is
  penalised, spreading environment-side stragglers; members of one group are not penalised,
  they share a prefix).
- Semantic-aware pausing. P(t) = w1*I_eval + w2*G_completion + w3*I_active + w4*L_context,
  L_context normalised to [0, 1]. When a rank's resident footprint exceeds its budget
  (contexts grow every turn) the lowest-priority tasks are paused until it fits again. The
  default weights make the sum behave like the paper's hierarchy: eval > group completion >
  execution state > context length.
- Resumption. Paused tasks are resumed, highest priority first, *before* any new admission.
  Group-ID affinity: a resumed task goes to the rank that holds most of its group's prefixes
  when it has room. Weight syncs flush every cache, so affinity is reset to current residency.
- Role changes. A rank leaving rollout hands its resident tasks back (`Requeue`); they become
  paused (rank-less) and are resumed elsewhere with a fresh prefill under the new weights.

Options real runs need (`CTBConfig`; `PAPER_RULES` turns them all off):

- Hysteresis: pausing starts above the budget (the high-water mark) and stops at it, but a rank
  admits or resumes only while it stays at or below `low_water` x budget, so a pause is not
  undone a moment later by a resume.
- Pause bounds: a task paused `max_pauses_per_task` times, or on its last `protect_final_turns`
  turns, is not paused again unless the rank is above `hard_water` x budget.
- Own-rank resumption: a paused task resumes first on the rank it ran on (its own context may
  still be cached there, not only its group's prompt); for `move_after_s` it waits for that
  rank, which meanwhile admits nothing new (resume-before-admit per rank); other ranks keep
  admitting. A task that may resume anywhere blocks admission on every rank.
- Resources beyond tokens: a rank holds at most `max_resident` tasks (resident + releasing);
  the real system derives it from the engine's request rows so that a free row always remains
  for a resident task's next turn (see `tide_megatron/rollout/ctb_config.py`).
- Confirmed release (`CTBScheduler(confirm_release=True)`, the real system): a paused task's
  tokens and row stay booked on its rank until the carrier reports `on_released`, because its
  session closes only after an in-flight turn ends; admitting into them earlier could take the
  last free row while that turn still waits for one (a deadlock). The simulator frees at once.

Why no configuration can make resident tasks wait on each other forever: a resident task's next
turn needs (a) a free request row, which the `max_resident` cap keeps (every booked task counts
until its release is confirmed), and (b) KV for its context, which pausing keeps below
`hard_water` x budget (below the engine's pool, checked at start) while more than one task is
resident; a task too large for every rank runs alone on an idle rank. Paused tasks resume
before new work is admitted, started groups are never throttled, and every wait ends when a
resident task finishes or is paused.

Failures and cancellation: a task whose runner failed is FAILED until the caller re-queues it
(`requeue`: it starts from scratch) or cancels its group (`cancel_group`: every unfinished
task is CANCELLED, running ones with a `Cancel` decision). At every moment each submitted task
is QUEUED, RUNNING, PAUSED, FAILED, FINISHED or CANCELLED: none is lost.
The policy is event-driven and clock-passing: callers report usage and finishes, then call
`schedule(now, ...)`, which returns plain decision objects for the runner (or simulator) to
carry out.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional

from tide_megatron.core.ctb_deadline import GroupLatency, TrainerClock
from tide_megatron.core.trajectory import is_fresh
from tide_megatron.core.ctb_types import (  # noqa: F401  (re-exported: the policy's public types)
    PAPER_RULES,
    TERMINAL,
    Admit,
    Cancel,
    CTBConfig,
    Decision,
    GroupCancelled,
    Pause,
    RankPool,
    Requeue,
    Resume,
    RolloutTask,
    TaskState,
    TaskStatus,
)


@dataclass
class _Group:
    group_id: Hashable
    task_type: str
    is_eval: bool
    probe: Hashable
    total: int = 0
    finished: int = 0
    probe_footprint: Optional[int] = None
    started: bool = False
    """Some task of the group has been admitted: the whole group is committed work."""
    cancelled: bool = False
    started_at: Optional[float] = None
    version: Optional[int] = None
    """Training groups started with a clock: the policy version at the start (its deadline)."""
    prefix_ranks: Counter = field(default_factory=Counter)
    queued: "OrderedDict[Hashable, None]" = field(default_factory=OrderedDict)
    members: list = field(default_factory=list)
    """Task ids of the group in submission order (what `forget` drops)."""

    @property
    def completion(self) -> float:
        return self.finished / self.total if self.total else 0.0


class CTBScheduler:
    """The CTB policy for all rollout ranks. Single-threaded; deterministic given its inputs."""

    def __init__(self, config: CTBConfig, ranks: Iterable[int] = (), *, confirm_release: bool = False):
        self.config = config
        self.confirm_release = confirm_release
        """True: Pause keeps the task's tokens and row booked until `on_released` (see module doc)."""
        self._tasks: dict[Hashable, TaskStatus] = {}
        self._groups: "OrderedDict[Hashable, _Group]" = OrderedDict()
        self._ranks: dict[int, RankPool] = {}
        self._used: dict[int, int] = {}
        """Tokens of each rank's residents (what pausing reduces)."""
        self._releasing_tokens: dict[int, int] = {}
        self._seq = 0
        # Paused tasks in pause order, and the counts the admission constraints read, kept
        # incrementally so a schedule() call costs O(decisions x ranks), not O(all tasks).
        self._paused: "OrderedDict[Hashable, None]" = OrderedDict()
        self._holding_env = 0
        self._committed_train = 0  # unfinished tasks of started training groups, queued ones included
        self._state_counts: Counter = Counter()  # tasks per state: the rollout loop reads them every pass
        self._now = 0.0
        """Time of the latest `schedule` call (the default time of events reported without one)."""
        self.latency = GroupLatency(config.latency_window, config.latency_quantile)
        """Completion latency of recent training groups (deadline admission)."""
        for r in ranks:
            self.add_rank(r)

    # ------------------------------------------------------------------ ranks
    def add_rank(self, rank: int, budget: Optional[int] = None, max_resident: Optional[int] = None) -> None:
        """A rank joins rollout with a token budget and a task cap (config defaults when None)."""
        if rank in self._ranks:
            raise ValueError(f"rank {rank} already in rollout")
        cap = max_resident if max_resident is not None else self.config.max_resident_per_rank
        if cap is not None and cap < 1:
            raise ValueError(f"rank {rank}: max_resident must be >= 1, got {cap}")
        self._ranks[rank] = RankPool(rank, budget or self.config.rank_token_budget, cap)
        self._used[rank] = 0
        self._releasing_tokens[rank] = 0

    def resize_rank(self, rank: int, budget: int, max_resident: Optional[int]) -> None:
        """New limits for a rollout rank (its engine reported what it really allocated). Tasks
        it holds stay; admission and pausing use the new limits from the next decision on."""
        if budget < 1 or (max_resident is not None and max_resident < 1):
            raise ValueError(f"rank {rank}: need budget >= 1 and max_resident >= 1, got {budget}, {max_resident}")
        pool = self._ranks[rank]
        pool.budget, pool.max_resident = budget, max_resident

    def set_accepting(self, rank: int, accepting: bool) -> None:
        """Quarantine (False) or re-open (True) a rank; residents are left alone."""
        self._ranks[rank].accepting = accepting

    def remove_rank(self, rank: int) -> list[Requeue]:
        """The rank leaves rollout (ERS role change or failure): hand back every resident task.

        Its engine and caches are gone, so what it was releasing is released, and paused tasks
        that waited for it may resume anywhere."""
        pool = self._ranks.pop(rank)
        del self._used[rank], self._releasing_tokens[rank]
        for tid in pool.releasing:
            self._tasks[tid].releasing_on.discard(rank)
        out = []
        for tid in sorted(pool.residents, key=lambda t: self._tasks[t].seq):
            st = self._tasks[tid]
            st.rank = None
            self._to_paused(st, None, 0.0)
            out.append(Requeue(st.task, rank))
        for tid in self._paused:
            if self._tasks[tid].paused_on == rank:
                self._tasks[tid].paused_on = None
        for g in self._groups.values():
            g.prefix_ranks.pop(rank, None)
        return out

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def rank_usage(self, rank: int) -> tuple[int, int]:
        """(tokens of its resident tasks, token budget) of a rollout rank."""
        return self._used[rank], self._ranks[rank].budget

    def rank_releasing(self, rank: int) -> tuple[int, int]:
        """(tokens, tasks) a rank still holds for paused or cancelled tasks until their release is
        confirmed; admission counts them on top of `rank_usage`."""
        pool = self._ranks[rank]
        return self._releasing_tokens[rank], len(pool.releasing)

    def rank_tasks(self, rank: int) -> tuple[int, Optional[int]]:
        """(tasks held: residents + releasing, cap) of a rollout rank."""
        pool = self._ranks[rank]
        return pool.held, pool.max_resident

    # ------------------------------------------------------------------ task events
    def submit(self, tasks: Iterable[RolloutTask]) -> None:
        """Queue tasks; the first task seen of each group becomes the group's probe."""
        for task in tasks:
            if task.task_id in self._tasks:
                raise ValueError(f"task {task.task_id!r} submitted twice")
            group = self._groups.get(task.group_id)
            if group is None:
                group = self._groups[task.group_id] = _Group(task.group_id, task.task_type, task.is_eval, task.task_id)
            elif group.cancelled:
                raise ValueError(f"group {task.group_id!r} was cancelled; submit its retry as a new group")
            group.total += 1
            group.members.append(task.task_id)
            group.queued[task.task_id] = None
            self._committed_train += group.started and not group.is_eval
            self._seq += 1
            self._tasks[task.task_id] = TaskStatus(task, seq=self._seq)
            self._state_counts[TaskState.QUEUED] += 1

    def on_turn_started(self, task_id: Hashable, context_tokens: int) -> None:
        """A turn begins generating with `context_tokens` in context (actual usage)."""
        st = self._running(task_id)
        st.active = True
        self._set_usage(st, context_tokens)

    def on_turn_finished(self, task_id: Hashable, context_tokens: int) -> None:
        """A turn's generation ended; the task now waits for its environment."""
        st = self._running(task_id)
        st.active = False
        st.turns_done += 1
        st.needs_prefill = False
        self._set_usage(st, context_tokens)
        group = self._groups[st.task.group_id]
        if group.probe == task_id and group.probe_footprint is None:
            group.probe_footprint = context_tokens

    def on_task_finished(self, task_id: Hashable, context_tokens: Optional[int] = None,
                         now: Optional[float] = None) -> None:
        """The task's trajectory is done (at `now`, default: the last `schedule` time); whatever
        it held on any rank is free. A training group's last finish measures its latency."""
        st = self._tasks[task_id]
        if st.state not in (TaskState.RUNNING, TaskState.PAUSED):
            raise ValueError(f"task {task_id!r} is {st.state.name}: only a running or paused task can finish")
        group = self._groups[st.task.group_id]
        if group.probe == task_id and group.probe_footprint is None:
            # A probe that finished within its first turn still measured that turn.
            group.probe_footprint = context_tokens if context_tokens is not None else st.footprint
        self._release_everything(st)
        self._committed_train -= not group.is_eval
        self._set_state(st, TaskState.FINISHED)
        st.active = False
        group.finished += 1
        if group.finished == group.total and not group.is_eval and group.started_at is not None:
            self.latency.record(max(0.0, (self._now if now is None else now) - group.started_at))

    def on_task_failed(self, task_id: Hashable) -> None:
        """The task's runner raised (env or engine error) and closed its session: it holds
        nothing any more and waits, FAILED, for `requeue` or `cancel_group`."""
        st = self._tasks[task_id]
        if st.state not in (TaskState.RUNNING, TaskState.PAUSED):
            raise ValueError(f"task {task_id!r} is {st.state.name}: only a running or paused task can fail")
        self._release_everything(st)
        self._set_state(st, TaskState.FAILED)
        st.active = False

    def requeue(self, task_id: Hashable) -> None:
        """Start a FAILED task, or a PAUSED one whose runner is gone, again from scratch.

        What it held is freed (a PAUSED one keeps only bookings still to be confirmed released);
        it is admitted again like a new member of its group (the probe again if the group's
        footprint was never measured). The group stays committed. Retry limits are the caller's."""
        st = self._tasks[task_id]
        if st.state not in (TaskState.FAILED, TaskState.PAUSED):
            raise ValueError(f"task {task_id!r} is {st.state.name}: only a failed or paused task can be re-queued")
        if st.state is TaskState.PAUSED:
            self._paused.pop(task_id)
            self._holding_env -= 1
        self._set_state(st, TaskState.QUEUED)
        st.active, st.needs_prefill = False, False
        st.context_tokens, st.reserved_tokens, st.turns_done, st.pauses, st.paused_on = None, 0, 0, 0, None
        self._groups[st.task.group_id].queued[task_id] = None

    def cancel_group(self, group_id: Hashable) -> list[Cancel]:
        """Drop every unfinished task of a group (it can no longer be used: a failure past its
        retries, or too late to be consumed within the staleness bound). Its queued and failed
        tasks just leave the queue; running and paused ones get a `Cancel` for the carrier, and
        with confirmed release their bookings stay until `on_released`. Finished tasks stay
        FINISHED (the caller books their tokens as wasted). Returns the Cancels."""
        group = self._groups[group_id]
        if group.cancelled:
            return []
        group.cancelled = True
        out = []
        for tid in group.members:
            st = self._tasks[tid]
            if st.state in TERMINAL:
                continue
            if st.state is TaskState.RUNNING:
                out.append(Cancel(st.task, st.rank))
                self._evict(st, keep_booked=self.confirm_release)
            elif st.state is TaskState.PAUSED:
                out.append(Cancel(st.task, None))
            if st.state in (TaskState.RUNNING, TaskState.PAUSED):
                self._holding_env -= 1
            self._paused.pop(tid, None)
            group.queued.pop(tid, None)
            self._committed_train -= group.started and not group.is_eval
            self._set_state(st, TaskState.CANCELLED)
            st.active, st.paused_on = False, None
        return out

    def on_released(self, rank: int, task_id: Hashable) -> None:
        """The carrier confirms that `rank` holds nothing more of a paused task (session closed).
        Unknown or already released pairs are a no-op (a release may race with a finish)."""
        pool = self._ranks.get(rank)
        st = self._tasks.get(task_id)
        if pool is None or st is None or task_id not in pool.releasing:
            return
        self._releasing_tokens[rank] -= pool.releasing.pop(task_id)
        st.releasing_on.discard(rank)

    def awaits_release(self, group_id: Hashable) -> bool:
        """Some cancelled or paused task of the group still waits for `on_released` (so the
        group cannot be forgotten yet). Unknown ids: False."""
        group = self._groups.get(group_id)
        return group is not None and any(self._tasks[t].releasing_on for t in group.members)

    def forget(self, group_id: Hashable) -> list[Hashable]:
        """Drop a group whose tasks have all finished or been cancelled (and released); returns
        the forgotten task ids.

        Such tasks hold no KV, no environment and no admission counter, so forgetting them
        changes no decision; it keeps a long run's tables (and `schedule`'s scans) bounded. A
        group with a task still queued, running, paused, failed or releasing is refused
        (ValueError): forgetting it would silently lose work. Unknown ids are a no-op.
        """
        group = self._groups.get(group_id)
        if group is None:
            return []
        if any(self._tasks[t].state not in TERMINAL for t in group.members):
            raise ValueError(f"group {group_id!r} has unfinished tasks ({group.finished}/{group.total} finished)")
        if any(self._tasks[t].releasing_on for t in group.members):
            raise ValueError(f"group {group_id!r} has cancelled tasks whose release is not confirmed yet")
        for tid in group.members:
            self._state_counts[self._tasks.pop(tid).state] -= 1
        del self._groups[group_id]
        return list(group.members)

    def on_weight_sync(self) -> None:
        """Caches were flushed: only current residents re-establish group prefixes."""
        for g in self._groups.values():
            g.prefix_ranks = Counter()
        for st in self._tasks.values():
            if st.state is TaskState.RUNNING:
                self._groups[st.task.group_id].prefix_ranks[st.rank] += 1
                st.needs_prefill = True

    # ------------------------------------------------------------------ decisions
    def priority(self, task_id: Hashable) -> float:
        """P(t) = w1*I_eval + w2*G_completion + w3*I_active + w4*L_context."""
        st = self._tasks[task_id]
        c = self.config
        context = min((st.context_tokens or st.reserved_tokens) / c.context_norm_tokens, 1.0)
        return (c.w_eval * st.task.is_eval + c.w_group * self._groups[st.task.group_id].completion
                + c.w_active * st.active + c.w_context * context)

    def schedule(self, now: float, *, unconsumed_trajectories: int = 0,
                 clock: Optional[TrainerClock] = None) -> list[Decision]:
        """Cancel doomed groups, pause over-budget ranks, resume paused tasks, admit new ones.

        `unconsumed_trajectories`: finished training trajectories not yet consumed by the
        trainer (`GlobalBuffer.unconsumed_trajectories()`), for the staleness throttle.
        `clock`: the trainer's version, step time and consumption rate; with it training groups
        get deadlines (`deadline_admission`, `throttle_from_consumption`, `cancel_doomed`).
        `now` dates pauses (`move_after_s`), group starts and deadlines.
        """
        self._now = now
        decisions: list[Decision] = []
        if clock is not None and self.config.cancel_doomed:
            for gid in self.doomed_groups(clock.version):
                decisions.append(GroupCancelled(gid, self._groups[gid].version))
                decisions += self.cancel_group(gid)
        decisions += self._pause_over_budget(now)
        decisions += self._resume_paused(now)
        awaited = self._ranks_awaited_by_paused(now)
        if awaited is not None:
            decisions += self._admit_new(unconsumed_trajectories, awaited, now, clock)
        return decisions

    def deadline(self, group_id: Hashable, clock: TrainerClock, now: float) -> float:
        """End of the last step that may consume a started training group (inf: no deadline)."""
        version = self._groups[group_id].version
        return math.inf if version is None else self._deadline(version, clock, now)

    def _deadline(self, version: int, clock: TrainerClock, now: float) -> float:
        # The step now running cannot end before now, however late its estimate says.
        return max(clock.next_sync_at, now) + (version + self.config.max_staleness - clock.version) * clock.step_time_s

    def doomed_groups(self, version: int) -> list[Hashable]:
        """Started, unfinished training groups that no step can consume any more now that the
        ranks serve `version`: their start version v has v + max_staleness < version. Only the
        exact rule: a late estimate of the step time never cancels work that may still count."""
        bound = self.config.max_staleness
        return [g.group_id for g in self._groups.values()
                if g.version is not None and not g.cancelled and g.finished < g.total
                and not is_fresh(g.version, version, bound)]

    def _deadline_key(self, st: TaskStatus) -> float:
        """Earliest deadline first among equal priorities: the start version orders deadlines."""
        version = self._groups[st.task.group_id].version
        return math.inf if version is None else version

    def _protected(self, st: TaskStatus) -> bool:
        c = self.config
        if c.max_pauses_per_task is not None and st.pauses >= c.max_pauses_per_task:
            return True
        return c.task_max_turns is not None and st.turns_done >= c.task_max_turns - c.protect_final_turns

    def _pause_over_budget(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        hard = self.config.hard_water
        for rank in self.ranks:
            pool = self._ranks[rank]
            if self._used[rank] <= pool.budget:
                continue
            # Lowest priority first; among equals the latest deadline, then the latest submitted.
            victims = sorted(pool.residents, key=lambda t: (self.priority(t), -self._deadline_key(self._tasks[t]),
                                                            -self._tasks[t].seq))
            for tid in victims:
                if self._used[rank] <= pool.budget or len(pool.residents) == 1:
                    break  # pausing a rank's only task frees nothing it could use
                st = self._tasks[tid]
                if self._protected(st) and self._used[rank] <= pool.budget * hard:
                    continue
                prio = self.priority(tid)
                self._evict(st, keep_booked=self.confirm_release)
                self._to_paused(st, rank, now)
                st.pauses += 1
                out.append(Pause(st.task, rank, prio))
        return out

    def _waiting_home(self, st: TaskStatus, now: float) -> Optional[int]:
        """The rank a paused task still waits for (None: it may resume anywhere)."""
        home = st.paused_on
        if home is None or home not in self._ranks or now - st.paused_at >= self.config.move_after_s:
            return None
        return home

    def _ranks_awaited_by_paused(self, now: float) -> Optional[set]:
        """Resume-before-admit: ranks on which nothing new may be admitted (None: every rank)."""
        awaited = set()
        for tid in self._paused:
            home = self._waiting_home(self._tasks[tid], now)
            if home is None:
                return None  # a task that may go anywhere waits for room: nobody is admitted
            awaited.add(home)
        return awaited

    def _resume_paused(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        paused = sorted((self._tasks[t] for t in self._paused),
                        key=lambda st: (-self.priority(st.task.task_id), self._deadline_key(st), st.seq))
        for st in paused:
            need = st.footprint
            rank, affinity = None, False
            if st.paused_on is not None and self._placeable(st.paused_on, need):
                rank, affinity = st.paused_on, True
            elif self._waiting_home(st, now) is None:
                group = self._groups[st.task.group_id]
                for r, _ in sorted(group.prefix_ranks.items(), key=lambda kv: (-kv[1], kv[0])):
                    if self._placeable(r, need):
                        rank, affinity = r, True
                        break
                if rank is None:
                    rank = self._best_rank(st.task, need)
            if rank is None:
                continue
            del self._paused[st.task.task_id]
            self._place(st, rank)
            out.append(Resume(st.task, rank, affinity))
        return out

    def _train_cap(self, now: float, clock: Optional[TrainerClock]) -> Optional[float]:
        """Most outstanding training trajectories (staleness throttle; None: no throttle)."""
        c = self.config
        if not c.staleness_throttle:
            return None
        if clock is not None and c.throttle_from_consumption and clock.consumed_per_s is not None:
            return clock.consumed_per_s * (self._deadline(clock.version, clock, now) - now)
        return (c.max_staleness + 1) * c.trainer_batch_trajectories

    def predicted_in_time(self, now: float, clock: TrainerClock) -> bool:
        """Would a training group started now complete by its deadline (measured latencies)?
        True at cold start (no completed group to predict from)."""
        latency = self.latency.estimate()
        return latency is None or now + latency <= self._deadline(clock.version, clock, now)

    def _admit_new(self, unconsumed_trajectories: int, awaited: set, now: float,
                   clock: Optional[TrainerClock]) -> list[Decision]:
        c = self.config
        holding_env = self._holding_env
        train_cap = self._train_cap(now, clock)
        in_time = clock is None or not c.deadline_admission or self.predicted_in_time(now, clock)
        out: list[Decision] = []
        # Eval groups first (they gate the weight sync), then groups already under way (a group
        # is only trainable once whole) earliest deadline first, then new groups in submission order.
        groups = sorted((g for g in self._groups.values() if g.queued),
                        key=lambda g: (not g.is_eval, not g.started, math.inf if g.version is None else g.version))
        for group in groups:
            if holding_env >= c.env_concurrency:
                break
            if not group.started and not group.is_eval:
                # Both gates commit whole groups: starting one books all G of its trajectories, so
                # groups already under way can always finish (no deadlock on partial groups); with
                # nothing outstanding a group always starts, or the trainer would wait forever.
                outstanding = unconsumed_trajectories + self._committed_train
                if outstanding > 0 and (not in_time or (train_cap is not None and outstanding + group.total > train_cap)):
                    continue
            if group.probe_footprint is None and not (c.probe_only_when_tight and self._fits_unprobed(group, awaited)):
                candidates = [group.probe] if group.probe in group.queued else []
            else:
                candidates = list(group.queued)
            for tid in candidates:
                st = self._tasks[tid]
                if holding_env >= c.env_concurrency:
                    break
                need = self._estimate(st)
                rank = self._best_rank(st.task, need, awaited)
                if rank is None:
                    break  # same estimate for every queued member of the group
                st.reserved_tokens = need
                self._place(st, rank)
                del group.queued[tid]
                if not group.started:
                    group.started, group.started_at = True, now
                    if clock is not None and not group.is_eval:
                        group.version = clock.version
                    self._committed_train += 0 if group.is_eval else group.total - group.finished
                self._holding_env += 1
                holding_env += 1
                out.append(Admit(st.task, rank, need))
        return out

    # ------------------------------------------------------------------ helpers
    def _estimate(self, st: TaskStatus) -> int:
        group = self._groups[st.task.group_id]
        if group.probe_footprint is not None:
            return max(group.probe_footprint, st.task.prompt_tokens)
        return st.task.prompt_tokens + self.config.probe_turn_reserve_tokens

    def _fits_unprobed(self, group: "_Group", awaited: Iterable[int]) -> bool:
        """Some rank holds every queued member of the group at the unmeasured estimate."""
        queued = [self._tasks[t] for t in group.queued]
        if not queued:
            return False
        need = sum(self._estimate(st) for st in queued)
        for rank, pool in self._ranks.items():
            slots = math.inf if pool.max_resident is None else pool.max_resident - pool.held
            if pool.accepting and rank not in awaited and slots >= len(queued) and \
                    self._used[rank] + self._releasing_tokens[rank] + need <= pool.budget * self.config.low_water:
                return True
        return False

    def _placeable(self, rank: int, need: int, awaited: Iterable[int] = ()) -> bool:
        """May a task of `need` tokens be placed on `rank` now?

        Within the rank's task cap, and its booked tokens stay at or below low water; a task
        larger than every rank's low-water budget may run alone on an idle rank instead (it
        would otherwise never run)."""
        pool = self._ranks.get(rank)
        if pool is None or not pool.accepting or rank in awaited:
            return False
        if pool.max_resident is not None and pool.held >= pool.max_resident:
            return False
        low = self.config.low_water
        if self._used[rank] + self._releasing_tokens[rank] + need <= pool.budget * low:
            return True
        return pool.idle and all(need > p.budget * low for p in self._ranks.values())

    def _best_rank(self, task: RolloutTask, need: int, awaited: Iterable[int] = ()) -> Optional[int]:
        """Most headroom (as a budget fraction) minus the diversity penalty; ties -> lowest rank."""
        best, best_score = None, None
        group = self._groups[task.group_id]
        for r in self.ranks:
            if not self._placeable(r, need, awaited):
                continue
            pool = self._ranks[r]
            same_type = pool.type_counts[task.task_type]
            if group.task_type == task.task_type:
                same_type -= pool.group_counts[task.group_id]
            # Group members share a prompt prefix: a small bonus keeps them together.
            score = (pool.free(self._used[r] + self._releasing_tokens[r]) / pool.budget
                     - self.config.diversity_penalty * same_type
                     + (self.config.diversity_penalty if group.prefix_ranks.get(r, 0) else 0.0))
            if best_score is None or score > best_score:
                best, best_score = r, score
        return best

    def _place(self, st: TaskStatus, rank: int) -> None:
        self._set_state(st, TaskState.RUNNING)
        st.rank, st.paused_on = rank, None
        pool = self._ranks[rank]
        pool.residents.add(st.task.task_id)
        pool.type_counts[st.task.task_type] += 1
        pool.group_counts[st.task.group_id] += 1
        self._used[rank] += st.footprint
        self._groups[st.task.group_id].prefix_ranks[rank] += 1

    def _evict(self, st: TaskStatus, keep_booked: bool = False) -> None:
        """The task stops being resident; `keep_booked`: its tokens and row stay booked on the
        rank until the release is confirmed."""
        if st.rank is not None and st.rank in self._ranks:
            pool = self._ranks[st.rank]
            tid = st.task.task_id
            pool.residents.discard(tid)
            pool.type_counts[st.task.task_type] -= 1
            pool.group_counts[st.task.group_id] -= 1
            self._used[st.rank] -= st.footprint
            if keep_booked:
                pool.releasing[tid] = pool.releasing.get(tid, 0) + st.footprint
                self._releasing_tokens[st.rank] += st.footprint
                st.releasing_on.add(st.rank)
        st.rank = None

    def _release_everything(self, st: TaskStatus) -> None:
        """Finished (or failed): the runner closed its session, so nothing stays booked anywhere."""
        if st.state is TaskState.RUNNING:
            self._evict(st)
        for rank in list(st.releasing_on):
            self.on_released(rank, st.task.task_id)
        if st.state in (TaskState.RUNNING, TaskState.PAUSED):
            self._holding_env -= 1
        self._paused.pop(st.task.task_id, None)
        st.paused_on = None

    def _to_paused(self, st: TaskStatus, rank: Optional[int], now: float) -> None:
        self._set_state(st, TaskState.PAUSED)
        st.active, st.needs_prefill = False, True
        st.paused_on, st.paused_at = rank, now
        self._paused[st.task.task_id] = None

    def _set_usage(self, st: TaskStatus, context_tokens: int) -> None:
        if context_tokens < 0:
            raise ValueError("context_tokens must be >= 0")
        self._used[st.rank] += context_tokens - st.footprint
        st.context_tokens = context_tokens

    def _running(self, task_id: Hashable) -> TaskStatus:
        st = self._tasks[task_id]
        if st.state is not TaskState.RUNNING:
            raise ValueError(f"task {task_id!r} is {st.state.name}, not RUNNING")
        return st

    # ------------------------------------------------------------------ views
    def status(self, task_id: Hashable) -> TaskStatus:
        return self._tasks[task_id]

    def tasks_in(self, state: TaskState) -> list[Hashable]:
        return [tid for tid, st in self._tasks.items() if st.state is state]

    def residents(self, rank: int) -> list[Hashable]:
        return sorted(self._ranks[rank].residents, key=lambda t: self._tasks[t].seq)

    def group_completion(self, group_id: Hashable) -> float:
        return self._groups[group_id].completion

    def probe_footprint(self, group_id: Hashable) -> Optional[int]:
        return self._groups[group_id].probe_footprint

    def queued_tasks(self) -> int:
        """Tasks waiting for admission (O(groups))."""
        return sum(len(g.queued) for g in self._groups.values())

    def outstanding_training_tasks(self) -> int:
        """Unfinished tasks of started training groups (queued members included): the work the
        staleness throttle and deadline admission count besides the unconsumed trajectories."""
        return self._committed_train

    def counts(self) -> dict[str, int]:
        return {s.value: self._state_counts[s] for s in TaskState}

    def _set_state(self, st: TaskStatus, state: TaskState) -> None:
        self._state_counts[st.state] -= 1
        st.state = state
        self._state_counts[state] += 1

    def audit(self) -> list[str]:
        """Invariant violations (empty when healthy)."""
        problems = []
        if +self._state_counts != Counter(st.state for st in self._tasks.values()):
            problems.append("task counts per state drifted")
        resident_ids: set = set()
        for r, pool in self._ranks.items():
            types = Counter(self._tasks[t].task.task_type for t in pool.residents)
            if +pool.type_counts != types:
                problems.append(f"rank {r}: type counts drifted")
            used = sum(self._tasks[t].footprint for t in pool.residents)
            if used != self._used[r]:
                problems.append(f"rank {r}: usage {self._used[r]} != residents' footprint {used}")
            if sum(pool.releasing.values()) != self._releasing_tokens[r]:
                problems.append(f"rank {r}: releasing tokens drifted")
            if any(r not in self._tasks[t].releasing_on for t in pool.releasing):
                problems.append(f"rank {r}: releasing index drifted")
            if pool.max_resident is not None and len(pool.residents) > pool.max_resident:
                problems.append(f"rank {r}: {len(pool.residents)} residents > cap {pool.max_resident}")
            resident_ids |= pool.residents
        holding = [st for st in self._tasks.values() if st.state in (TaskState.RUNNING, TaskState.PAUSED)]
        committed = sum(1 for st in self._tasks.values() if st.state not in TERMINAL and not st.task.is_eval
                        and self._groups[st.task.group_id].started)
        if self._holding_env != len(holding) or self._committed_train != committed:
            problems.append("incremental env/training counters drifted")
        if set(self._paused) != {t for t, st in self._tasks.items() if st.state is TaskState.PAUSED}:
            problems.append("paused index drifted")
        for tid, st in self._tasks.items():
            running = st.state is TaskState.RUNNING
            if running != (tid in resident_ids):
                problems.append(f"task {tid!r} is {st.state.name} but resident={tid in resident_ids}")
            if running and (st.rank not in self._ranks or tid not in self._ranks[st.rank].residents):
                problems.append(f"task {tid!r} points at rank {st.rank} which does not hold it")
            queued = tid in self._groups[st.task.group_id].queued
            if queued != (st.state is TaskState.QUEUED):
                problems.append(f"task {tid!r} queue membership disagrees with state {st.state.name}")
            if any(r not in self._ranks or tid not in self._ranks[r].releasing for r in st.releasing_on):
                problems.append(f"task {tid!r} releasing index drifted")
        return problems
