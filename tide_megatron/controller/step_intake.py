"""The trainer's side of the global buffer: what each step takes, as the rollout service's
thread sees it.

A step takes its groups from the buffer in one of two ways: the whole global batch at once, or
(streaming modes) the groups ready when it opens and then each later group as it completes,
handed to the trainer's micro-batch source from the rollout thread (`feed`, every loop turn).
The rollout side needs to know what the open step consumed for two things: admission (a group
started now must fit in the staleness window less what this step took already) and CTB's
deadlines (the trainer's clock: when the next weight sync is due and how fast steps consume).

Owned by the rollout service's thread; the main thread reaches it through the service's
`open_step`, `fetch_batch`, `stream_into` and `close_step`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from tide_megatron.core.buffer import CompletedGroup, GlobalBuffer
from tide_megatron.core.ctb_deadline import ConsumptionMeter, TrainerClock

logger = logging.getLogger(__name__)


class StepIntake:
    """What the open step took from the buffer, and the trainer clock that CTB's deadlines read."""

    def __init__(self, *, buffer: GlobalBuffer, continuous_rollout: bool, group_size: int, groups_per_step: int):
        self.buffer = buffer
        self.continuous_rollout = continuous_rollout
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.consumed_groups = 0
        """Groups the open step (or the last, until the next weight sync) took from the buffer."""
        self._stream: Optional[tuple[Any, int, Callable[[CompletedGroup], None]]] = None
        self._started: Optional[float] = None
        self._consumption = ConsumptionMeter(window_steps=4)

    def open(self, max_groups: int, version: int) -> tuple[float, float, list[CompletedGroup], int]:
        """A streaming step starts: RAS and the head-of-line age, the groups ready now, and the
        groups it trains in all (fewer than `max_groups` while the buffer retains a reservoir
        after a rollout scale-down, see `GlobalBuffer.open_stream`)."""
        now = time.monotonic()
        hol = self.buffer.head_of_line_latency(now)
        ras = self.buffer.begin_step(now)
        self._started = now
        taken, groups = self.buffer.open_stream(version, now, max_groups)
        self.consumed_groups = len(taken)
        if groups < max_groups:
            logger.info("step of %d group(s), not %d: the buffer keeps a reservoir after a rollout scale-down",
                        groups, max_groups)
        return ras, hol, taken, groups

    def stream_into(self, sink, groups_left: int, on_group: Callable[[CompletedGroup], None], version: int) -> None:
        """Completed groups of the open step go to `on_group` as they complete (this thread)."""
        self._stream = (sink, groups_left, on_group)
        self.feed(version)

    def feed(self, version: int) -> None:
        """Hand the open stream each group completed since (one loop turn)."""
        while self._stream is not None and self._stream[1] > 0:
            sink, left, on_group = self._stream
            taken = self.buffer.fetch(version, time.monotonic(), left * self.group_size, max_groups=1)
            if not taken:
                return
            self.consumed_groups += 1
            self._stream = (sink, left - 1, on_group)
            on_group(taken[0])

    def fail(self, error: BaseException) -> None:
        """The rollout side failed: a trainer blocked on the open stream's source stops too."""
        if self._stream is not None:
            self._stream[0].fail(error)

    def batch_ready(self, version: int) -> bool:
        return self.buffer.batch_available(version)

    def can_open(self, version: int) -> bool:
        """A streaming step starts once it has a group to train, or one it must wait for."""
        return self.buffer.fetchable_trajectories(version, self.groups_per_step * self.group_size) > 0 or \
            self.buffer.last_chance_reserve(version) > 0

    def fetch_batch(self, version: int):
        """A whole-batch step starts: (the global batch, RAS, head-of-line age), or None when
        stale groups were dropped and what is left falls short (the caller waits again)."""
        now = time.monotonic()
        self.buffer.drop_stale(version, now)
        if not self.batch_ready(version):
            return None
        hol = self.buffer.head_of_line_latency(now)
        ras = self.buffer.begin_step(now)
        self._started = now
        batch = self.buffer.fetch_batch(version, now)
        assert batch is not None, "batch_available and fetch_batch disagree"
        self.consumed_groups = len(batch.groups)
        return batch, ras, hol

    def close(self):
        """The step's update is done: its readiness signals (`GlobalBuffer.end_step`)."""
        self._stream = None
        now = time.monotonic()
        readiness = self.buffer.end_step(now)
        if self._started is not None:
            self._consumption.record_step(self._started, now, self.consumed_groups * self.group_size)
        self._started = None
        return readiness

    def clock(self, now: float, version: int) -> Optional[TrainerClock]:
        """The trainer's clock for deadline-aware admission (None until a step was measured)."""
        est = self.buffer.estimate()
        if not self.continuous_rollout or not est.steps_observed:
            return None
        started = self._started if self._started is not None else now
        return TrainerClock(version=version, step_time_s=est.step_time_s,
                            next_sync_at=started + est.step_time_s, consumed_per_s=self._consumption.rate())
