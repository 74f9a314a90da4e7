"""CostMeter (EWMA of measured costs) and ModeSelector (core C_dec / C_col on measured costs)."""

from __future__ import annotations

import pytest

from tide_megatron.core.ra2p import MicroBatchTimes, RA2PConfig
from tide_megatron.core.roles import RA2PMode
from tide_megatron.trainer.ra2p.mode_selector import ModeSelector, ModeSelectorConfig
from tide_megatron.trainer.ra2p.timing import CostMeter, CostMeterConfig, StepReport

# Per-micro-batch costs of the order the CPU micro-benchmark measured (30M params, 256 tokens).
MEASURED = dict(ref_fwd=0.10, actor_fwd=0.11, actor_bwd=0.25, swap=0.20)


def _measured_meter() -> CostMeter:
    meter = CostMeter()
    for _ in range(3):
        for kind, seconds in MEASURED.items():
            meter.observe(kind, seconds)
    return meter


def test_ewma_tracks_and_smooths():
    meter = CostMeter(CostMeterConfig(ewma_alpha=0.5))
    meter.observe("swap", 1.0)
    assert meter.values["swap"] == 1.0
    meter.observe("swap", 3.0)
    assert meter.values["swap"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        meter.observe("nonsense", 1.0)


def test_step_report_folds_in_per_micro_batch_costs():
    meter = CostMeter()
    meter.observe_step(StepReport(mode="colocated", num_micro_batches=4, ref_fwd_s=0.4, actor_fwd_s=0.8,
                                  actor_bwd_s=1.6, swap_s=0.6, num_swaps=2))
    assert meter.times() == MicroBatchTimes(0.1, 0.2, 0.4)
    assert meter.ra2p_config(RA2PConfig(swap_cost_s=9.0)).swap_cost_s == pytest.approx(0.3)


def test_priors_until_measured_then_measurements():
    selector = ModeSelector(ModeSelectorConfig(prior_times=MicroBatchTimes(1.0, 2.0, 3.0)))
    times, cfg = selector.cost_inputs()
    assert times == MicroBatchTimes(1.0, 2.0, 3.0) and cfg.swap_cost_s == RA2PConfig().swap_cost_s
    selector.meter.merge(MEASURED)
    times, cfg = selector.cost_inputs()
    assert times == MicroBatchTimes(0.10, 0.11, 0.25) and cfg.swap_cost_s == 0.20


def test_both_modes_chosen_under_the_workloads_that_call_for_them():
    """High RAS / short TPRM -> DECOUPLED (swaps would dominate); low RAS / long TPRM -> COLOCATED
    (a dedicated Ref rank would idle between sparse arrivals)."""
    selector = ModeSelector(ModeSelectorConfig(ra2p=RA2PConfig(pipeline_fill_s=0.05)), _measured_meter())
    burst = selector.choose(ras=16, tprm_s=0.0, num_micro_batches=16, dp_size=3)
    assert burst.mode is RA2PMode.DECOUPLED, burst
    sparse = selector.choose(ras=1, tprm_s=5.0, num_micro_batches=16, dp_size=3)
    assert sparse.mode is RA2PMode.COLOCATED, sparse
    fast_stream = selector.choose(ras=1, tprm_s=0.05, num_micro_batches=16, dp_size=3)
    assert fast_stream.mode is RA2PMode.DECOUPLED, fast_stream
    assert selector.choose(ras=16, tprm_s=0.0, num_micro_batches=16, dp_size=3,
                           ref_rank_available=False).mode is RA2PMode.COLOCATED


def test_measured_swap_cost_drives_the_choice():
    """The same burst is colocated when swaps are measured cheap and decoupled when they are dear."""
    cheap = CostMeter()
    cheap.merge(dict(MEASURED, swap=0.001))
    selector = ModeSelector(ModeSelectorConfig(ra2p=RA2PConfig(pipeline_fill_s=0.05)), cheap)
    assert selector.choose(ras=16, tprm_s=0.0, num_micro_batches=16, dp_size=3).mode is RA2PMode.COLOCATED
    selector.meter = _measured_meter()
    assert selector.choose(ras=16, tprm_s=0.0, num_micro_batches=16, dp_size=3).mode is RA2PMode.DECOUPLED
    assert selector.summary()["mode"] == "decoupled"
