"""Who does what in one trainer configuration, and what changes between two (pure Python).

`TrainerAssignment` turns a role plan (rank -> Role) into the trainer's view:
how many actor blocks (the DP size), each actor rank's DP rank, which reference rank streams
which actor rank its log-probs, and the micro-batch split by the current DP size.
`plan_transition` compares two assignments at the post-update boundary and tells every rank
what to do: leave or join the actors (and from whom a joiner receives weights and optimizer
state), re-point its DP group, release or load a reference model.

Decoupled routing: reference units (a reference's home TP group: a TP block, or one rank after
the last block) serve the actor DP ranks round-robin (DP rank d -> unit d mod R); inside a unit
of t ranks, TP rank (j mod t) sends to the actor ranks at TP position j. With TP=1 references
and TP=2 actors the one reference rank sends to both TP ranks of each actor block it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from tide_megatron.comm.groups import GroupLayout
from tide_megatron.comm.messages import SetRoles
from tide_megatron.core.roles import Role


@dataclass(frozen=True)
class TrainerAssignment:
    """The trainer side of a role plan."""

    layout: GroupLayout
    actor_blocks: int
    """k: the actor ranks are the first k TP blocks; k is the DP size."""
    ref_ranks: tuple[int, ...] = ()
    """Dedicated reference ranks (decoupled steps); each unit's ranks listed in full."""
    actors_hold_ref: bool = True
    """Actors also hold the reference (ACTOR_REF, colocated steps). ERS plans have either this
    or dedicated reference ranks; a static partition with a reference rank may keep both and
    choose the RA2P mode per step."""

    def __post_init__(self) -> None:
        layout = self.layout
        actors = set(layout.actor_ranks(self.actor_blocks))
        refs = set(self.ref_ranks)
        if not self.actors_hold_ref and not refs:
            raise ValueError("the reference must live somewhere: actors_hold_ref or at least one reference rank")
        if actors & refs:
            raise ValueError(f"ranks {sorted(actors & refs)} are both actor and reference")
        for rank in refs:
            missing = set(layout.home_tp_ranks(rank)) - refs
            if missing:
                raise ValueError(f"reference rank {rank} needs its whole TP group "
                                 f"{list(layout.home_tp_ranks(rank))}; missing {sorted(missing)}")

    @classmethod
    def from_roles(cls, layout: GroupLayout, roles: Mapping[int, Role]) -> "TrainerAssignment":
        """From a role plan over every rank; ValueError naming the rule a plan breaks."""
        actors = [r for r, role in roles.items() if role in (Role.ACTOR, Role.ACTOR_REF)]
        refs = tuple(sorted(r for r, role in roles.items() if role is Role.REF))
        kinds = {roles[r] for r in actors}
        if len(kinds) > 1:
            raise ValueError("actor ranks mix ACTOR and ACTOR_REF: one RA2P mode per step")
        return cls(layout, layout.actor_blocks_of(actors), refs, actors_hold_ref=Role.ACTOR_REF in kinds)

    @classmethod
    def at_startup(cls, layout: GroupLayout, trainer_ranks: Sequence[int], ref_ranks: Sequence[int]
                   ) -> "TrainerAssignment":
        """A job's first configuration (`comm.topology.Topology`): the actors also hold the
        reference, so a step may run colocated or, with reference ranks, decoupled."""
        return cls(layout, layout.actor_blocks_of(trainer_ranks), tuple(ref_ranks), actors_hold_ref=True)

    def to_message(self, previous: "TrainerAssignment") -> SetRoles:
        """The control message that announces this assignment, replacing `previous` (the layout is
        known to every rank)."""
        return SetRoles(self.actor_blocks, list(self.ref_ranks), self.actors_hold_ref,
                        previous.actor_blocks, list(previous.ref_ranks), previous.actors_hold_ref)

    @classmethod
    def from_message(cls, layout: GroupLayout, msg: SetRoles) -> "TrainerAssignment":
        """The configuration `msg` announces."""
        return cls(layout, int(msg.actor_blocks), tuple(int(r) for r in msg.ref_ranks),
                   actors_hold_ref=bool(msg.actors_hold_ref))

    @classmethod
    def replaced_by(cls, layout: GroupLayout, msg: SetRoles) -> "TrainerAssignment":
        """The configuration `msg` replaces."""
        return cls(layout, int(msg.was_actor_blocks), tuple(int(r) for r in msg.was_ref_ranks),
                   actors_hold_ref=bool(msg.was_actors_hold_ref))

    def catch_up(self, current: "TrainerAssignment", rank: int) -> "TrainerAssignment":
        """`current` for a rank whose view is this one: a rank that rolled out while the trainer
        changed without it missed those changes, all of which left its own role as it was."""
        if current != self and current.role_of(rank) is not self.role_of(rank):
            raise RuntimeError(f"rank {rank} is {self.role_of(rank).name} in its own view of the trainer but "
                               f"{current.role_of(rank).name} in rank 0's: a role change reached it out of order")
        return current

    @property
    def modes(self) -> frozenset[str]:
        """RA2P modes a step may run in: "colocated" needs actors holding the reference,
        "decoupled" reference ranks."""
        return frozenset({"colocated"} if self.actors_hold_ref else set()) | (
            frozenset({"decoupled"}) if self.ref_ranks else frozenset())

    # ---- actors ------------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return self.actor_blocks

    @property
    def actor_ranks(self) -> tuple[int, ...]:
        return self.layout.actor_ranks(self.actor_blocks)

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        """Every rank in a trainer role (actors and reference ranks), ascending."""
        return tuple(sorted(set(self.actor_ranks) | set(self.ref_ranks)))

    def dp_rank(self, rank: int) -> int:
        """The DP rank of an actor rank (its block)."""
        if rank not in self.actor_ranks:
            raise ValueError(f"rank {rank} is not an actor rank ({self.actor_blocks} actor blocks)")
        return rank // self.layout.tp_size

    def dp_members(self, dp_rank: int) -> tuple[int, ...]:
        """The TP ranks of actor DP rank `dp_rank` (each gets the same micro-batches)."""
        if not 0 <= dp_rank < self.actor_blocks:
            raise ValueError(f"DP rank {dp_rank} outside 0..{self.actor_blocks - 1}")
        return self.layout.home_tp_ranks(dp_rank * self.layout.tp_size)

    def role_of(self, rank: int) -> Role:
        if rank in self.actor_ranks:
            return Role.ACTOR_REF if self.actors_hold_ref else Role.ACTOR
        return Role.REF if rank in self.ref_ranks else Role.ROLLOUT

    # ---- decoupled routing ---------------------------------------------------------------

    @property
    def ref_units(self) -> list[tuple[int, ...]]:
        """Reference units (home TP groups of the reference ranks), lowest rank first."""
        units = {self.layout.home_tp_ranks(r) for r in self.ref_ranks}
        return sorted(units)

    def ref_unit_of(self, dp_rank: int) -> tuple[int, ...]:
        """The reference unit serving actor DP rank `dp_rank`."""
        units = self.ref_units
        if not units:
            raise ValueError("no reference ranks: only colocated steps")
        return units[dp_rank % len(units)]

    def ref_source(self, actor_rank: int) -> int:
        """The reference rank that sends `actor_rank` its reference log-probs."""
        unit = self.ref_unit_of(self.dp_rank(actor_rank))
        return unit[self.layout.tp_position(actor_rank) % len(unit)]

    def ref_destinations(self, ref_rank: int) -> dict[int, tuple[int, ...]]:
        """Actor DP rank -> the actor ranks `ref_rank` sends that DP rank's log-probs to."""
        unit = self.layout.home_tp_ranks(ref_rank)
        if ref_rank not in self.ref_ranks:
            raise ValueError(f"rank {ref_rank} is not a reference rank")
        out = {}
        for dp in range(self.actor_blocks):
            if self.ref_unit_of(dp) == unit:
                out[dp] = tuple(r for r in self.dp_members(dp) if self.ref_source(r) == ref_rank)
        return out

    def served_dp_ranks(self, ref_rank: int) -> list[int]:
        """Actor DP ranks whose micro-batches `ref_rank` computes (every rank of its unit)."""
        unit = self.layout.home_tp_ranks(ref_rank)
        return [dp for dp in range(self.actor_blocks) if self.ref_unit_of(dp) == unit]


