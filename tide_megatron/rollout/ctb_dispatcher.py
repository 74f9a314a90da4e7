"""The CTB dispatcher: task-level admission, pausing and resumption across rollout ranks.

It wraps core's `CTBScheduler` (the policy: token-aware admission with probing, env
concurrency, staleness and diversity constraints, P(t) pausing, resume-before-admit with
group affinity) and turns its decisions into actions on `TaskHandle`s:
- Admit  -> the task is placed on a rank; its runner starts (the caller starts it).
- Pause  -> the task stops before its next turn and its SGLang session is closed, so its KV
            becomes evictable (it stays in the radix tree until something evicts it).
- Resume -> the task is placed again, on its group's rank when that rank has room; the runner
            opens a new session there and sends the whole context (the prefix may still hit).
The runner reports every turn (`turn_started` / `turn_finished`), which keeps the policy's
footprints equal to the real contexts, and the `tide_ctb` SGLang plugin's report on each
response carries the engine's KV state back (`rank_kv`).

Request-level scheduling stays available as the vanilla baseline (`enabled=False`): every
task is dispatched at once (round robin, env concurrency only), no tags, no sessions, no
pauses; SGLang's own continuous batching and retraction decide everything.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from sglang_patches.task_tag import TaskTag
from tide_megatron.core.ctb import Admit, CTBConfig, CTBScheduler, Pause, Requeue, Resume, RolloutTask, TaskState
from tide_megatron.rollout.ctb_task_runner import TaskHandle
from tide_megatron.rollout.engine import RolloutEngine
from tide_megatron.rollout.task_runner import TaskAssignment

logger = logging.getLogger(__name__)


@dataclass
class CTBDispatchConfig:
    """How rollout tasks are dispatched to rollout ranks."""

    enabled: bool = True
    """Task-level CTB. False: vanilla request-level scheduling (every task dispatched at once,
    whole context resent each turn, SGLang alone batches and retracts)."""
    policy: CTBConfig = field(default_factory=CTBConfig)
    """The CTB policy (priority weights, env concurrency, staleness bound, probing reserve).
    Its `rank_token_budget` is used only for ranks added without an explicit budget."""
    kv_budget_fraction: float = 0.85
    """A rank's CTB token budget as a fraction of its engine's KV pool (`max_total_tokens`):
    the rest is headroom for the tokens a turn generates before its footprint is reported, so
    CTB pauses before SGLang has to retract."""
    max_resident_tasks_per_rank: int = 48
    """Most tasks resident on one rank. Each open streaming session holds one of SGLang's
    request slots between turns, so keep this below the engine's `max_running_requests`."""
    prompt_tokens_estimate: int = 256
    """Prompt length assumed for a task before its probe has measured one."""
    turn_reserve_tokens: int = 64
    """Tokens one more turn of a waiting task may add (observation + action). The engine-side
    admission check keeps this much free per pinned waiting task."""
    require_plugin: bool = True
    """Fail a rank whose responses carry no `tide_ctb` report (plugin missing or refused)."""
    schedule_interval_s: float = 0.01
    """Longest wait between two scheduling passes when no event wakes the loop earlier."""
    low_water: float = 0.85
    """Hysteresis: tasks are admitted or resumed on a rank only while its usage stays at or
    below this fraction of its budget (pausing starts above the budget, the high-water mark), so
    a pause is not undone by the next resume a moment later."""
    hard_water: float = 1.15
    """Above this fraction of the budget even protected tasks (near their end, or out of pauses)
    may be paused, lowest P(t) first: the KV pool must never run out."""
    max_pauses_per_task: int = 2
    """A task paused this often is not paused again (below `hard_water`)."""
    task_max_turns: Optional[int] = None
    """The runner's turn limit; a task on its last `protect_final_turns` turns is not paused."""
    protect_final_turns: int = 1
    move_after_s: float = 2.0
    """A paused task resumes on the rank it ran on (its whole context may still be cached there);
    only after waiting this long for room there may it move to another rank."""

    def __post_init__(self) -> None:
        if not 0.0 < self.low_water <= 1.0 <= self.hard_water:
            raise ValueError("need 0 < low_water <= 1 <= hard_water")
        if self.max_pauses_per_task < 0 or self.protect_final_turns < 0 or self.move_after_s < 0:
            raise ValueError("max_pauses_per_task, protect_final_turns and move_after_s must be >= 0")
        if not 0.0 < self.kv_budget_fraction <= 1.0:
            raise ValueError("kv_budget_fraction must be in (0, 1]")
        if self.max_resident_tasks_per_rank <= 0:
            raise ValueError("max_resident_tasks_per_rank must be positive")


