"""Readiness signals: RAS, TPRM and head-of-line latency, measured in tokens.

The paper drives all three components from one readiness view of the global buffer:

- RAS (Ready-at-Start): the trainer work already ready when a training step begins, in
  tokens (prompt + generated + observation tokens: what the trainer processes).
- Arrival rate: trainer-work tokens made ready per second during the step (ready volume after
  the start / step duration). TPRM (Time Per Ready Micro-batch) follows for any micro-batch
  size: `tprm_for(micro_batch_tokens, rate)`.
- HoL latency: the age of the oldest ready group in the buffer.

One unit. Decisions (RA2P's mode and round sizes, ERS's layout) convert tokens into
micro-batches with the micro-batch of the trainer they plan for (dp ranks x tokens per rank),
at decision time; measuring RAS in one micro-batch size and comparing it with a break-even
computed for another was a bug. `SignalsConfig.micro_batch_tokens` only sets the unit of the
`ras` / `tprm_s` fields kept for logs and the buffer's reservoir.

Noise. Trajectory variance skews instantaneous arrivals even within one step, so step-level
values are smoothed across steps with an EWMA (one odd step moves the estimate by `alpha` of
its deviation). A rate over the whole step is used for decisions rather than the median gap
between micro-batch arrivals: when every group is larger than one micro-batch, a group's
completion counts as several arrivals at one instant and the median gap reads 0 (an infinitely
fast stream) whatever the real pace. The median gap is still reported (`tprm_s`); when no
micro-batch becomes ready it is censored at the step duration.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class SignalsConfig:
    """How readiness is measured and smoothed."""

    micro_batch_tokens: int = 32768
    """Token volume of the micro-batch the logged `ras` / `tprm_s` fields count in (and of the
    buffer's retention reservoir); decisions use the token fields."""
    ewma_alpha: float = 0.5
    """Weight of the newest step in the cross-step EWMA (1.0 disables smoothing)."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens <= 0:
            raise ValueError("micro_batch_tokens must be positive")
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError("ewma_alpha must be in (0, 1]")


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
    """Ready-at-start backlog in micro-batches of `SignalsConfig.micro_batch_tokens` (logs)."""
    tprm_s: float
    """Median interval between micro-batches becoming ready after the start (censored: step time)."""
    arrivals: int
    """Micro-batches that became ready during the step."""
    hol_latency_s: float
    """Age of the oldest ready group at the step start."""
    batch_trajectories: int
    """Trajectories the trainer consumed in this step (the global batch volume)."""
    ras_tokens: int = 0
    """Ready-at-start backlog, trainer-work tokens (the unit decisions use)."""
    arrived_tokens: int = 0
    """Trainer-work tokens made ready during the step."""

    @property
    def duration_s(self) -> float:
        return self.end_time - self.start_time

    @property
    def arrival_tokens_per_s(self) -> float:
        """Ready tokens per second over the step (0 for an empty or instantaneous step)."""
        return self.arrived_tokens / self.duration_s if self.duration_s > 0 else 0.0


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
        self._ras_tokens = 0
        self._hol = 0.0
        self._tokens_since_start = 0
        self._arrival_times: list[float] = []

    @property
    def in_step(self) -> bool:
        return self._open

    def begin_step(self, now: float, ready_tokens: int, hol_latency_s: float) -> float:
        """Open a step; returns its RAS in micro-batches of `micro_batch_tokens` (for logs)."""
        if self._open:
            raise RuntimeError("begin_step called twice without end_step")
        self._open = True
        self._step += 1
        self._start = now
        self._ras_tokens = ready_tokens
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
            ras_tokens=self._ras_tokens,
            arrived_tokens=self._tokens_since_start,
        )


@dataclass(frozen=True)
class ReadinessEstimate:
    """Cross-step smoothed readiness, what RA2P and ERS decide on."""

    ras: float
    """EWMA of RAS, micro-batches of `SignalsConfig.micro_batch_tokens` (logs)."""
    tprm_s: float
    """EWMA of the median TPRM, seconds (logs)."""
    step_time_s: float
    """EWMA of the step duration (T_step)."""
    batch_trajectories: float
    """EWMA of the consumed global batch volume, trajectories."""
    steps_observed: int
    """How many steps fed the estimate (0: cold start, values are zero)."""
    ras_tokens: float = 0.0
    """EWMA of RAS, trainer-work tokens."""
    arrival_tokens_per_s: float = 0.0
    """EWMA of the ready-token arrival rate during steps, tokens/s."""


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
    _ras_tokens: float = field(default=0.0, init=False, repr=False)
    _rate: float = field(default=0.0, init=False, repr=False)

    def observe(self, step: StepReadiness) -> ReadinessEstimate:
        a = self.config.ewma_alpha
        if not self.history:
            # Seed with the first observation instead of decaying from zero: a zero seed would
            # read as "no backlog, instant arrivals" for several steps after cold start.
            self._ras, self._tprm = step.ras, step.tprm_s
            self._step_time, self._volume = step.duration_s, float(step.batch_trajectories)
            self._ras_tokens, self._rate = float(step.ras_tokens), step.arrival_tokens_per_s
        else:
            self._ras += a * (step.ras - self._ras)
            self._tprm += a * (step.tprm_s - self._tprm)
            self._step_time += a * (step.duration_s - self._step_time)
            self._volume += a * (step.batch_trajectories - self._volume)
            self._ras_tokens += a * (step.ras_tokens - self._ras_tokens)
            self._rate += a * (step.arrival_tokens_per_s - self._rate)
        self.history.append(step)
        return self.estimate()

    def estimate(self) -> ReadinessEstimate:
        return ReadinessEstimate(
            ras=self._ras,
            tprm_s=self._tprm,
            step_time_s=self._step_time,
            batch_trajectories=self._volume,
            steps_observed=len(self.history),
            ras_tokens=self._ras_tokens,
            arrival_tokens_per_s=self._rate,
        )


def tprm_for(micro_batch_tokens: float, arrival_tokens_per_s: float) -> float:
    """Seconds per ready micro-batch of `micro_batch_tokens` at the given arrival rate (inf: none)."""
    if micro_batch_tokens <= 0:
        raise ValueError("micro_batch_tokens must be positive")
    return micro_batch_tokens / arrival_tokens_per_s if arrival_tokens_per_s > 0 else math.inf
