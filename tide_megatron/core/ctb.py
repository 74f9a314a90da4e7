"""Continuous Task Batching (CTB): task-level admission, pausing and resumption on rollout ranks.

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
  At every moment each submitted task is QUEUED, RUNNING, PAUSED or FINISHED: none is lost.

The policy is event-driven and clock-free: callers report usage and finishes, then call
`schedule(now, ...)`, which returns plain decision objects for the runner (or simulator) to
carry out.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Union


@dataclass
class CTBConfig:
    """Continuous Task Batching policy configuration."""

    rank_token_budget: int = 262_144
    """Default KV token budget of one rollout rank (below the engine's physical KV capacity,
    so CTB pauses before the engine starts evicting on its own)."""
    env_concurrency: int = 512
    """Most tasks that may hold an environment at once (running + paused)."""
    max_staleness: int = 1
    """Staleness bound shared with the buffer (consumer version - trajectory version)."""
    trainer_batch_trajectories: int = 128
    """B_ideal: trajectories the trainer consumes per step (staleness throttle)."""
    staleness_throttle: bool = True
    """Cap outstanding training trajectories at (max_staleness + 1) * trainer_batch_trajectories."""
    probe_turn_reserve_tokens: int = 2048
    """Tokens reserved beyond the prompt for an unmeasured probe's first turn."""
    context_norm_tokens: int = 32_768
    """Context length that maps to L_context = 1 (the longest context expected)."""
    w_eval: float = 1000.0
    """w1: weight of I_eval (evaluation task)."""
    w_group: float = 100.0
    """w2: weight of G_completion (finished / total of the task's group)."""
    w_active: float = 10.0
    """w3: weight of I_active (task is generating now, not waiting for its environment)."""
    w_context: float = 1.0
    """w4: weight of L_context (normalised current context length)."""
    diversity_penalty: float = 0.05
    """Rank score penalty (in budget fractions) per resident same-type task from another group."""

    def __post_init__(self) -> None:
        if self.rank_token_budget <= 0 or self.env_concurrency <= 0:
            raise ValueError("rank_token_budget and env_concurrency must be positive")
        if self.trainer_batch_trajectories <= 0 or self.context_norm_tokens <= 0:
            raise ValueError("trainer_batch_trajectories and context_norm_tokens must be positive")


class TaskState(enum.Enum):
    QUEUED = "queued"
    """Submitted, never admitted."""
    RUNNING = "running"
    """Resident on a rollout rank (generating or waiting for its environment)."""
    PAUSED = "paused"
    """Holds an environment but no KV: paused by priority, or handed back by a leaving rank."""
    FINISHED = "finished"


@dataclass(frozen=True)
class RolloutTask:
    """What CTB needs to know about one trajectory to run."""

    task_id: Hashable
    """Unique id of this trajectory-task."""
    group_id: Hashable
    """GRPO group (G tasks sharing one prompt)."""
    task_type: str
    """Environment/task family (diversity constraint)."""
    prompt_tokens: int
    """Initial prompt length."""
    is_eval: bool = False
    """Evaluation tasks get the highest priority and bypass the staleness throttle."""


@dataclass
class TaskStatus:
    """CTB's live view of one task."""

    task: RolloutTask
    state: TaskState = TaskState.QUEUED
    rank: Optional[int] = None
    """Rank the task is resident on (RUNNING only)."""
    context_tokens: Optional[int] = None
    """Last reported actual context (None until the first report)."""
    reserved_tokens: int = 0
    """Footprint reserved at admission, used until the first usage report."""
    active: bool = False
    """Generating now (True) vs waiting for the environment (False)."""
    turns_done: int = 0
    needs_prefill: bool = False
    """Lost its KV (paused or moved): the next turn recomputes the prefix."""
    seq: int = 0
    """Submission order (FIFO tie-break)."""

    @property
    def footprint(self) -> int:
        return self.context_tokens if self.context_tokens is not None else self.reserved_tokens


@dataclass(frozen=True)
class Admit:
    task: RolloutTask
    rank: int
    estimated_tokens: int


@dataclass(frozen=True)
class Pause:
    task: RolloutTask
    rank: int
    priority: float


