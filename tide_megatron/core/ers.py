"""Elastic Resource Scaling (ERS): a closed-loop controller of the rollout / trainer split.

Paper ("ERS Scheduling of RA2P Strategies"): right after each actor update, before the weight
sync, ERS plans which ranks roll out and which train in the next step, and in which RA2P mode;
roles change on the sync boundary, where rollout caches are flushed anyway. It reacts to two
imbalances: the trainer starving for ready data (move ranks to Rollout, colocated RA2P) and
ready data piling up while Rollout waits (move ranks to the Trainer, decoupled RA2P). Trainer
scale-up is bounded to one rank per step (one TP block, `rank_block`, when the trainer's
data-parallel replicas span several ranks), and during cold starts and evaluation phases
Rollout is maximised preemptively instead of waiting for the signals.

Control law. Each step the controller reads `ERSMeasurements` (quantities the real system
measures; nothing comes from a hardware model) and:

1. Rates. r_t = trainer-work tokens consumed per busy trainer-rank-second; r_r = rollout work
   delivered (fresh training groups plus evaluation trajectories, in tokens) while admission was
   open, per rollout rank-second it was open. Both are EWMA-smoothed across steps, as are the
   window's shares (item 3).
   A window that opened as the rollout ranks changed (a move, a loan's start or end) measures
   the trainer's rate only, and the split is held after it. Delivery lags the work by a
   trajectory's latency, so such a window counts work of the old split against the new one's
   ranks: after a shrink, groups rolled out mostly on the ranks that left (and the tasks they
   handed over) complete on the ones that stay, inflating r_r (up to 3x after the cold-start
   loan on the CPU stack); after a growth, the joining rank starts empty. Its shares mix the
   two splits as well: the admission slots that filled while the cold-start loan's extra ranks
   rolled out stay full while the trainer works off their backlog, which reads as a rollout
   with ranks to spare. Deciding on the shares measured before the change instead would act
   twice on evidence a plan has already acted on.
2. Target. With N ranks, the split where delivery matches consumption is
   R* = N r_t / (r_t + r_r) rollout ranks. That holds while rollout is bound by its ranks.
   Its engines' busy share e (the time they ran a prefill or decode batch, over the ranks'
   time) says whether it is: an engine with nothing to run waits for work (every task on its
   env, or none admitted), which a rank more does not bring. So rollout's predicted delivery on
   R ranks is R r_r / e (the work per busy rank-second), capped at today's delivery when e is
   below `busy_headroom`.
3. Censored delivery. While the staleness throttle keeps the admission slots full, Rollout
   delivers what it is allowed to, not what it could; counting only the time admission was
   open, and what was delivered then, corrects r_r for short throttled spells (while open, a
   group waits for a rank, so Rollout runs at capacity; trajectories admitted before the slots
   filled keep completing while they are full, and counting those against the open time alone
   inflated r_r by up to 1 / (1 - full share)). When the slots were full for most of the step
   r_r says little (the trap of a trainer-bound run: the trainer's backlog fills the slots,
   Rollout starves into tiny decode batches, and the measured rates look balanced). How much
   decode batching slows each trajectory is what tells the cases apart. A decode iteration
   costs its weight read plus the KV reads of its batch, so its measured time over the
   batch-of-one time (the decode slowdown s) says how much batching stretches decode; but a
   trajectory also waits on its env, so only its decode share stretches. Of the window's
   task-seconds T on the rollout ranks, decode took D sequence-seconds, D (1 - 1/s) of them
   beyond the floor; trajectories ran T / (T - D (1 - 1/s)) times longer than with decode at
   its floor (the trajectory slowdown; s itself when T is not measured). More rollout ranks
   recover part of that, no more: when env waits fill the trajectories, a slowed decode still
   leaves them env-bound. So, with the slots full:
   - the trainer did not starve, decode runs near its floor (small batches: the engines'
     own load, which the rank taken away adds to) and Rollout has KV headroom to absorb one
     rank's load: Rollout is over-provisioned, R* = R - 1;
   - the trainer starved, batching slows the trajectories by more than the deadband (so a
     rollout block more would speed the data's arrival: the window holds the number of
     trajectories, their latency sets the rate), and the trainer has the slack to give a
     block of b ranks: busy u = busy / (busy + starved) of the time it had, it keeps up on
     N - R - b ranks while (N - R - b) / ((N - R) u) >= 1. Then R* = R + b: the trainer loses
     nothing and the trajectories gain. A trainer without that slack keeps its ranks however
     slow the decode: when env waits fill the trajectories, a rank moved to rollout only waits
     on the env with the others;
   - otherwise the split is held (the window and the env, not the ranks, bound the pipeline).
   Whether the window is full or not, a trainer that did not starve gets a block when the
   engines' busy share, scaled to one block fewer (e R / (R - b)), stays below
   `busy_headroom` and KV has room: the ranks left absorb the work in time their engines idled.
   Without it, a trainer-bound run with idle engines held its split whenever decode batches
   were large (the small-batch test above), or grew rollout from a delivery rate that the
   supply of work, not the ranks, had set; on random workloads in the simulator this left
   TIDE up to 28% below the best fixed split.
4. Deadband and rate limit. Within `max_moves_per_step` ranks of the current split (the
   paper's one trainer rank per step) and the minimum sizes, the split with the highest
   predicted throughput min(R r_r / e (capped as in 2), (N - R) r_t) is chosen, and only if
   it beats the current split's prediction by the relative deadband (a rank is indivisible:
   R* = 6.4 may be served best by 6 or by 7, so the prediction, not |R* - R|, decides).
5. RA2P mode. The trainer's ranks are laid out by RA2P's cost model (`trainer_layout`): all
   colocated, or decoupled with dedicated Ref ranks, whichever the model finds faster for the
   measured ready backlog and arrival rate (both in tokens), a lead within the model's measured
   error counting as a tie (`LatencyCorrection`, the same rule as the trainer's own choice).
6. Payoff check (`failed_move_hold_steps`, `payoff_windows`). Every rule above predicts what a
   move gains; none measures what it costs (the rank's stall loading the training state, the
   handed-over tasks' re-prefill, decode batching on the ranks left). So a move is judged by
   what it did: the trainer-work tokens consumed per second over the `payoff_windows` clean
   windows after it (the split held meanwhile) against the smoothed rate of the windows before
   it. One that fell by more than the deadband is undone, and its direction is held for
   `failed_move_hold_steps` steps: without it the window-full rules alternated on the paper's
   text workload (rollout over-provisioned, then trajectories slowed, one rank back and forth
   every two steps) and ERS lost 2-8% against the fixed split in the simulator.
   Holding the split for the whole check makes ERS take 4 steps a block (the resized window and
   3 to measure), 30 steps to go from 16 to 8 rollout ranks. With `streaks`, a move may start a
   streak: once a clean window under the new split trained more tokens per second than before
   it, the next block the control law asks for in the same direction moves at once, judged, as
   the first, against the smoothed rate before the streak (one window's rate, fed from backlog
   or not, is too noisy a baseline: it undid good moves). A move to the trainer extends a
   streak only while the ready backlog held: a larger trainer trains faster at first by eating
   it, which says nothing of what rollout sustains. A streak never turns back before its check
   ends.

Preemptive maximal rollout (`preemptive_plan`): at cold start (nothing to train yet) all but
the minimum trainer ranks roll out until the trainer's first micro-batch is ready; during an
evaluation phase the step is bounded below by the evaluation anyway, so every trainer rank the
step does not need to finish its batch within the expected evaluation time rolls out. Both are
loans: the caller returns to the reactive plan at the next boundary, outside the move limit.

Rank choice is deterministic: a rollout rank is reclaimed from the least loaded (fewest
resident tokens per the caller's `rollout_load`; ties to the highest rank id, keeping low ranks
stable) or, with `reclaim="lowest"`, the lowest rollout id (the real trainer needs its ranks
to be a prefix of the job: actor DP groups are the first TP blocks); a trainer rank is
released from the highest id, and Ref ranks are the highest trainer ids.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Optional

from tide_megatron.core.ra2p import LatencyCorrection, MicroBatchTimes, RA2PConfig, TrainerLayout, trainer_layout
from tide_megatron.core.roles import RA2PMode, Role, RolePlan


@dataclass
class ERSConfig:
    """Elastic Resource Scaling configuration."""

    enabled: bool = True
    """False freezes the role plan (static partition)."""
    min_rollout_ranks: int = 1
    """Rollout never shrinks below this many ranks (loans excepted: they only add rollout)."""
    min_trainer_ranks: int = 1
    """Actor ranks never drop below this many (Ref ranks do not count)."""
    max_moves_per_step: int = 1
    """Rank blocks (`rank_block` ranks each) that may change side in one plan (the paper bounds
    trainer scale-up to one rank)."""
    rank_block: int = 1
    """Ranks move between rollout and the trainer this many at a time: the trainer's TP size,
    since a data-parallel replica of the actor is a whole TP block. Every split planned differs
    from the current one by whole blocks, and a loan keeps whole blocks in the trainer."""
    deadband: float = 0.02
    """A rate-driven move must promise this much more throughput (relative) than the current
    split. Below the gain of one rank on a side of up to ~50 ranks (2%), so every rank-level
    improvement is taken; above zero, so near-ties do not flip the split back and forth. With
    the window full, the share by which batching must slow the trajectories before a starved
    trainer gives a rank (below it, what a rank could recover is noise)."""
    rate_ewma_alpha: float = 0.5
    """Weight of the newest step in the smoothed rates and shares the controller decides on
    (steps alternate between backlog-fed and arrival-fed, so single steps mislead)."""
    cooldown_steps: int = 1
    """Steps held after a move, so the next decision sees whole steps under the new split."""
    slots_full_fraction: float = 0.8
    """The rollout's delivery counts as throttled when the admission window was full for at
    least this share of the step: then too little of the step is left to measure what Rollout
    delivers when free (shorter spells are corrected for by counting only the open time)."""
    starved_fraction: float = 0.1
    """The trainer counts as starved when it waited for ready data at least this share of the step."""
    kv_headroom: float = 0.9
    """Rollout can absorb one rank's load when its KV use, scaled by R/(R-1), stays below this
    share of the budget (CTB's budget is below the physical pool already)."""
    busy_headroom: float = 0.9
    """Rollout whose engines computed less than this share of their time was limited by its
    supply of work (admission, env waits), not by its ranks: a rank more would deliver no more,
    and a block fewer costs nothing while the busy share, scaled by R/(R-b), stays below it
    (module docstring, 2 and 3). Below 1, so the short gaps between a rank's turns do not read
    as spare ranks."""
    reclaim: str = "least_loaded"
    """Which rollout rank joins the trainer: "least_loaded" (fewest resident tokens, the least
    work re-dispatched) or "lowest" (the lowest id, so the trainer stays a prefix of the ranks,
    as the real system's process groups need)."""
    decode_slowdown: float = 0.25
    """Decode runs near its floor while its mean iteration exceeds the batch-of-one iteration
    by at most this share; only then may a throttled rollout give up a rank, which loads the
    others more: at 25% a fifth of decode's time is batching's already."""
    failed_move_hold_steps: int = 0
    """The payoff check (module docstring, 6): a move whose next `payoff_windows` clean windows
    trained fewer tokens per second than the steps before it (by more than `deadband`) is
    undone, and no move in its direction is made for this many steps. 0: no check."""
    payoff_windows: int = 3
    """Clean windows (steps) after a move that its payoff is measured over; the split is held
    meanwhile. One step's rate swings with whether it was fed from backlog or from arrivals."""
    streaks: bool = False
    """While a move's payoff is measured, let the next block in the same direction move once a
    clean window trained faster than before it (module docstring, 6). Off by default: on random
    workloads in the simulator it changed TIDE's goodput by +0.1% to +0.3% (geomean of three
    draws, docs/ers.md), single workloads by -8% to +7%."""

    def __post_init__(self) -> None:
        if self.min_rollout_ranks < 0 or self.min_trainer_ranks < 1:
            raise ValueError("need min_rollout_ranks >= 0 and min_trainer_ranks >= 1")
        if self.cooldown_steps < 0:
            raise ValueError("cooldown_steps must be >= 0")
        if self.max_moves_per_step < 0 or self.deadband < 0:
            raise ValueError("max_moves_per_step and deadband must be >= 0")
        if self.rank_block < 1 or self.min_trainer_ranks % self.rank_block:
            raise ValueError(f"rank_block must be >= 1 and divide min_trainer_ranks={self.min_trainer_ranks}")
        if self.rank_block > 1 and self.reclaim != "lowest":
            raise ValueError("rank_block > 1 needs reclaim='lowest': blocks are whole only in a prefix layout")
        if not 0 < self.rate_ewma_alpha <= 1:
            raise ValueError("rate_ewma_alpha must be in (0, 1]")
        if self.reclaim not in ("least_loaded", "lowest"):
            raise ValueError(f"reclaim must be 'least_loaded' or 'lowest', got {self.reclaim!r}")
        if self.decode_slowdown < 0:
            raise ValueError("decode_slowdown must be >= 0")
        if self.failed_move_hold_steps < 0 or self.payoff_windows < 1:
            raise ValueError("failed_move_hold_steps must be >= 0 and payoff_windows >= 1")
        for name in ("slots_full_fraction", "starved_fraction", "kv_headroom", "busy_headroom"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")


@dataclass(frozen=True)
class ERSMeasurements:
    """What the controller measured over the window since the previous plan (one training step,
    its waits and its weight sync). Every field is something the real system can measure."""

    window_s: float
    """Wall seconds since the previous plan."""
    trainer_ranks: int
    """Trainer ranks (ACTOR, REF, ACTOR_REF) during the window."""
    trainer_busy_s: float
    """Seconds of the window in which the trainer had work (computing or swapping models):
    the window minus its waits for ready data, for evaluation and for the weight sync."""
    trainer_starved_s: float
    """Seconds of the window in which the trainer waited for ready data (TWT / trainer ranks)."""
    trained_tokens: int
    """Trainer-work tokens (prompt + generated + observation tokens) consumed in the window."""
    rollout_ranks: int
    """Rollout ranks during the window."""
    fresh_tokens: int
    """Trainer-work tokens of training groups that became ready (complete, within the
    staleness bound) in the window while admission was open (not `slots_full_s`)."""
    eval_tokens: int
    """Tokens (counted as for the trainer) of evaluation trajectories completed in the window
    while admission was open: rollout work that does not reach the trainer."""
    slots_full_s: float
    """Seconds of the window in which a new group waited but could not be admitted because the
    staleness throttle's slots ((bound + 1) x B trajectories of admitted, unconsumed groups)
    were full."""
    kv_used_fraction: float
    """Time-averaged share of the rollout ranks' KV token budget in use."""
    ras_tokens: float = 0.0
    """Ready-at-start backlog, tokens (`ReadinessEstimate.ras_tokens`)."""
    arrival_tokens_per_s: float = 0.0
    """Ready-token arrival rate during steps, tokens/s (`ReadinessEstimate.arrival_tokens_per_s`)."""
    decode_iteration_s: float = 0.0
    """Mean decode iteration time on the rollout ranks in the window (0: none measured)."""
    decode_floor_s: float = 0.0
    """Decode iteration time of a batch of one (the weights' read; from the engine's profile)."""
    mean_decode_batch: float = 0.0
    """Time-averaged sequences per decode iteration on a rollout rank (reported with the plan)."""
    decode_seq_s: float = 0.0
    """Sequence-seconds in decode on the rollout ranks: the sum over decode iterations of batch
    size x iteration seconds (0: not measured)."""
    tasks_in_flight_s: float = 0.0
    """Task-seconds on the rollout ranks: the time-integral of the tasks placed there, whether
    decoding, queued, paused or waiting on their env (0: not measured)."""
    rollout_busy_s: float = 0.0
    """Rank-seconds in which the rollout ranks' engines ran a batch (prefill or decode), summed
    over the ranks; the rest of their time they had nothing to compute (every task waiting on
    its env, or none placed). 0: not measured (the rollout is then read as always busy)."""
    rollout_resized: bool = False
    """The rollout ranks changed as the window opened (a move, a loan's start or end, with work
    in flight): its delivery and shares mix the two splits, so only the trainer's rate is read."""

    @property
    def decode_slowdown(self) -> float:
        """Mean decode iteration over the batch-of-one iteration (1.0 when not measured)."""
        if self.decode_iteration_s > 0 and self.decode_floor_s > 0:
            return self.decode_iteration_s / self.decode_floor_s
        return 1.0

    @property
    def trajectory_slowdown(self) -> float:
        """How many times longer the trajectories ran than with decode at its batch-of-one
        floor: T / (T - D (1 - 1/s)) for task-seconds T, decode sequence-seconds D and decode
        slowdown s (module docstring); the decode slowdown itself when T or D is not measured
        (trajectories taken as all decode)."""
        s = self.decode_slowdown
        if self.tasks_in_flight_s <= 0 or self.decode_seq_s <= 0 or s <= 1.0:
            return s
        excess = min(self.decode_seq_s, self.tasks_in_flight_s) * (1.0 - 1.0 / s)
        return self.tasks_in_flight_s / (self.tasks_in_flight_s - excess)

    @property
    def rollout_busy_share(self) -> float:
        """Share of the rollout ranks' time their engines computed (1.0 when not measured)."""
        if self.rollout_busy_s <= 0 or self.rollout_ranks <= 0:
            return 1.0
        return min(1.0, self.rollout_busy_s / (self.window_s * self.rollout_ranks))

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.trainer_ranks < 0 or self.rollout_ranks < 0:
            raise ValueError("window_s must be > 0 and rank counts >= 0")
        if min(self.trainer_busy_s, self.trainer_starved_s, self.trained_tokens, self.fresh_tokens,
               self.eval_tokens, self.slots_full_s, self.kv_used_fraction, self.decode_seq_s,
               self.tasks_in_flight_s, self.rollout_busy_s) < 0:
            raise ValueError("measurements must be >= 0")


@dataclass
class _MoveCheck:
    """A move whose payoff is being measured (module docstring, 6)."""

    rollout_before: int
    direction: int
    """+1: a block to rollout, -1: to the trainer."""
    goodput_before: float
    ras_before: float = 0.0
    """The ready backlog (tokens) as the move was planned."""
    tokens: int = 0
    seconds: float = 0.0
    windows: int = 0

    @property
    def rate(self) -> float:
        """Trainer-work tokens per second over the windows measured so far."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ERSController:
    """Closed-loop planner of rank roles and the RA2P mode; deterministic given its inputs."""

    def __init__(self, config: ERSConfig, world_size: int, ra2p: RA2PConfig):
        if world_size < max(1, config.min_rollout_ranks) + config.min_trainer_ranks:
            raise ValueError("world too small for min_rollout_ranks + min_trainer_ranks")
        self.config = config
        self.world_size = world_size
        self.ra2p = ra2p
        self.trainer_rate: Optional[float] = None
        """Smoothed trainer-work tokens per busy trainer-rank-second."""
        self.rollout_rate: Optional[float] = None
        """Smoothed tokens delivered while admission was open, per rollout-rank-second it was open."""
        self.step_tokens: Optional[float] = None
        """Smoothed trainer-work tokens per step."""
        self.shares: Optional[dict[str, float]] = None
        """Smoothed window shares: admission window full, trainer starved; KV use; decode and
        trajectory slowdowns."""
        self.last_move_step: Optional[int] = None
        self.goodput: Optional[float] = None
        """Smoothed trainer-work tokens consumed per second of window (clean windows only)."""
        self._check_move: Optional[_MoveCheck] = None  # a move whose payoff is being measured
        self._held_until: dict[int, int] = {}  # direction -> the last step it is held

    # ------------------------------------------------------------------ plans
    def initial_plan(self, rollout_share: float) -> RolePlan:
        """The starting split: round(share x world) rollout ranks (the highest ids), colocated."""
        n_roll = self._clamp_rollout(round(rollout_share * self.world_size))
        roles = {r: (Role.ROLLOUT if r >= self.world_size - n_roll else Role.ACTOR_REF)
                 for r in range(self.world_size)}
        return RolePlan(roles, RA2PMode.COLOCATED, reason="initial split", step=-1, changed=True)

    def plan(self, current: RolePlan, m: ERSMeasurements, times: MicroBatchTimes, *, step: int,
             rollout_load: Optional[Mapping[int, float]] = None, ra2p: Optional[RA2PConfig] = None,
             correction: Optional[LatencyCorrection] = None) -> RolePlan:
        """The role plan for the next step from the window's measurements (module docstring).

        `current`: the reactive plan in force (not a loan). `times`: RA2P's per-micro-batch
        compute times (measured by the executors). `rollout_load`: resident tokens per rollout
        rank, to pick which rank to reclaim. `ra2p`: the cost model with its measured values
        (the swap cost), where the caller measures them; else the one given at construction.
        `correction`: the RA2P latency model's measured error per mode, where the caller tracks it.
        """
        self._check(current)
        if not self.config.enabled:
            return self._keep(current, step, "ERS disabled")
        self._observe(m)
        r_now = len(current.rollout_ranks)
        undone = None if m.rollout_resized else self._payoff(r_now, m, step)
        if undone is not None:
            n_roll, target, why = undone
        elif self._check_move is not None:
            n_roll, target, why = self._streak(r_now, m)
        elif m.rollout_resized:
            n_roll, target, why = r_now, None, ("split held: the rollout ranks changed as the window opened, so it "
                                                "measured the trainer's rate only")
        else:
            n_roll, target, why = self._decide(r_now)
        cooling = self.last_move_step is not None and step - self.last_move_step <= self.config.cooldown_steps
        if n_roll != r_now and cooling and undone is None:
            n_roll, why = r_now, f"cooldown after the move at step {self.last_move_step} ({why})"
        direction = (n_roll > r_now) - (n_roll < r_now)
        if direction and undone is None and self._held_until.get(direction, -1) >= step:
            n_roll, why = r_now, (f"held: a move to {'rollout' if direction > 0 else 'the trainer'} did not pay "
                                  f"before ({why})")
        if n_roll != r_now:
            self.last_move_step = step
            if undone is None and self.config.failed_move_hold_steps and self.goodput:
                # a streak's moves are judged against the smoothed rate before it: one window's
                # rate swings too much with the backlog to judge the next move against
                self._check_move = _MoveCheck(r_now, direction, self.goodput, m.ras_tokens)
        layout = self._layout(self.world_size - n_roll, m, times, ra2p or self.ra2p, correction)
        roles = self._assign(current, n_roll, layout, rollout_load or {})
        extras = {"target_rollout_ranks": target if target is not None else float(r_now),
                  "trainer_rate": self.trainer_rate or 0.0, "rollout_rate": self.rollout_rate or 0.0,
                  **(self.shares or {}), "mean_decode_batch": m.mean_decode_batch,
                  "latency_colocated_s": layout.latency_colocated_s,
                  "latency_decoupled_s": layout.latency_decoupled_s,
                  "round_micro_batches": float(layout.round_micro_batches)}
        return self._emit(current, roles, layout.mode, step, why, extras)

    def preemptive_plan(self, base: RolePlan, *, keep_trainer_ranks: int, reason: str,
                        rollout_load: Optional[Mapping[int, float]] = None) -> RolePlan:
        """Maximal rollout for a phase where generation dominates (module docstring): all but
        `keep_trainer_ranks` (at least the minimum) of `base`'s trainer ranks roll out, the rest
        colocated. A loan: return to the reactive plan at the next boundary."""
        self._check(base)
        keep = max(self.config.min_trainer_ranks, min(self._blocks_up(keep_trainer_ranks), len(base.trainer_ranks)))
        n_roll = self.world_size - keep
        layout = TrainerLayout(RA2PMode.COLOCATED, keep, 0, math.nan, math.nan, 1)
        roles = self._assign(base, n_roll, layout, rollout_load or {})
        return self._emit(base, roles, RA2PMode.COLOCATED, base.step, f"{reason}: preemptive maximal rollout",
                          {"kept_trainer_ranks": float(keep)})

    def eval_trainer_ranks(self, expected_eval_s: float) -> int:
        """Trainer ranks that still finish a step's work within `expected_eval_s` at the measured
        trainer rate (all of the world when nothing is measured yet: no loan)."""
        if not self.trainer_rate or not self.step_tokens or expected_eval_s <= 0:
            return self.world_size
        return max(self.config.min_trainer_ranks,
                   self._blocks_up(math.ceil(self.step_tokens / (self.trainer_rate * expected_eval_s))))

    # ------------------------------------------------------------------ control law
    def _payoff(self, r_now: int, m: ERSMeasurements, step: int) -> Optional[tuple[int, None, str]]:
        """The payoff check (module docstring, 6), fed each clean window after a move: once
        `payoff_windows` were measured, the move undone (with its reason) if it cost goodput;
        else None."""
        check = self._check_move
        if check is None:
            return None
        check.tokens += m.trained_tokens
        check.seconds += m.window_s
        check.windows += 1
        if check.windows < self.config.payoff_windows:
            return None
        self._check_move = None
        after = check.rate
        if after >= check.goodput_before * (1 - self.config.deadband) or \
                self._clamp_rollout(check.rollout_before) != check.rollout_before:
            return None
        self._held_until[check.direction] = step + self.config.failed_move_hold_steps
        return check.rollout_before, None, (
            f"undone: the move to {r_now} rollout ranks did not pay ({after:.0f} tokens/s trained after it, "
            f"{check.goodput_before:.0f} before); held for {self.config.failed_move_hold_steps} steps")

    def _streak(self, r_now: int, m: ERSMeasurements) -> tuple[int, Optional[float], str]:
        """While a move's payoff is measured (module docstring, 6): with `streaks`, the next block
        may go the same way once a clean window under the new split trained more tokens per second
        than before it (a streak); anything else waits for the check to end."""
        check = self._check_move
        hold = (r_now, None, "split held: measuring what the last move gained")
        if not self.config.streaks or m.rollout_resized or not check.windows or \
                check.rate <= check.goodput_before:
            return hold
        if check.direction < 0 and m.ras_tokens < check.ras_before:
            # a larger trainer eats the ready backlog first: a faster window that shrank it
            # says nothing of what rollout sustains
            return hold
        n_roll, target, why = self._decide(r_now)
        if (n_roll > r_now) - (n_roll < r_now) != check.direction:
            return hold
        return n_roll, target, f"{why}; the last move paid so far ({check.rate:.0f} tokens/s trained after it, " \
                               f"{check.goodput_before:.0f} before)"

    def _observe(self, m: ERSMeasurements) -> None:
        a = self.config.rate_ewma_alpha

        def ewma(old: Optional[float], new: float) -> float:
            return new if old is None else old + a * (new - old)

        if not m.rollout_resized and self._check_move is None:  # the goodput a move is judged against
            self.goodput = ewma(self.goodput, m.trained_tokens / m.window_s)

        if m.trainer_busy_s > 0 and m.trainer_ranks > 0 and m.trained_tokens > 0:
            self.trainer_rate = ewma(self.trainer_rate, m.trained_tokens / (m.trainer_busy_s * m.trainer_ranks))
            self.step_tokens = ewma(self.step_tokens, float(m.trained_tokens))
        if m.rollout_resized:  # the rollout side mixes two splits (module docstring, 1)
            return
        if m.rollout_ranks > 0 and m.slots_full_s < self.config.slots_full_fraction * m.window_s:
            open_s = m.window_s - m.slots_full_s
            self.rollout_rate = ewma(self.rollout_rate, (m.fresh_tokens + m.eval_tokens) / (open_s * m.rollout_ranks))
        new = {"full_share": min(1.0, m.slots_full_s / m.window_s),
               "starved_share": min(1.0, m.trainer_starved_s / m.window_s),
               "busy_share": min(1.0, m.trainer_busy_s / m.window_s),
               "kv_used_fraction": m.kv_used_fraction, "rollout_busy_share": m.rollout_busy_share,
               "decode_slowdown": m.decode_slowdown,
               "trajectory_slowdown": m.trajectory_slowdown}
        old = self.shares or new
        self.shares = {k: ewma(old[k], v) for k, v in new.items()}

    def _decide(self, r_now: int) -> tuple[int, Optional[float], str]:
        """(rollout ranks for the next step, target R* or None, reason), from smoothed signals."""
        cfg = self.config
        sh = self.shares
        starved = sh["starved_share"] >= cfg.starved_fraction
        full = sh["full_share"] >= cfg.slots_full_fraction
        b = cfg.rank_block
        room = r_now > b and sh["kv_used_fraction"] * r_now / (r_now - b) <= cfg.kv_headroom
        spare = r_now > b and sh["rollout_busy_share"] * r_now / (r_now - b) <= cfg.busy_headroom
        decode = (f"decode at {sh['decode_slowdown']:.2f}x its floor, trajectories at "
                  f"{sh['trajectory_slowdown']:.2f}x theirs, engines busy {sh['rollout_busy_share']:.0%}")
        if not starved and room and (spare or (full and sh["decode_slowdown"] <= 1 + cfg.decode_slowdown)):
            return self._move(r_now, -1), None, (
                f"rollout over-provisioned: admission window full {sh['full_share']:.0%} of the step, "
                f"{decode}, KV at {sh['kv_used_fraction']:.0%}, trainer starved {sh['starved_share']:.0%}")
        if full:
            keeps_up = self._trainer_keeps_up(r_now)
            if starved and sh["trajectory_slowdown"] > 1 + cfg.deadband and keeps_up >= 1.0:
                return self._move(r_now, +1), None, (
                    f"trajectories slowed by decode batching ({decode}) while the trainer starved "
                    f"{sh['starved_share']:.0%} of the step; it keeps up ({keeps_up:.2f}x) with a block fewer")
            return r_now, None, (f"window full: the staleness bound, not the split, limits the pipeline ({decode}; "
                                 f"trainer starved {sh['starved_share']:.0%}, {keeps_up:.2f}x with a block fewer)")
        if not self.trainer_rate or not self.rollout_rate:
            return r_now, None, "rates not measured yet"
        r_t, r_r, n = self.trainer_rate, self.rollout_rate, self.world_size
        target = n * r_t / (r_t + r_r)
        busy = sh["rollout_busy_share"]
        # work per busy rank-second; an engine idle for want of work caps delivery at today's
        supply = r_now * r_r if busy < cfg.busy_headroom else math.inf

        def predicted(r: int) -> float:
            return min(r * r_r / busy, supply, (n - r) * r_t)

        options = sorted({r_now + j * b for j in range(-cfg.max_moves_per_step, cfg.max_moves_per_step + 1)
                          if self._clamp_rollout(r_now + j * b) == r_now + j * b} | {r_now},
                         key=lambda r: (-predicted(r), abs(r - r_now)))
        best = options[0]
        if predicted(best) <= predicted(r_now) * (1 + cfg.deadband):
            best = r_now
        return best, target, (f"balance: trainer {r_t:.0f} tok/rank-s, rollout {r_r:.0f} tok/rank-s "
                              f"(engines busy {busy:.0%}) -> R* = {target:.1f}; "
                              f"predicted {predicted(r_now):.0f} -> {predicted(best):.0f} tok/s")

    def _trainer_keeps_up(self, r_now: int) -> float:
        """The trainer's capacity with one block fewer over the throughput it delivered: time
        it had (busy + starved) over the time its busy work takes on the remaining ranks
        (module docstring, 3); >= 1 means it loses nothing."""
        sh, b = self.shares, self.config.rank_block
        trainer = self.world_size - r_now
        if trainer <= b:
            return 0.0
        busy = sh["busy_share"]
        if busy <= 0:  # no work done at all: every rank is spare
            return math.inf
        return (trainer - b) / trainer * (busy + sh["starved_share"]) / busy

    def _move(self, r_now: int, direction: int) -> int:
        """One block in `direction`, or none when that leaves the bounds (no partial block)."""
        r = r_now + direction * min(1, self.config.max_moves_per_step) * self.config.rank_block
        return r if self._clamp_rollout(r) == r else r_now

    def _blocks_up(self, ranks: int) -> int:
        b = self.config.rank_block
        return -(-ranks // b) * b

    def _layout(self, trainer_ranks: int, m: ERSMeasurements, times: MicroBatchTimes,
                ra2p: RA2PConfig, correction: Optional[LatencyCorrection] = None) -> TrainerLayout:
        if not self.step_tokens:
            return TrainerLayout(RA2PMode.COLOCATED, trainer_ranks, 0, math.nan, math.nan, 1)
        # RA2P's cost model counts data-parallel replicas: with TP blocks, whole blocks
        b = self.config.rank_block
        lay = trainer_layout(trainer_ranks // b, ras_tokens=m.ras_tokens, arrival_tokens_per_s=m.arrival_tokens_per_s,
                             step_tokens=self.step_tokens, times=times, cfg=ra2p, correction=correction)
        return dataclasses.replace(lay, actor_ranks=lay.actor_ranks * b, ref_ranks=lay.ref_ranks * b)

    # ------------------------------------------------------------------ roles
    def _clamp_rollout(self, n_roll: int) -> int:
        lo = max(1, self.config.min_rollout_ranks)
        return max(lo, min(self.world_size - self.config.min_trainer_ranks, n_roll))

    def _assign(self, current: RolePlan, n_roll: int, layout: TrainerLayout,
                load: Mapping[int, float]) -> dict[int, Role]:
        rollout = list(current.rollout_ranks)
        trainer = list(current.trainer_ranks)
        lowest = self.config.reclaim == "lowest"
        while len(rollout) > n_roll:  # reclaim the least loaded (or the lowest) rollout rank
            r = min(rollout) if lowest else min(rollout, key=lambda k: (load.get(k, 0.0), -k))
            rollout.remove(r)
            trainer.append(r)
        while len(rollout) < n_roll:  # release the highest trainer rank
            r = max(trainer)
            trainer.remove(r)
            rollout.append(r)
        trainer.sort()
        roles = {r: Role.ROLLOUT for r in rollout}
        if layout.mode is RA2PMode.DECOUPLED and layout.ref_ranks:
            refs = set(trainer[len(trainer) - layout.ref_ranks:])
            roles.update({r: (Role.REF if r in refs else Role.ACTOR) for r in trainer})
        else:
            roles.update({r: Role.ACTOR_REF for r in trainer})
        return roles

    # ------------------------------------------------------------------ bookkeeping
    def _check(self, plan: RolePlan) -> None:
        if set(plan.roles) != set(range(self.world_size)):
            raise ValueError("plan must cover ranks 0..world_size-1")

    def _emit(self, current: RolePlan, roles: dict[int, Role], mode: RA2PMode, step: int, reason: str,
              extras: dict[str, float]) -> RolePlan:
        changed = mode is not current.mode or any(roles[r] is not current.roles[r] for r in roles)
        return RolePlan(roles, mode, reason=reason, step=step, changed=changed, extras=extras)

    def _keep(self, current: RolePlan, step: int, reason: str) -> RolePlan:
        return RolePlan(dict(current.roles), current.mode, reason=reason, step=step, changed=False)
