"""Imported once by the forkserver of `forked_ranks`: the modules every rank would import, so a
forked rank starts with them loaded. Then the loaded objects are frozen out of the cyclic
garbage collector: its passes write to every object they scan, which would copy the shared
pages into each rank one by one."""

import gc

# First: setproctitle finds the process's argv memory by walking back from `environ`, which the
# imports below move (a module's putenv); once moved, a forked rank or SGLang child could not
# set its title (`sglang::scheduler`, which fault injection looks for; the rank's command line).
from setproctitle import getproctitle, setproctitle

setproctitle(getproctitle())

import torch  # noqa: F401, E402
import megatron.core  # noqa: F401, E402
import hydra  # noqa: F401, E402

import tide_megatron.job  # noqa: F401, E402

try:
    import sglang.srt.entrypoints.engine  # noqa: F401  (rollout ranks; absent from a trainer-only install)
except ImportError:
    pass

gc.freeze()
