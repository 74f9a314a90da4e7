"""The scheduling modes a job can run in, named once for the real system and the simulator.

The paper compares TIDE with a synchronous (VeRL-like: every rank rolls out, then every rank
trains), a static-partition asynchronous (AReaL-like) and a streaming (StreamRL-like) system,
and `sync_split` is a synchronous run on a fixed split (rollout ranks and trainer ranks take
turns); each is a mode of the same controller
(`controller/modes.py` says what each mode does) and of the simulator.
"""

from __future__ import annotations

SCHEDULER_MODES = ("sync", "sync_split", "async_static", "stream", "tide")
"""The modes of `scheduler.mode`, real runs and simulator alike."""

SIM_ONLY_MODES = ("elastic",)
"""Baselines only the simulator models (`elastic`: verl-like dynamic scaling, `sim/verl_elastic.py`)."""
