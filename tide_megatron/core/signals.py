"""Readiness signals: RAS, TPRM, head-of-line latency and the two deficits.

The paper drives all three components from one readiness view of the global buffer:

- RAS (Ready-at-Start): the micro-batch work already present when a training step begins.
  We measure it in micro-batches: ready generated+prompt tokens at step start divided by the
  micro-batch token volume, so RA2P can compare it with its per-micro-batch cost model.
- TPRM (Time Per Ready Micro-batch): the interval at which additional micro-batches become
  ready after the step starts. A micro-batch "becomes ready" each time the tokens made ready
  since the step start cross another multiple of the micro-batch volume.
- HoL latency: the age of the oldest ready group in the buffer (consumption deficit signal).
- Generation deficit: the batch volume is below B_ideal or steps start with no whole ready
  micro-batch, and no reservoir is waiting now (see `detect_deficits`).
- Consumption deficit: HoL latency > tau * T_step, or the whole ready micro-batches at start
  reach the decoupled break-even (at least one).

Noise. The paper warns that instantaneous arrivals are skewed by trajectory variance even
within one step. We therefore (1) summarise a step's arrivals by the *median* inter-arrival
interval, which ignores the burst of several groups finishing together and a single straggler
gap, and (2) smooth step-level values across steps with an EWMA, so one odd step moves the
estimate by only `alpha` of its deviation. ERS adds its own hysteresis on top (k consecutive
steps + cooldown), because a deficit flag that flips is costlier than a slow one: every role
change re-dispatches tasks and reloads weights.

If no micro-batch becomes ready during a step, TPRM is right-censored: all we know is that the
interval exceeds the step duration, so we record the step duration (a lower bound). This keeps
the estimate finite and still reads as "slow" against any per-micro-batch compute time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SignalsConfig:
    """How readiness is measured and smoothed."""

    micro_batch_tokens: int = 32768
    """Token volume of one micro-batch across all DP ranks; the unit of RAS and TPRM."""
    ewma_alpha: float = 0.5
    """Weight of the newest step in the cross-step EWMA (1.0 disables smoothing)."""
    hol_tau: float = 1.0
    """Consumption deficit when HoL latency exceeds hol_tau * T_step (the paper's tau)."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens <= 0:
            raise ValueError("micro_batch_tokens must be positive")
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError("ewma_alpha must be in (0, 1]")
        if self.hol_tau <= 0:
            raise ValueError("hol_tau must be positive")


@dataclass(frozen=True)
class StepReadiness:
    """Raw readiness measured over one training step."""

    step: int
    """Index of the training step."""
    start_time: float
    """Clock value when the step began (its batch was first fetched)."""
    end_time: float
    """Clock value when the step's actor update finished."""
    ras: float
    """Ready-at-start backlog, in micro-batches."""
    tprm_s: float
    """Median interval between micro-batches becoming ready after the start (censored: step time)."""
    arrivals: int
    """Micro-batches that became ready during the step."""
    hol_latency_s: float
    """Age of the oldest ready group at the step start."""
    batch_trajectories: int
    """Trajectories the trainer consumed in this step (the global batch volume)."""

    @property
    def duration_s(self) -> float:
        return self.end_time - self.start_time


def median_interval(start_time: float, event_times: list[float], censor_at: float) -> float:
    """Median gap of the sequence start, t1, t2, ...; `censor_at` - start if there is no event."""
    if not event_times:
        return max(censor_at - start_time, 0.0)
    points = [start_time, *sorted(event_times)]
    return statistics.median(b - a for a, b in zip(points, points[1:]))


class ReadinessMeter:
    """Measures RAS, TPRM and HoL within one step. Fed by the global buffer; holds no clock."""

    def __init__(self, config: SignalsConfig):
        self.config = config
        self._step = -1
        self._open = False
        self._start = 0.0
        self._ras = 0.0
        self._hol = 0.0
        self._tokens_since_start = 0
        self._arrival_times: list[float] = []

    @property
    def in_step(self) -> bool:
        return self._open

    def begin_step(self, now: float, ready_tokens: int, hol_latency_s: float) -> float:
        """Open a step; returns its RAS (micro-batches ready at the start)."""
        if self._open:
            raise RuntimeError("begin_step called twice without end_step")
        self._open = True
        self._step += 1
        self._start = now
        self._ras = ready_tokens / self.config.micro_batch_tokens
        self._hol = hol_latency_s
        self._tokens_since_start = 0
        self._arrival_times = []
        return self._ras

    def on_tokens_ready(self, now: float, tokens: int) -> None:
        """A group completed during the step, making `tokens` more tokens ready."""
        if not self._open or tokens <= 0:
            return
        mb = self.config.micro_batch_tokens
        before = self._tokens_since_start // mb
        self._tokens_since_start += tokens
        after = self._tokens_since_start // mb
        # One large group may complete several micro-batches at once; each counts as an
        # arrival at the same instant, which the median reads as a fast stream (it is).
        self._arrival_times.extend([now] * (after - before))

    def end_step(self, now: float, batch_trajectories: int) -> StepReadiness:
        if not self._open:
            raise RuntimeError("end_step without begin_step")
        self._open = False
        return StepReadiness(
            step=self._step,
            start_time=self._start,
            end_time=now,
            ras=self._ras,
            tprm_s=median_interval(self._start, self._arrival_times, censor_at=now),
            arrivals=len(self._arrival_times),
            hol_latency_s=self._hol,
            batch_trajectories=batch_trajectories,
        )


@dataclass(frozen=True)
class ReadinessEstimate:
    """Cross-step smoothed readiness, what RA2P and ERS decide on."""

    ras: float
    """EWMA of RAS, micro-batches."""
    tprm_s: float
    """EWMA of TPRM, seconds."""
    step_time_s: float
    """EWMA of the step duration (T_step)."""
    batch_trajectories: float
    """EWMA of the consumed global batch volume, trajectories."""
    steps_observed: int
    """How many steps fed the estimate (0: cold start, values are zero)."""


@dataclass
class ReadinessEstimator:
    """EWMA over completed steps of the per-step readiness measurements."""

    config: SignalsConfig
    """Smoothing configuration."""
    history: list[StepReadiness] = field(default_factory=list)
    """Every observed step, oldest first (kept for metrics)."""
    _ras: float = field(default=0.0, init=False, repr=False)
    _tprm: float = field(default=0.0, init=False, repr=False)
    _step_time: float = field(default=0.0, init=False, repr=False)
    _volume: float = field(default=0.0, init=False, repr=False)

    def observe(self, step: StepReadiness) -> ReadinessEstimate:
        a = self.config.ewma_alpha
        if not self.history:
            # Seed with the first observation instead of decaying from zero: a zero seed would
            # read as "no backlog, instant arrivals" for several steps after cold start.
            self._ras, self._tprm = step.ras, step.tprm_s
            self._step_time, self._volume = step.duration_s, float(step.batch_trajectories)
        else:
            self._ras += a * (step.ras - self._ras)
            self._tprm += a * (step.tprm_s - self._tprm)
            self._step_time += a * (step.duration_s - self._step_time)
            self._volume += a * (step.batch_trajectories - self._volume)
        self.history.append(step)
        return self.estimate()

    def estimate(self) -> ReadinessEstimate:
        return ReadinessEstimate(
            ras=self._ras,
            tprm_s=self._tprm,
            step_time_s=self._step_time,
            batch_trajectories=self._volume,
            steps_observed=len(self.history),
        )


@dataclass(frozen=True)
class Deficits:
    """The two queue metrics ERS acts on."""

    generation: bool
    """Rollout is too slow: the batch volume falls short of B_ideal."""
    consumption: bool
    """Trainer is too slow: old ready data (HoL) or a backlog beyond the decoupled break-even."""
    reasons: tuple[str, ...] = ()
    """Which tests fired, for logging."""


def detect_deficits(
    estimate: ReadinessEstimate,
    hol_latency_s: float,
    *,
    b_ideal: int,
    break_even_ras: float,
    hol_tau: float,
    ready_micro_batches: Optional[float] = None,
) -> Deficits:
    """Classify the current readiness into generation / consumption deficits.

    `hol_latency_s` is the *current* head-of-line age (read at the ERS planning point, right
    after the actor update): it is already a queue-integral quantity, so it needs no extra
    smoothing. `break_even_ras` comes from `ra2p.break_even_ras` for the current TPRM.
    `ready_micro_batches` is the ready volume in the buffer at the planning point (the paper
    reads "the current ready volume" together with HoL); None when the caller has none.

    Generation deficit (paper: "the global batch volume < B_ideal"; "the Trainer is
    starved"): the consumed batch volume fell short of B_ideal and no whole micro-batch is
    waiting now. A short elastic batch taken while a reservoir is kept is adaptive
    retention, not starvation, so it must not move ranks away from the trainer.

    Consumption deficit: HoL > tau * T_step, or the whole ready micro-batches at start
    (floor(RAS), as the cost model counts them) reach the decoupled break-even, with at
    least one of them. The "at least one" matters: with a fast TPRM the break-even can be 0
    (decoupled is cheaper even with nothing ready), and an EWMA of RAS that decays towards 0
    stays positive forever, so a bare `RAS > break-even` read an empty buffer as a backlog.

    """
    reasons: list[str] = []
    if estimate.steps_observed == 0:
        return Deficits(False, False, ("no steps observed",))
    whole_ras = math.floor(estimate.ras + 1e-9)
    reservoir = ready_micro_batches is not None and ready_micro_batches >= 1.0
    short_batch = estimate.batch_trajectories < b_ideal
    generation = short_batch and not reservoir
    if short_batch:
        reasons.append(f"batch volume {estimate.batch_trajectories:.1f} < B_ideal {b_ideal}")
    if reservoir and short_batch:
        reasons.append(f"not starved: {ready_micro_batches:.1f} micro-batches ready now")
    hol_limit = hol_tau * estimate.step_time_s
    hol_high = estimate.step_time_s > 0 and hol_latency_s > hol_limit
    ras_high = math.isfinite(break_even_ras) and whole_ras >= max(break_even_ras, 1.0)
    if hol_high:
        reasons.append(f"HoL {hol_latency_s:.2f}s > tau*T_step {hol_limit:.2f}s")
    if ras_high:
        reasons.append(f"RAS {estimate.ras:.2f} >= break-even {break_even_ras:.2f}")
    return Deficits(generation=generation, consumption=hol_high or ras_high, reasons=tuple(reasons))
