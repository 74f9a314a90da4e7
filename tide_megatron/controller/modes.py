"""Scheduling modes as policy objects: one step loop, four ways of filling and feeding it.

The paper compares TIDE against a synchronous, a static-partition asynchronous and a
streaming system on the same hardware, model and task stream. Here they are modes of the same
controller (`scheduler.mode`), differing only in the answers below; the simulator uses the
same names and meanings (`tide_megatron/sim`).

| mode          | rollout runs           | trainer consumes                   | executor                     | tasks placed by |
|---------------|------------------------|------------------------------------|------------------------------|-----------------|
| sync          | only before each step  | the whole global batch             | Ref over all, then Actor     | request level   |
| async_static  | always (fixed split)   | the whole global batch when ready  | Ref over the batch, one swap, Actor | request level |
| stream        | always (fixed split)   | micro-batches as they arrive       | Ref/Actor alternation with offload (VSO) | request level |
| tide          | always                 | micro-batches as they arrive       | RA2P: colocated or decoupled by RAS/TPRM | CTB      |

sync is the VeRL-like baseline (rollout then train, a barrier each step); async_static the
AReaL-like one (staleness bounded at admission, whole batches); stream the StreamRL-like one
(per micro-batch model alternation). Asynchronous modes bound staleness at admission: a group
is started only while what is already admitted can be consumed within the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide_megatron.core.modes import SCHEDULER_MODES as MODES


@dataclass(frozen=True)
class ModePolicy:
    """What distinguishes one scheduling mode from another (see the module table)."""

    name: str
    continuous_rollout: bool
    """Rollout keeps going while the trainer trains (False: only before each step)."""
    streaming: bool
    """The trainer starts on the first ready group and takes later ones as they arrive
    (False: it waits for the whole global batch)."""
    executor: str
    """`colocated` (RA2P's aggregated rounds, at most `ra2p.cost_model.aggregation_limit`
    micro-batches each), `batch` (one round over the whole batch), `vso` (alternation per
    micro-batch, offload), `vs` (both resident), `decoupled`, or `auto` (RA2P's choice each step)."""
    task_level: bool
    """Tasks are placed by CTB (task-level admission, pausing) instead of request level."""

    def colocated_config(self, aggregation_limit: int):
        """The colocated executor's knobs for this mode's executor (every actor rank builds its
        executor from it). Sync is the VeRL-like baseline: both models resident."""
        from tide_megatron.trainer.ra2p import ColocatedConfig

        name = "resident" if self.name == "sync" else self.executor
        return {"vs": ColocatedConfig.vanilla_streaming(offload=False),
                "vso": ColocatedConfig.vanilla_streaming(offload=True),
                "resident": ColocatedConfig(offload=False, name="colocated_resident"),
                "batch": ColocatedConfig(name="colocated_batch"),
                }.get(name, ColocatedConfig(aggregation_limit=aggregation_limit))


def mode_policy(mode: str, *, ra2p_executor: str = "auto", ctb_enabled: bool = True) -> ModePolicy:
    """The policy of `scheduler.mode`; in `tide` mode `ra2p.executor` and `ctb.enabled` apply."""
    if mode == "sync":
        return ModePolicy("sync", continuous_rollout=False, streaming=False, executor="colocated", task_level=False)
    if mode == "async_static":
        return ModePolicy("async_static", continuous_rollout=True, streaming=False, executor="batch",
                          task_level=False)
    if mode == "stream":
        return ModePolicy("stream", continuous_rollout=True, streaming=True, executor="vso", task_level=False)
    if mode == "tide":
        return ModePolicy("tide", continuous_rollout=True, streaming=True, executor=ra2p_executor,
                          task_level=ctb_enabled)
    raise ValueError(f"scheduler.mode={mode!r}: expected one of {MODES}")
