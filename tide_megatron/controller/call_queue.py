"""Requests from the main thread, run on the rollout service's thread.

The rollout service's state is owned by its thread alone, so the main thread never touches it:
it queues a function (and, optionally, a condition) and waits for a Future. The service's loop
runs each queued function on its own thread once per turn, and keeps a conditional one until its
condition holds, checking it again every turn; the main thread's waits (a batch to train, the
weights to settle) cost it nothing while the condition is false.

The queue itself is the one thing both threads touch; `queue.Queue` does its locking. Everything
else here (the conditional requests waiting) is the service thread's.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable, Optional

_When = Optional[Callable[[], bool]]


class CallQueue:
    def __init__(self):
        self.arrived = threading.Event()
        """Set by `submit`: the service thread's idle wait ends at once for a new request."""
        self._calls: "queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future, _When]]" = queue.Queue()
        self._waiting: list[tuple[Callable[[], bool], Callable[[], Any], concurrent.futures.Future]] = []

    def submit(self, fn: Callable[[], Any], when: _When = None) -> concurrent.futures.Future:
        """Any thread: queue `fn` (to run once `when()` holds, if given); its result's Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut, when))
        self.arrived.set()
        return fut

    def serve(self) -> int:
        """The service thread: run what was queued, in order, then every waiting request whose
        condition holds now (newly queued conditional ones included). Returns how many ran."""
        ran = 0
        while True:
            try:
                fn, fut, when = self._calls.get_nowait()
            except queue.Empty:
                break
            if when is None:
                _run(fn, fut)
                ran += 1
            else:
                self._waiting.append((when, fn, fut))
        still = []
        for when, fn, fut in self._waiting:
            if when():
                _run(fn, fut)
                ran += 1
            else:
                still.append((when, fn, fut))
        self._waiting = still
        return ran

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """The service thread failed: every request not run yet, waiting or queued, gets an
        `error()` of its own instead of a result."""
        for _, _, fut in self._waiting:
            fut.set_exception(error())
        while not self._calls.empty():
            _, fut, _ = self._calls.get_nowait()
            fut.set_exception(error())


def _run(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
    try:
        fut.set_result(fn())
    except BaseException as exc:
        fut.set_exception(exc)
