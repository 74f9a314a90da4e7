"""Task-level placement by CTB across remote rollout ranks: the CTB dispatcher decides, the
mailbox carries.

The dispatcher (`rollout/ctb_dispatcher.py`) owns CTB's policy: token-budget admission with
probing, request rows and env slots, deadlines from the trainer's clock, P(t) pausing,
resume-before-admit, retries and cancellation. `MailboxCarrier` turns its decisions into typed
messages, one FIFO per rank, so a rank sees each task's decisions in order:

- admit  -> `RunTask` with the task's CTB tag fields;
- pause  -> `PauseTask`: no further turn; the rank closes the session after any in-flight turn
  and answers `TaskReleased`;
- resume -> `ResumeTask` on the rank that holds the task (a mailbox cannot move a task);
- cancel -> `CancelTask`: the rank drops the task and answers `TaskCancelled`.

A rank that ERS moves to the trainer hands its tasks over instead (`hand_off_rank`): each one's
state comes back to rank 0 (`TaskCarried`) and starts where CTB resumes it, as a `RunTask`
carrying it (`RunTask.carry`). One whose group ends before it starts again has its env session
closed by a rollout rank (`ReleaseCarry`).

`CTBPlacement` gives the rollout service the same interface as `RequestPlacement`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Callable, Iterable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (CancelTask, PauseTask, ReleaseCarry, ResumeTask, RunTask, TaskAssignment,
                                         TurnEvent)
from tide_megatron.controller.control_meter import DecisionTimer
from tide_megatron.core.ctb import Admit, GroupCancelled
from tide_megatron.core.ctb_deadline import TrainerClock
from tide_megatron.rollout.ctb_carrier import TagFields
from tide_megatron.rollout.ctb_dispatcher import CTBDispatcher, RankResources

logger = logging.getLogger(__name__)


class MailboxCarrier:
    """CTB decisions as typed messages to the ranks' mailboxes."""

    can_move_tasks = False  # a task's runner lives in its rank's process

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox
        self.dispatched_to: Counter[int] = Counter()
        """Tasks started (or handed over) on each rank so far."""

    def admit(self, rank: int, assignment: TaskAssignment, tag: Optional[TagFields],
              carry: Optional[dict] = None) -> None:
        self.dispatched_to[rank] += 1
        self.mailbox.post(rank, RunTask(assignment, tag.to_json() if tag is not None else None, carry))

    def pause(self, rank: int, task_id: str) -> None:
        self.mailbox.post(rank, PauseTask(task_id))

    def resume(self, rank: int, task_id: str, tag: TagFields) -> None:
        self.mailbox.post(rank, ResumeTask(task_id, tag.to_json()))

    def cancel(self, rank: int, task_id: str) -> None:
        self.mailbox.post(rank, CancelTask(task_id, "cancelled by CTB"))

    def release(self, rank: int, carry: dict) -> None:
        self.mailbox.post(rank, ReleaseCarry(str(carry["claim"])))


