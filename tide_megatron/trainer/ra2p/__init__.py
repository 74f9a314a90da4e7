"""RA2P executors: how one training step runs its Ref and Actor (paper, "Resource-Aware Ref-Actor
Collaboration").

- `ColocatedExecutor`: Ref and Actor on the same ranks, ready-batch aggregation, offloading the
  idle model; with `ColocatedConfig.vanilla_streaming(offload)` also the VS / VSO baselines.
- `RefStreamServer` + `DecoupledActorExecutor`: Ref ranks apart, log-probs streamed per
  micro-batch over a gloo group, the Actor's loss evaluated in backward.
- `ModeSelector`: the core's C_dec / C_col comparison fed with costs measured by the executors.
- `plan_step` / `micro_batches_for_rank`: the core planner's micro-batch dispatch applied.
"""

from tide_megatron.trainer.ra2p.colocated import ColocatedConfig, ColocatedExecutor
from tide_megatron.trainer.ra2p.decoupled import (
    DecoupledActorExecutor,
    DecoupledConfig,
    LogprobStream,
    RefStreamServer,
)
from tide_megatron.trainer.ra2p.dispatch import micro_batches_for_rank, plan_step
from tide_megatron.trainer.ra2p.mode_selector import ModeSelector, ModeSelectorConfig
from tide_megatron.trainer.ra2p.source import ArrivingSource, MicroBatchSource, ReadySource
from tide_megatron.trainer.ra2p.timing import ActorPassTimer, CostMeter, CostMeterConfig, StepReport

__all__ = [
    "ActorPassTimer", "ArrivingSource", "ColocatedConfig", "ColocatedExecutor", "CostMeter",
    "CostMeterConfig", "DecoupledActorExecutor", "DecoupledConfig", "LogprobStream",
    "MicroBatchSource", "ModeSelector", "ModeSelectorConfig", "ReadySource", "RefStreamServer",
    "StepReport", "micro_batches_for_rank", "plan_step",
]