class HysteresisCTBScheduler(CTBScheduler):
    """Core's CTB policy with hysteresis, pause bounds and own-rank affinity.

    Core's `CTBScheduler` is kept as is (P(t), probing, constraints, resume-before-admit); this
    subclass changes only *when* its rules fire, to stop pause/resume thrash:
    - pause only above the high-water mark (the rank budget), down to it, lowest P(t) first
      (core's order); tasks near their end or already paused `max_pauses_per_task` times are
      skipped unless usage is above `hard_water` x budget;
    - admit or resume only while the rank stays at or below `low_water` x budget;
    - a paused task resumes on the rank it last ran on (its own context is cached there); only
      after `move_after_s` without room there does it fall back to core's placement (group
      affinity, then most headroom). Resume-before-admit holds per rank: a rank that a paused
      task is waiting for admits nothing new; other ranks keep admitting.
    """

    def __init__(self, config: CTBConfig, *, low_water: float, hard_water: float, max_pauses_per_task: int,
                 task_max_turns: Optional[int], protect_final_turns: int, move_after_s: float):
        super().__init__(config)
        self.low_water, self.hard_water = low_water, hard_water
        self.max_pauses_per_task = max_pauses_per_task
        self.task_max_turns, self.protect_final_turns = task_max_turns, protect_final_turns
        self.move_after_s = move_after_s
        self.pause_counts: dict = {}
        self._home: dict = {}
        """Paused task -> (rank it ran on, time it was paused)."""
        self._now = 0.0

    def schedule(self, now: float, *, unconsumed_trajectories: int = 0) -> list:
        self._now = now
        decisions = self._pause_over_budget()
        decisions += self._resume_paused()
        if not self._paused:
            return decisions + self._admit_new(unconsumed_trajectories)
        blocked = set()
        for tid in self._paused:
            home = self._waiting_home(tid)
            if home is None:
                return decisions  # a task that may go anywhere waits for room: nobody is admitted
            blocked.add(home)
        saved = {r: self._ranks[r].accepting for r in blocked}
        try:
            for r in blocked:
                self._ranks[r].accepting = False
            decisions += self._admit_new(unconsumed_trajectories)
        finally:
            for r, accepting in saved.items():
                self._ranks[r].accepting = accepting
        return decisions

    def _waiting_home(self, tid) -> Optional[int]:
        """The rank a paused task still waits for (None: it may resume anywhere)."""
        home = self._home.get(tid)
        if home is None or home[0] not in self._ranks or self._now - home[1] >= self.move_after_s:
            return None
        return home[0]

    def _fits(self, rank: int, need: int) -> bool:  # admission and resumption: below low water
        pool = self._ranks.get(rank)
        return pool is not None and pool.accepting and self._used[rank] + need <= pool.budget * self.low_water

    def _protected(self, tid) -> bool:
        st = self._tasks[tid]
        if self.pause_counts.get(tid, 0) >= self.max_pauses_per_task:
            return True
        return (self.task_max_turns is not None
                and st.turns_done >= self.task_max_turns - self.protect_final_turns)

    def _pause_over_budget(self) -> list:
        out = []
        for rank in self.ranks:
            pool = self._ranks[rank]
            if self._used[rank] <= pool.budget:
                continue
            # Core's order: lowest priority first; among equals the most recently submitted.
            victims = sorted(pool.residents, key=lambda t: (self.priority(t), -self._tasks[t].seq))
            for tid in victims:
                if self._used[rank] <= pool.budget or len(pool.residents) == 1:
                    break
                if self._protected(tid) and self._used[rank] <= pool.budget * self.hard_water:
                    continue
                st = self._tasks[tid]
                prio = self.priority(tid)
                self._evict(st)
                self._to_paused(st)
                self.pause_counts[tid] = self.pause_counts.get(tid, 0) + 1
                self._home[tid] = (rank, self._now)
                out.append(Pause(st.task, rank, prio))
        return out

    def _resume_paused(self) -> list:
        out = []
        paused = sorted((self._tasks[t] for t in self._paused), key=lambda st: (-self.priority(st.task.task_id), st.seq))
        for st in paused:
            tid = st.task.task_id
            need = st.footprint
            home = self._home.get(tid)
            rank, affinity = None, False
            if home is not None and self._fits(home[0], need):
                rank, affinity = home[0], True
            elif self._waiting_home(tid) is None:
                group = self._groups[st.task.group_id]
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
            del self._paused[tid]
            self._home.pop(tid, None)
            self._place(st, rank)
            out.append(Resume(st.task, rank, affinity))
        return out

    def on_task_finished(self, task_id, context_tokens: Optional[int] = None) -> None:
        super().on_task_finished(task_id, context_tokens)
        self._home.pop(task_id, None)
        self.pause_counts.pop(task_id, None)


