import math

import pytest

from tide_megatron.core import (
    ReadinessEstimator,
    ReadinessMeter,
    SignalsConfig,
    StepReadiness,
    median_interval,
    tprm_for,
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


def test_meter_reports_ras_and_arrivals_in_tokens():
    meter = ReadinessMeter(SignalsConfig(micro_batch_tokens=100))
    meter.begin_step(now=0.0, ready_tokens=250, hol_latency_s=0.0)
    meter.on_tokens_ready(2.0, 300)
    meter.on_tokens_ready(3.0, 300)
    step = meter.end_step(now=10.0, batch_trajectories=8)
    assert step.ras_tokens == 250 and step.arrived_tokens == 600
    assert step.arrival_tokens_per_s == pytest.approx(60.0)


def test_large_groups_arriving_together_do_not_read_as_an_instant_stream():
    # Each group holds 3 micro-batches: the median gap between micro-batch arrivals is 0 (three
    # at one instant), which read as an infinitely fast stream. The rate says 90 tokens/s.
    meter = ReadinessMeter(SignalsConfig(micro_batch_tokens=100))
    meter.begin_step(0.0, 0, 0.0)
    for t in (10.0, 20.0, 30.0):
        meter.on_tokens_ready(t, 300)
    step = meter.end_step(10.0 * 3 + 0.0, 3)
    assert step.tprm_s == 0.0
    assert tprm_for(100, step.arrival_tokens_per_s) == pytest.approx(100 / 30.0)
    assert tprm_for(100, 0.0) == math.inf


def test_estimator_smooths_token_fields():
    est = ReadinessEstimator(SignalsConfig(ewma_alpha=0.5))
    est.observe(StepReadiness(0, 0.0, 10.0, 0.0, 1.0, 1, 0.0, 8, ras_tokens=1000, arrived_tokens=500))
    e = est.observe(StepReadiness(1, 10.0, 20.0, 0.0, 1.0, 1, 0.0, 8, ras_tokens=3000, arrived_tokens=1500))
    assert e.ras_tokens == pytest.approx(2000) and e.arrival_tokens_per_s == pytest.approx(100)


@pytest.mark.parametrize("kwargs", [dict(micro_batch_tokens=0), dict(ewma_alpha=0.0)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SignalsConfig(**kwargs)
