"""RA2P mode choice at each step, from RAS and TPRM, on costs measured online.

The decision itself is the core's analytical comparison of C_dec and C_col (`core/ra2p.
choose_mode_for_tokens`, readiness in tokens converted to the cost model's micro-batch of this
trainer); what this component adds is its inputs: the Ref forward, Actor forward and Actor
backward times per token and the Ref<->Actor swap time that the executors measured on this
hardware (`CostMeter`), with configured priors only until a measurement exists. A mode
that has never run still gets measured costs: the colocated executors measure all four, and a
decoupled step measures the Actor's passes (its Ref rank measures the Ref forward and its meter
is merged in); only the swap cost needs one colocated step (or the prior).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from tide_megatron.core.ra2p import LatencyCorrection, MicroBatchTimes, ModeChoice, RA2PConfig, choose_mode_for_tokens
from tide_megatron.core.roles import RA2PMode
from tide_megatron.trainer.ra2p.timing import CostMeter


@dataclass
class ModeSelectorConfig:
    """Inputs of the mode choice that are not measured."""

    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    """Cost-model constants (pipeline fill, actors per Ref, aggregation limit). Its
    `swap_cost_s` is a prior, replaced by the measured swap time once there is one."""

    prior_times: MicroBatchTimes = field(default_factory=lambda: MicroBatchTimes(1.0, 1.0, 2.0))
    """Times of one cost-model micro-batch (`ra2p.tokens_per_rank` tokens per actor rank) used
    until the executors have measured them."""


@dataclass
class ModeSelector:
    """Chooses the RA2P mode for the next step: `choose(dp_size, ras_tokens=..., ...)`."""

    cfg: ModeSelectorConfig = field(default_factory=ModeSelectorConfig)
    meter: CostMeter = field(default_factory=CostMeter)
    last: Optional[ModeChoice] = None
    correction: LatencyCorrection = field(default_factory=LatencyCorrection)
    """The latency model's measured error per mode (`observe`); choices and ERS's layout use it."""
    _last_on_measured: bool = False  # the last choice's passes were all measured, not priors

    def cost_inputs(self) -> tuple[MicroBatchTimes, RA2PConfig]:
        """(times of one cost-model micro-batch, cost-model config) with measured values where
        available: what `trainer_layout` (ERS) takes too."""
        return self.meter.times(self.cfg.ra2p.tokens_per_rank, prior=self.cfg.prior_times), \
            self.meter.ra2p_config(self.cfg.ra2p)

    def choose(self, dp_size: int, *, ras_tokens: float, arrival_tokens_per_s: float, step_tokens: float,
               ref_ranks: int = 0) -> ModeChoice:
        """The mode with the lower GPU-second cost for this readiness (ties: colocated), on
        `dp_size` actor ranks and `ref_ranks` dedicated Ref ranks (0: colocated only)."""
        times, ra2p_cfg = self.cost_inputs()
        self._last_on_measured = self.meter.has("ref_fwd", "actor_fwd", "actor_bwd")
        self.last = choose_mode_for_tokens(dp_size, ras_tokens=ras_tokens, arrival_tokens_per_s=arrival_tokens_per_s,
                                           step_tokens=step_tokens, times=times, cfg=ra2p_cfg, ref_ranks=ref_ranks,
                                           correction=self.correction)
        return self.last

    def observe(self, mode: RA2PMode, measured_s: float) -> None:
        """The step of the last choice ran in `mode` and took `measured_s` (the executor's wall
        time, arrival waits included, as the latency model counts it). A choice made on the
        configured priors says nothing of the model's error (off by ~100x on the first step)."""
        if self.last is not None and self._last_on_measured:
            predicted = self.last.latency_decoupled if mode is RA2PMode.DECOUPLED else self.last.latency_colocated
            self.correction.observe(mode, predicted, measured_s)

    def summary(self) -> dict:
        times, ra2p_cfg = self.cost_inputs()
        out = dict(dataclasses.asdict(times), swap_cost_s=ra2p_cfg.swap_cost_s,
                   measured=sorted(self.meter.values),
                   latency_factors={m.value: f for m, f in self.correction.ratios.items()},
                   latency_deviations={m.value: d for m, d in self.correction.deviations.items()})
        if self.last is not None:
            out.update(mode=self.last.mode.value, cost_decoupled=self.last.cost_decoupled,
                       cost_colocated=self.last.cost_colocated, break_even_ras=self.last.break_even_ras,
                       ras=self.last.ras, micro_batches=self.last.micro_batches)
        return out
