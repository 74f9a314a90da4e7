"""RA2P mode choice at each step, from RAS and TPRM, on costs measured online.

The decision itself is the core's analytical comparison of C_dec and C_col (`core/ra2p.
choose_mode`); what this component adds is its inputs: the per-micro-batch Ref forward, Actor
forward and Actor backward times and the Ref<->Actor swap time that the executors measured on
this hardware (`CostMeter`), with configured priors only until a measurement exists. A mode
that has never run still gets measured costs: the colocated executors measure all four, and a
decoupled step measures the Actor's passes (its Ref rank measures the Ref forward and its meter
is merged in); only the swap cost needs one colocated step (or the prior).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from tide_megatron.core.ra2p import MicroBatchTimes, ModeChoice, RA2PConfig, choose_mode
from tide_megatron.trainer.ra2p.timing import CostMeter


@dataclass
class ModeSelectorConfig:
    """Inputs of the mode choice that are not measured."""

    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    """Cost-model constants (pipeline fill, actors per Ref, aggregation limit). Its
    `swap_cost_s` is a prior, replaced by the measured swap time once there is one."""

    prior_times: MicroBatchTimes = field(default_factory=lambda: MicroBatchTimes(1.0, 1.0, 2.0))
    """Per-micro-batch times used until the executors have measured them."""


@dataclass
class ModeSelector:
    """Chooses the RA2P mode for the next step: `choose(ras, tprm_s, n, dp_size)`."""

    cfg: ModeSelectorConfig = field(default_factory=ModeSelectorConfig)
    meter: CostMeter = field(default_factory=CostMeter)
    last: Optional[ModeChoice] = None

    def cost_inputs(self) -> tuple[MicroBatchTimes, RA2PConfig]:
        """(per-micro-batch times, cost-model config) with measured values where available."""
        return self.meter.times(prior=self.cfg.prior_times), self.meter.ra2p_config(self.cfg.ra2p)

    def choose(self, ras: float, tprm_s: float, num_micro_batches: int, dp_size: int,
               ref_rank_available: bool = True) -> ModeChoice:
        """The mode with the lower GPU-second cost for this readiness (ties: colocated)."""
        times, ra2p_cfg = self.cost_inputs()
        self.last = choose_mode(ras, tprm_s, num_micro_batches, times, ra2p_cfg, dp_size,
                                ref_rank_available=ref_rank_available)
        return self.last

    def summary(self) -> dict:
        times, ra2p_cfg = self.cost_inputs()
        out = dict(dataclasses.asdict(times), swap_cost_s=ra2p_cfg.swap_cost_s,
                   measured=sorted(self.meter.values))
        if self.last is not None:
            out.update(mode=self.last.mode.value, cost_decoupled=self.last.cost_decoupled,
                       cost_colocated=self.last.cost_colocated, break_even_ras=self.last.break_even_ras)
        return out