def split_by_dp(items: Sequence[Hashable], dp_size: int) -> list[list[Hashable]]:
    """Round-robin a global batch over the current DP size: item i to DP rank i mod dp_size.

    The split for micro-batches that arrive after a step has been planned (the ready backlog is
    split by the RA2P planner, `trainer.ra2p.plan_step(..., dp_size)`).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    shards: list[list[Hashable]] = [[] for _ in range(dp_size)]
    for i, item in enumerate(items):
        shards[i % dp_size].append(item)
    return shards


# ---- transitions at the post-update boundary ------------------------------------------------


@dataclass(frozen=True)
class RankTransition:
    """What one rank does when the assignment changes."""

    rank: int
    old_role: Role
    new_role: Role
    actor: str = "none"
    """"keep" (an actor before and after), "join", "leave" or "none"."""
    ref: str = "none"
    """The reference model: "keep", "load", "release" or "none"."""
    new_actor_blocks: int = 0
    """DP size after the change (0 when the rank is no actor after it)."""
    state_source: int | None = None
    """A joining actor: the current actor rank that sends it weights and optimizer state."""
    state_targets: tuple[int, ...] = ()
    """A staying actor: the joining ranks it sends weights and optimizer state to, in order."""


def _holds_ref(role: Role) -> bool:
    return role in (Role.REF, Role.ACTOR_REF)


def plan_transition(old: TrainerAssignment, new: TrainerAssignment) -> dict[int, RankTransition]:
    """Every rank's transition from `old` to `new` (same layout).

    A rank that joins the actors at block b, TP position j receives from the current actor at
    block b mod k_old, position j: joiners spread over the current actors, every pair lies in
    the new configuration's DP group of position j.
    """
    if old.layout != new.layout:
        raise ValueError("both assignments must use the same group layout")
    layout, tp = old.layout, old.layout.tp_size
    out: dict[int, RankTransition] = {}
    targets: dict[int, list[int]] = {}
    sources: dict[int, int] = {}
    for rank in new.actor_ranks:
        if rank not in old.actor_ranks:
            src = (rank // tp) % old.actor_blocks * tp + layout.tp_position(rank)
            sources[rank] = src
            targets.setdefault(src, []).append(rank)
    for rank in range(layout.world_size):
        was, now = old.role_of(rank), new.role_of(rank)
        in_old, in_new = rank in old.actor_ranks, rank in new.actor_ranks
        actor = {(True, True): "keep", (False, True): "join", (True, False): "leave"}.get((in_old, in_new), "none")
        ref = {(True, True): "keep", (False, True): "load", (True, False): "release"}.get(
            (_holds_ref(was), _holds_ref(now)), "none")
        out[rank] = RankTransition(rank, was, now, actor=actor, ref=ref,
                                   new_actor_blocks=new.actor_blocks if in_new else 0,
                                   state_source=sources.get(rank), state_targets=tuple(targets.get(rank, ())))
    return out