class PluginMissing(RuntimeError):
    """A rank's SGLang scheduler does not run the `tide_ctb` plugin."""


class CTBDispatcher:
    """Rank-0 side of CTB. Single-threaded (one asyncio loop); every method is synchronous."""

    def __init__(self, cfg: CTBDispatchConfig, engines: dict[int, RolloutEngine],
                 rank_budgets: Optional[dict[int, int]] = None):
        self.cfg = cfg
        self.engines = engines
        self.policy = HysteresisCTBScheduler(
            cfg.policy, low_water=cfg.low_water, hard_water=cfg.hard_water,
            max_pauses_per_task=cfg.max_pauses_per_task, task_max_turns=cfg.task_max_turns,
            protect_final_turns=cfg.protect_final_turns, move_after_s=cfg.move_after_s)
        self.handles: dict[str, TaskHandle] = {}
        self.assignments: dict[str, TaskAssignment] = {}
        self._quarantined: set[int] = set()
        self._vanilla_ranks = itertools.cycle(sorted(engines))
        self._vanilla_queue: list[str] = []
        self._plugin_seen: set[int] = set()
        self._slot_wait: dict[str, int] = {}
        """Tasks the policy placed on a rank whose request slots are all taken (FIFO)."""
        self.rank_kv: dict[int, dict[str, Any]] = {}
        """Latest engine KV report per rank (from the plugin)."""
        self.stats = {"admits": 0, "pauses": 0, "resumes": 0, "resumes_with_affinity": 0, "requeues": 0}
        self.wakeup = asyncio.Event()
        """Set on every event that may unblock a decision (turn end, finish, submit)."""
        for rank in sorted(engines):
            budget = (rank_budgets or {}).get(rank)
            if budget is None:
                total = engines[rank].cfg.max_total_tokens
                budget = int(total * cfg.kv_budget_fraction) if total else cfg.policy.rank_token_budget
            self.policy.add_rank(rank, budget)

    # -- tasks --------------------------------------------------------------------------
    def submit(self, assignments: Iterable[TaskAssignment], prompt_tokens: Optional[int] = None) -> list[TaskHandle]:
        """Queue trajectories; the first of each group is its probe."""
        out, tasks = [], []
        for a in assignments:
            tid = a.trajectory_id
            self.assignments[tid] = a
            self.handles[tid] = handle = TaskHandle(tid)
            out.append(handle)
            tasks.append(RolloutTask(task_id=tid, group_id=a.group_id, task_type=str(a.task.get("env", "")),
                                     prompt_tokens=prompt_tokens or self.cfg.prompt_tokens_estimate,
                                     is_eval=a.is_eval))
            self._vanilla_queue.append(tid)
        if self.cfg.enabled:
            self.policy.submit(tasks)
        self.wakeup.set()
        return out

    def schedule(self, now: float, unconsumed_trajectories: int = 0) -> list[Admit]:
        """One scheduling pass: carry out pauses and resumes, return the new admissions
        (whose runners the caller starts)."""
        if not self.cfg.enabled:
            return self._schedule_vanilla()
        for rank in self.policy.ranks:
            slots_left = len(self.policy.residents(rank)) < self.cfg.max_resident_tasks_per_rank
            self.policy.set_accepting(rank, slots_left and rank not in self._quarantined)
        admits: list[Admit] = []
        for d in self.policy.schedule(now, unconsumed_trajectories=unconsumed_trajectories):
            handle = self.handles[d.task.task_id]
            if isinstance(d, Pause):
                self.stats["pauses"] += 1
                self._slot_wait.pop(d.task.task_id, None)
                handle.pause(self.engines)
            elif isinstance(d, Resume):
                self.stats["resumes"] += 1
                self.stats["resumes_with_affinity"] += d.prefix_affinity
                self._place_in_slot(handle, d.rank)
            elif isinstance(d, Admit):
                self.stats["admits"] += 1
                self._place_in_slot(handle, d.rank)
                admits.append(d)
        self._fill_free_slots()
        return admits

    def _slots_used(self, rank: int) -> int:
        return sum(1 for tid in self.policy.residents(rank) if self.handles[tid].rank == rank)

    def _place_in_slot(self, handle: TaskHandle, rank: int) -> None:
        # One policy pass may admit several tasks onto a rank at once; those beyond the rank's
        # request slots keep their reservation but wait (not runnable) until a slot frees.
        if self._slots_used(rank) < self.cfg.max_resident_tasks_per_rank:
            handle.place(rank)
        else:
            self._slot_wait[handle.task_id] = rank

    def _fill_free_slots(self) -> None:
        for tid, rank in list(self._slot_wait.items()):
            st = self.policy.status(tid)
            if st.state is not TaskState.RUNNING or st.rank != rank:
                del self._slot_wait[tid]
            elif self._slots_used(rank) < self.cfg.max_resident_tasks_per_rank:
                del self._slot_wait[tid]
                self.handles[tid].place(rank)

    def _schedule_vanilla(self) -> list[Admit]:
        admits = []
        limit = self.cfg.policy.env_concurrency
        running = sum(1 for h in self.handles.values() if h.rank is not None)
        while self._vanilla_queue and running < limit:
            tid = self._vanilla_queue.pop(0)
            rank = next(self._vanilla_ranks)
            while rank in self._quarantined:
                rank = next(self._vanilla_ranks)
            self.handles[tid].place(rank)
            a = self.assignments[tid]
            admits.append(Admit(RolloutTask(tid, a.group_id, str(a.task.get("env", "")), 0, a.is_eval), rank, 0))
            running += 1
        return admits

    # -- events from runners ----------------------------------------------------------------
    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> Optional[TaskTag]:
        if not self.cfg.enabled:
            return None
        self.policy.on_turn_started(task_id, context_tokens)
        st = self.policy.status(task_id)
        return TaskTag(kind=kind, task_id=task_id, group_id=str(st.task.group_id), is_eval=st.task.is_eval,
                       priority=self.policy.priority(task_id), footprint_tokens=st.footprint,
                       turn_reserve_tokens=self.cfg.turn_reserve_tokens)

    def turn_finished(self, task_id: str, context_tokens: int, report: Optional[dict[str, Any]]) -> None:
        if not self.cfg.enabled:
            return
        rank = self.handles[task_id].last_rank
        if report is not None:
            self._plugin_seen.add(rank)
            self.rank_kv[rank] = report
            context_tokens = max(context_tokens, int(report.get("context_tokens", context_tokens)))
        elif self.cfg.require_plugin and rank not in self._plugin_seen:
            raise PluginMissing(
                f"rank {rank}: SGLang response carries no tide_ctb report; the sglang_patches plugin is not "
                "loaded in its scheduler (is tide-megatron installed with its entry points, and SGLang the pinned "
                "version?)")
        if self.policy.status(task_id).state is TaskState.RUNNING:  # may have been paused mid-turn
            self.policy.on_turn_finished(task_id, context_tokens)
        self.wakeup.set()

    def task_finished(self, task_id: str, context_tokens: Optional[int] = None) -> None:
        handle = self.handles[task_id]
        handle.rank = None
        if self.cfg.enabled:
            self.policy.on_task_finished(task_id, context_tokens)
        self.wakeup.set()

    # -- rank lifecycle -----------------------------------------------------------------
    def on_weight_sync(self) -> None:
        """Call after new weights reach the ranks (their caches were flushed)."""
        if self.cfg.enabled:
            self.policy.on_weight_sync()

    def quarantine(self, rank: int, quarantined: bool = True) -> None:
        """Stop (or restart) dispatching to a rank; its residents keep running."""
        (self._quarantined.add if quarantined else self._quarantined.discard)(rank)

    def remove_rank(self, rank: int) -> list[Requeue]:
        """A rank leaves rollout: its resident tasks are paused and resume elsewhere."""
        requeues = self.policy.remove_rank(rank) if self.cfg.enabled else []
        for r in requeues:
            handle = self.handles[r.task.task_id]
            handle.rank, handle.session_id = None, None  # its engine and sessions are gone
            handle.runnable.clear()
        self.stats["requeues"] += len(requeues)
        self.engines.pop(rank, None)
        self.wakeup.set()
        return requeues

    def add_rank(self, rank: int, engine: RolloutEngine, budget: Optional[int] = None) -> None:
        self.engines[rank] = engine
        if self.cfg.enabled:
            total = engine.cfg.max_total_tokens
            self.policy.add_rank(rank, budget or (int(total * self.cfg.kv_budget_fraction) if total else None))
        self.wakeup.set()
