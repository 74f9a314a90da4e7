"""The start-up check of CTB's resources: contradicting caps fail at start, naming the keys."""

import pytest

from tide_megatron.config import JobConfig, SchedulerConfig, validate
from tide_megatron.core.ctb import CTBConfig
from tide_megatron.rollout.ctb_config import CTBDispatchConfig, check_ctb_resources, resident_cap_for_rows


def _check(ctb=None, rows=32, kv=16384):
    check_ctb_resources(ctb or CTBDispatchConfig(), max_running_requests=rows, max_total_tokens=kv)


def test_the_resident_cap_follows_the_engines_rows_by_default():
    assert CTBDispatchConfig().rank_limits(16384, 32) == (int(16384 * 0.85), 31)
    assert resident_cap_for_rows(32) == 31
    _check(CTBDispatchConfig(max_resident_tasks_per_rank=31))


@pytest.mark.parametrize("cap", [32, 48])
def test_a_resident_cap_that_leaves_no_row_free_names_both_keys(cap):
    with pytest.raises(ValueError) as err:
        _check(CTBDispatchConfig(max_resident_tasks_per_rank=cap))
    message = str(err.value)
    assert "ctb.max_resident_tasks_per_rank" in message and "rollout.engine.max_running_requests=32" in message
    assert "\n" not in message


def test_ctb_needs_the_engines_row_count():
    with pytest.raises(ValueError, match="rollout.engine.max_running_requests"):
        _check(rows=None)
    with pytest.raises(ValueError, match="at most 0"):
        _check(rows=1)  # one row: no task could be resident with a row to spare


def test_pausing_headroom_must_fit_the_kv_pool():
    with pytest.raises(ValueError, match="ctb.kv_budget_fraction=0.95 x ctb.policy.hard_water=1.15"):
        _check(CTBDispatchConfig(kv_budget_fraction=0.95))
    _check(CTBDispatchConfig(kv_budget_fraction=0.95, policy=CTBConfig(hard_water=1.05)))


def test_a_probe_that_no_rank_budget_can_hold_fails_at_start():
    big = CTBDispatchConfig(prompt_tokens_estimate=4000, policy=CTBConfig(probe_turn_reserve_tokens=2000))
    with pytest.raises(ValueError, match="ctb.prompt_tokens_estimate \\+ ctb.policy.probe_turn_reserve_tokens = 6000"):
        _check(big, kv=4096)
    with pytest.raises(ValueError, match="ctb.policy.rank_token_budget"):
        _check(CTBDispatchConfig(policy=CTBConfig(rank_token_budget=1000, probe_turn_reserve_tokens=2000)), kv=None)
    _check(big, kv=16384)


def test_the_jobs_validate_runs_the_check_in_tide_mode_only():
    job = JobConfig(scheduler=SchedulerConfig(mode="tide"), ctb=CTBDispatchConfig(max_resident_tasks_per_rank=48))
    job.rollout.engine.max_running_requests = 32
    job.trainer.kl_coef = 0.01
    with pytest.raises(ValueError, match="ctb.max_resident_tasks_per_rank=48 with rollout.engine.max_running_requests=32"):
        validate(job, 3)
    job.scheduler.mode = "sync"
    validate(job, 3)
    job.scheduler.mode = "tide"
    job.ctb.max_resident_tasks_per_rank = None  # the default: rows - 1
    validate(job, 3)
