"""Scheduling modes as policy objects: one step loop, four ways of filling and feeding it.

The paper compares TIDE against a synchronous, a static-partition asynchronous and a
streaming system on the same hardware, model and task stream. Here they are modes of the same
controller (`scheduler.mode`), differing only in the answers below; the simulator uses the
same names and meanings (`tide_megatron/sim`).

| mode          | rollout runs           | trainer consumes                   | executor                     | tasks placed by |
|---------------|------------------------|------------------------------------|------------------------------|-----------------|
| sync          | only before each step, on every rank but rank 0's TP block | the whole global batch, on every rank | Ref over all, then Actor | request level |
| sync_split    | only before each step  | the whole global batch             | Ref over all, then Actor     | request level   |
| async_static  | always (fixed split)   | the whole global batch when ready  | Ref over the batch, one swap, Actor | request level |
| stream        | always (fixed split)   | micro-batches as they arrive       | VSO, or `ra2p.executor` (vs, colocated) | request level |
| tide          | always                 | micro-batches as they arrive       | RA2P: colocated or decoupled by RAS/TPRM | CTB      |

sync is the VeRL-like baseline: all ranks time-share (rollout, then a barrier, then training,
then the weights go to every engine). The trainer ranks other than rank 0's TP block (the
controller's, which always trains) are lent to rollout at each weight sync and come back when
the batch is complete (`TrainerRoles`' loans, each such rank keeping a standby engine that
frees its memory while it trains where SGLang can). sync_split is rollout then training on a
fixed split (the rollout ranks idle while the trainer trains, and the other way round);
async_static the
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
    time_shared: bool = False
    """Every rank that can train also rolls out: trainer ranks are lent to rollout for each
    step's rollout and return for its training (sync)."""

    def colocated_config(self, aggregation_limit: int, offload_idle_model: bool = False):
        """The colocated executor's knobs for this mode's executor (every actor rank builds its
        executor from it). VS and VSO are defined by their swapping; every other executor parks
        the idle model only under `ra2p.offload_idle_model`, so no mode swaps where another
        keeps both models resident. Sync is the VeRL-like baseline: one round per step."""
        from tide_megatron.trainer.ra2p import ColocatedConfig

        if self.executor in ("vs", "vso"):
            return ColocatedConfig.vanilla_streaming(offload=self.executor == "vso")
        if self.name in ("sync", "sync_split"):
            return ColocatedConfig(offload=offload_idle_model, name="colocated_sync")
        if self.executor == "batch":
            return ColocatedConfig(offload=offload_idle_model, name="colocated_batch")
        return ColocatedConfig(aggregation_limit=aggregation_limit, offload=offload_idle_model)


def mode_policy(mode: str, *, ra2p_executor: str = "auto", ctb_enabled: bool = True) -> ModePolicy:
    """The policy of `scheduler.mode`; in `tide` mode `ra2p.executor` and `ctb.enabled` apply, in
    `stream` mode `ra2p.executor` (config.validate checks which)."""
    if mode in ("sync", "sync_split"):
        return ModePolicy(mode, continuous_rollout=False, streaming=False, executor="colocated", task_level=False,
                          time_shared=mode == "sync")
    if mode == "async_static":
        return ModePolicy("async_static", continuous_rollout=True, streaming=False, executor="batch",
                          task_level=False)
    if mode == "stream":
        # StreamRL alternates Ref and Actor per micro-batch with offload (VSO); a user tunes the
        # baseline to its fastest executor with `ra2p.executor` (vs, vso or colocated)
        return ModePolicy("stream", continuous_rollout=True, streaming=True,
                          executor="vso" if ra2p_executor == "auto" else ra2p_executor, task_level=False)
    if mode == "tide":
        return ModePolicy("tide", continuous_rollout=True, streaming=True, executor=ra2p_executor,
                          task_level=ctb_enabled)
    raise ValueError(f"scheduler.mode={mode!r}: expected one of {MODES}")


def time_shared(cfg) -> bool:
    """Every rank that can train rolls out too (`ModePolicy.time_shared`: sync). `cfg`: the job's."""
    return mode_policy(cfg.scheduler.mode).time_shared


def moves_ranks(cfg) -> bool:
    """Ranks change sides during the run: ERS moves them, or the mode time-shares them."""
    return time_shared(cfg) or (cfg.ers.enabled and cfg.ers.move_ranks)
