"""Request-level task placement: whole groups onto the least loaded rollout rank.

The baselines (and `tide` with `ctb.enabled=false`) place tasks the way request-level systems
do: a GRPO group goes to the rollout rank with the fewest running tasks (its members share the
prompt's prefix there), at most `max_tasks_per_rank` run on a rank at once, and SGLang's own
continuous batching and retraction decide the rest. CTB (`ctb.enabled` in `tide` mode) places
task by task instead, with the same interface (see `ctb_placement.py`).

Single-threaded: only the rollout service thread calls it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import CancelTask, RunTask, TaskAssignment


class RequestPlacement:
    """Queues assignments and posts `RunTask`s while ranks have room."""

    def __init__(self, mailbox: Mailbox, ranks: Iterable[int], max_tasks_per_rank: int,
                 on_group_started: Optional[Callable[[str], None]] = None):
        if max_tasks_per_rank < 1:
            raise ValueError("scheduler.max_tasks_per_rank must be >= 1")
        self.mailbox = mailbox
        self.max_tasks_per_rank = max_tasks_per_rank
        self._load = {r: 0 for r in ranks}
        self._queue: deque[TaskAssignment] = deque()
        self._where: dict[str, int] = {}
        self._home: dict[str, int] = {}  # group -> the rank its members go to
        self.on_group_started = on_group_started or (lambda group_id: None)
        """Called when a group's first task is sent to a rank (its admission, for staleness)."""
        self.stats = {"dispatched": 0}

    @property
    def ranks(self) -> list[int]:
        return sorted(self._load)

    def submit(self, assignments: Iterable[TaskAssignment], *, front: bool = False) -> None:
        items = list(assignments)
        if front:
            self._queue.extendleft(reversed(items))
        else:
            self._queue.extend(items)

    def dispatch(self, now: float, unconsumed_trajectories: int = 0) -> None:
        """Post queued tasks while some rank has room; a group stays on its first rank."""
        del now, unconsumed_trajectories  # request level: no readiness input
        while self._queue and self._load:
            a = self._queue[0]
            rank = self._home.get(a.group_id)
            if rank not in self._load or self._load[rank] >= self.max_tasks_per_rank:
                rank = min(self._load, key=lambda r: (self._load[r], r))
                if self._load[rank] >= self.max_tasks_per_rank:
                    return
            self._queue.popleft()
            if a.group_id not in self._home:
                self._home[a.group_id] = rank
                self.on_group_started(a.group_id)
            self._where[a.trajectory_id] = rank
            self._load[rank] += 1
            self.stats["dispatched"] += 1
            self.mailbox.post(rank, RunTask(a))

    def running_on(self, task_id: str) -> Optional[int]:
        return self._where.get(task_id)

    def release(self, task_id: str, context_tokens: Optional[int] = None) -> None:
        """The task ended on its rank (done, failed or cancelled): its slot is free."""
        rank = self._where.pop(task_id, None)
        if rank is not None and rank in self._load:
            self._load[rank] -= 1

    def cancel(self, task_id: str, reason: str) -> bool:
        """Stop a task; True when it runs on a rank (a `TaskCancelled` will follow)."""
        for a in list(self._queue):
            if a.trajectory_id == task_id:
                self._queue.remove(a)
                return False
        rank = self._where.get(task_id)
        if rank is None:
            return False
        self.mailbox.post(rank, CancelTask(task_id, reason))
        return True

    def on_turn(self, event) -> None:
        """Request level has no per-turn state (tasks are never paused)."""

    def on_weight_sync(self) -> None:
        """Request level keeps no cache affinity to reset."""

    def forget_group(self, group_id: str) -> None:
        self._home.pop(group_id, None)

    def remove_rank(self, rank: int) -> list[str]:
        """The rank leaves rollout (role change or failure); returns the task ids it ran."""
        self._load.pop(rank, None)
        gone = [tid for tid, r in self._where.items() if r == rank]
        for tid in gone:
            del self._where[tid]
        self._home = {g: r for g, r in self._home.items() if r != rank}
        return gone

    def add_rank(self, rank: int) -> None:
        self._load.setdefault(rank, 0)

    def queued(self) -> int:
        return len(self._queue)

    def running(self) -> int:
        return len(self._where)
