"""Processes and process groups of a job: who is rollout, who trains, who controls.

torchrun starts W ranks. Rank 0 always trains and also runs the controller. The last
`cluster.rollout_ranks` ranks start as rollout; the others train. Every group is made
here, once, at start-up, from the job's rendezvous store:

- the trainer world: torch.distributed's default group spans the actor ranks only.
  Megatron-core runs collectives on the default group in places (optimizer param groups,
  dist_checkpointing barriers), so rollout ranks must not be in it. Actor ranks come
  first, so an actor's rank in that world is its global rank. A dedicated reference rank
  (decoupled RA2P) is a Megatron world of its own (it never reduces gradients). Rollout
  ranks have no default group at all, which keeps torch.distributed out of SGLang's way.
- the job group: a gloo group over all W ranks, held as an object (not registered as a
  default), for the weight broadcast. Every rank is in it, so a rank that changes role
  later needs no new group to send or receive weights.
- control messages go through the store itself (see `mailbox.py`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tide_megatron.core.roles import Role

logger = logging.getLogger(__name__)


@dataclass
class Topology:
    """This rank's place in the job."""

    rank: int
    world_size: int
    trainer_ranks: list[int]
    """Actor ranks (the Megatron world of the trained policy)."""
    rollout_ranks: list[int]
    store: dist.Store
    """The job's key-value store (torchrun's rendezvous store), under a `tide/` prefix."""
    job_group: dist.ProcessGroup
    """gloo over every rank of the job: the weight broadcast."""

    ref_ranks: list[int] = field(default_factory=list)
    """Dedicated reference ranks (decoupled RA2P)."""

    @property
    def role(self) -> Role:
        if self.rank in self.rollout_ranks:
            return Role.ROLLOUT
        if self.rank in self.ref_ranks:
            return Role.REF
        # Actor ranks also hold the reference, for colocated steps.
        return Role.ACTOR_REF

    @property
    def is_controller(self) -> bool:
        return self.rank == 0

    @property
    def trains(self) -> bool:
        return self.rank in self.trainer_ranks


def init_topology(rollout_ranks: int, tp_size: int, seed: int, ref_ranks: int = 0,
                  timeout_s: float = 1800.0) -> Topology:
    """Join the torchrun job, split the ranks and create every process group."""
    if "RANK" not in os.environ:
        raise RuntimeError(
            "launch/train.py must run under torchrun (it needs RANK, WORLD_SIZE, MASTER_ADDR): "
            "torchrun --nproc-per-node 2 launch/train.py +recipe=tiny_cpu"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n_train = world - rollout_ranks - ref_ranks
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    # torchrun keeps its store across `--max-restarts`: each attempt gets its own keys, or a
    # restarted job would read the dead attempt's mailboxes and process-group addresses.
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    topo = Topology(
        rank=rank,
        world_size=world,
        trainer_ranks=list(range(n_train)),
        rollout_ranks=list(range(n_train + ref_ranks, world)),
        ref_ranks=list(range(n_train, n_train + ref_ranks)),
        store=dist.PrefixStore("tide", store),
        job_group=dist.ProcessGroupGloo(dist.PrefixStore("tide/job_group", store), rank, world, timeout),
    )
    if topo.role is not Role.ROLLOUT:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if topo.trains:
            world_store, world_rank, world_size, tp = dist.PrefixStore("tide/trainers", store), rank, n_train, tp_size
        else:
            world_store, world_rank, world_size, tp = dist.PrefixStore(f"tide/ref{rank}", store), 0, 1, 1
        dist.init_process_group(backend=backend, store=world_store, rank=world_rank, world_size=world_size,
                                timeout=timeout)
        from tide_megatron.models.megatron_gpt import init_parallel

        init_parallel(tp_size=tp, seed=seed)
    logger.info("rank %d/%d: %s", rank, world, topo.role.name)
    return topo


def close_topology(topo: Topology) -> None:
    """Tear the groups down in order (an unowned gloo group aborts the process at exit)."""
    if hasattr(topo.job_group, "shutdown"):
        topo.job_group.shutdown()
    topo.job_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
