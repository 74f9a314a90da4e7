"""The CTB dispatcher: rank 0's side of Continuous Task Batching, for every kind of run.

It owns the policy (core's `CTBScheduler`, with confirmed releases), the task assignments, the
per-rank budgets and the stats, and hands every decision to a carrier (`ctb_carrier.Carrier`):
the in-process one (`ctb_rollout.LocalCarrier`: benchmarks, tests, one node) or the mailbox
one (multi-process runs). Both carriers feed rank events back through the same methods
(`turn_started`, `turn_finished`, `task_finished`, `task_failed`, `task_released`).

Checks that live here, once:
- the `tide_ctb` SGLang plugin runs on every rank: a response without its report fails the
  run (`PluginMissing`) when `require_plugin`;
- the engine a rank really has matches its configured budgets: the first report of each rank
  carries the engine's KV pool and request rows (`RankMismatch` otherwise).

Request-level scheduling stays available as the vanilla baseline (`enabled=False`): every
task is dispatched at once (to its group's rank or the least loaded one, as every baseline
places: `core.request_placement`; env concurrency only), no tags, no sessions, no pauses;
SGLang's own continuous batching and retraction decide everything.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from tide_megatron.comm.messages import TaskAssignment
from tide_megatron.core.ctb import (
    Admit,
    Cancel,
    CTBScheduler,
    Decision,
    GroupCancelled,
    Pause,
    Requeue,
    Resume,
    RolloutTask,
    TaskState,
)
from tide_megatron.core.ctb_deadline import TrainerClock
from tide_megatron.core.request_placement import LeastLoadedPlacer
from tide_megatron.rollout.ctb_carrier import Carrier, TagFields
from tide_megatron.rollout.ctb_config import CTBDispatchConfig, resident_cap_for_rows

logger = logging.getLogger(__name__)


class PluginMissing(RuntimeError):
    """A rank's SGLang scheduler does not run the `tide_ctb` plugin."""


class RankMismatch(RuntimeError):
    """A rank's engine is smaller than the budgets CTB was configured with."""


@dataclass
class _Transit:
    """A task a rank leaving rollout hands over (`hand_off_rank`) on its way to another rank."""

    carry: Optional[dict[str, Any]] = None
    """Its state, once the leaving rank sent it (`task_carried`)."""
    rank: Optional[int] = None
    """Where CTB resumed it, once it did: the task starts there when its state is here."""
    cancelled: bool = False
    """Its group was cancelled meanwhile: its state is dropped when it comes."""


@dataclass(frozen=True)
class RankResources:
    """What a rollout rank's engine has: from `RolloutEngineConfig` until the engine starts, then
    what SGLang allocated (`RankReady`)."""

    kv_tokens: Optional[int]
    """KV pool in tokens (`max_total_tokens`; None: sized by SGLang, `ctb.policy.rank_token_budget` is used)."""
    request_rows: Optional[int]
    """Request rows (`max_running_requests`)."""


