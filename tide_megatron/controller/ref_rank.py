"""Moved: a reference rank is a `tide_megatron.trainer.worker.TrainerWorker` in the REF role
(it serves every actor DP rank the assignment routes to it, with the same "ref_step" /
"ref_mb" messages). `RefRank` keeps the old constructor for the current job until it calls
`TrainerWorker` directly.
"""

from __future__ import annotations

from tide_megatron.comm.topology import current_topology
from tide_megatron.trainer.assignment import TrainerAssignment
from tide_megatron.trainer.config import TrainerConfig
from tide_megatron.trainer.worker import TrainerWorker


class RefRank(TrainerWorker):
    """A reference rank of the start-up configuration (old constructor; `actor_rank` is implied
    by the assignment's routing)."""

    def __init__(self, model_path: str, rank: int, actor_rank: int, job_group, pad_to_multiple_of: int = 1):
        topo = current_topology()
        if rank != topo.rank:
            raise ValueError(f"RefRank built for rank {rank} on rank {topo.rank}")
        assignment = TrainerAssignment.at_startup(topo.groups.layout, topo.trainer_ranks, topo.ref_ranks)
        # A reference rank exists for the KL term; any non-zero coefficient makes it hold the model.
        cfg = TrainerConfig(kl_coef=1.0, pad_to_multiple_of=pad_to_multiple_of)
        super().__init__(cfg, model_path, "", topo.groups, assignment, job_group, seed=topo.seed)
