"""Test-only fault injectors: kill rank 0 right after a given step is logged; kill a rollout
rank's SGLang engine at a named moment (`KILL_ENGINE_ENV`, below).

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


# -- a rollout rank's SGLang engine ------------------------------------------------------------

KILL_ENGINE_ENV = "TIDE_FAULT_KILL_ENGINE"
"""Test-only: `<moment>:<n>[:<which>]`. The rollout rank (or ranks) named by `which` SIGKILLs its
own SGLang scheduler (as a crash or the OOM killer would) at that moment, once per rank (its
first engine only), so tests can show the rank and the run survive a dead engine whatever else
is in flight. Moments (n is a weight version, a checkpoint step or a count, as named):

- `after_version:n`      right after the rank loaded weight version n;
- `during_weight_sync:n` while the rank takes version n in: after the transfer, as the load
                         into the engine starts (the load then meets a dying engine);
- `at_step_boundary:n`   when version n is announced to the rank (its `LoadWeights` arrives: the
                         step before it closed), before the rank receives or loads it;
- `after_checkpoint:n`   once rank 0 has saved the checkpoint of step n (the rank watches
                         `$TIDE_FAULT_RUN_DIR/checkpoints/latest`; the test sets that variable to
                         the run's `run.output_dir`);
- `during_handover:n`    at the rank's n-th move out of rollout (ERS), after it told its tasks to
                         hand themselves over, before they have.

`which`: `self` (the default: rank 1, the first rollout rank when rank 0 trains), a rank
number, or `all` (every rollout rank kills its own engine at that moment: all engines at once).
Unset (the default), nothing happens; never set it in a real run."""

RUN_DIR_ENV = "TIDE_FAULT_RUN_DIR"
ENGINE_MOMENTS = ("after_version", "during_weight_sync", "at_step_boundary", "after_checkpoint", "during_handover")


class EngineFault:
    """A rollout rank's view of `TIDE_FAULT_KILL_ENGINE`: `fires(moment, n)` is true once, at
    the moment named, on a rank it names (`at(moment, n)` kills the scheduler then)."""

    def __init__(self, rank: int, spec: str | None = None):
        spec = os.environ.get(KILL_ENGINE_ENV, "") if spec is None else spec
        self.moment: str | None = None
        self.n = 0
        self.fired = False
        self._next_look = 0.0
        if not spec:
            return
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ENGINE_MOMENTS:
            raise ValueError(f"{KILL_ENGINE_ENV}={spec!r}: expected <moment>:<n>[:<which>], moment one of "
                             f"{', '.join(ENGINE_MOMENTS)}")
        which = parts[2] if len(parts) == 3 else "self"
        if which not in ("self", "all") and not which.isdigit():
            raise ValueError(f"{KILL_ENGINE_ENV}={spec!r}: which must be self, all or a rank number")
        target = 1 if which == "self" else None if which == "all" else int(which)
        if target is not None and target != rank:
            return  # not this rank
        if parts[0] == "after_checkpoint" and not os.environ.get(RUN_DIR_ENV):
            raise ValueError(f"{KILL_ENGINE_ENV}={spec!r} needs {RUN_DIR_ENV} (the run's output_dir)")
        self.moment, self.n = parts[0], int(parts[1])

    def fires(self, moment: str, n: int) -> bool:
        return not self.fired and self.moment == moment and self.n == n

    def at(self, moment: str, n: int) -> bool:
        """Kill the engine if this is the moment; true if it did."""
        if not self.fires(moment, n):
            return False
        self.fired = True
        logger.warning("fault injection: %s=%s:%d at this moment", KILL_ENGINE_ENV, moment, n)
        kill_scheduler()
        return True

    def poll(self, now: float) -> bool:
        """For moments nothing announces (`after_checkpoint`): look, at most 5 times a second."""
        if self.fired or self.moment != "after_checkpoint" or now < self._next_look:
            return False
        self._next_look = now + 0.2
        try:
            with open(os.path.join(os.environ[RUN_DIR_ENV], "checkpoints", "latest")) as f:
                name = f.read().strip()
        except OSError:
            return False
        if not name.startswith("step_") or not name[5:].isdigit() or int(name[5:]) < self.n:
            return False
        return self.at("after_checkpoint", self.n)


def kill_scheduler() -> None:
    """SIGKILL this process's SGLang scheduler subprocess (`sglang::scheduler`)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        if "scheduler" in title:  # SGLang names the process `sglang::scheduler`
            logger.warning("fault injection: killing SGLang scheduler pid %d", child.pid)
            os.kill(child.pid, signal.SIGKILL)
