"""A call waiting on SGLang's scheduler returns at once when the scheduler dies (no SGLang here:
the engine object is built without starting one). A weight update that waited on a dead
scheduler once stalled a rollout rank past its heartbeat timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from tide_megatron.rollout.engine import RolloutEngine


def _engine_without_sglang() -> RolloutEngine:
    engine = object.__new__(RolloutEngine)
    engine.died = False
    engine._death = asyncio.Event()
    engine.loop = asyncio.new_event_loop()
    return engine


def test_a_waiting_call_raises_as_soon_as_the_scheduler_dies():
    engine = _engine_without_sglang()
    never_answers = asyncio.Event()

    async def call():
        engine.loop.call_later(0.1, engine._child_died, None, None)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            await engine._unless_dead(never_answers.wait())
        return time.monotonic() - t0

    try:
        assert engine.loop.run_until_complete(asyncio.wait_for(call(), 10)) < 5
        # once dead, a new call does not even start
        with pytest.raises(RuntimeError, match="died"):
            engine.loop.run_until_complete(engine._unless_dead(asyncio.sleep(0, result=1)))
    finally:
        engine.loop.close()


def test_a_live_scheduler_answers_through_the_guard():
    engine = _engine_without_sglang()
    try:
        assert engine.loop.run_until_complete(engine._unless_dead(asyncio.sleep(0.01, result="ok"))) == "ok"
    finally:
        engine.loop.close()