class CTBDispatcher:
    """Rank 0's CTB. Single-threaded; every method is synchronous and returns at once."""

    def __init__(self, cfg: CTBDispatchConfig, carrier: Carrier, ranks: dict[int, RankResources]):
        self.cfg = cfg
        self.carrier = carrier
        policy_cfg = cfg.policy
        if not carrier.can_move_tasks:  # a paused task resumes where its runner is
            policy_cfg = dataclasses.replace(policy_cfg, move_after_s=math.inf)
        self.policy = CTBScheduler(policy_cfg, confirm_release=True)
        self.assignments: dict[str, TaskAssignment] = {}
        self.runner_rank: dict[str, int] = {}
        """Rank of each task's latest admit or resume: where its runner is."""
        self.rank_kv: dict[int, dict[str, Any]] = {}
        """Latest engine report per rank (from the plugin)."""
        self.stats = {"admits": 0, "pauses": 0, "resumes": 0, "resumes_with_affinity": 0, "requeues": 0,
                      "restarts": 0, "failures": 0, "cancels": 0, "groups_cancelled": 0, "handed_over": 0,
                      "carried": 0, "released": 0}
        self._transit: dict[str, _Transit] = {}
        """Tasks handed over by a rank that left rollout, until they start on another rank."""
        self.dropped_carries: list[tuple[str, dict[str, Any]]] = []
        """States of handed-over tasks whose group was cancelled before they started again: the
        caller books their tokens (and takes the list)."""
        self._forget_after_release: set[str] = set()
        """Cancelled groups the controller is done with, kept until their ranks confirm every release."""
        self.resources: dict[int, RankResources] = {}
        """Each rank's engine, as configured until the engine reports what it allocated."""
        self._checked: set[int] = set()
        self._quarantined: set[int] = set()
        self._vanilla = LeastLoadedPlacer()  # request-level placement (ctb.enabled=false)
        self._vanilla_queue: deque[str] = deque()
        self._vanilla_running: dict[str, int] = {}  # task -> its rank
        for rank, resources in sorted(ranks.items()):
            self.add_rank(rank, resources)

    # -- ranks ----------------------------------------------------------------------------
    def add_rank(self, rank: int, resources: RankResources) -> None:
        """A rank joins rollout (at start, or an ERS role change after a weight sync)."""
        self._checked.discard(rank)
        if not self.cfg.enabled:
            self._vanilla.add_rank(rank)
            return
        resources = self.resources.setdefault(rank, resources)  # what its engine reported, once it has
        budget, cap = self.cfg.rank_limits(resources.kv_tokens, resources.request_rows)
        self.policy.add_rank(rank, budget, cap)

    def engine_sized(self, rank: int, resources: RankResources) -> Optional[tuple[int, int]]:
        """A rank's engine reported the KV pool and request rows SGLang really allocated
        (`max_total_tokens: null` leaves the pool to SGLang): its CTB limits follow them.
        Returns the new (token budget, task cap); None when CTB is off or the rank not in it."""
        self.resources[rank] = resources
        if not self.cfg.enabled or rank not in self.policy.ranks:
            return None
        budget, cap = self.cfg.rank_limits(resources.kv_tokens, resources.request_rows)
        self.policy.resize_rank(rank, budget, cap)
        self._checked.discard(rank)  # the next report is checked against the new limits
        return budget, cap

    def remove_rank(self, rank: int) -> list[str]:
        """A rank leaves rollout (ERS role change or failure). Its tasks are re-dispatched: with
        a carrier that can move tasks they are paused and resume elsewhere (fresh prefill);
        otherwise every task whose runner is there is cancelled there and restarts from scratch.
        Returns the ids of the tasks concerned."""
        self._vanilla.remove_rank(rank)
        requeues: list[Requeue] = self.policy.remove_rank(rank) if self.cfg.enabled else []
        self.stats["requeues"] += len(requeues)
        self._quarantined.discard(rank)
        self.rank_kv.pop(rank, None)
        moved = [str(r.task.task_id) for r in requeues]
        if self.carrier.can_move_tasks:
            for tid in moved:
                self.carrier.pause(rank, tid)
            return moved
        stranded = moved + [str(t) for t in self.policy.tasks_in(TaskState.PAUSED)
                            if self.runner_rank.get(str(t)) == rank and str(t) not in moved]
        for tid in stranded:
            self.carrier.cancel(rank, tid)
            self.policy.requeue(tid)
            del self.runner_rank[tid]
            self.stats["restarts"] += 1
        return stranded

    def drop_rank(self, rank: int) -> list[str]:
        """A rank that stopped answering (the controller quarantined it) leaves rollout. Unlike
        `remove_rank`, nothing is sent to it (it would not read it; the controller clears the
        rank itself once it is heard from again), and its tasks, resident or paused with their
        runner there, end FAILED: the caller retries each (`requeue_failed`: a fresh prefill
        elsewhere) or cancels its group, as for the tasks of a dead engine. Returns their ids.
        `add_rank` brings the rank back."""
        ids = self._take_out(rank)
        for tid in ids:
            self.policy.on_task_failed(tid)
            self.stats["failures"] += 1
        self._forget_released_groups()
        return ids

    def hand_off_rank(self, rank: int) -> list[str]:
        """A rank leaves rollout alive (an ERS move): its tasks, resident or paused with their
        runner there, keep their state. In CTB's policy they become paused tasks that may resume
        on any rank (so resume-before-admit gives them room before anything new); the rank hands
        each one over (`task_carried`), and it starts where CTB resumes it once both happened.
        One the rank cannot hand over comes back through `task_not_carried` and starts afresh.
        Returns the ids of the tasks the rank hands over.

        A task CTB resumed on this rank while its state was still on its way from a rank that
        left before (two ranks leave at one boundary) never reached it: it stays in transit,
        the earlier rank answers for it, and CTB resumes it on another rank."""
        ids = []
        for tid in self._take_out(rank):
            transit = self._transit.get(tid)
            if transit is None:
                self._transit[tid] = _Transit()
                ids.append(tid)
            else:
                transit.rank = None
        self.stats["handed_over"] += len(ids)
        self._forget_released_groups()
        return ids

    def _take_out(self, rank: int) -> list[str]:
        """The rank leaves CTB's policy (its residents become paused tasks there); returns the
        ids of the tasks whose runner it was, resident or paused."""
        if not self.cfg.enabled:
            raise ValueError("request-level dispatch (ctb.enabled=false) does not track where tasks run")
        ids = [str(r.task.task_id) for r in self.policy.remove_rank(rank)]
        ids += [str(t) for t in self.policy.tasks_in(TaskState.PAUSED)
                if self.runner_rank.get(str(t)) == rank and str(t) not in ids]
        self._quarantined.discard(rank)
        self.rank_kv.pop(rank, None)
        for tid in ids:
            self.runner_rank.pop(tid, None)
        return ids

    def _forget_released_groups(self) -> None:
        """Cancelled groups that waited for releases of a rank that left: nothing is held there now."""
        for gid in sorted(self._forget_after_release):
            if not self.policy.awaits_release(gid):
                self.forget_group(gid)

    def in_transit(self, task_id: str) -> bool:
        return task_id in self._transit

    def describe(self) -> str:
        """Where the tasks are (CTB's task states, and the hand-overs under way), for a
        stalled run's message."""
        if not self.cfg.enabled:
            return f"request-level dispatch: {len(self._vanilla_queue)} queued, {len(self._vanilla_running)} running"
        states = {state: self.policy.tasks_in(state) for state in (TaskState.QUEUED, TaskState.PAUSED)}
        running = ", ".join(
            f"rank {r}: {len(self.policy.residents(r))} ({self.policy.rank_usage(r)[0]} of "
            f"{self.policy.rank_usage(r)[1]} tokens; {self.policy.rank_releasing(r)[1]} releasing)"
            for r in self.policy.ranks)
        waiting_state = sum(t.carry is None and not t.cancelled for t in self._transit.values())
        waiting_rank = sum(t.carry is not None and t.rank is None for t in self._transit.values())
        return (f"CTB: {len(states[TaskState.QUEUED])} queued, {len(states[TaskState.PAUSED])} paused; resident: "
                f"{running or 'no rank'}; handed over: {waiting_state} awaiting the leaving rank's state, "
                f"{waiting_rank} awaiting a rank")

    def task_carried(self, task_id: str, carry: dict[str, Any]) -> bool:
        """The leaving rank handed the task over with its state. False: it is no longer wanted
        (its group was cancelled or forgotten meanwhile); the caller books its tokens."""
        transit = self._transit.get(task_id)
        if transit is None or transit.cancelled:
            self._transit.pop(task_id, None)
            self._release(carry)
            return False
        transit.carry = carry
        self._start_carried(task_id)
        return True

    def task_not_carried(self, task_id: str) -> bool:
        """The leaving rank could not hand the task over (it had not begun its episode): it
        starts afresh. False: it is no longer wanted."""
        transit = self._transit.pop(task_id, None)
        st = self._status(task_id)
        if transit is None or transit.cancelled or st is None:
            return False
        if st.state is TaskState.RUNNING:  # CTB resumed it already: what it booked there is freed
            self.policy.on_task_failed(task_id)
        self.requeue_failed(task_id)
        return True

    def _start_carried(self, task_id: str) -> None:
        transit = self._transit[task_id]
        if transit.carry is None or transit.rank is None:
            return
        del self._transit[task_id]
        self.stats["carried"] += 1
        self.carrier.admit(transit.rank, self.assignments[task_id], self.tag_fields(task_id), carry=transit.carry)

    def quarantine(self, rank: int, quarantined: bool = True) -> None:
        """Stop (or restart) dispatching to a rank; its residents keep running."""
        (self._quarantined.add if quarantined else self._quarantined.discard)(rank)
        self._vanilla.set_accepting(rank, not quarantined)
        if self.cfg.enabled:
            self.policy.set_accepting(rank, not quarantined)

    def on_weight_sync(self) -> None:
        """Call after new weights reach the ranks (their caches were flushed)."""
        if self.cfg.enabled:
            self.policy.on_weight_sync()

    # -- tasks ----------------------------------------------------------------------------
    def submit(self, assignments: Iterable[TaskAssignment], prompt_tokens: Optional[int] = None) -> None:
        """Queue trajectories; the first of each group is its probe."""
        tasks = []
        for a in assignments:
            tid = a.trajectory_id
            self.assignments[tid] = a
            tasks.append(RolloutTask(task_id=tid, group_id=a.group_id,
                                     task_type=str(a.task.get("task_type", a.task.get("env", ""))),
                                     prompt_tokens=prompt_tokens or self.cfg.prompt_tokens_estimate,
                                     is_eval=a.is_eval))
            self._vanilla_queue.append(tid)
        if self.cfg.enabled:
            self.policy.submit(tasks)

    def schedule(self, now: float, unconsumed_trajectories: int = 0,
                 clock: Optional[TrainerClock] = None) -> list[Decision]:
        """One scheduling pass; every decision goes to the carrier. Returns the decisions: the
        caller books each `GroupCancelled` (a group past its staleness deadline) as wasted.

        `clock`: the trainer's version, measured step time, next sync and consumption rate;
        without it there are no deadlines (fixed staleness throttle, nothing cancelled)."""
        if not self.cfg.enabled:
            return self._schedule_vanilla()
        decisions = self.policy.schedule(now, unconsumed_trajectories=unconsumed_trajectories, clock=clock)
        for d in decisions:
            self._carry(d)
        return decisions

    def tag_fields(self, task_id: str) -> TagFields:
        """What a rank needs to tag the task's requests (see `sglang_patches.task_tag`)."""
        st = self.policy.status(task_id)
        return TagFields(self.policy.priority(task_id), st.footprint, self.cfg.turn_reserve_tokens)

    def requeue_failed(self, task_id: str) -> None:
        """Run a failed task again from scratch (the caller counts attempts and enforces its limit)."""
        self.policy.requeue(task_id)
        self.runner_rank.pop(task_id, None)
        self.stats["restarts"] += 1

    def cancel_group(self, group_id: str) -> list[str]:
        """Stop every unfinished task of a group (retries exhausted, or too stale to be used);
        running and paused ones are cancelled on their ranks. Returns the cancelled task ids
        that had started; the caller books the group's tokens as wasted."""
        cancels = self.policy.cancel_group(group_id)
        for c in cancels:
            self._carry(c)
        return [str(c.task.task_id) for c in cancels]

    def forget_group(self, group_id: str) -> None:
        """Drop a finished or cancelled group's tables; a cancelled group whose ranks have not
        confirmed every release yet is dropped at its last `task_released`."""
        if self.cfg.enabled and self.policy.awaits_release(group_id):
            self._forget_after_release.add(group_id)
            return
        self._forget_after_release.discard(group_id)
        self._vanilla.forget_group(group_id)
        for tid in self.policy.forget(group_id):
            self.assignments.pop(str(tid), None)
            self.runner_rank.pop(str(tid), None)
            self._drop_transit(str(tid))

    def _drop_transit(self, task_id: str) -> None:
        """The task is not wanted any more: a state already here is dropped (and reported in
        `dropped_carries`), one still coming is dropped when it comes."""
        transit = self._transit.get(task_id)
        if transit is None:
            return
        if transit.carry is not None:
            del self._transit[task_id]
            self.dropped_carries.append((task_id, transit.carry))
            self._release(transit.carry)
        else:
            transit.cancelled = True

    def _release(self, carry: dict[str, Any]) -> None:
        """A handed-over task will not go on: the rollout rank with the fewest residents closes
        its env session. With no rank taking work, the env server's idle reaper closes it."""
        ranks = [r for r in self.policy.ranks if r not in self._quarantined]
        if not ranks:
            logger.info("no rollout rank to close a dropped hand-over's env session; the env server's "
                        "idle reaper will")
            return
        self.stats["released"] += 1
        self.carrier.release(min(ranks, key=lambda r: len(self.policy.residents(r))), carry)

    def _carry(self, d: Decision) -> None:
        if isinstance(d, GroupCancelled):  # its tasks' Cancels follow
            self.stats["groups_cancelled"] += 1
            return
        tid = str(d.task.task_id)
        if isinstance(d, Admit):
            self.stats["admits"] += 1
            self.runner_rank[tid] = d.rank
            self.carrier.admit(d.rank, self.assignments[tid], self.tag_fields(tid))
        elif isinstance(d, Pause):
            self.stats["pauses"] += 1
            self.carrier.pause(d.rank, tid)
        elif isinstance(d, Resume):
            transit = self._transit.get(tid)
            if transit is None and not self.carrier.can_move_tasks and d.rank != self.runner_rank[tid]:
                raise RuntimeError(f"CTB resumed {tid} on rank {d.rank} but its runner is on {self.runner_rank[tid]}")
            self.stats["resumes"] += 1
            self.stats["resumes_with_affinity"] += d.prefix_affinity
            self.runner_rank[tid] = d.rank
            if transit is not None:  # a handed-over task starts there (once its state is here)
                transit.rank = d.rank
                self._start_carried(tid)
            else:
                self.carrier.resume(d.rank, tid, self.tag_fields(tid))
        elif isinstance(d, Cancel):
            self.stats["cancels"] += 1
            if tid in self._transit:  # running nowhere: nothing to tell a rank, nothing to release
                self.runner_rank.pop(tid, None)
                self._drop_transit(tid)
                if d.rank is not None:
                    self.policy.on_released(d.rank, tid)
            else:
                self.carrier.cancel(self.runner_rank[tid], tid)
        else:
            raise TypeError(f"unknown CTB decision {d!r}")

    def _schedule_vanilla(self) -> list[Decision]:
        admits: list[Decision] = []
        while self._vanilla_queue and len(self._vanilla_running) < self.cfg.policy.env_concurrency:
            tid = self._vanilla_queue[0]
            a = self.assignments[tid]
            rank = self._vanilla.place(a.group_id)
            if rank is None:
                break
            self._vanilla_queue.popleft()
            self._vanilla_running[tid] = rank
            self.carrier.admit(rank, a, None)
            admits.append(Admit(RolloutTask(tid, a.group_id, str(a.task.get("env", "")), 0, a.is_eval), rank, 0))
        return admits

    # -- events from ranks (both carriers call these) ---------------------------------------
    def turn_started(self, rank: int, task_id: str, context_tokens: int) -> None:
        if self.cfg.enabled and self._resident_on(rank, task_id):
            self.policy.on_turn_started(task_id, context_tokens)

    def turn_finished(self, rank: int, task_id: str, context_tokens: int, report: Optional[dict[str, Any]]) -> None:
        if not self.cfg.enabled:
            return
        self._check_report(rank, report)
        if report is not None:
            context_tokens = max(context_tokens, int(report.get("context_tokens", context_tokens)))
        if self._resident_on(rank, task_id):  # not paused or moved meanwhile
            self.policy.on_turn_finished(task_id, context_tokens)

    def task_finished(self, rank: int, task_id: str, context_tokens: Optional[int] = None,
                      now: Optional[float] = None) -> bool:
        """A trajectory is complete (at `now`; default: the last `schedule` time, which dates its
        group's completion latency). False: the report is stale (the task was cancelled or
        restarted elsewhere meanwhile) and its trajectory must not be used."""
        if not self.cfg.enabled:
            self._vanilla_ended(task_id)
            return True
        if not self._runner_is(rank, task_id) and not self._ends_in_transit(task_id):
            return False
        self.policy.on_task_finished(task_id, context_tokens, now=now)
        return True

    def task_failed(self, rank: int, task_id: str, error: str) -> bool:
        """The task's runner raised. It is FAILED: `requeue_failed` it or `cancel_group` its
        group. False: the report is stale (nothing changes)."""
        if not self.cfg.enabled:
            self._vanilla_ended(task_id)
            return True
        if not self._runner_is(rank, task_id) and not self._ends_in_transit(task_id):
            return False
        self.policy.on_task_failed(task_id)
        self.stats["failures"] += 1
        return True

    def _vanilla_ended(self, task_id: str) -> None:
        rank = self._vanilla_running.pop(task_id, None)
        if rank is not None:
            self._vanilla.release(rank)

    def _ends_in_transit(self, task_id: str) -> bool:
        """A handed-over task the leaving rank ended instead (it finished or failed before it
        could stop): True when it is still wanted. Only the leaving rank still knows it: the
        caller routes that rank's reports of the tasks it hands over here."""
        transit = self._transit.pop(task_id, None)
        if transit is None or transit.cancelled:
            return False
        self.runner_rank.pop(task_id, None)
        return True

    def task_released(self, rank: int, task_id: str) -> None:
        """The rank holds nothing more of a paused or cancelled task."""
        if self.cfg.enabled:
            st = self._status(task_id)
            self.policy.on_released(rank, task_id)
            if st is not None and st.task.group_id in self._forget_after_release:
                self.forget_group(st.task.group_id)

    def _resident_on(self, rank: int, task_id: str) -> bool:
        st = self._status(task_id)
        return st is not None and st.state is TaskState.RUNNING and st.rank == rank

    def _runner_is(self, rank: int, task_id: str) -> bool:
        st = self._status(task_id)
        if st is None or st.state not in (TaskState.RUNNING, TaskState.PAUSED):
            return False
        return self.carrier.can_move_tasks or self.runner_rank.get(task_id) == rank

    def _status(self, task_id: str):
        try:
            return self.policy.status(task_id)
        except KeyError:
            return None

    def _check_report(self, rank: int, report: Optional[dict[str, Any]]) -> None:
        if report is None:
            if self.cfg.require_plugin:
                raise PluginMissing(
                    f"rank {rank}: SGLang response carries no tide_ctb report; the sglang_patches plugin is not loaded "
                    "in its scheduler (is tide-megatron installed with its entry points, and SGLang the pinned version?)")
            return
        self.rank_kv[rank] = report
        if rank in self._checked or rank not in self.policy.ranks:
            return
        self._checked.add(rank)
        budget = self.policy.rank_usage(rank)[1]
        cap = self.policy.rank_tasks(rank)[1]
        kv_total, rows_total = report.get("kv_total"), report.get("rows_total")
        hard = self.policy.config.hard_water
        if kv_total and budget * hard > kv_total:
            raise RankMismatch(
                f"rank {rank}: CTB lets its tasks book up to {int(budget * hard)} tokens (ctb.kv_budget_fraction x "
                f"rollout.engine.max_total_tokens, or ctb.policy.rank_token_budget, x ctb.policy.hard_water) but its "
                f"engine's KV pool holds {kv_total}")
        if rows_total and cap is not None and cap > resident_cap_for_rows(rows_total):
            raise RankMismatch(
                f"rank {rank}: CTB lets it hold {cap} tasks (ctb.max_resident_tasks_per_rank) but its engine has "
                f"{rows_total} request rows (rollout.engine.max_running_requests): at most "
                f"{resident_cap_for_rows(rows_total)} keep a row free for the next turn")
