"""A rollout rank ends on SIGTERM (torchrun's stop before a restart), as rank 0 does: the handler
SGLang's tokenizer manager installs (it only flags an HTTP drain) is removed once the engine is
up, or the rank outlived the SIGTERM until torchrun's SIGKILL 30 s later (seen in the chaos soak:
a rank kill took 31 s to detect)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tide_megatron.rollout.engine import _default_sigterm

uvloop = pytest.importorskip("uvloop", reason="SGLang's event loop (uvloop) is not installed")


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_sigterm_goes_back_to_its_default_on_the_engines_loop(new_loop):
    before = signal.getsignal(signal.SIGTERM)
    loop = new_loop()
    try:
        async def install_like_sglang() -> None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)

        loop.run_until_complete(install_like_sglang())
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        loop.run_until_complete(_default_sigterm())
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        loop.close()
        signal.signal(signal.SIGTERM, before)
