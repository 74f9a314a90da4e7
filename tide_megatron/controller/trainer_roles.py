"""ERS in the real system: rank 0 plans the next step's roles at the post-update boundary and
moves the ranks to them before the weight sync.

After each actor update rank 0 asks core's `ERSController` for the next role plan (the
rollout/trainer split and the RA2P layout) and, when it differs from the one in force, carries
it out:

1. A rank leaving rollout for the trainer stops taking tasks: the rollout service takes its
   tasks back (`CancelAll`) and, with CTB, the rank hands each one over: its episode so far and
   its env session go on where CTB resumes it, re-prefilled under the new weights (no KV moves;
   `rollout/task_carry.py`); without CTB, or for a task that had not begun, the task starts
   afresh elsewhere. Rank 0 waits for its `AllCancelled` (a turn in flight ends first; an env
   step in flight does not hold it up, its result comes with the session); this drain is the
   move's share of the critical path on the rollout side.
2. Every rank whose trainer role changes gets the new `TrainerAssignment` (`SetRoles`,
   `trainer.step_feed.post_roles`); rank 0 applies it itself (`TrainerWorker.apply`), the
   others answer `RolesDone` with the seconds each part took. A joining actor receives the
   weights and optimizer state from a current one over the new DP group; a leaving actor drops
   its state (its DP peers hold the same); a reference is built from the initial checkpoint or
   restored from host memory, and parked when released. No process group is created
   (`comm/groups.py`).
3. A rank leaving the trainer for rollout is named to the rollout service before the sync: it
   is one of the sync's receivers whether or not its engine is up yet (the send waits for its
   receive), and takes tasks once it has loaded those weights. Its engine was started at
   start-up (`ers.standby_engines`, see `standby_engine_ranks`) or starts the first time it rolls
   out; it releases and resumes its memory where SGLang can.

The plan keeps the trainer a prefix of the ranks (`ERSConfig.reclaim="lowest"`): actor DP
groups are the first TP blocks, reference ranks the highest trainer ranks. The split moves one
TP block per step (`ERSConfig.rank_block`: one rank with TP=1; `ers.move_ranks`), so the
trainer is always whole data-parallel replicas; ranks past the last whole block only roll out.

Preemptive maximal rollout at cold start (`cold_start`, `ers.preemptive_cold_start`): before
the first step every trainer rank but rank 0's block rolls out (its standby engine makes that a
weight load). The loan ends when the first step's data is ready (`end_cold_start`), as in the
simulator: from then on the trainer has work for every rank, and rollout's admission window
soon fills (lent ranks kept to the first boundary sat idle in rollout while the trainer ran
short of them). The ranks come back as at a boundary, their tasks handed over, under the same
weights (version 0): no sync follows.

The evaluation loan (`ers.preemptive_eval`): the loop evaluates step i's model during step
i+1, beside training, so that step is bounded below by the evaluation. At the boundary where
an evaluation starts, every trainer rank the step does not need to finish its batch within the
last evaluation's duration rolls out (core's `eval_trainer_ranks`); the next boundary, after
the evaluation is gathered (no eval task is moved), returns to the reactive plan. A loan is
outside the one-move-per-step limit both ways, as in the simulator.

Time sharing (`scheduler.mode=sync`, the VeRL-like baseline; no ERS planning): the same loan at
every step. Before each step's rollout (at cold start, then at each boundary, before the weight
sync so the lent ranks take the new weights) every trainer rank but rank 0's block rolls out;
when the step's batch is complete they all come back and the step trains on every whole TP
block of the world. A rank that rejoins the trainer receives the weights and optimizer state
from rank 0's DP group each time (it dropped them on leaving): the cost of time sharing here.

`ers.drill_every=N` moves to the next configuration of `ers.drill` every N steps whatever the
measurements say: a drill that exercises role changes under load in tests and soaks, not a
policy (and no loan, at cold start or for an evaluation, runs with it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import RolesDone
from tide_megatron.comm.topology import Topology
from tide_megatron.controller.control_meter import DecisionTimer
from tide_megatron.controller.modes import moves_ranks, time_shared
from tide_megatron.core.ers import ERSConfig, ERSController, ERSMeasurements
from tide_megatron.core.roles import RA2PMode, Role, RolePlan
from tide_megatron.trainer.assignment import TrainerAssignment
from tide_megatron.trainer.step_feed import post_roles
from tide_megatron.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)

ROLES_TIMEOUT_S = 600.0
"""How long rank 0 waits for every affected rank to finish a role change (state transfers of
a large model included), and for a rank leaving rollout to drop its tasks."""


def standby_engine_ranks(cfg, trainer_side: list[int]) -> list[int]:
    """The trainer ranks that start an SGLang engine at start-up (`ers.standby_engines`): those
    that may move into rollout, i.e. all but rank 0's TP block (which always trains) when ranks
    move. A time-shared run always keeps them (its ranks roll out every step)."""
    if not (time_shared(cfg) or (moves_ranks(cfg) and cfg.ers.standby_engines)):
        return []
    return [r for r in trainer_side if r >= cfg.trainer.tp_size]


def may_train(cfg, rank: int, world_size: int) -> bool:
    """Whether `rank` can ever be on the trainer side: it starts there, or it may be moved there
    (it lies in a whole TP block; ranks past the last whole block only roll out)."""
    tp = cfg.trainer.tp_size
    return rank < world_size - cfg.cluster.rollout_ranks or (moves_ranks(cfg) and rank < world_size // tp * tp)


class TrainerRoles:
    """Rank 0's owner of the role plan (the controller thread only)."""

    def __init__(self, ers_cfg, topo: Topology, mailbox: Mailbox, worker: TrainerWorker, ra2p_cfg,
                 take, rollout=None, min_rollout_ranks: int = 1, time_share: bool = False):
        """`ers_cfg`: `config.ERSJobConfig`; `take(kind, count, timeout_s)`: the trainer
        driver's reply collector; `rollout`: the rollout service (None: the split is held);
        `time_share`: lend every trainer rank to each step's rollout (module docstring)."""
        self.cfg = ers_cfg
        self.topo, self.mailbox, self.worker, self._take, self.rollout = topo, mailbox, worker, take, rollout
        self.world = topo.world_size
        self.tp = worker.registry.layout.tp_size
        self.time_share = bool(time_share and rollout is not None)
        self.moves_split = self.time_share or bool(ers_cfg.move_ranks and rollout is not None)
        self.ers = ERSController(ERSConfig(enabled=ers_cfg.enabled, max_moves_per_step=1 if self.moves_split else 0,
                                           reclaim="lowest", min_rollout_ranks=min_rollout_ranks,
                                           min_trainer_ranks=self.tp, rank_block=self.tp,
                                           failed_move_hold_steps=ers_cfg.failed_move_hold_steps,
                                           payoff_windows=ers_cfg.payoff_windows, streaks=ers_cfg.streaks),
                                 self.world, ra2p_cfg)
        self._startup = worker.assignment
        self.plan = self._plan_of(worker.assignment)
        self.changes = 0
        self.moves = 0
        self._on_loan = False  # lent (at cold start, or time sharing's every step), and not yet back
        self.plan_times = DecisionTimer()
        """How long each ERS plan took (`control_meter.py`)."""
        self.rollout_resized = False
        """The rollout ranks changed since the last plan, with work in flight: ERS's window then
        mixes two splits: ERS reads the trainer's rate only and holds the split
        (`ERSMeasurements.rollout_resized`)."""

    @property
    def ranks(self) -> list[int]:
        """The trainer-side ranks now (actors and reference ranks)."""
        return list(self.worker.assignment.trainer_ranks)

    @property
    def enabled(self) -> bool:
        """Roles may change at a boundary (ERS, or time sharing)."""
        return self.time_share or (self.cfg.enabled and (len(self.ranks) >= 2 or self.moves_split))

    def predicted_step_s(self, mode: RA2PMode) -> float:
        """The latency ERS's layout predicted for a step in `mode` under the plan in force
        (NaN: no prediction, e.g. on a loan or before ERS planned)."""
        if self._on_loan or self.plan.mode is not mode:
            return math.nan
        return float(self.plan.extras.get(f"latency_{mode.value}_s", math.nan))

    def _whole_world_plan(self) -> RolePlan:
        """Time sharing's training split: every whole TP block trains (colocated)."""
        trainers = self.world // self.tp * self.tp
        roles = {r: Role.ACTOR_REF if r < trainers else Role.ROLLOUT for r in range(self.world)}
        return RolePlan(roles, RA2PMode.COLOCATED, reason="time sharing: every rank trains", step=-1)

    def _lend_for_rollout(self, step: int, reason: str) -> dict[str, float]:
        """Time sharing: every trainer rank but rank 0's block rolls out until the step's batch
        is complete (`end_cold_start` brings them back)."""
        train = self._whole_world_plan()
        loan = self.ers.preemptive_plan(train, keep_trainer_ranks=self.tp, reason=reason)
        out = self._carry_out(loan, step, reactive=train)
        self._on_loan = self.ranks != train.trainer_ranks
        return out

    # -- plan <-> assignment ------------------------------------------------------------------
    def _plan_of(self, a: TrainerAssignment) -> RolePlan:
        roles = {r: Role.ROLLOUT for r in range(self.world)}
        decoupled = not a.actors_hold_ref
        for r in a.actor_ranks:
            roles[r] = Role.ACTOR if decoupled else Role.ACTOR_REF
        for r in a.ref_ranks:
            # The start-up hybrid (actors hold the reference and reference ranks exist) reads as
            # colocated over every trainer-side rank: ERS's colocated layout.
            roles[r] = Role.REF if decoupled else Role.ACTOR_REF
        return RolePlan(roles, RA2PMode.DECOUPLED if decoupled else RA2PMode.COLOCATED, step=-1)

    def _assignment_of(self, plan: RolePlan) -> Optional[TrainerAssignment]:
        """The assignment of `plan`, or None when its trainer is not a prefix of whole TP blocks."""
        layout = self.worker.registry.layout
        trainer = plan.trainer_ranks
        refs = [r for r in trainer if plan.roles[r] is Role.REF]
        refs = refs[len(refs) % self.tp:]  # whole TP blocks, the highest ranks
        actors = [r for r in trainer if r not in refs]
        if not actors or len(actors) % self.tp or actors != list(range(len(actors))):
            return None
        return TrainerAssignment(layout, len(actors) // self.tp, tuple(refs), actors_hold_ref=not refs)

    def _drill_plan(self, step: int) -> RolePlan:
        roles = {r: Role.ROLLOUT for r in range(self.world)}
        base = list(self._startup.trainer_ranks)
        if self.cfg.drill == "split":
            # the start-up trainer, then the next TP block of ranks joins as an actor, then
            # serves as the reference (with a reference model), then returns to rollout
            phases = 3 if self.worker.needs_ref else 2
            phase = (step // self.cfg.drill_every) % phases
            extra = list(range(base[-1] + 1, base[-1] + 1 + self.tp))
            trainer = base + extra if phase else base
            decoupled = phase == 2
            for r in trainer:
                roles[r] = (Role.REF if r in extra else Role.ACTOR) if decoupled else Role.ACTOR_REF
            what = ["start-up split", f"rank(s) {extra} join the actors", f"rank(s) {extra} are the reference"][phase]
        else:
            decoupled = self.plan.mode is RA2PMode.COLOCATED  # the other layout
            trainer = self.plan.trainer_ranks
            n_ref = self.tp if decoupled else 0
            for i, r in enumerate(trainer):
                roles[r] = (Role.REF if i >= len(trainer) - n_ref else Role.ACTOR) if decoupled else Role.ACTOR_REF
            what = "the other layout"
        return RolePlan(roles, RA2PMode.DECOUPLED if decoupled else RA2PMode.COLOCATED,
                        reason=f"drill every {self.cfg.drill_every} steps: {what}", step=step, changed=True)

    # -- the boundary ---------------------------------------------------------------------------
    def cold_start(self) -> dict[str, float]:
        """Preemptive maximal rollout at cold start (paper, "ERS"): before the first step,
        nothing is ready to train, so every trainer rank but the minimum rolls out; a loan that
        `end_cold_start` ends (or, failing that, the first boundary). Returns metrics (empty
        when not lent).
        The caller sends the weights next, so the lent ranks enter rollout service."""
        if self.time_share:
            out = self._lend_for_rollout(0, "time sharing: the first step's rollout")
            self.rollout_resized = False
            return out
        if not (self.enabled and self.moves_split and self.cfg.preemptive_cold_start and not self.cfg.drill_every):
            return {}
        loan = self.ers.preemptive_plan(self.plan, keep_trainer_ranks=self.ers.config.min_trainer_ranks,
                                        reason="cold start")
        out = self._carry_out(loan, step=0, reactive=self.plan)
        self._on_loan = self.ranks != self.plan.trainer_ranks  # lent (the move may not have run)
        self.rollout_resized = False  # nothing was in flight: every rank starts empty
        return out

    def end_cold_start(self, step: int, timeout_s: float) -> dict[str, float]:
        """The first step's data is ready: the cold-start loan ends (module docstring). A lent
        rank still loading the weights of version 0 is waited for (at most `timeout_s`; one that
        fails to load them is quarantined, which ends the wait); while one is out of service the
        loan lasts to the first boundary. Returns metrics (empty when no loan was in force)."""
        if not self._on_loan:
            return {}
        self._on_loan = False
        lent = [r for r in self.plan.trainer_ranks if r not in self.ranks]
        self.rollout.wait(self.rollout.submit(lambda: None, when=lambda: not any(
            self.rollout.returning(r) for r in lent)), timeout_s, f"lent rank(s) {lent} to load the first weights")
        # The loan's end is not a rollout scale-down to retain data for: the step that opened
        # was sized under it, and the next is the split ERS planned from (as in the simulator).
        back = dataclasses.replace(self.plan, reason="time sharing: the step's batch is complete, every rank trains"
                                   if self.time_share else "the cold-start loan ends: the first step's data is ready")
        out = self._carry_out(back, step, retain=False)
        return {"ers/cold_start_end_s": out["ers/role_change_s"]} if "ers/role_change_s" in out else {}

    def after_update(self, step: int, m: ERSMeasurements, times, ra2p=None,
                     expected_eval_s: float = 0.0, correction=None) -> dict[str, float | str]:
        """Plan the next step's roles and move to them; returns metrics for the step (numbers,
        and the plan's reason as `ers/reason`). `times`, `ra2p`, `correction`: RA2P's cost
        inputs as the trainer's mode selector measured them (`ModeSelector.cost_inputs`, its
        latency correction); `expected_eval_s`:
        an evaluation starts at this boundary and is expected to take this long (0: none
        starts, or its length is not measured yet)."""
        if not self.enabled:
            return {}
        self._on_loan = False  # a loan still in force ends at this boundary
        if self.time_share:
            return self._lend_for_rollout(step, f"time sharing: step {step + 1}'s rollout")
        drill = self.cfg.drill_every and step % self.cfg.drill_every == 0
        if drill:
            plan = self._drill_plan(step)
        else:
            t0 = time.perf_counter()
            plan = self.ers.plan(self.plan, m, times, step=step, ra2p=ra2p, correction=correction)
            self.plan_times.record(time.perf_counter() - t0)
        self.rollout_resized = False  # read into `m`; the next window starts with this plan's moves
        # what ERS read and concluded (rates, shares, decode slowdown, target split), for the
        # logs; `ers/reason` says why, also when the split is held
        signals = {f"ers/{k}": v for k, v in plan.extras.items() if math.isfinite(v)}
        keep = self.ers.eval_trainer_ranks(expected_eval_s)
        chosen, reactive = plan, None
        if not self.cfg.drill_every and expected_eval_s > 0 and self.moves_split and self.cfg.preemptive_eval \
                and keep < len(plan.trainer_ranks):
            chosen, reactive = self.ers.preemptive_plan(plan, keep_trainer_ranks=keep, reason=(
                f"evaluation expected to take {expected_eval_s:.1f} s; {keep} trainer rank(s) finish the step "
                f"within it")), plan
        return {**signals, "ers/reason": chosen.reason, **self._carry_out(chosen, step, reactive=reactive)}

    def _carry_out(self, plan: RolePlan, step: int, reactive: Optional[RolePlan] = None,
                   retain: bool = True) -> dict[str, float]:
        """Move the ranks to `plan` (module docstring, steps 1-3). `reactive`: `plan` is a loan
        and this is the plan ERS goes on from (the next boundary returns to it). `retain`: a
        rank leaving rollout starts adaptive data retention."""
        new = self._assignment_of(plan)
        old = self.worker.assignment
        goes_on = reactive or plan  # the plan ERS plans from next
        out = {"ers/trainer_ranks": float(len(self.ranks)), "ers/trainer_ranks_ref": float(len(old.ref_ranks)),
               "ers/changes": float(self.changes), "ers/moves": float(self.moves),
               "ers/lent_ranks": float(len(goes_on.trainer_ranks) - len(plan.trainer_ranks)) if new is not None else 0.0}
        if new is None or new == old:
            if new is not None:
                self.plan = goes_on
            return out
        before, after = set(self.ranks), set(new.trainer_ranks)
        joining, leaving = sorted(after - before), sorted(before - after)
        if joining and not self.rollout.call(lambda: all(r in self.rollout.quarantine.serving for r in joining)):
            logger.warning("step %d: ERS planned ranks %s into the trainer, but not all are rollout ranks in service "
                           "(quarantined, or not back from the trainer yet); the roles stay as they are",
                           step, joining)
            return out
        started = time.perf_counter()
        # All in one call on the rollout thread: no placement pass runs between two ranks'
        # moves, so CTB cannot resume a task of the first on the second as it leaves.
        if joining:
            self.rollout.call(lambda: [self.rollout.move_to_trainer(r, plan.reason, retain=retain) for r in joining])
            self.rollout.wait(self.rollout.submit(lambda: None, when=lambda: all(self.rollout.in_trainer(r)
                                                                                for r in joining)),
                              ROLES_TIMEOUT_S, f"rank(s) {joining} to drop their rollout tasks")
        drain_s = time.perf_counter() - started
        affected = sorted(before | after)
        post_roles(self.mailbox, old, new, affected)
        for r in leaving:  # before the sync: they receive its weights
            self.rollout.call(lambda r=r: self.rollout.return_to_rollout(r))
        mine = self.worker.apply(new)
        replies = self._take(RolesDone, len(affected) - 1, timeout_s=ROLES_TIMEOUT_S)
        critical = time.perf_counter() - started
        self.plan = goes_on
        self.changes += 1
        self.moves += len(joining) + len(leaving)
        self.rollout_resized = self.rollout_resized or bool(joining or leaving)
        logger.info("step %d: roles -> %d actor DP rank(s), reference ranks %s, rollout %s (%s); %.2f s",
                    step, new.dp_size, list(new.ref_ranks) or "none (actors hold it)",
                    [r for r in range(self.world) if r not in after], plan.reason, critical)
        slowest = max([mine.get("total_s", 0.0)] + [r.times.get("total_s", 0.0) for r in replies])
        return {**out, "ers/changes": float(self.changes), "ers/moves": float(self.moves),
                "ers/trainer_ranks": float(len(after)), "ers/trainer_ranks_ref": float(len(new.ref_ranks)),
                "ers/role_change_s": critical, "ers/role_change_drain_s": drain_s,
                "ers/role_change_slowest_rank_s": slowest}
