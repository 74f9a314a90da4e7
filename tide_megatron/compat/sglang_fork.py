"""SGLang's scheduler and detokenizer started by `fork` on CPU, not `spawn`.

SGLang starts its subprocesses with `spawn` (forced in `_set_envs_and_config`) because a CUDA
context does not survive a fork. Without CUDA there is none to lose, and a spawned child pays
for a fresh interpreter that imports SGLang again, most of an engine's start-up on a CPU
(`benchmarks/engine_start.py` measures both ways). Every end-to-end test starts one to four
engines on two cores.

A forked child begins as a copy of the rollout rank, and three things of the rank's must not
carry over; the child forgets them at once (`_forget_the_rank`, an at-fork hook that acts only
for forks made while an engine starts):
- torch.distributed's default group: SGLang's scheduler joins its own one-rank gloo group only
  `if not torch.distributed.is_initialized()`, and the rank's group would say it is. The rank's
  groups are kept referenced, never destroyed: their threads stayed in the parent.
- the asyncio signal wake-up fd: a signal to the child would be written into the rank's event
  loop's pipe and read there as the rank's own (a SIGTERM would stop the rank);
- the rank's Python signal handlers (its SIGQUIT handler reports a dead scheduler; in the
  scheduler itself it would report the scheduler's own death to a copy of the rank). A spawned
  child starts with the interpreter's defaults, and so does a forked one here;
- the rank's TCP sockets (its store, gloo and env-server connections, its listening ports):
  a spawned child gets none of them, and a forked one that kept them would hold the rank's
  ports open as its own. SGLang's children talk over pipes and IPC sockets made for them, and
  the scheduler's own process group opens its sockets after the fork.

Inert where CUDA exists (`cuda_present`) or `TIDE_DISABLE_CPU_COMPAT=1`: SGLang spawns as upstream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import sys
from typing import Iterator

from tide_megatron.compat import DISABLE_ENV, cuda_present

logger = logging.getLogger(__name__)

_starting_engine = False
"""True while an engine starts in this process: only its forks forget the rank's state."""

_inherited: list = []
"""The rank's torch.distributed state in a forked child: kept alive, never torn down."""

_DEFAULT_HANDLERS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL,
                     signal.SIGINT: signal.default_int_handler, signal.SIGCHLD: signal.SIG_DFL}


def fork_allowed() -> bool:
    """Whether SGLang's children may be forked here (no CUDA, compat layer on)."""
    return os.environ.get(DISABLE_ENV) != "1" and not cuda_present()


def _forget_the_rank() -> None:
    if not _starting_engine:
        return
    signal.set_wakeup_fd(-1)
    for signum, handler in _DEFAULT_HANDLERS.items():
        signal.signal(signum, handler)
    _close_tcp_sockets()
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:  # else the rank holds no group
        _inherited.append(c10d._world)
        c10d._world = c10d._World()


def _close_tcp_sockets() -> None:
    """Let go of this process's TCP sockets (a forked child's copies; the parent's stay open).

    Each fd is pointed at /dev/null rather than closed: objects copied from the rank still
    name these numbers, and one collected later would close whatever new file had taken its
    number."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                if fd == null or not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                sock = socket.socket(fileno=fd)
            except OSError:  # the listing's own fd, closed by now
                continue
            family = sock.family
            sock.detach()
            if family in (socket.AF_INET, socket.AF_INET6):
                os.dup2(null, fd, inheritable=os.get_inheritable(fd))
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_forget_the_rank)


def fork_hazard() -> str | None:
    """Why a child forked from this process now could hang, or None.

    GNU OpenMP (torch's intra-op pool on Linux) is not fork-safe: a child forked after the pool
    ran waits forever for threads that stayed in the parent at its first parallel op (seen: a
    scheduler stuck building its rotary cache). With one intra-op thread torch opens no
    parallel region. torchrun sets OMP_NUM_THREADS=1 for every rank unless told otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() > 1:
        return (f"torch runs {torch.get_num_threads()} intra-op threads here, and a child forked after "
                "OpenMP's thread pool ran can hang (OMP_NUM_THREADS=1 allows the fork)")
    return None


@contextlib.contextmanager
def forked_engine_children(wanted: bool = True) -> Iterator[bool]:
    """While an `sglang.Engine` is built inside this block, its children are forked, if `wanted`,
    `fork_allowed()` and there is no `fork_hazard()`; else the block changes nothing. Yields
    whether they are forked.

    SGLang sets the start method to `spawn` in `_set_envs_and_config`, just before it starts
    them; the wrapper sets `fork` right after, and the block restores `spawn` on exit."""
    global _starting_engine
    allowed = wanted and fork_allowed()
    hazard = fork_hazard() if allowed else None
    if hazard:
        logger.warning("SGLang's scheduler and detokenizer are spawned, not forked: %s", hazard)
    if not allowed or hazard:
        yield False
        return
    import multiprocessing as mp

    import sglang.srt.entrypoints.engine as engine_module

    upstream = engine_module._set_envs_and_config

    def then_fork(*args, **kwargs):
        result = upstream(*args, **kwargs)
        mp.set_start_method("fork", force=True)
        return result

    engine_module._set_envs_and_config = then_fork
    _starting_engine = True
    try:
        yield True
    finally:
        _starting_engine = False
        engine_module._set_envs_and_config = upstream
        mp.set_start_method("spawn", force=True)
