"""Elastic Resource Scaling (ERS): move ranks between Rollout and Trainer from readiness.

Paper rules ("ERS Scheduling of RA2P Strategies"):

- When. A plan is made right after each actor update and before the weight sync; roles
  change on that sync boundary, where rollout caches are flushed anyway.
- Generation deficit (batch volume < B_ideal; small RAS, long TPRM, trainer starving):
  select COLOCATED RA2P and give the ranks that were dedicated Ref ranks to Rollout. If the
  trainer is already colocated, one more trainer rank goes to Rollout (down to the minimum).
- Consumption deficit (HoL > tau * T_step, or RAS above the decoupled break-even; ready
  data piling up): select DECOUPLED RA2P and reclaim one Rollout rank as a dedicated Ref
  rank; if already decoupled, reclaim one Rollout rank as more trainer capacity (a Ref rank
  when the actors outnumber `actors_per_ref` per Ref, else an actor).
- Trainer scale-up is at most one rank per step (`max_trainer_scale_up_per_step`).
- Preemptive generation allocation: at cold start and during evaluation phases generation
  dominates, so Rollout is maximised at once instead of waiting for the signals.
- Hysteresis (our addition; the paper asks for "conservative" plans that do not thrash):
  a deficit must persist `trigger_steps` consecutive steps and at least `cooldown_steps`
  steps must separate two reactive changes. When both deficits fire, generation wins: a batch
  below B_ideal is direct evidence that Rollout cannot fill the trainer, while a reservoir
  deliberately kept by adaptive retention ages the head of line on its own.

Rank choice is deterministic: a rollout rank is reclaimed from the least loaded (fewest
resident tokens per the caller's `rollout_load`; ties to the highest rank id, keeping low
ranks stable), a trainer rank is released from the highest id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from tide_megatron.core.buffer import GlobalBuffer
from tide_megatron.core.ra2p import MicroBatchTimes, RA2PConfig, break_even_ras
from tide_megatron.core.roles import RA2PMode, Role, RolePlan
from tide_megatron.core.signals import Deficits, detect_deficits


@dataclass
class ERSConfig:
    """Elastic Resource Scaling configuration."""

    enabled: bool = True
    """False freezes the role plan (static partition, the AReaL-style baseline)."""
    min_rollout_ranks: int = 1
    """Rollout never shrinks below this many ranks."""
    min_trainer_ranks: int = 1
    """Actor ranks never drop below this many (Ref ranks do not count)."""
    max_trainer_scale_up_per_step: int = 1
    """Most ranks the trainer may gain in one plan (the paper bounds it to one)."""
    trigger_steps: int = 2
    """Consecutive steps a deficit must be observed before ERS reacts."""
    cooldown_steps: int = 1
    """Steps after a reactive change during which no other reactive change is made."""
    actors_per_ref: int = 3
    """Actor ranks per dedicated Ref rank when growing a decoupled trainer (match RA2PConfig)."""

    def __post_init__(self) -> None:
        if self.min_rollout_ranks < 0 or self.min_trainer_ranks < 1:
            raise ValueError("need min_rollout_ranks >= 0 and min_trainer_ranks >= 1")
        if self.trigger_steps < 1 or self.cooldown_steps < 0 or self.actors_per_ref < 1:
            raise ValueError("trigger_steps >= 1, cooldown_steps >= 0, actors_per_ref >= 1")
        if self.max_trainer_scale_up_per_step < 0:
            raise ValueError("max_trainer_scale_up_per_step must be >= 0")


class ERSPlanner:
    """Stateful (streaks, cooldown) but deterministic planner of rank roles and RA2P mode."""

    def __init__(self, config: ERSConfig, world_size: int):
        if world_size < config.min_rollout_ranks + config.min_trainer_ranks:
            raise ValueError("world too small for min_rollout_ranks + min_trainer_ranks")
        self.config = config
        self.world_size = world_size
        self.generation_streak = 0
        self.consumption_streak = 0
        self.last_change_step: Optional[int] = None

    def initial_plan(self) -> RolePlan:
        """Cold start: the fewest trainer ranks (colocated), everything else generates."""
        n_train = self.config.min_trainer_ranks
        roles = {r: (Role.ACTOR_REF if r < n_train else Role.ROLLOUT) for r in range(self.world_size)}
        return RolePlan(roles, RA2PMode.COLOCATED, reason="cold start: maximal rollout", step=-1, changed=True)

    def plan(self, current: RolePlan, deficits: Deficits, *, step: int, cold_start: bool = False,
             eval_phase: bool = False, rollout_load: Optional[Mapping[int, float]] = None) -> RolePlan:
        """The role plan for the next step, given the deficits measured up to `step`."""
        if set(current.roles) != set(range(self.world_size)):
            raise ValueError("current plan must cover ranks 0..world_size-1")
        if not self.config.enabled:
            return self._keep(current, step, "ERS disabled")
        generation = deficits.generation
        consumption = deficits.consumption and not generation
        self.generation_streak = self.generation_streak + 1 if generation else 0
        self.consumption_streak = self.consumption_streak + 1 if consumption else 0

        if cold_start or eval_phase:
            roles, mode = self._maximal_rollout(current)
            why = "cold start" if cold_start else "evaluation phase"
            return self._emit(current, roles, mode, step, f"{why}: preemptive maximal rollout", reactive=False)

        in_cooldown = self.last_change_step is not None and step - self.last_change_step <= self.config.cooldown_steps
        if in_cooldown:
            return self._keep(current, step, "cooldown")
        if self.generation_streak >= self.config.trigger_steps:
            roles, mode = self._toward_generation(current)
            return self._emit(current, roles, mode, step, "generation deficit: " + "; ".join(deficits.reasons))
        if self.consumption_streak >= self.config.trigger_steps:
            roles, mode = self._toward_consumption(current, rollout_load or {})
            return self._emit(current, roles, mode, step, "consumption deficit: " + "; ".join(deficits.reasons))
        return self._keep(current, step, "no sustained deficit")

    # ------------------------------------------------------------------ transitions
    def _maximal_rollout(self, current: RolePlan) -> tuple[dict[int, Role], RA2PMode]:
        # Keep the current actor ranks that hold actor weights, lowest ids first.
        actors = current.actor_ranks or current.trainer_ranks
        keep = set(actors[: self.config.min_trainer_ranks])
        for r in current.trainer_ranks:
            if len(keep) >= self.config.min_trainer_ranks:
                break
            keep.add(r)
        roles = {r: (Role.ACTOR_REF if r in keep else Role.ROLLOUT) for r in current.roles}
        return roles, RA2PMode.COLOCATED

    def _toward_generation(self, current: RolePlan) -> tuple[dict[int, Role], RA2PMode]:
        roles = dict(current.roles)
        actors = [r for r in current.trainer_ranks if roles[r] in (Role.ACTOR, Role.ACTOR_REF)]
        refs = [r for r in current.trainer_ranks if roles[r] is Role.REF]
        for r in actors:
            roles[r] = Role.ACTOR_REF
        # Dedicated Ref ranks go to Rollout, unless the actors alone fall short of the minimum.
        for r in refs:
            roles[r] = Role.ACTOR_REF if len(actors) < self.config.min_trainer_ranks else Role.ROLLOUT
            if roles[r] is Role.ACTOR_REF:
                actors.append(r)
        if not refs and len(actors) > self.config.min_trainer_ranks:
            roles[max(actors)] = Role.ROLLOUT
        return roles, RA2PMode.COLOCATED

    def _toward_consumption(self, current: RolePlan, load: Mapping[int, float]) -> tuple[dict[int, Role], RA2PMode]:
        cfg = self.config
        roles = dict(current.roles)
        rollout = current.rollout_ranks
        spare = len(rollout) > cfg.min_rollout_ranks and cfg.max_trainer_scale_up_per_step >= 1
        reclaim = min(rollout, key=lambda r: (load.get(r, 0.0), -r)) if spare else None
        if current.mode is RA2PMode.COLOCATED:
            actors = current.actor_ranks
            if reclaim is not None:
                for r in actors:
                    roles[r] = Role.ACTOR
                roles[reclaim] = Role.REF
                return roles, RA2PMode.DECOUPLED
            if len(actors) - 1 >= cfg.min_trainer_ranks:
                # No rank to spare: turn one colocated rank into the Ref; decoupling still
                # removes every model swap, which is what a backlog pays for.
                for r in actors:
                    roles[r] = Role.ACTOR
                roles[max(actors)] = Role.REF
                return roles, RA2PMode.DECOUPLED
            return roles, current.mode
        if reclaim is None:
            return roles, current.mode
        n_actor = len(current.ranks_with(Role.ACTOR))
        n_ref = len(current.ranks_with(Role.REF))
        roles[reclaim] = Role.REF if n_actor > cfg.actors_per_ref * n_ref else Role.ACTOR
        return roles, RA2PMode.DECOUPLED

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, current: RolePlan, roles: dict[int, Role], mode: RA2PMode, step: int, reason: str,
              reactive: bool = True) -> RolePlan:
        changed = mode is not current.mode or any(roles[r] is not current.roles[r] for r in roles)
        gained = len([r for r in roles if roles[r].is_trainer]) - len(current.trainer_ranks)
        if reactive and gained > self.config.max_trainer_scale_up_per_step:
            raise AssertionError(f"plan grows the trainer by {gained} ranks")  # a bug, never policy
        if changed:
            self.generation_streak = self.consumption_streak = 0
            self.last_change_step = step
        return RolePlan(roles, mode, reason=reason if changed else f"{reason} (no feasible change)",
                        step=step, changed=changed, extras=self._extras())

    def _keep(self, current: RolePlan, step: int, reason: str) -> RolePlan:
        return RolePlan(dict(current.roles), current.mode, reason=reason, step=step, changed=False,
                        extras=self._extras())

    def _extras(self) -> dict[str, float]:
        return {"generation_streak": float(self.generation_streak),
                "consumption_streak": float(self.consumption_streak)}


def readiness_deficits(buffer: GlobalBuffer, now: float, *, n_micro_batches: int, times: MicroBatchTimes,
                       ra2p: RA2PConfig, dp_size: int) -> tuple[Deficits, float]:
    """The ERS input at the planning point: (deficits, decoupled break-even RAS).

    Glue for callers that own a `GlobalBuffer`: reads its smoothed estimate and the current
    head-of-line age, computes the break-even RAS for the smoothed TPRM with RA2P's cost model
    (`n_micro_batches` per step on `dp_size` actor ranks), and classifies.
    """
    estimate = buffer.estimate()
    be = break_even_ras(estimate.tprm_s, n_micro_batches, times, ra2p, dp_size)
    ready_mb = buffer.ready_tokens() / buffer.signals.micro_batch_tokens
    deficits = detect_deficits(estimate, buffer.head_of_line_latency(now), b_ideal=buffer.config.b_ideal,
                               break_even_ras=be, hol_tau=buffer.signals.hol_tau, ready_micro_batches=ready_mb)
    return deficits, be
