"""Micro-batch dispatch: the core planner's plan turned into this rank's micro-batches.

The core planner (`core/ra2p.plan_microbatches`) decides, from sequence lengths alone, how a step's
trajectories form micro-batches (saturating early ones, a deliberately small final one) and how
each micro-batch is split across the DP ranks (zig-zag over the whole step in colocated mode;
largest micro-batch first and the smallest last in decoupled mode). This module applies that
plan to real trajectories: each rank builds its shard of every micro-batch (packed or
padded, `BatchLayout`), in plan order.
"""

from __future__ import annotations

from typing import Hashable, Mapping

from tide_megatron.core.ra2p import MicroBatchPlan, RA2PConfig, plan_microbatches
from tide_megatron.core.roles import RA2PMode
from tide_megatron.trainer.batch import BatchLayout, MicroBatch, TrajectoryTensors


def plan_step(trajectories: Mapping[Hashable, TrajectoryTensors], dp_size: int, mode: RA2PMode,
              cfg: RA2PConfig) -> MicroBatchPlan:
    """The core planner's plan for these trajectories (ids are the mapping's keys)."""
    return plan_microbatches({sid: len(t) for sid, t in trajectories.items()}, dp_size, mode, cfg)


def micro_batches_for_rank(plan: MicroBatchPlan, trajectories: Mapping[Hashable, TrajectoryTensors], rank: int,
                           layout: BatchLayout = BatchLayout()) -> list[MicroBatch]:
    """This DP rank's micro-batches, in plan (feed) order; an empty shard yields none.

    Every rank of a step may then hold a different number of micro-batches; that is fine for
    Megatron's no-pipelining schedule (one gradient all-reduce at the end, and the token count
    that normalises the loss is all-reduced there too).
    """
    if not 0 <= rank < plan.dp_size:
        raise ValueError(f"rank {rank} outside the plan's {plan.dp_size} DP ranks")
    out = []
    for mb in plan.micro_batches:
        shard = mb.shards[rank]
        if shard:
            out.append(layout.micro_batch([trajectories[sid] for sid in shard]))
    return out
