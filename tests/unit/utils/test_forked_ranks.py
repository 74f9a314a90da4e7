"""When `launch/torchrun.py` forks its ranks from a preloaded server (`forked_ranks.wanted`)."""

from __future__ import annotations

import logging

import pytest
import torch

from tide_megatron.utils import forked_ranks


def test_the_setting_decides_and_without_it_the_host_does(monkeypatch):
    monkeypatch.delenv("TIDE_DISABLE_CPU_COMPAT", raising=False)
    monkeypatch.setenv(forked_ranks.PRELOAD_ENV, "1")
    assert forked_ranks.wanted()
    monkeypatch.setenv(forked_ranks.PRELOAD_ENV, "0")
    assert not forked_ranks.wanted()
    monkeypatch.delenv(forked_ranks.PRELOAD_ENV)
    assert forked_ranks.wanted() == (not torch.cuda.is_available())
    monkeypatch.setenv("TIDE_DISABLE_CPU_COMPAT", "1")  # the GPU path, forced on a CPU host
    assert not forked_ranks.wanted()
    with pytest.raises(ValueError, match="TIDE_PRELOAD_RANKS must be 0 or 1, got 'yes'"):
        forked_ranks.wanted("yes")


def test_torchruns_line_for_a_failed_forked_rank_loses_its_traceback_only():
    try:
        raise RuntimeError("the agent's own wait")
    except RuntimeError:
        import sys

        exc_info = sys.exc_info()
    failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed (exitcode: %s) local_rank: %s", (1, 0), exc_info)
    other = logging.LogRecord("x", logging.ERROR, __file__, 1, "something else", (), exc_info)
    assert forked_ranks._failure_in_one_line(failed) and failed.exc_info is None
    assert failed.getMessage() == "failed (exitcode: 1) local_rank: 0"
    assert forked_ranks._failure_in_one_line(other) and other.exc_info is exc_info


@pytest.mark.parametrize("argv,forkable", [(["launch/train.py", "+recipe=tiny_cpu"], True),
                                           (["-m", "some.module"], False), (["--no-python", "echo"], False)])
def test_only_a_python_script_file_runs_in_a_forked_rank(argv, forkable):
    from torch.distributed import run

    assert forked_ranks.can_run(run.parse_args(["--nproc-per-node", "2", *argv])) == forkable


def test_the_private_multiprocessing_calls_forked_ranks_makes_are_still_there():
    """Drift: `run_rank`, `stop_forkserver` and `stop_resource_tracker` call four functions no
    public API offers (each call says why); an upgrade of Python that renames one must fail here,
    not as a rank that hangs at exit or a server left behind."""
    import atexit
    import threading
    from multiprocessing import forkserver, resource_tracker

    for owner, name in ((threading, "_shutdown"), (atexit, "_run_exitfuncs"), (forkserver._forkserver, "_stop"),
                        (resource_tracker._resource_tracker, "_stop")):
        assert callable(getattr(owner, name, None)), f"{owner!r} has no {name}()"
