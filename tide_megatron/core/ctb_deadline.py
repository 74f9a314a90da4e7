"""Deadlines for CTB: the trainer's clock, group completion latency, and the consumption rate.

A training group admitted while the rollout ranks serve policy version v may be trained on by
steps whose consumer version is at most v + max_staleness, i.e. it must be consumed by the step
that produces version v + max_staleness + 1. With the trainer's clock (`TrainerClock`: current
version V, measured step time T, estimated end of the current step) that step ends at

    deadline(v) = next_sync_at + (v + max_staleness - V) * T.

CTB admits a new training group only if it is predicted to complete by then, from the MEASURED
completion latency of recent groups (`GroupLatency`), and cancels started groups that can no
longer be consumed in time. Pure Python, deterministic, clock-passing: the caller measures.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TrainerClock:
    """What CTB needs to know about the trainer to date deadlines (measured by the caller)."""

    version: int
    """V: the policy version the rollout ranks serve now (the weights of the last sync)."""
    step_time_s: float
    """Measured duration of one training step (weight sync included), e.g. the buffer's EWMA."""
    next_sync_at: float
    """Estimated time at which the step now running ends and version V + 1 reaches the ranks."""
    consumed_per_s: Optional[float] = None
    """Measured training trajectories consumed per second (`ConsumptionMeter.rate()`); None
    until measured."""

    def __post_init__(self) -> None:
        if self.step_time_s <= 0:
            raise ValueError(f"step_time_s must be > 0, got {self.step_time_s}")

    def deadline(self, version: int, max_staleness: int) -> float:
        """End of the last step that may consume a group of policy `version`."""
        return self.next_sync_at + (version + max_staleness - self.version) * self.step_time_s


class GroupLatency:
    """Online estimate of GRPO group completion latency (first admission -> last trajectory done).

    The estimate is the nearest-rank `quantile` of the last `window` completed groups. With fewer
    than 1 / (1 - quantile) samples that is the largest latency seen (conservative); with none
    there is no estimate (cold start: the caller decides without one)."""

    def __init__(self, window: int, quantile: float):
        if window < 1 or not 0.0 < quantile <= 1.0:
            raise ValueError(f"need window >= 1 and 0 < quantile <= 1, got {window}, {quantile}")
        self.quantile = quantile
        self._samples: deque[float] = deque(maxlen=window)

    def record(self, latency_s: float) -> None:
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        self._samples.append(latency_s)

    @property
    def samples(self) -> int:
        return len(self._samples)

    def estimate(self) -> Optional[float]:
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]


class ConsumptionMeter:
    """Training trajectories consumed per second over the last `window_steps` training steps."""

    def __init__(self, window_steps: int = 4):
        if window_steps < 1:
            raise ValueError("window_steps must be >= 1")
        self._steps: deque[tuple[float, int]] = deque(maxlen=window_steps)

    def record_step(self, started_at: float, ended_at: float, trajectories: int) -> None:
        """One training step consumed `trajectories` training trajectories between these times."""
        if ended_at < started_at or trajectories < 0:
            raise ValueError("need ended_at >= started_at and trajectories >= 0")
        self._steps.append((ended_at - started_at, trajectories))

    def rate(self) -> Optional[float]:
        """Trajectories per second (None before the first step)."""
        seconds = sum(s for s, _n in self._steps)
        return sum(n for _s, n in self._steps) / seconds if seconds > 0 else None
