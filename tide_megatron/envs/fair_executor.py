"""Blocking work of the env server, on worker threads, shared fairly between connections.

The server's event loop must stay free to read, parse small requests and answer pings, so
everything that can take long runs on threads: envs whose calls block (a game engine, a VM,
Pillow rendering), image checks and writes, building a task list, decoding a long request,
encoding a large reply. A plain thread pool serves its queue first come first served: one
client that pipelines a hundred heavy calls would put them all ahead of everyone else's
next call. `FairExecutor` keeps one queue per owner (a connection) and hands free threads to
the owners in turn, so a job of any other connection waits for at most one job per worker
before it starts, however deep one connection's backlog is.

Used from the event loop only (`run` is a coroutine); the jobs themselves run on threads.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from typing import Any, Callable, Hashable


class FairExecutor:
    def __init__(self, workers: int, thread_name_prefix: str = "env-worker"):
        if workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {workers}")
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix)
        self._idle = workers
        # Owners with queued jobs, in turn order: the next job comes from the first owner,
        # which then moves to the back.
        self._queues: collections.OrderedDict[Hashable, collections.deque] = collections.OrderedDict()
        self._closed = False

    async def run(self, owner: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on a worker thread in `owner`'s turn; returns its result."""
        if self._closed:
            raise RuntimeError("the executor is shut down")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queues.setdefault(owner, collections.deque()).append((fn, args, fut))
        self._pump(loop)
        return await fut

    @property
    def closed(self) -> bool:
        return self._closed

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._idle > 0 and self._queues:
            owner, queue = next(iter(self._queues.items()))
            fn, args, fut = queue.popleft()
            del self._queues[owner]
            if queue:
                self._queues[owner] = queue
            if fut.cancelled():  # its caller went away (a dropped connection) before it started
                continue
            self._idle -= 1
            job = self._pool.submit(fn, *args)
            job.add_done_callback(lambda job, fut=fut: _notify(loop, self._finished, loop, job, fut))

    def _finished(self, loop: asyncio.AbstractEventLoop, job: concurrent.futures.Future, fut: asyncio.Future) -> None:
        self._idle += 1
        if not fut.cancelled():
            if job.cancelled():
                fut.cancel()
            elif job.exception() is not None:
                fut.set_exception(job.exception())
            else:
                fut.set_result(job.result())
        if not self._closed:
            self._pump(loop)

    def shutdown(self) -> None:
        """Stop taking jobs; queued ones are cancelled, running ones finish on their threads."""
        self._closed = True
        for queue in self._queues.values():
            for _, _, fut in queue:
                fut.cancel()
        self._queues.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _notify(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    # Runs on the worker thread; the loop may be gone when a job outlives a stopped server.
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
