"""The weight-update boundary of an engine's turns, shared by the SGLang engine and its stand-in.

A weight update is a boundary for the tasks running on an engine: turns that are generating
finish first, no new turn starts, every open session is closed (its KV was computed by the old
weights), the weights load and the cache is flushed, then turns go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable


class TurnGate:
    """Counts the turns generating on one engine and holds new ones while weights change."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def turn(self):
        """Hold while one turn generates: a weight update waits for it and blocks new ones."""
        await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    @property
    def active(self) -> int:
        return self._active

    async def closed(self, work: Callable[[], Awaitable[None]]) -> None:
        """Await `work()` with no turn in flight and none starting meanwhile."""
        self._open.clear()
        try:
            await self._idle.wait()
            await work()
        finally:
            self._open.set()
