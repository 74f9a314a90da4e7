import math

import pytest

from tide_megatron.core import (
    ReadinessEstimator,
    ReadinessMeter,
    SignalsConfig,
    StepReadiness,
    detect_deficits,
    median_interval,
)


def test_median_interval_ignores_a_single_straggler_gap():
    # Arrivals every 1 s, then one 50 s gap: the median stays at the typical interval.
    assert median_interval(0.0, [1, 2, 3, 4, 54], censor_at=60) == 1.0


def test_median_interval_is_censored_at_step_end_without_arrivals():
    assert median_interval(10.0, [], censor_at=25.0) == 15.0


def test_meter_counts_micro_batches_by_token_volume():
    meter = ReadinessMeter(SignalsConfig(micro_batch_tokens=100))
    ras = meter.begin_step(now=0.0, ready_tokens=250, hol_latency_s=3.0)
    assert ras == 2.5
    meter.on_tokens_ready(2.0, 60)   # 60 since start: no full micro-batch
    meter.on_tokens_ready(4.0, 60)   # 120: first micro-batch at t=4
    meter.on_tokens_ready(6.0, 200)  # 320: two more at t=6 (one big group)
    step = meter.end_step(now=10.0, batch_trajectories=16)
    assert step.arrivals == 3
    assert step.tprm_s == 2.0  # gaps 4, 2, 0 -> median 2
    assert step.hol_latency_s == 3.0 and step.duration_s == 10.0 and step.batch_trajectories == 16


def test_meter_ignores_tokens_outside_a_step():
    meter = ReadinessMeter(SignalsConfig(micro_batch_tokens=10))
    meter.on_tokens_ready(1.0, 1000)
    meter.begin_step(2.0, 0, 0.0)
    step = meter.end_step(5.0, 0)
    assert step.arrivals == 0 and step.tprm_s == 3.0


def test_meter_rejects_unbalanced_calls():
    meter = ReadinessMeter(SignalsConfig())
    with pytest.raises(RuntimeError):
        meter.end_step(1.0, 0)
    meter.begin_step(0.0, 0, 0.0)
    with pytest.raises(RuntimeError):
        meter.begin_step(1.0, 0, 0.0)


def _step(i, ras, tprm, dur, vol):
    return StepReadiness(i, 0.0, dur, ras, tprm, 1, 0.0, vol)


def test_estimator_seeds_with_first_step_then_ewma():
    est = ReadinessEstimator(SignalsConfig(ewma_alpha=0.5))
    e = est.observe(_step(0, 4.0, 2.0, 10.0, 64))
    assert (e.ras, e.tprm_s, e.step_time_s, e.batch_trajectories) == (4.0, 2.0, 10.0, 64.0)
    e = est.observe(_step(1, 0.0, 6.0, 20.0, 128))
    assert (e.ras, e.tprm_s, e.step_time_s, e.batch_trajectories) == (2.0, 4.0, 15.0, 96.0)
    assert e.steps_observed == 2


def test_estimator_damps_a_single_outlier_step():
    est = ReadinessEstimator(SignalsConfig(ewma_alpha=0.25))
    for i in range(10):
        est.observe(_step(i, 1.0, 1.0, 10.0, 128))
    e = est.observe(_step(10, 1.0, 100.0, 10.0, 128))
    assert e.tprm_s == pytest.approx(1.0 + 0.25 * 99)


def _estimate(ras=1.0, tprm=1.0, step_time=10.0, volume=128.0, steps=3):
    from tide_megatron.core import ReadinessEstimate

    return ReadinessEstimate(ras, tprm, step_time, volume, steps)


def test_generation_deficit_when_batch_volume_below_ideal():
    d = detect_deficits(_estimate(volume=64), 0.0, b_ideal=128, break_even_ras=math.inf, hol_tau=1.0)
    assert d.generation and not d.consumption


def test_consumption_deficit_from_head_of_line_latency():
    d = detect_deficits(_estimate(step_time=10.0), 15.0, b_ideal=128, break_even_ras=math.inf, hol_tau=1.0)
    assert d.consumption and not d.generation
    d = detect_deficits(_estimate(step_time=10.0), 15.0, b_ideal=128, break_even_ras=math.inf, hol_tau=2.0)
    assert not d.consumption


def test_consumption_deficit_from_ras_above_break_even():
    d = detect_deficits(_estimate(ras=6.0), 0.0, b_ideal=128, break_even_ras=4.0, hol_tau=1.0)
    assert d.consumption and any("break-even" in r for r in d.reasons)
    d = detect_deficits(_estimate(ras=3.0), 0.0, b_ideal=128, break_even_ras=4.0, hol_tau=1.0)
    assert not d.consumption


def test_no_deficit_before_any_step():
    d = detect_deficits(_estimate(volume=0, steps=0), 99.0, b_ideal=128, break_even_ras=0.0, hol_tau=1.0)
    assert not d.generation and not d.consumption


@pytest.mark.parametrize("kwargs", [dict(micro_batch_tokens=0), dict(ewma_alpha=0.0), dict(hol_tau=0)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SignalsConfig(**kwargs)


def test_decayed_ras_is_no_backlog_even_at_zero_break_even():
    # A fast TPRM can put the break-even at 0; an EWMA of RAS decaying towards 0 stays
    # positive, and used to read as a backlog, growing the trainer while it starved.
    d = detect_deficits(_estimate(ras=1e-4), 0.0, b_ideal=128, break_even_ras=0.0, hol_tau=1.0)
    assert not d.consumption
    d = detect_deficits(_estimate(ras=1.0), 0.0, b_ideal=128, break_even_ras=0.0, hol_tau=1.0)
    assert d.consumption


def test_short_elastic_batch_with_ready_reservoir_is_not_a_generation_deficit():
    # ERS must not scale the trainer down after a small elastic batch when ready data waits.
    d = detect_deficits(_estimate(volume=64), 0.0, b_ideal=128, break_even_ras=math.inf, hol_tau=1.0,
                        ready_micro_batches=2.5)
    assert not d.generation
    d = detect_deficits(_estimate(volume=64), 0.0, b_ideal=128, break_even_ras=math.inf, hol_tau=1.0,
                        ready_micro_batches=0.5)
    assert d.generation
