"""A verl-like dynamic rollout scaling policy: the elastic peer TIDE is compared with.

verl's fully-asynchronous trainer (`fully_async_policy`, "dynamic resource scheduling", verl
PR #6556; the same idea at the step boundary of `separate_async`, PR #7373) keeps a fixed pool
of standalone rollout replicas and lends the trainer's own GPUs ("hybrid" replicas, colocated
with the trainer) to rollout while the trainer would otherwise wait for samples:

- After each weight sync it decides whether to activate the hybrid replicas. It does only if
  they are needed and worth their cost: the gap between the samples it wants queued before it
  reclaims them (deactivate_ratio x samples per step) and the samples already produced beyond
  what training consumed must be positive, and that gap, valued at the measured wait per fresh
  sample (trainer wait time / samples it had to wait for in the last cycle), must exceed the
  measured switch cost (the recent activate + deactivate durations).
- Active hybrid replicas generate until deactivate_ratio x samples per step are queued; then
  they are deactivated (in-flight requests aborted and retried on the standalone replicas) and
  the GPUs train.
- The ratio adapts after every step: if the trainer had to wait for freshly generated samples
  it grows by the waited share of the step's samples (clipped to [0.02, 0.1]); otherwise it
  shrinks by 0.02.

This module is our own implementation of that decision rule from the public description; the
simulator (`trainers.run_elastic`) measures the quantities and carries out the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class VerlElasticConfig:
    """The peer's knobs (verl's defaults)."""

    deactivate_ratio: float = 0.3
    """Initial share of a step's samples the hybrid replicas help queue before they are reclaimed."""
    ratio_step_up_min: float = 0.02
    ratio_step_up_max: float = 0.1
    ratio_step_down: float = 0.02
    default_switch_cost_s: float = 10.0
    """Switch cost assumed before any switch was measured."""
    initial_per_sample_s: float = 1000.0
    """Deliberately pessimistic wait per sample before one was measured (biases toward activating)."""
    switch_window: int = 3
    """Recent activate + deactivate cycles averaged into the switch cost."""


@dataclass
class VerlElasticPolicy:
    """Activation gate and adaptive deactivate ratio (module docstring)."""

    config: VerlElasticConfig = field(default_factory=VerlElasticConfig)
    ratio: float = -1.0
    per_sample_s: float = -1.0
    switch_costs: List[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.ratio < 0:
            self.ratio = self.config.deactivate_ratio
        if self.per_sample_s < 0:
            self.per_sample_s = self.config.initial_per_sample_s

    def deactivate_threshold(self, step_samples: int) -> int:
        """Queued samples at which the hybrid replicas are reclaimed for training."""
        return int(step_samples * self.ratio)

    def switch_cost_s(self) -> float:
        recent = self.switch_costs[-self.config.switch_window:]
        return sum(recent) / len(recent) if recent else self.config.default_switch_cost_s

    def should_activate(self, step_samples: int, surplus_samples: int) -> bool:
        """After a weight sync: lend the trainer GPUs to rollout? `surplus_samples`: produced
        beyond what training consumed (queued, fresh)."""
        gap = self.deactivate_threshold(step_samples) - surplus_samples
        return gap > 0 and gap * self.per_sample_s > self.switch_cost_s()

    def after_step(self, step_samples: int, wait_s: float, wait_samples: int, switch_s: float) -> None:
        """Fold in one cycle: the trainer waited `wait_s` for `wait_samples` freshly generated
        samples; `switch_s` is this cycle's activate + deactivate time (0: no switch)."""
        cfg = self.config
        if switch_s > 0:
            self.switch_costs.append(switch_s)
        if wait_samples > 0:
            if wait_s > 0:
                self.per_sample_s = wait_s / wait_samples
            step_up = min(cfg.ratio_step_up_max, max(cfg.ratio_step_up_min, wait_samples / step_samples))
            self.ratio = min(1.0, self.ratio + step_up)
        else:
            self.ratio = max(0.0, self.ratio - cfg.ratio_step_down)
