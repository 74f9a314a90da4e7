"""A small deterministic discrete-event loop.

Events are ordered by (time, insertion number), so two runs with the same inputs pop events in
the same order: determinism needs no more than that and seeded workloads. Long-lived actors
(the trainer, the controller) are written as generators that yield either a delay in seconds
or a `WaitUntil` predicate, re-checked whenever the simulator calls `notify()`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Generator, List, Optional, Union


@dataclass
class WaitUntil:
    """Suspend a process until `predicate()` is true (checked on `notify`)."""

    predicate: Callable[[], bool]
    label: str = ""


ProcessGen = Generator[Union[float, WaitUntil], None, None]


class Process:
    """A generator driven by the loop."""

    def __init__(self, loop: "EventLoop", gen: ProcessGen, name: str):
        self.loop = loop
        self.gen = gen
        self.name = name
        self.waiting: Optional[WaitUntil] = None
        self.wait_since = 0.0
        self.finished = False

    def step(self) -> None:
        """Run until the next yield and register what it waits for."""
        self.waiting = None
        try:
            item = next(self.gen)
        except StopIteration:
            self.finished = True
            return
        if isinstance(item, WaitUntil):
            if item.predicate():
                self.loop.at(self.loop.now, self.step)
                return
            self.waiting = item
            self.wait_since = self.loop.now
            self.loop._waiters.append(self)
        else:
            self.loop.at(self.loop.now + max(0.0, float(item)), self.step)


class EventLoop:
    """Time-ordered callbacks plus condition-waiting processes."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: List[tuple] = []
        self._seq = 0
        self._waiters: List[Process] = []
        self.events_processed = 0
        self.stopped = False

    def at(self, time: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, fn, args))

    def after(self, delay: float, fn: Callable, *args) -> None:
        self.at(self.now + delay, fn, *args)

    def spawn(self, gen: ProcessGen, name: str) -> Process:
        proc = Process(self, gen, name)
        self.at(self.now, proc.step)
        return proc

    def notify(self) -> None:
        """State changed: wake every process whose condition now holds (in wait order)."""
        if not self._waiters:
            return
        still = []
        for proc in self._waiters:
            if proc.waiting is not None and proc.waiting.predicate():
                proc.waiting = None
                self.at(self.now, proc.step)
            else:
                still.append(proc)
        self._waiters = still

    def stop(self) -> None:
        self.stopped = True

    def run(self, max_time: float) -> None:
        heap = self._heap
        while heap and not self.stopped:
            time, _, fn, args = heapq.heappop(heap)
            if time > max_time:
                self.now = max_time
                return
            self.now = time
            self.events_processed += 1
            fn(*args)
