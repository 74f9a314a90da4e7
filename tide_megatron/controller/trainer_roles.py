"""ERS on the trainer side, carried out by rank 0 at the post-update boundary.

After each actor update and before the weight sync, rank 0 asks core's `ERSController` for the
next role plan and RA2P layout and, when it differs from the current one, moves the
trainer-side ranks (the start-up actor and reference ranks, a prefix of the job in TP blocks)
to it: every rank gets the new `TrainerAssignment` ("roles", `trainer.step_feed.post_roles`),
rank 0 applies it itself (`TrainerWorker.apply`), and the others answer "roles_done" with the
seconds each part took. A colocated plan makes every trainer-side rank an actor holding the
reference (DP = all of them); a decoupled plan makes the highest ones dedicated reference ranks
(whole TP blocks) and the rest actors. A joining actor receives the weights and optimizer state
from a current one over the new DP group; a leaving actor drops its state (its DP peers hold the
same); references are parked in host memory. No process group is created (`comm/groups.py`).

What this version does not move: ranks between rollout and the trainer. The plan is made with
`max_moves_per_step=0` (the split is held), so ERS decides the RA2P layout of the trainer ranks
it has; moving a rollout rank needs its SGLang engine to release and resume its memory, which
the controller does not do yet.

`ers.drill_every=N` alternates between the two layouts every N steps whatever the measurements
say: a drill that exercises role changes under load in tests and soaks, not a policy.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.topology import Topology
from tide_megatron.core.ers import ERSConfig, ERSController, ERSMeasurements
from tide_megatron.core.roles import RA2PMode, Role, RolePlan
from tide_megatron.trainer.assignment import TrainerAssignment
from tide_megatron.trainer.step_feed import post_roles
from tide_megatron.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)

ROLES_TIMEOUT_S = 600.0
"""How long rank 0 waits for every trainer-side rank to finish a role change (state transfers
of a large model included)."""


class TrainerRoles:
    """Rank 0's owner of the trainer-side role plan (the controller thread only)."""

    def __init__(self, ers_cfg, topo: Topology, mailbox: Mailbox, worker: TrainerWorker, ra2p_cfg,
                 take):
        """`ers_cfg`: `config.ERSJobConfig`; `take(kind, count, timeout_s)`: the trainer
        driver's reply collector."""
        self.cfg = ers_cfg
        self.topo, self.mailbox, self.worker, self._take = topo, mailbox, worker, take
        self.ranks = sorted(topo.trainer_ranks + topo.ref_ranks)
        self.tp = worker.registry.layout.tp_size
        self.ers = ERSController(ERSConfig(enabled=ers_cfg.enabled, max_moves_per_step=0),
                                 topo.world_size, ra2p_cfg)
        self.plan = self._plan_of(worker.assignment)
        self.changes = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled and len(self.ranks) >= 2

    # -- plan <-> assignment ------------------------------------------------------------------
    def _plan_of(self, a: TrainerAssignment) -> RolePlan:
        roles = {r: Role.ROLLOUT for r in range(self.topo.world_size)}
        decoupled = not a.actors_hold_ref
        for r in a.actor_ranks:
            roles[r] = Role.ACTOR if decoupled else Role.ACTOR_REF
        for r in a.ref_ranks:
            # The start-up hybrid (actors hold the reference and reference ranks exist) reads as
            # colocated over every trainer-side rank: ERS's colocated layout.
            roles[r] = Role.REF if decoupled else Role.ACTOR_REF
        return RolePlan(roles, RA2PMode.DECOUPLED if decoupled else RA2PMode.COLOCATED, step=-1)

    def _assignment_of(self, plan: RolePlan) -> Optional[TrainerAssignment]:
        """The assignment of `plan` on the trainer-side prefix, or None when it does not fit
        whole TP blocks."""
        layout = self.worker.registry.layout
        refs = [r for r in self.ranks if plan.roles[r] is Role.REF]
        refs = refs[len(refs) % self.tp:]  # whole TP blocks, the highest ranks
        actors = [r for r in self.ranks if r not in refs]
        if not actors or len(actors) % self.tp:
            return None
        return TrainerAssignment(layout, len(actors) // self.tp, tuple(refs), actors_hold_ref=not refs)

    def _drill_plan(self, step: int) -> RolePlan:
        decoupled = self.plan.mode is RA2PMode.COLOCATED  # the other layout
        roles = dict(self.plan.roles)
        n_ref = self.tp if decoupled else 0
        for i, r in enumerate(self.ranks):
            roles[r] = (Role.REF if i >= len(self.ranks) - n_ref else Role.ACTOR) if decoupled else Role.ACTOR_REF
        return RolePlan(roles, RA2PMode.DECOUPLED if decoupled else RA2PMode.COLOCATED,
                        reason=f"drill every {self.cfg.drill_every} steps", step=step, changed=True)

    # -- the boundary ---------------------------------------------------------------------------
    def after_update(self, step: int, m: ERSMeasurements, times) -> dict[str, float]:
        """Plan the next step's trainer roles and move to them; returns metrics for the step."""
        if not self.enabled:
            return {}
        drill = self.cfg.drill_every and step % self.cfg.drill_every == 0
        plan = self._drill_plan(step) if drill else self.ers.plan(self.plan, m, times, step=step)
        new = self._assignment_of(plan)
        out = {"ers/trainer_ranks_ref": float(len(self.worker.assignment.ref_ranks)),
               "ers/changes": float(self.changes)}
        if new is None or new == self.worker.assignment:
            self.plan = plan if new is not None else self.plan
            return out
        started = time.perf_counter()
        post_roles(self.mailbox, new, self.ranks)
        mine = self.worker.apply(new)
        replies = self._take("roles_done", len(self.ranks) - 1, timeout_s=ROLES_TIMEOUT_S)
        critical = time.perf_counter() - started
        self.plan = plan
        self.changes += 1
        logger.info("step %d: trainer roles -> %d actor DP rank(s), reference ranks %s (%s); %.2f s",
                    step, new.dp_size, list(new.ref_ranks) or "none (actors hold it)", plan.reason, critical)
        slowest = max([mine.get("total_s", 0.0)] + [r["times"].get("total_s", 0.0) for r in replies])
        return {**out, "ers/changes": float(self.changes), "ers/trainer_ranks_ref": float(len(new.ref_ranks)),
                "ers/role_change_s": critical, "ers/role_change_slowest_rank_s": slowest}

    def roles(self) -> dict[int, str]:
        """Every trainer-side rank's current role, for the timeline."""
        return {r: self.worker.assignment.role_of(r).value for r in self.ranks}
