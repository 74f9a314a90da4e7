"""A test-only fault injector: kill rank 0 right after a given step is logged.

    TIDE_FAULT_KILL_RANK0_AFTER_STEP=3 python launch/torchrun.py --max-restarts 1 ... run.resume=auto

makes rank 0 SIGKILL itself once step 3's metrics line is written, in the first attempt of a
torchrun job only (`TORCHELASTIC_RESTART_COUNT` unset or 0), so the restarted attempt runs on.
A SIGKILL is the crash nothing can clean up after: no `finally`, no atexit, no flush. The
resume tests use it to show that a restarted job continues from its checkpoint. Unset (the
default), it does nothing; never set it in a real run.
"""

from __future__ import annotations

import logging
import os
import signal

KILL_AFTER_STEP_ENV = "TIDE_FAULT_KILL_RANK0_AFTER_STEP"

logger = logging.getLogger(__name__)


def after_step_logged(step: int) -> None:
    wanted = os.environ.get(KILL_AFTER_STEP_ENV)
    if not wanted or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or step != int(wanted):
        return
    logger.warning("%s=%s: killing this process (test fault injection)", KILL_AFTER_STEP_ENV, wanted)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
