"""Request-level task placement: whole groups onto the least loaded rollout rank.

The baselines (and `tide` with `ctb.enabled=false`) place tasks the way request-level systems
do (`core.request_placement.LeastLoadedPlacer`, the rule the simulator uses too): a GRPO group
goes to the rollout rank with the fewest running tasks (its members share the prompt's prefix
there), at most `max_tasks_per_rank` run on a rank at once, and SGLang's own continuous
batching and retraction decide the rest. CTB (`ctb.enabled` in `tide` mode) places
task by task instead, with the same interface (see `ctb_placement.py`).

A rank that stops answering is dropped (`drop_rank`: its tasks come back as failed) and added
again when it rejoins (`add_rank`); see `quarantine.py`.

Single-threaded: only the rollout service thread calls it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable, Iterable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import CancelTask, RunTask, TaskAssignment
from tide_megatron.controller.control_meter import DecisionTimer
from tide_megatron.core.request_placement import LeastLoadedPlacer


class RequestPlacement:
    """Queues assignments and posts `RunTask`s while ranks have room."""

    hands_over = False
    """A rank leaving rollout drops its tasks (they start afresh elsewhere); CTB hands them over."""

    def __init__(self, mailbox: Mailbox, ranks: Iterable[int], max_tasks_per_rank: int,
                 on_group_started: Optional[Callable[[str], None]] = None):
        if max_tasks_per_rank < 1:
            raise ValueError("scheduler.max_tasks_per_rank must be >= 1")
        self.mailbox = mailbox
        self._placer = LeastLoadedPlacer(ranks, max_tasks_per_rank)
        self._queue: deque[TaskAssignment] = deque()
        self._where: dict[str, int] = {}  # running task -> its rank
        self._cancelled: set[str] = set()  # running tasks told to stop, until their rank answers
        self.on_group_started = on_group_started or (lambda group_id: None)
        """Called when a group's first task is sent to a rank (its admission, for staleness)."""
        self.dispatched_to: Counter[int] = Counter()
        """Tasks posted to each rank so far (the step log shows how evenly a step spread them)."""
        self.decision_times = DecisionTimer()
        """How long each placement pass that posted a task took (`control_meter.py`)."""

    @property
    def stats(self) -> dict[str, int]:
        return {"dispatched": self.dispatched_to.total()}

    @property
    def ranks(self) -> list[int]:
        return self._placer.ranks

    def describe(self) -> str:
        """Where the tasks are, for a stalled run's message."""
        running = ", ".join(f"rank {r}: {n}" for r, n in sorted(self._placer.loads().items()) if n)
        return f"request placement: {len(self._queue)} queued; running: {running or 'none'}"

    def submit(self, assignments: Iterable[TaskAssignment], *, front: bool = False) -> None:
        items = list(assignments)
        if front:
            self._queue.extendleft(reversed(items))
        else:
            self._queue.extend(items)

    def dispatch(self, now: float, unconsumed_trajectories: int = 0, clock=None) -> list[str]:
        """Post queued tasks while some rank has room; a group stays on its first rank.
        Returns the groups it cancelled: none (request level has no deadlines)."""
        del now, unconsumed_trajectories, clock  # request level: no readiness input
        t0, before = time.perf_counter(), self.dispatched_to.total()
        self._post_queued()
        if self.dispatched_to.total() > before:
            self.decision_times.record(time.perf_counter() - t0)
        return []

    def _post_queued(self) -> None:
        while self._queue:
            a = self._queue[0]
            started = self._placer.is_placed(a.group_id)
            rank = self._placer.place(a.group_id)
            if rank is None:
                return
            self._queue.popleft()
            if not started:
                self.on_group_started(a.group_id)
            self._where[a.trajectory_id] = rank
            self.dispatched_to[rank] += 1
            self.mailbox.post(rank, RunTask(a))

    def finished(self, task_id: str, rank: int, context_tokens: Optional[int] = None) -> bool:
        """A trajectory arrived; False when the task was cancelled meanwhile (drop it)."""
        return self._end(task_id, rank)

    def failed(self, task_id: str, rank: int, error: str) -> bool:
        return self._end(task_id, rank)

    def released(self, task_id: str, rank: int) -> None:
        """The rank dropped a cancelled task: its slot is free."""
        self._end(task_id, rank)

    def _end(self, task_id: str, rank: int) -> bool:
        if self._where.get(task_id) != rank:
            return False
        del self._where[task_id]
        self._placer.release(rank)
        if task_id in self._cancelled:
            self._cancelled.discard(task_id)
            return False
        return True

    def retry(self, assignment: TaskAssignment) -> None:
        """Run a failed task again from scratch, ahead of new groups."""
        self._cancelled.discard(assignment.trajectory_id)
        self.submit([assignment], front=True)

    def cancel_group(self, group_id: str, reason: str) -> None:
        """Stop a group's tasks: queued ones are dropped, running ones cancelled on their rank
        (its `TaskCancelled` frees the slot; a trajectory that crosses the cancel is stale)."""
        self._queue = deque(a for a in self._queue if a.group_id != group_id)
        for tid, rank in list(self._where.items()):
            if tid.rsplit("/", 1)[0] == group_id and tid not in self._cancelled:
                self._cancelled.add(tid)
                self.mailbox.post(rank, CancelTask(tid, reason))

    def on_turn(self, event) -> None:
        """Request level has no per-turn state (tasks are never paused)."""

    def on_weight_sync(self) -> None:
        """Request level keeps no cache affinity to reset."""

    def forget_group(self, group_id: str) -> None:
        self._placer.forget_group(group_id)

    def remove_rank(self, rank: int) -> list[str]:
        """The rank leaves rollout (role change or failure); returns the task ids it ran."""
        self._placer.remove_rank(rank)
        gone = [tid for tid, r in self._where.items() if r == rank]
        for tid in gone:
            del self._where[tid]
        return gone

    def drop_rank(self, rank: int) -> list[str]:
        """The rank stopped answering (quarantine): nothing more goes to it, and nothing is sent
        to it now (it would not read it; the controller clears it with one `CancelAll`).
        Returns the ids of the tasks it held; each failed there (the caller retries it or
        gives its group up)."""
        gone = self.remove_rank(rank)
        self._cancelled.difference_update(gone)  # a cancel it never answered: nothing to wait for
        return gone

    def take_dropped_carries(self) -> list:
        return []  # nothing is ever handed over here

    def add_rank(self, rank: int) -> None:
        self._placer.add_rank(rank)

    def engine_ready(self, rank: int, kv_tokens: int | None, request_rows: int | None) -> None:
        """Request-level placement leaves KV and rows to SGLang: nothing to size."""

    def queued(self) -> int:
        return len(self._queue)

    def running(self) -> int:
        return len(self._where)
