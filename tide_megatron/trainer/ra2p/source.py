"""Where a step's micro-batches come from: all ready at start (RAS), or arriving (TPRM).

A step's size is fixed when it starts (the elastic batch in [B_min, B_ideal] is chosen then, and
Megatron's schedule needs the micro-batch count up front), but its micro-batches need not all be
ready: RAS of them are, the rest arrive one every TPRM on average. Executors read them through
`MicroBatchSource`, which tells how many are ready *now* (what colocated aggregation batches
together) and blocks for the next one when none is.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

from tide_megatron.trainer.batch import MicroBatch


@runtime_checkable
class MicroBatchSource(Protocol):
    """The micro-batches of one step on one rank, in dispatch order."""

    def __len__(self) -> int:
        """Micro-batches in the step (ready or not)."""
        ...

    def take_ready(self, limit: int) -> list[MicroBatch]:
        """Up to `limit` micro-batches: all that are ready, or block until one is. [] at the end."""
        ...

    @property
    def last_wait_s(self) -> float:
        """Seconds the last `take_ready` blocked for an arrival (trainer waiting, not compute)."""
        ...


class ReadySource:
    """Every micro-batch ready at the start of the step (RAS >= N)."""

    def __init__(self, micro_batches: Sequence[MicroBatch]):
        self._items = list(micro_batches)
        self._next = 0

    def __len__(self) -> int:
        return len(self._items)

    def take_ready(self, limit: int) -> list[MicroBatch]:
        taken = self._items[self._next:self._next + limit]
        self._next += len(taken)
        return taken

    @property
    def last_wait_s(self) -> float:
        return 0.0


class SourceError(RuntimeError):
    """No micro-batch can arrive: the producer failed, or none came within the timeout."""


class ArrivingSource:
    """Micro-batches pushed by a producer thread (the buffer reader) while the step runs.

    A blocked `take_ready` never waits forever: it raises `SourceError` when the producer
    calls `fail` (the rollout side died or stalled), when `health()` raises, or after
    `timeout_s` without an arrival. The time it blocked is `last_wait_s` (and summed in
    `waited_s`): arrival waits are the trainer's waiting time, not compute.
    """

    def __init__(self, num_micro_batches: int, *, timeout_s: float = 3600.0,
                 health: Optional[Callable[[], None]] = None):
        self._n = num_micro_batches
        self._queue: "queue.Queue[MicroBatch]" = queue.Queue()
        self._taken = 0
        self._lock = threading.Lock()
        self._timeout_s = timeout_s
        self._health = health
        self._error: Optional[BaseException] = None
        self.waited_s = 0.0
        self._last_wait_s = 0.0

    def __len__(self) -> int:
        return self._n

    def put(self, micro_batch: MicroBatch) -> None:
        self._queue.put(micro_batch)

    def fail(self, error: BaseException) -> None:
        """The producer cannot deliver: wake a blocked consumer with this error."""
        self._error = error
        self._queue.put(None)  # type: ignore[arg-type]

    @property
    def last_wait_s(self) -> float:
        return self._last_wait_s

    def _get(self) -> MicroBatch:
        started = time.perf_counter()
        deadline = started + self._timeout_s
        while True:
            if self._error is not None:
                raise SourceError(str(self._error)) from self._error
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._health is not None:
                    self._health()
                if time.perf_counter() > deadline:
                    raise SourceError(f"no micro-batch arrived for {self._timeout_s:.0f} s "
                                      f"({self._taken} of {self._n} taken)") from None
                continue
            if item is None:
                continue  # the wake-up of `fail`: raise at the top
            self._last_wait_s = time.perf_counter() - started
            self.waited_s += self._last_wait_s
            return item

    def take_ready(self, limit: int) -> list[MicroBatch]:
        with self._lock:
            if self._taken >= self._n:
                return []
            taken = [self._get()]  # block for the first one only
            while len(taken) < limit and self._taken + len(taken) < self._n:
                try:
                    taken.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._taken += len(taken)
            return taken


def as_source(micro_batches: "Sequence[MicroBatch] | MicroBatchSource") -> MicroBatchSource:
    if isinstance(micro_batches, MicroBatchSource) and not isinstance(micro_batches, (list, tuple)):
        return micro_batches
    return ReadySource(micro_batches)


def iterate(source: MicroBatchSource) -> Iterator[MicroBatch]:
    """One micro-batch at a time, in order, blocking for arrivals."""
    while True:
        taken = source.take_ready(1)
        if not taken:
            return
        yield taken[0]
