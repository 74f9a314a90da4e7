"""Ranks forked from a server that has imported the ML stack once, where no GPU is present.

A rank started by torchrun is a fresh interpreter that imports torch, Megatron-core and (on a
rollout rank) SGLang: ~6 s of CPU for the first two and ~4 s more for SGLang, per rank. On a
2-core host the ranks of a 4-rank job pay that at once, which is most of a short job's start.
With `launch/torchrun.py` on a host without CUDA, torchrun starts its ranks with the
`forkserver` method instead: a server process imports those modules once
(`tide_megatron.utils.rank_preload`) and every rank, restarts included, is a fork of it, which
runs the training script as its `__main__` (torchrun's `--run-path`).

Never where CUDA exists: a process that has initialised CUDA cannot be forked (SGLang's import
may query the device), and on GPU hosts the import is a small part of a job's start.
`TIDE_PRELOAD_RANKS=0` turns it off, `=1` forces it.
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import sys
import threading

PRELOAD_ENV = "TIDE_PRELOAD_RANKS"
PRELOAD_MODULE = "tide_megatron.utils.rank_preload"
ELASTIC_PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
RESOURCE_TRACKER = "multiprocessing.resource_tracker"
"""What the command line of multiprocessing's resource tracker names; the launcher starts one for
its forkserver."""


def wanted(setting: str | None = None) -> bool:
    """Whether ranks are forked from a preloaded server: `TIDE_PRELOAD_RANKS` (0 or 1) when set,
    else when this host has no CUDA device (and the CPU compat layer is not turned off)."""
    setting = os.environ.get(PRELOAD_ENV, "") if setting is None else setting
    if setting not in ("", "0", "1"):
        raise ValueError(f"{PRELOAD_ENV} must be 0 or 1, got {setting!r}")
    if setting:
        return setting == "1"
    if os.environ.get("TIDE_DISABLE_CPU_COMPAT") == "1":
        return False
    import torch  # the launcher's own process: the forkserver is a fresh interpreter

    return not torch.cuda.is_available()


def can_run(args) -> bool:
    """Whether torchrun's parsed `args` name a Python script file, which a forked rank runs; a
    module (`-m`) or another program (`--no-python`) starts as torchrun starts it."""
    return not (args.no_python or args.module)


def configure(args) -> None:
    """Point torchrun's parsed `args` at forked ranks: the forkserver start method, the script
    run in the rank's interpreter, and the modules the server imports first. The environment
    the server starts with is the ranks' (a fork keeps it), so what the imports read from it is
    set here: one OpenMP thread per rank (torchrun's default for several ranks, and libgomp
    reads it when torch loads) and unbuffered output, as torchrun's `python -u` has."""
    import multiprocessing

    args.start_method = "forkserver"
    args.run_path = True
    args.training_script = os.path.abspath(args.training_script)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONUNBUFFERED"] = "1"
    multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD_MODULE])
    logging.getLogger(ELASTIC_PROCESS_LOGGER).addFilter(_failure_in_one_line)


def _failure_in_one_line(record: logging.LogRecord) -> bool:
    """torchrun logs a failed forked rank with the traceback of its own wait for it (a process
    started from a script gets one line): the line, without that traceback. The rank's own
    lines say why it failed."""
    if str(record.msg).startswith("failed (exitcode"):
        record.exc_info, record.exc_text = None, None
    return True


def run_rank(script: str, *script_args: str) -> None:
    """torchrun's entry point for one forked rank: run `script` as `__main__` with its own
    directory first on sys.path, as `python script.py` would, then end as that interpreter
    would. A forked child ends with `os._exit` and never runs the exit handlers; the rank's
    (the weight sync's /dev/shm cleanup, the job's exit without teardown) run here, after the
    executors stop and the non-daemon threads join, in the interpreter's own order."""
    from setproctitle import setproctitle, setthreadtitle

    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    # `ps`, py-spy and the tools that find a rank by its command line see what torchrun's own
    # `python -u script ...` would show, not the forkserver's command line (one string: a title
    # has no argument boundaries); the process name stays the interpreter's
    setproctitle(" ".join([sys.executable, "-u", script, *script_args]))
    setthreadtitle(os.path.basename(sys.executable))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        threading._shutdown()  # what Py_FinalizeEx does first (multiprocessing calls it too)
        atexit._run_exitfuncs()


def stop_forkserver() -> None:
    """Stop the launcher's forkserver once its ranks have ended, rather than leave it to notice
    the launcher's exit. multiprocessing has no public call for this; its own tests use `_stop`."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def stop_resource_tracker() -> None:
    """Stop the launcher's resource tracker and wait for it (it unlinks what a killed rank left of
    multiprocessing's semaphores). It ends when every process holding its pipe has: the launcher
    calls this after the job's leftovers are reaped."""
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()


def is_resource_tracker(cmdline: list[str]) -> bool:
    """Whether a process's command line is multiprocessing's resource tracker (the launcher's own,
    for a child of the launcher: not a process the job left behind)."""
    return any(RESOURCE_TRACKER in part for part in cmdline)