@dataclass(frozen=True)
class Resume:
    task: RolloutTask
    rank: int
    prefix_affinity: bool
    """True when placed on a rank that holds the group's prefixes."""


@dataclass(frozen=True)
class Requeue:
    """A task handed back by a rank leaving rollout; it is PAUSED and resumes elsewhere."""

    task: RolloutTask
    from_rank: int


Decision = Union[Admit, Pause, Resume, Requeue]


@dataclass
class RankPool:
    """One rollout rank's token budget and residents."""

    rank: int
    budget: int
    accepting: bool = True
    """False while quarantined: no new admissions or resumes."""
    residents: set = field(default_factory=set)
    type_counts: Counter = field(default_factory=Counter)
    """Resident tasks per task type (diversity constraint without rescanning residents)."""
    group_counts: Counter = field(default_factory=Counter)
    """Resident tasks per group."""

    def free(self, used: int) -> int:
        return self.budget - used


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
    prefix_ranks: Counter = field(default_factory=Counter)
    queued: "OrderedDict[Hashable, None]" = field(default_factory=OrderedDict)
    members: list = field(default_factory=list)
    """Task ids of the group in submission order (what `forget` drops)."""

    @property
    def completion(self) -> float:
        return self.finished / self.total if self.total else 0.0


class CTBScheduler:
    """The CTB policy for all rollout ranks. Single-threaded; deterministic given its inputs."""

    def __init__(self, config: CTBConfig, ranks: Iterable[int] = ()):
        self.config = config
        self._tasks: dict[Hashable, TaskStatus] = {}
        self._groups: "OrderedDict[Hashable, _Group]" = OrderedDict()
        self._ranks: dict[int, RankPool] = {}
        self._used: dict[int, int] = {}
        self._seq = 0
        # Paused tasks in pause order, and the counts the admission constraints read, kept
        # incrementally so a schedule() call costs O(decisions x ranks), not O(all tasks).
        self._paused: "OrderedDict[Hashable, None]" = OrderedDict()
        self._holding_env = 0
        self._committed_train = 0  # unfinished tasks of started training groups, queued ones included
        for r in ranks:
            self.add_rank(r)

    # ------------------------------------------------------------------ ranks
    def add_rank(self, rank: int, budget: Optional[int] = None) -> None:
        if rank in self._ranks:
            raise ValueError(f"rank {rank} already in rollout")
        self._ranks[rank] = RankPool(rank, budget or self.config.rank_token_budget)
        self._used[rank] = 0

    def set_accepting(self, rank: int, accepting: bool) -> None:
        """Quarantine (False) or re-open (True) a rank; residents are left alone."""
        self._ranks[rank].accepting = accepting

    def remove_rank(self, rank: int) -> list[Requeue]:
        """The rank leaves rollout (ERS role change or failure): hand back every resident task."""
        pool = self._ranks.pop(rank)
        del self._used[rank]
        out = []
        for tid in sorted(pool.residents, key=lambda t: self._tasks[t].seq):
            st = self._tasks[tid]
            st.rank = None
            self._to_paused(st)
            out.append(Requeue(st.task, rank))
        for g in self._groups.values():
            g.prefix_ranks.pop(rank, None)
        return out

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def rank_usage(self, rank: int) -> tuple[int, int]:
        """(tokens in use, budget) of a rollout rank."""
        return self._used[rank], self._ranks[rank].budget

    # ------------------------------------------------------------------ task events
    def submit(self, tasks: Iterable[RolloutTask]) -> None:
        """Queue tasks; the first task seen of each group becomes the group's probe."""
        for task in tasks:
            if task.task_id in self._tasks:
                raise ValueError(f"task {task.task_id!r} submitted twice")
            group = self._groups.get(task.group_id)
            if group is None:
                group = self._groups[task.group_id] = _Group(task.group_id, task.task_type, task.is_eval, task.task_id)
            group.total += 1
            group.members.append(task.task_id)
            group.queued[task.task_id] = None
            self._committed_train += group.started and not group.is_eval
            self._seq += 1
            self._tasks[task.task_id] = TaskStatus(task, seq=self._seq)

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

    def on_task_finished(self, task_id: Hashable, context_tokens: Optional[int] = None) -> None:
        st = self._tasks[task_id]
        if st.state is TaskState.FINISHED:
            raise ValueError(f"task {task_id!r} finished twice")
        if st.state is TaskState.QUEUED:
            raise ValueError(f"task {task_id!r} finished without being admitted")
        group = self._groups[st.task.group_id]
        if group.probe == task_id and group.probe_footprint is None:
            # A probe that finished within its first turn still measured that turn.
            group.probe_footprint = context_tokens if context_tokens is not None else st.footprint
        if st.state is TaskState.RUNNING:
            self._evict(st)
        self._paused.pop(task_id, None)
        self._holding_env -= 1
        self._committed_train -= not group.is_eval
        st.state, st.active = TaskState.FINISHED, False
        group.finished += 1

    def forget(self, group_id: Hashable) -> list[Hashable]:
        """Drop a group whose tasks have all finished; returns the forgotten task ids.

        Finished tasks hold no KV, no environment and no admission counter, so forgetting
        them changes no decision; it keeps a long run's tables (and `schedule`'s scans)
        bounded. A group with a task still queued, running or paused is refused
        (ValueError): forgetting it would silently lose work. Unknown ids are a no-op.
        """
        group = self._groups.get(group_id)
        if group is None:
            return []
        if group.finished < group.total:
            raise ValueError(f"group {group_id!r} has unfinished tasks ({group.finished}/{group.total})")
        for tid in group.members:
            del self._tasks[tid]
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

    def schedule(self, now: float, *, unconsumed_trajectories: int = 0) -> list[Decision]:
        """Pause over-budget ranks, resume paused tasks, then admit new ones.

        `unconsumed_trajectories`: finished training trajectories not yet consumed by the
        trainer (`GlobalBuffer.unconsumed_trajectories()`), for the staleness throttle.
        """
        del now  # decisions depend on state only; kept for a uniform, clock-passing interface
        decisions: list[Decision] = self._pause_over_budget()
        decisions += self._resume_paused()
        if not self._paused:
            decisions += self._admit_new(unconsumed_trajectories)
        return decisions

    def _pause_over_budget(self) -> list[Decision]:
        out: list[Decision] = []
        for rank in self.ranks:
            pool = self._ranks[rank]
            if self._used[rank] <= pool.budget:
                continue
            # Lowest priority first; among equals the most recently submitted goes first.
            victims = sorted(pool.residents, key=lambda t: (self.priority(t), -self._tasks[t].seq))
            for tid in victims:
                if self._used[rank] <= pool.budget or len(pool.residents) == 1:
                    break  # pausing a rank's only task frees nothing it could use
                st = self._tasks[tid]
                prio = self.priority(tid)
                self._evict(st)
                self._to_paused(st)
                out.append(Pause(st.task, rank, prio))
        return out

    def _resume_paused(self) -> list[Decision]:
        out: list[Decision] = []
        paused = [self._tasks[t] for t in self._paused]
        paused.sort(key=lambda st: (-self.priority(st.task.task_id), st.seq))
        for st in paused:
            need = st.footprint
            group = self._groups[st.task.group_id]
            rank, affinity = None, False
            for r, _ in sorted(group.prefix_ranks.items(), key=lambda kv: (-kv[1], kv[0])):
                if self._fits(r, need):
                    rank, affinity = r, True
                    break
            if rank is None:
                rank = self._best_rank(st.task, need)
            if rank is None:
                rank = self._empty_rank_for_oversize(need)
            if rank is None:
                continue
            del self._paused[st.task.task_id]
            self._place(st, rank)
            out.append(Resume(st.task, rank, affinity))
        return out

    def _admit_new(self, unconsumed_trajectories: int) -> list[Decision]:
        c = self.config
        holding_env = self._holding_env
        train_cap = (c.max_staleness + 1) * c.trainer_batch_trajectories if c.staleness_throttle else None
        out: list[Decision] = []
        # Eval groups first (they gate the weight sync), then groups already under way (a group
        # is only trainable once whole), then new groups, each in submission order.
        groups = sorted((g for g in self._groups.values() if g.queued), key=lambda g: (not g.is_eval, not g.started))
        for group in groups:
            if holding_env >= c.env_concurrency:
                break
            if not group.started and not group.is_eval and train_cap is not None:
                # The throttle commits whole groups: starting one books all G of its trajectories,
                # so groups already under way can always finish (no deadlock on partial groups).
                outstanding = unconsumed_trajectories + self._committed_train
                if outstanding + group.total > train_cap and outstanding > 0:
                    continue
            if group.probe_footprint is None:
                candidates = [group.probe] if group.probe in group.queued else []
            else:
                candidates = list(group.queued)
            for tid in candidates:
                st = self._tasks[tid]
                if holding_env >= c.env_concurrency:
                    break
                need = self._estimate(st)
                rank = self._best_rank(st.task, need)
                if rank is None:
                    break  # same estimate for every queued member of the group
                st.reserved_tokens = need
                self._place(st, rank)
                del group.queued[tid]
                if not group.started:
                    group.started = True
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

    def _fits(self, rank: int, need: int) -> bool:
        pool = self._ranks.get(rank)
        return pool is not None and pool.accepting and self._used[rank] + need <= pool.budget

    def _best_rank(self, task: RolloutTask, need: int) -> Optional[int]:
        """Most headroom (as a budget fraction) minus the diversity penalty; ties -> lowest rank."""
        best, best_score = None, None
        for r in self.ranks:
            if not self._fits(r, need):
                continue
            pool = self._ranks[r]
            same_type = pool.type_counts[task.task_type]
            if self._groups[task.group_id].task_type == task.task_type:
                same_type -= pool.group_counts[task.group_id]
            group_here = self._groups[task.group_id].prefix_ranks.get(r, 0)
            # Group members share a prompt prefix: a small bonus keeps them together.
            score = (pool.free(self._used[r]) / pool.budget - self.config.diversity_penalty * same_type
                     + (self.config.diversity_penalty if group_here else 0.0))
            if best_score is None or score > best_score:
                best, best_score = r, score
        return best

    def _empty_rank_for_oversize(self, need: int) -> Optional[int]:
        """A context larger than every budget may run alone on an idle rank, never beside others."""
        if any(need <= p.budget for p in self._ranks.values()):
            return None
        for r in self.ranks:
            if self._ranks[r].accepting and not self._ranks[r].residents:
                return r
        return None

    def _place(self, st: TaskStatus, rank: int) -> None:
        st.state, st.rank = TaskState.RUNNING, rank
        pool = self._ranks[rank]
        pool.residents.add(st.task.task_id)
        pool.type_counts[st.task.task_type] += 1
        pool.group_counts[st.task.group_id] += 1
        self._used[rank] += st.footprint
        self._groups[st.task.group_id].prefix_ranks[rank] += 1

    def _evict(self, st: TaskStatus) -> None:
        if st.rank is not None and st.rank in self._ranks:
            pool = self._ranks[st.rank]
            pool.residents.discard(st.task.task_id)
            pool.type_counts[st.task.task_type] -= 1
            pool.group_counts[st.task.group_id] -= 1
            self._used[st.rank] -= st.footprint
        st.rank = None

    def _to_paused(self, st: TaskStatus) -> None:
        st.state, st.active, st.needs_prefill = TaskState.PAUSED, False, True
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

    def counts(self) -> dict[str, int]:
        c = Counter(st.state.value for st in self._tasks.values())
        return {s.value: c.get(s.value, 0) for s in TaskState}

    def audit(self) -> list[str]:
        """Invariant violations (empty when healthy)."""
        problems = []
        resident_ids: set = set()
        for r, pool in self._ranks.items():
            types = Counter(self._tasks[t].task.task_type for t in pool.residents)
            if +pool.type_counts != types:
                problems.append(f"rank {r}: type counts drifted")
            used = sum(self._tasks[t].footprint for t in pool.residents)
            if used != self._used[r]:
                problems.append(f"rank {r}: usage {self._used[r]} != residents' footprint {used}")
            resident_ids |= pool.residents
        holding = [st for st in self._tasks.values() if st.state in (TaskState.RUNNING, TaskState.PAUSED)]
        committed = sum(g.total - g.finished for g in self._groups.values() if g.started and not g.is_eval)
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
        return problems
