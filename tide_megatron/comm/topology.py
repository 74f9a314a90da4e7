"""Processes and process groups of a job: who is rollout, who trains, who controls.

torchrun starts W ranks. Rank 0 always trains and also runs the controller. The first
`W - rollout_ranks - ref_ranks` ranks start as actors (whole TP blocks), the next `ref_ranks`
as dedicated reference ranks, the last `rollout_ranks` as rollout. Roles change later (ERS),
so every rank joins everything a role may need, once, at start-up:

- the default group: torch.distributed's world over all W ranks. It is also the job group:
  the point-to-point weight sends and the reference log-prob stream run on it (gloo; with CUDA the same
  group also has an NCCL backend). Rollout ranks are in it, so the trainer never runs a
  collective on it: Megatron gets its groups explicitly (below), and its few calls that
  insist on the default group run with the current actors' group standing in for it
  (`groups.as_default_group`).
- the trainer's groups: `groups.GroupRegistry` over the layout of W ranks in TP blocks
  (single-rank, TP, and per DP size the DP and all-actor groups), from which a role change
  selects; it never creates one.
- control messages go through the store itself (see `mailbox.py`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tide_megatron.comm.groups import GroupLayout, GroupRegistry, new_group_factory, set_registry
from tide_megatron.core.rank_plan import RankPlan
from tide_megatron.core.roles import Role

logger = logging.getLogger(__name__)


@dataclass
class Topology:
    """This rank's place in the job at start-up."""

    rank: int
    world_size: int
    trainer_ranks: list[int]
    """Actor ranks at start-up."""
    rollout_ranks: list[int]
    store: dist.Store
    """The job's key-value store (torchrun's rendezvous store), under a `tide/` prefix."""
    job_group: dist.ProcessGroup
    """Every rank of the job (the default group): point-to-point weight sends, reference log-probs."""
    groups: GroupRegistry
    """This rank's trainer groups, made at start-up."""
    seed: int = 0
    ref_ranks: list[int] = field(default_factory=list)
    """Dedicated reference ranks at start-up (decoupled RA2P)."""
    plan: RankPlan | None = None
    """The job's rank plan (`core/rank_plan.py`): every rank's role, GPU and engine."""

    @property
    def gpu(self) -> int:
        """This rank's local GPU id (its engine's `base_gpu_id` when it rolls out)."""
        return self.plan.slot(self.rank).gpu if self.plan else 0

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


_TOPOLOGY: Topology | None = None


def current_topology() -> Topology:
    """The topology `init_topology` set up in this process."""
    if _TOPOLOGY is None:
        raise RuntimeError("no job topology in this process: call comm.topology.init_topology first")
    return _TOPOLOGY


def init_topology(plan: RankPlan, seed: int, timeout_s: float = 1800.0) -> Topology:
    """Join the torchrun job, take this rank's place in `plan` and create every process group."""
    global _TOPOLOGY
    if "RANK" not in os.environ:
        raise RuntimeError(
            "launch/train.py must run under torchrun (it needs RANK, WORLD_SIZE, MASTER_ADDR): "
            "torchrun --nproc-per-node 2 launch/train.py +recipe=tiny_cpu"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != plan.world_size:
        raise RuntimeError(f"the rank plan is for {plan.world_size} ranks, the job has {world}")
    layout = GroupLayout(world, plan.request.trainer_tp)
    layout.actor_blocks_of(plan.actor_ranks)  # the start-up actors must be whole TP blocks
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    # torchrun keeps its store across `--max-restarts`: each attempt gets its own keys, or a
    # restarted job would read the dead attempt's mailboxes and process-group addresses.
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if torch.cuda.is_available():
        torch.cuda.set_device(plan.slot(rank).gpu)
    # gloo carries the control-plane tensors (weights on CPU, log-probs); NCCL, when there is a
    # GPU, the gradients.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.PrefixStore("tide/world", store), rank=rank,
                            world_size=world, timeout=timeout)
    # The trainer's groups carry device tensors only: NCCL alone with a GPU (connects on first
    # use, so the unused configurations cost nothing), gloo without.
    registry = GroupRegistry.build(layout, rank, new_group_factory(
        backend="nccl" if torch.cuda.is_available() else None, timeout_s=timeout_s))
    set_registry(registry)
    topo = Topology(
        rank=rank,
        world_size=world,
        trainer_ranks=plan.actor_ranks,
        rollout_ranks=plan.rollout_ranks,
        ref_ranks=plan.ref_ranks,
        store=dist.PrefixStore("tide", store),
        job_group=dist.group.WORLD,
        groups=registry,
        seed=seed,
        plan=plan,
    )
    _TOPOLOGY = topo
    logger.info("rank %d/%d: %s; %d process groups of %d in %.2f s", rank, world, topo.role.name,
                len(registry.groups), layout.num_groups, registry.startup_s)
    return topo


def close_topology(topo: Topology) -> None:
    """Tear the groups down (an unowned gloo group aborts the process at exit)."""
    global _TOPOLOGY
    set_registry(None)
    _TOPOLOGY = None
    topo.job_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
