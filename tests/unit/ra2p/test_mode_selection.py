"""CostMeter (EWMA of per-token costs) and ModeSelector (core C_dec / C_col on measured costs,
readiness in tokens converted to the cost model's micro-batch of the trainer it decides for)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core.ra2p import MicroBatchTimes, RA2PConfig, choose_mode, in_micro_batches
from tide_megatron.core.roles import RA2PMode
from tide_megatron.trainer.ra2p.mode_selector import ModeSelector, ModeSelectorConfig
from tide_megatron.trainer.ra2p.timing import CostMeter, CostMeterConfig

TOKENS_PER_RANK = 256
# Costs of the order the CPU micro-benchmark measured (30M params, 256-token micro-batches).
MEASURED = dict(ref_fwd=0.10, actor_fwd=0.11, actor_bwd=0.25)
SWAP_S = 0.20


def _measured_meter(swap_s: float = SWAP_S) -> CostMeter:
    meter = CostMeter()
    for _ in range(3):
        for kind, seconds in MEASURED.items():
            meter.observe(kind, seconds, TOKENS_PER_RANK)
        meter.observe("swap", swap_s)
    return meter


def _selector(meter: CostMeter) -> ModeSelector:
    return ModeSelector(ModeSelectorConfig(ra2p=RA2PConfig(pipeline_fill_s=0.05, tokens_per_rank=TOKENS_PER_RANK)),
                        meter)


def _choose(selector: ModeSelector, ras_mb: float, tprm_s: float, n_mb: int, dp: int = 3, ref_ranks: int = 1):
    """Readiness given in micro-batches of this trainer, passed in tokens as a real run does."""
    mb = selector.cfg.ra2p.micro_batch_tokens(dp)
    return selector.choose(dp, ras_tokens=ras_mb * mb, arrival_tokens_per_s=mb / tprm_s if tprm_s else math.inf,
                           step_tokens=n_mb * mb, ref_ranks=ref_ranks)


def test_ewma_tracks_and_smooths():
    meter = CostMeter(CostMeterConfig(ewma_alpha=0.5))
    meter.observe("swap", 1.0)
    assert meter.values["swap"] == 1.0
    meter.observe("swap", 3.0)
    assert meter.values["swap"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown cost kind"):
        meter.observe("nonsense", 1.0)
    with pytest.raises(ValueError, match="needs the tokens"):
        meter.observe("actor_fwd", 1.0)


def test_passes_are_kept_per_token_and_scaled_to_the_cost_models_micro_batch():
    """Executed micro-batches of 100 and 400 tokens at the same speed give one per-token cost;
    the cost model reads it for its own micro-batch size."""
    meter = CostMeter(CostMeterConfig(ewma_alpha=0.5))
    meter.observe("actor_fwd", 0.1, 100)
    meter.observe("actor_fwd", 0.4, 400)
    meter.observe("ref_fwd", 0.05, 100)
    meter.observe("actor_bwd", 0.2, 100)
    assert meter.values["actor_fwd"] == pytest.approx(1e-3)
    assert meter.times(1000) == pytest.approx(MicroBatchTimes(0.5, 1.0, 2.0))
    assert meter.times(2000).actor_fwd_s == pytest.approx(2.0)


def test_priors_until_measured_then_measurements():
    selector = ModeSelector(ModeSelectorConfig(ra2p=RA2PConfig(tokens_per_rank=TOKENS_PER_RANK),
                                               prior_times=MicroBatchTimes(1.0, 2.0, 3.0)))
    times, cfg = selector.cost_inputs()
    assert times == MicroBatchTimes(1.0, 2.0, 3.0) and cfg.swap_cost_s == RA2PConfig().swap_cost_s
    selector.meter.merge({k: v / TOKENS_PER_RANK for k, v in MEASURED.items()} | {"swap": SWAP_S})
    times, cfg = selector.cost_inputs()
    assert times == pytest.approx(MicroBatchTimes(0.10, 0.11, 0.25)) and cfg.swap_cost_s == SWAP_S


def test_both_modes_chosen_under_the_workloads_that_call_for_them():
    """High RAS / short TPRM -> DECOUPLED (swaps would dominate); low RAS / long TPRM -> COLOCATED
    (a dedicated Ref rank would idle between sparse arrivals)."""
    selector = _selector(_measured_meter())
    burst = _choose(selector, 16, 0.0, 16)
    assert burst.mode is RA2PMode.DECOUPLED, burst
    assert burst.ras == pytest.approx(16) and burst.micro_batches == 16
    sparse = _choose(selector, 1, 5.0, 16)
    assert sparse.mode is RA2PMode.COLOCATED, sparse
    fast_stream = _choose(selector, 1, 0.05, 16)
    assert fast_stream.mode is RA2PMode.DECOUPLED, fast_stream
    assert _choose(selector, 16, 0.0, 16, ref_ranks=0).mode is RA2PMode.COLOCATED


def test_measured_swap_cost_drives_the_choice():
    """The same burst is colocated when swaps are measured cheap and decoupled when they are dear."""
    selector = _selector(_measured_meter(swap_s=0.001))
    assert _choose(selector, 16, 0.0, 16).mode is RA2PMode.COLOCATED
    selector.meter = _measured_meter()
    assert _choose(selector, 16, 0.0, 16).mode is RA2PMode.DECOUPLED
    assert selector.summary()["mode"] == "decoupled"


def test_a_chosen_mode_that_ran_over_its_prediction_loses_the_next_close_call():
    selector = _selector(_measured_meter())
    burst = _choose(selector, 16, 0.0, 16)
    assert burst.mode is RA2PMode.DECOUPLED
    # the step took longer than colocated was predicted to (per rank-second): the same readiness
    # now goes to colocated, and the figures it reports are the model's own
    ranks_dec = 3 + 1  # three actor ranks and a Ref rank
    selector.observe(RA2PMode.DECOUPLED, 1.1 * burst.cost_colocated / ranks_dec)
    assert selector.correction.factor(RA2PMode.DECOUPLED) == pytest.approx(
        1.1 * burst.cost_colocated / (ranks_dec * burst.latency_decoupled))
    again = _choose(selector, 16, 0.0, 16)
    assert again.mode is RA2PMode.COLOCATED and again.cost_decoupled == pytest.approx(burst.cost_decoupled)
    assert selector.summary()["latency_factors"]["decoupled"] > 1.0
    assert selector.summary()["latency_deviations"]["decoupled"] > 0.0
    # a choice made on the configured priors teaches nothing about the model's error
    unmeasured = _selector(CostMeter())
    first = _choose(unmeasured, 16, 0.0, 16)
    unmeasured.observe(first.mode, 1000.0 * first.latency_colocated)
    assert unmeasured.correction.ratios == {}


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 8), ras_tokens=st.integers(0, 200_000), step_extra=st.integers(1, 200_000),
       rate=st.floats(10.0, 1e6), ref_ranks=st.integers(1, 3))
def test_the_real_choice_is_the_cores_on_this_trainers_micro_batch(dp, ras_tokens, step_extra, rate, ref_ranks):
    """What a real run decides equals the core's `choose_mode` on readiness counted in micro-batches
    of D x tokens_per_rank tokens with times of that micro-batch: the units `trainer_layout` (ERS,
    simulator) uses. N shrinks as D grows: the same tokens are fewer, wider micro-batches."""
    selector = _selector(_measured_meter())
    step_tokens = ras_tokens + step_extra
    got = selector.choose(dp, ras_tokens=ras_tokens, arrival_tokens_per_s=rate, step_tokens=step_tokens,
                          ref_ranks=ref_ranks)
    times, cfg = selector.cost_inputs()
    ras, tprm, n = in_micro_batches(dp, ras_tokens=ras_tokens, arrival_tokens_per_s=rate, step_tokens=step_tokens,
                                    cfg=cfg)
    assert n == math.ceil(step_tokens / (dp * TOKENS_PER_RANK))
    assert tprm == pytest.approx(dp * TOKENS_PER_RANK / rate)
    want = choose_mode(ras, tprm, n, times, cfg, dp, ref_ranks=ref_ranks)
    assert (got.mode, got.cost_decoupled, got.cost_colocated) == (want.mode, want.cost_decoupled, want.cost_colocated)
    assert times.actor_fwd_s == pytest.approx(MEASURED["actor_fwd"])  # 256 tokens per rank, whatever D
