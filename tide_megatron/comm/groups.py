"""Every process group a role change can need, created once at start-up, selected afterwards.

Layout. The W ranks of the job are cut into TP blocks of `tp_size` consecutive ranks (block b =
ranks [b*tp, (b+1)*tp)); the W % tp ranks after the last block are single-rank units (they
can roll out or serve as a TP=1 reference, never be actors). Actors are always the first k
blocks (a contiguous prefix), for k = 1..W // tp. The data-parallel group of TP position j
under k actor blocks is then (j, tp + j, ..., (k-1)*tp + j), one group per (k, j): W // tp * tp
groups, not one per subset of ranks (2^W). Together with each block's TP group, one single-rank
group per rank (Megatron's PP/CP/embedding groups when PP = CP = 1, and the TP group of a TP=1
unit) and the group of all actor ranks of each k (Megatron's TP x DP group: checkpoints, the
distributed optimizer) that is all a trainer configuration needs. With B = W // tp blocks:

    tp = 1:  unique groups = W (single-rank) + (B - 1) (DP = all actors)
    tp > 1:  unique groups = W + B (TP blocks) + (B - 1) * tp (DP) + (B - 1) (all actors)
    (+ the default group over all W ranks, made by init_process_group)

A role change picks the `ProcessGroupCollection` of the new k (`GroupRegistry.actor_groups`);
it never creates a group. Every rank calls `new_group` for every group of the layout in one
global order (torch names groups by a per-process counter, so all ranks must count alike); a
non-member returns at once, the members of a group connect to each other. Gloo groups connect
eagerly (a full mesh per group), NCCL groups on first use.

A consequence of the prefix rule: the ERS planner must add actor capacity at block k (the lowest
block above the actors) and release the highest actor block; a reference can sit anywhere else.

Megatron-core's `parallel_state` is not initialised: GPTModel, DDP, the optimizer and the
schedule all take these groups as a `ProcessGroupCollection` (megatron-core 0.16.1 supports it),
so one process can hold models of different parallel configurations, and no global decides
which DP group is current.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class GroupSpec:
    """One process group of the layout: a name (for logs) and its member ranks, ascending."""

    name: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class GroupLayout:
    """Which groups exist for a job of `world_size` ranks with actor tensor-parallel `tp_size`."""

    world_size: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.tp_size < 1:
            raise ValueError(f"need world_size >= 1 and tp_size >= 1, got {self.world_size}, {self.tp_size}")
        if self.tp_size > self.world_size:
            raise ValueError(f"tp_size {self.tp_size} exceeds the world of {self.world_size} ranks")

    # ---- ranks -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """TP blocks: the most actor DP ranks the job can have."""
        return self.world_size // self.tp_size

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the job's {self.world_size} ranks")

    def block_of(self, rank: int) -> int | None:
        """The TP block holding `rank`; None for a single-rank unit after the last block."""
        self._check(rank)
        block = rank // self.tp_size
        return block if block < self.num_blocks else None

    def tp_position(self, rank: int) -> int:
        """`rank`'s TP rank inside its home TP group."""
        return 0 if self.block_of(rank) is None else rank % self.tp_size

    def home_tp_ranks(self, rank: int) -> tuple[int, ...]:
        """The TP group every role on `rank` uses: its block, or the rank alone."""
        block = self.block_of(rank)
        if block is None:
            return (rank,)
        return tuple(range(block * self.tp_size, (block + 1) * self.tp_size))

    def actor_ranks(self, actor_blocks: int) -> tuple[int, ...]:
        """The ranks of the first `actor_blocks` blocks."""
        self._check_blocks(actor_blocks)
        return tuple(range(actor_blocks * self.tp_size))

    def dp_ranks(self, actor_blocks: int, position: int) -> tuple[int, ...]:
        """The DP group of TP position `position` under `actor_blocks` actor blocks."""
        self._check_blocks(actor_blocks)
        if not 0 <= position < self.tp_size:
            raise ValueError(f"TP position {position} outside 0..{self.tp_size - 1}")
        return tuple(b * self.tp_size + position for b in range(actor_blocks))

    def _check_blocks(self, actor_blocks: int) -> None:
        if not 1 <= actor_blocks <= self.num_blocks:
            raise ValueError(f"{actor_blocks} actor blocks: need 1..{self.num_blocks} "
                             f"({self.world_size} ranks in TP blocks of {self.tp_size})")

    def actor_blocks_of(self, ranks: Iterable[int]) -> int:
        """How many actor blocks a set of actor ranks is; ValueError unless it is a prefix of
        whole blocks (the only configurations whose groups exist)."""
        ranks = sorted(set(ranks))
        if not ranks or len(ranks) % self.tp_size or ranks != list(range(len(ranks))):
            raise ValueError(
                f"actor ranks {ranks} are not the first k TP blocks of {self.tp_size} ranks: the trainer's "
                "process groups exist for contiguous prefixes only (see comm/groups.py)")
        blocks = len(ranks) // self.tp_size
        self._check_blocks(blocks)
        return blocks

    # ---- groups ------------------------------------------------------------------------

    def group_specs(self) -> list[GroupSpec]:
        """Every group of the layout, once per member set, in the global creation order."""
        specs: list[GroupSpec] = [GroupSpec(f"self/{r}", (r,)) for r in range(self.world_size)]
        if self.tp_size > 1:
            specs += [GroupSpec(f"tp/{b}", self.home_tp_ranks(b * self.tp_size)) for b in range(self.num_blocks)]
        specs += [GroupSpec(f"dp/{k}/{j}", self.dp_ranks(k, j))
                  for k in range(2, self.num_blocks + 1) for j in range(self.tp_size)]
        if self.tp_size > 1:  # with TP = 1 the actors of k blocks are dp/k/0 (or self/0)
            specs += [GroupSpec(f"actors/{k}", self.actor_ranks(k)) for k in range(2, self.num_blocks + 1)]
        return specs

    def groups_of(self, rank: int) -> list[GroupSpec]:
        """The groups `rank` belongs to (what it creates at start-up), in creation order."""
        self._check(rank)
        return [spec for spec in self.group_specs() if rank in spec.ranks]

    @property
    def num_groups(self) -> int:
        """Groups the layout creates (the default group over all ranks not counted)."""
        blocks = self.num_blocks
        if self.tp_size == 1:
            return self.world_size + blocks - 1
        return self.world_size + blocks + (blocks - 1) * (self.tp_size + 1)


