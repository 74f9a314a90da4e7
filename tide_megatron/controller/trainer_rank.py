"""Moved: what trainer ranks run is `tide_megatron.trainer.worker.TrainerWorker` (every trainer
role, role changes included; `TrainerWorker.at_startup` builds a rank's worker), the rollout-JSON
conversions are in `trainer/payload.py`.

`TrainerRank` keeps the old constructor for the current controller and job until they call
`TrainerWorker` directly; it takes the start-up configuration from `comm.topology`.
"""

from __future__ import annotations

from tide_megatron.comm.topology import current_topology
from tide_megatron.trainer.assignment import TrainerAssignment
from tide_megatron.trainer.config import TrainerConfig
from tide_megatron.trainer.payload import micro_batch_of, to_train_trajectory
from tide_megatron.trainer.worker import TrainerWorker

__all__ = ["TrainerRank", "micro_batch_of", "to_train_trajectory"]


class TrainerRank(TrainerWorker):
    """An actor rank of the start-up configuration (old constructor)."""

    def __init__(self, trainer_cfg: TrainerConfig, model_path: str, rank: int, checkpoint_root: str, job_group):
        topo = current_topology()
        if rank != topo.rank:
            raise ValueError(f"TrainerRank built for rank {rank} on rank {topo.rank}")
        assignment = TrainerAssignment.at_startup(topo.groups.layout, topo.trainer_ranks, topo.ref_ranks)
        super().__init__(trainer_cfg, model_path, checkpoint_root, topo.groups, assignment, job_group, seed=topo.seed)