class CTBPlacement:
    def __init__(self, cfg, mailbox: Mailbox, ranks: Iterable[int],
                 on_group_started: Optional[Callable[[str], None]] = None):
        sched, engine = cfg.scheduler, cfg.rollout.engine
        ctb_cfg = dataclasses.replace(cfg.ctb, policy=dataclasses.replace(
            cfg.ctb.policy, task_max_turns=cfg.rollout.runner.max_turns, max_staleness=sched.max_staleness,
            trainer_batch_trajectories=sched.groups_per_step * sched.group_size))
        self._resources = RankResources(engine.max_total_tokens, engine.max_running_requests)
        self._carrier = MailboxCarrier(mailbox)
        self.dispatcher = CTBDispatcher(ctb_cfg, self._carrier, {r: self._resources for r in sorted(ranks)})
        self.on_group_started = on_group_started or (lambda group_id: None)
        """Called when CTB admits a group's first task (its admission, for staleness)."""
        self._started_groups: set[str] = set()
        self.decision_times = DecisionTimer()
        """How long each placement pass that decided something took (`control_meter.py`)."""

    @property
    def stats(self) -> dict[str, int]:
        return {**self.dispatcher.stats, **self.budget_tokens}

    @property
    def dispatched_to(self) -> Counter[int]:
        return self._carrier.dispatched_to

    def submit(self, assignments: Iterable[TaskAssignment], *, front: bool = False) -> None:
        del front  # P(t) orders tasks: evaluation tasks first through I_eval
        self.dispatcher.submit(assignments)

    def dispatch(self, now: float, unconsumed_trajectories: int = 0,
                 clock: Optional[TrainerClock] = None) -> list[str]:
        """One CTB pass; returns the groups it cancelled (past their staleness deadline)."""
        cancelled, t0 = [], time.perf_counter()
        decisions = self.dispatcher.schedule(now, unconsumed_trajectories, clock=clock)
        if decisions:
            self.decision_times.record(time.perf_counter() - t0)
        for d in decisions:
            if isinstance(d, GroupCancelled):
                cancelled.append(str(d.group_id))
            elif isinstance(d, Admit):
                gid = str(d.task.group_id)
                if gid not in self._started_groups:
                    self._started_groups.add(gid)
                    self.on_group_started(gid)
        return cancelled

    def on_turn(self, event: TurnEvent) -> None:
        if event.phase == "started":
            self.dispatcher.turn_started(event.src, event.task_id, event.context_tokens)
        else:
            self.dispatcher.turn_finished(event.src, event.task_id, event.context_tokens, event.report)

    def finished(self, task_id: str, rank: int, context_tokens: Optional[int] = None) -> bool:
        return self.dispatcher.task_finished(rank, task_id, context_tokens)

    def failed(self, task_id: str, rank: int, error: str) -> bool:
        return self.dispatcher.task_failed(rank, task_id, error)

    def released(self, task_id: str, rank: int) -> None:
        self.dispatcher.task_released(rank, task_id)

    def retry(self, assignment: TaskAssignment) -> None:
        self.dispatcher.requeue_failed(assignment.trajectory_id)

    def cancel_group(self, group_id: str, reason: str) -> None:
        del reason
        self.dispatcher.cancel_group(group_id)

    def forget_group(self, group_id: str) -> None:
        self.dispatcher.forget_group(group_id)
        self._started_groups.discard(group_id)

    def on_weight_sync(self) -> None:
        self.dispatcher.on_weight_sync()

    @property
    def hands_over(self) -> bool:
        """A rank leaving rollout alive hands its tasks over (`hand_off_rank`) rather than
        dropping them."""
        return self.dispatcher.cfg.enabled

    def hand_off_rank(self, rank: int) -> list[str]:
        """See `CTBDispatcher.hand_off_rank`."""
        return self.dispatcher.hand_off_rank(rank)

    def in_transit(self, task_id: str) -> bool:
        return self.dispatcher.in_transit(task_id)

    def describe(self) -> str:
        """Where the tasks are, for a stalled run's message."""
        return self.dispatcher.describe()

    def carried(self, task_id: str, carry: dict) -> bool:
        return self.dispatcher.task_carried(task_id, carry)

    def not_carried(self, task_id: str) -> bool:
        return self.dispatcher.task_not_carried(task_id)

    def take_dropped_carries(self) -> list[tuple[str, dict]]:
        """Handed-over tasks whose group was cancelled before they started again (their tokens
        are the caller's to book)."""
        out, self.dispatcher.dropped_carries = self.dispatcher.dropped_carries, []
        return out

    def drop_rank(self, rank: int) -> list[str]:
        """A quarantined rank: CTB forgets it; its tasks come back failed (see `CTBDispatcher.drop_rank`)."""
        return self.dispatcher.drop_rank(rank)

    def add_rank(self, rank: int) -> None:
        """A rank rejoins with a fresh engine state (it dropped every task and loaded new weights)."""
        self.dispatcher.add_rank(rank, self._resources)

    def engine_ready(self, rank: int, kv_tokens: int | None, request_rows: int | None) -> None:
        """A rank's engine started: CTB's budget for it comes from what SGLang allocated."""
        if kv_tokens is None or request_rows is None:
            return
        sized = self.dispatcher.engine_sized(rank, RankResources(kv_tokens, request_rows))
        if sized is not None:
            logger.info("rank %d: CTB budget %d tokens of SGLang's KV pool of %d (ctb.kv_budget_fraction), "
                        "at most %d tasks of %d request rows", rank, sized[0], kv_tokens, sized[1], request_rows)

    @property
    def budget_tokens(self) -> dict[str, int]:
        """KV pool and CTB token budget summed over the ranks in rollout (metrics)."""
        ranks = self.dispatcher.policy.ranks  # each added with its resources (config or engine's)
        pools = [self.dispatcher.resources[r].kv_tokens or 0 for r in ranks]
        return {"kv_pool_tokens": sum(pools),
                "kv_budget_tokens": sum(self.dispatcher.policy.rank_usage(r)[1] for r in ranks)}

    def kv_usage(self, ranks) -> float | None:
        """Mean share of the KV token budget that resident tasks hold on `ranks` (None: none
        known to CTB, or CTB off)."""
        if not self.dispatcher.cfg.enabled:
            return None
        shares = []
        for rank in ranks:
            try:
                used, budget = self.dispatcher.policy.rank_usage(rank)
            except KeyError:
                continue
            shares.append(used / budget if budget else 0.0)
        return sum(shares) / len(shares) if shares else None

    def queued(self) -> int:
        return self.dispatcher.policy.counts()["queued"]

    def running(self) -> int:
        counts = self.dispatcher.policy.counts()
        return counts["running"] + counts["paused"]
