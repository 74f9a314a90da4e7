"""Rank roles and the role plan that ERS hands to the controller.

TideRL makes every data-parallel rank a schedulable slot (paper, "Introduction" and "ERS"):
at any moment a rank has exactly one role, and roles change only at the weight-sync boundary
that follows an actor update. This module holds the vocabulary shared by the RA2P planner,
the ERS planner, the simulator and the real controller, so none of them depends on another
just to name a role.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping


class Role(enum.Enum):
    """What a rank does during one training step."""

    ROLLOUT = "rollout"
    """Drives one inference engine and runs multi-turn tasks (CTB admits tasks onto it)."""
    ACTOR = "actor"
    """A Megatron actor DP rank in decoupled RA2P mode (forward + backward, no reference)."""
    REF = "ref"
    """A dedicated reference-model rank in decoupled RA2P mode (forward only, streams log-probs)."""
    ACTOR_REF = "actor_ref"
    """An actor DP rank that also hosts the reference model: colocated RA2P mode."""

    @property
    def is_trainer(self) -> bool:
        return self is not Role.ROLLOUT


class RA2PMode(enum.Enum):
    """The two Ref-Actor execution strategies of RA2P."""

    DECOUPLED = "decoupled"
    """Ref and Actor on distinct ranks; streaming micro-batch pipeline, loss in backward."""
    COLOCATED = "colocated"
    """Ref and Actor share ranks; ready-batch aggregation amortises the model swaps."""


def trainer_roles_for(mode: RA2PMode) -> frozenset[Role]:
    """The trainer-side roles that are legal under `mode`."""
    if mode is RA2PMode.DECOUPLED:
        return frozenset({Role.ACTOR, Role.REF})
    return frozenset({Role.ACTOR_REF})


@dataclass(frozen=True)
class RolePlan:
    """The role of every rank for the next training step, and the RA2P mode it runs in.

    Produced by `ERSController.plan` after each actor update, applied at the weight sync.
    """

    roles: Mapping[int, Role]
    """rank -> role, for every rank of the world."""
    mode: RA2PMode
    """RA2P mode the trainer ranks run in; consistent with the trainer roles."""
    reason: str = ""
    """Human-readable cause of the plan (logged with the step metrics)."""
    step: int = -1
    """Training step after which the plan was made (-1: initial plan)."""
    changed: bool = False
    """Whether any rank's role or the mode differs from the previous plan."""
    extras: Mapping[str, float] = field(default_factory=dict)
    """Signal values the decision was based on, for logging."""

    def __post_init__(self) -> None:
        legal = trainer_roles_for(self.mode)
        for rank, role in self.roles.items():
            if role.is_trainer and role not in legal:
                raise ValueError(f"rank {rank} has role {role.name}, illegal in {self.mode.name} mode")
        if self.mode is RA2PMode.DECOUPLED and self.actor_ranks and not self.ref_ranks:
            raise ValueError("decoupled mode needs at least one REF rank")
        if self.mode is RA2PMode.DECOUPLED and self.ref_ranks and not self.actor_ranks:
            raise ValueError("decoupled mode needs at least one ACTOR rank")

    def ranks_with(self, *roles: Role) -> list[int]:
        return sorted(r for r, role in self.roles.items() if role in roles)

    @property
    def rollout_ranks(self) -> list[int]:
        return self.ranks_with(Role.ROLLOUT)

    @property
    def trainer_ranks(self) -> list[int]:
        return self.ranks_with(Role.ACTOR, Role.REF, Role.ACTOR_REF)

    @property
    def actor_ranks(self) -> list[int]:
        """Ranks that run actor forward/backward (the trainer's DP ranks)."""
        return self.ranks_with(Role.ACTOR, Role.ACTOR_REF)

    @property
    def ref_ranks(self) -> list[int]:
        """Ranks that run the reference forward (dedicated REF, or ACTOR_REF when colocated)."""
        return self.ranks_with(Role.REF, Role.ACTOR_REF)

    @property
    def world_size(self) -> int:
        return len(self.roles)

    def role_changes(self, previous: "RolePlan") -> dict[int, tuple[Role, Role]]:
        """rank -> (old role, new role) for every rank whose role differs from `previous`."""
        return {
            rank: (previous.roles[rank], role)
            for rank, role in sorted(self.roles.items())
            if rank in previous.roles and previous.roles[rank] is not role
        }

    def ranks_leaving_rollout(self, previous: "RolePlan") -> list[int]:
        """Ranks that were ROLLOUT and are not any more: CTB must re-dispatch their tasks."""
        return [r for r, (old, new) in self.role_changes(previous).items() if old is Role.ROLLOUT]

    def ranks_joining_rollout(self, previous: "RolePlan") -> list[int]:
        return [r for r, (old, new) in self.role_changes(previous).items() if new is Role.ROLLOUT]
