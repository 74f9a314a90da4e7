"""Processes and process groups of a job: who is rollout, who trains, who controls.

torchrun starts W ranks. Rank 0 always trains and also runs the controller. The last
`cluster.rollout_ranks` ranks start as rollout; the others train. All groups are made
here, once, at start-up (creating a group is collective over the whole world, so it
cannot happen later on a subset of ranks without stalling the others):

- the world gloo group carries control traffic and the weight broadcast, in which every
  rank takes part, so a rank that changes role never needs a new group to receive weights;
- Megatron's model-parallel groups span the trainer ranks only. Megatron derives its
  groups from `torch.distributed.get_world_size()`, so while they are made that call
  answers the trainer count; trainer ranks come first, so Megatron's rank lists are
  already the global ranks. Rollout ranks take part in the (collective) creation and
  belong to none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tide_megatron.core.roles import Role

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _world_size_seen_by_megatron(n: int):
    real = dist.get_world_size
    dist.get_world_size = lambda group=None: n if group is None else real(group)
    try:
        yield
    finally:
        dist.get_world_size = real


@dataclass
class Topology:
    """This rank's place in the job."""

    rank: int
    world_size: int
    trainer_ranks: list[int]
    rollout_ranks: list[int]
    store: dist.Store

    @property
    def role(self) -> Role:
        # A static split colocates reference and actor on every trainer rank.
        return Role.ROLLOUT if self.rank in self.rollout_ranks else Role.ACTOR_REF

    @property
    def is_controller(self) -> bool:
        return self.rank == 0

    @property
    def trains(self) -> bool:
        return self.rank in self.trainer_ranks


def init_topology(rollout_ranks: int, tp_size: int, seed: int, timeout_s: float = 1800.0) -> Topology:
    """Join the torchrun job, split the ranks and create every process group."""
    if "RANK" not in os.environ:
        raise RuntimeError(
            "launch/train.py must run under torchrun (it needs RANK, WORLD_SIZE, MASTER_ADDR): "
            "torchrun --nproc-per-node 2 launch/train.py +recipe=tiny_cpu"
        )
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    n_train = world - rollout_ranks
    topo = Topology(
        rank=rank,
        world_size=world,
        trainer_ranks=list(range(n_train)),
        rollout_ranks=list(range(n_train, world)),
        store=_default_store(),
    )
    with _world_size_seen_by_megatron(n_train):
        if topo.trains:
            from tide_megatron.models.megatron_gpt import init_parallel

            init_parallel(tp_size=tp_size, seed=seed)
        else:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    logger.info("rank %d/%d: %s", rank, world, topo.role.name)
    return topo


def _default_store() -> dist.Store:
    """The job's key-value store (torchrun's rendezvous store), prefixed per job."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("tide", _get_default_store())