# ---- creating the groups -------------------------------------------------------------------

GroupFactory = Callable[[GroupSpec], "dist.ProcessGroup | None"]
"""Called by every rank for every group, in the global order; returns the group on its members
and None elsewhere."""


def new_group_factory(backend: str | None = None, timeout_s: float | None = None) -> GroupFactory:
    """The production factory: `torch.distributed.new_group` over the default group's store."""
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s) if timeout_s else None

    def create(spec: GroupSpec) -> dist.ProcessGroup | None:
        group = dist.new_group(list(spec.ranks), timeout=timeout, backend=backend, group_desc=spec.name)
        return group if dist.get_rank() in spec.ranks else None

    return create


@dataclass
class GroupRegistry:
    """This rank's groups of a `GroupLayout`, and the Megatron `ProcessGroupCollection` of each
    trainer configuration built from them (cached; building one creates no group)."""

    layout: GroupLayout
    rank: int
    groups: dict[tuple[int, ...], dist.ProcessGroup]
    """Member ranks -> group, for every group this rank belongs to."""
    startup_s: float = 0.0
    """Seconds spent creating them."""
    _collections: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, layout: GroupLayout, rank: int, factory: GroupFactory | None = None) -> "GroupRegistry":
        """Create the layout's groups, keeping those `rank` belongs to. Every rank of the job
        must call this."""
        factory = factory or new_group_factory()
        started = time.perf_counter()
        groups = {}
        for spec in layout.group_specs():
            group = factory(spec)
            if rank in spec.ranks:
                groups[spec.ranks] = group
        return cls(layout, rank, groups, time.perf_counter() - started)

    def group(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The pre-made group with exactly these members (KeyError naming them if none)."""
        key = tuple(sorted(ranks))
        if key not in self.groups:
            raise KeyError(f"rank {self.rank} holds no group over ranks {list(key)}: the layout "
                           f"(W={self.layout.world_size}, TP={self.layout.tp_size}) never made it")
        return self.groups[key]

    @property
    def self_group(self) -> dist.ProcessGroup:
        return self.group((self.rank,))

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """This rank's home TP group (its block, or the rank alone)."""
        return self.group(self.layout.home_tp_ranks(self.rank))

    def dp_group(self, actor_blocks: int) -> dist.ProcessGroup:
        """This rank's DP group when the first `actor_blocks` blocks are actors."""
        if self.rank not in self.layout.actor_ranks(actor_blocks):
            raise ValueError(f"rank {self.rank} is not an actor when {actor_blocks} blocks train")
        return self.group(self.layout.dp_ranks(actor_blocks, self.layout.tp_position(self.rank)))

    def actors_group(self, actor_blocks: int) -> dist.ProcessGroup:
        """All actor ranks when the first `actor_blocks` blocks train (group rank == global rank)."""
        return self.group(self.layout.actor_ranks(actor_blocks))

    def actor_groups(self, actor_blocks: int):
        """Megatron's `ProcessGroupCollection` for an actor rank under `actor_blocks` DP ranks."""
        key = ("actor", actor_blocks)
        if key not in self._collections:
            self._collections[key] = self._collection(self.dp_group(actor_blocks),
                                                      self.actors_group(actor_blocks))
        return self._collections[key]

    def model_groups(self):
        """The `ProcessGroupCollection` of a forward-only model on this rank's home TP group
        (a reference): DP is the rank alone."""
        if "model" not in self._collections:
            self._collections["model"] = self._collection(self.self_group, self.tp_group)
        return self._collections["model"]

    def _collection(self, dp: dist.ProcessGroup, tp_dp: dist.ProcessGroup):
        from megatron.core.process_groups_config import ProcessGroupCollection

        tp, alone = self.tp_group, self.self_group
        # PP = CP = EP = 1: those groups are the rank alone; no MoE, so the expert groups mirror
        # the dense ones. A single distributed-optimizer instance spans the DP group.
        return ProcessGroupCollection(
            tp=tp, mp=tp, tp_cp=tp, expt_tp=tp, tp_ep=tp, tp_ep_pp=tp,
            pp=alone, cp=alone, ep=alone, embd=alone, pos_embd=alone,
            dp=dp, dp_cp=dp, intra_dp_cp=dp, expt_dp=dp, intra_expt_dp=dp, intra_dist_opt=dp,
            tp_dp_cp=tp_dp, inter_dist_opt=None)


# ---- the process-wide registry -------------------------------------------------------------

_REGISTRY: GroupRegistry | None = None


def set_registry(registry: GroupRegistry | None) -> None:
    global _REGISTRY
    _REGISTRY = registry


def registry(required: bool = True) -> GroupRegistry | None:
    """The registry built at start-up (`init_parallel` / `init_topology`); None if there is none
    and not `required`."""
    if _REGISTRY is None and required:
        raise RuntimeError("process groups are not set up: call models.megatron_gpt.init_parallel "
                           "or comm.topology.init_topology first")
    return _REGISTRY


# ---- guards and helpers --------------------------------------------------------------------


class GroupCreatedError(RuntimeError):
    """A process group was created where the design forbids it (after start-up)."""


@contextlib.contextmanager
def forbid_new_groups() -> Iterator[list[str]]:
    """Inside the block, creating any process group raises `GroupCreatedError`.

    Wraps the public creators (`new_group`, `new_subgroups`, `new_subgroups_by_enumeration`,
    `init_process_group`, the `ProcessGroupGloo`/`ProcessGroupNCCL` constructors as reached
    through `torch.distributed`) and torch's internal `_new_process_group_helper`, which every
    creator goes through. Yields the list of attempted creations (empty while nothing tried).
    """
    from torch.distributed import distributed_c10d as c10d

    attempts: list[str] = []

    def refuse(name):
        def wrapper(*args, **kwargs):
            attempts.append(name)
            raise GroupCreatedError(f"{name} called after start-up: every process group must come "
                                    "from the start-up registry (comm/groups.py)")
        return wrapper

    targets = [(dist, n) for n in ("new_group", "new_subgroups", "new_subgroups_by_enumeration",
                                   "init_process_group", "ProcessGroupGloo", "ProcessGroupNCCL")
               if hasattr(dist, n)]
    targets += [(c10d, n) for n in ("new_group", "_new_group_with_tag", "_new_process_group_helper")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name, _ in saved:
        setattr(module, name, refuse(f"torch.distributed.{name}"))
    try:
        yield attempts
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@contextlib.contextmanager
def as_default_group(group: dist.ProcessGroup) -> Iterator[None]:
    """Make `group` torch.distributed's default group inside the block.

    For Megatron calls that act on the default group with no way to pass one (the optimizer's
    param-group alignment, `dist_checkpointing`): they then see `group` as the whole world.
    Only sound where those calls do not mix default-group ranks with global ranks of other
    groups: a group whose ranks are a prefix 0..n-1 (group rank == global rank), or the rank
    alone when the call communicates with nobody.
    """
    from torch.distributed.distributed_c10d import _world

    saved = _world.default_pg
    _world.default_pg = group
    try:
        yield
    finally:
        _world.default_pg = saved
