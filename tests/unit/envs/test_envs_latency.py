import math
import statistics

import pytest

from tide_megatron.envs.config import EnvConfig, LatencyConfig
from tide_megatron.envs.door_game import DoorGameEnv
from tide_megatron.envs.latency import RETRY_TEXT, LatencyEnv, LatencyModel


def test_draws_are_deterministic_under_a_seed():
    a, b = LatencyModel(LatencyConfig(seed=3)), LatencyModel(LatencyConfig(seed=3))
    c = LatencyModel(LatencyConfig(seed=4))
    draws_a = [a.step_delay_s("train/1", "t0", k) for k in range(20)]
    assert draws_a == [b.step_delay_s("train/1", "t0", k) for k in range(20)]
    assert draws_a != [c.step_delay_s("train/1", "t0", k) for k in range(20)]
    assert a.task_speed("train/9") == b.task_speed("train/9")
    assert a.reset_delay_s("train/9", "x") == b.reset_delay_s("train/9", "x")


def test_step_delays_are_heavy_tailed_lognormal():
    cfg = LatencyConfig(step_median_s=0.05, step_sigma=0.5, task_speed_sigma=0.0, slow_step_prob=0.01,
                        slow_step_factor=20.0, max_delay_s=5.0)
    model = LatencyModel(cfg)
    delays = sorted(model.step_delay_s(f"train/{i % 50}", f"t{i}", i % 7) for i in range(20000))
    median = statistics.median(delays)
    assert median == pytest.approx(0.05, rel=0.05)
    logs = [math.log(d) for d in delays[: int(0.98 * len(delays))]]
    assert statistics.pstdev(logs) == pytest.approx(0.5, rel=0.15)
    slow = sum(d > 0.05 * math.exp(3 * 0.5) for d in delays) / len(delays)  # beyond 3 sigma: stalls
    assert 0.006 < slow < 0.016
    assert delays[-1] <= 5.0 and delays[int(0.999 * len(delays))] / median > 10


def test_task_speed_makes_some_tasks_slower_throughout():
    model = LatencyModel(LatencyConfig(task_speed_sigma=0.8, slow_step_prob=0.0))
    med = {t: statistics.median(model.step_delay_s(t, f"r{i}", 0) for i in range(200)) for t in ("train/1", "train/2", "train/3", "train/4")}
    assert max(med.values()) / min(med.values()) > 1.5


def test_time_scale_and_cap():
    model = LatencyModel(LatencyConfig(time_scale=0.0))
    assert model.step_delay_s("train/1", "t", 0) == 0.0
    capped = LatencyModel(LatencyConfig(step_median_s=10.0, max_delay_s=1.0))
    assert capped.step_delay_s("train/1", "t", 0) <= 1.0


def test_extra_turns_vary_per_task_and_keep_the_game_rules():
    cfg = LatencyConfig(enabled=True, extra_turns_mean=1.5, max_extra_turns=3, extra_turns_within=2)
    model = LatencyModel(cfg)
    extras = [model.extra_turns(f"train/{i}") for i in range(200)]
    assert min(extras) == 0 and max(extras) == 3 and 1.0 < statistics.mean(extras) < 1.6
    env = LatencyEnv(DoorGameEnv(EnvConfig()), cfg)
    for i in range(30):
        first = env.reset(f"train/{i}", "t")
        assert first.latency_s > 0
        total, turns, retries = 0.0, 0, 0
        while True:
            res = env.step(env.inner.solution())
            total += res.reward
            turns += 1
            retries += bool(res.info.get("retry"))
            if res.info.get("retry"):
                assert res.observation.startswith(RETRY_TEXT) and res.reward == 0
            if res.done:
                break
        assert total == pytest.approx(1.0)
        assert retries == model.extra_turns(f"train/{i}") == first.info["injected_retry_turns"]
        assert turns == retries + res.info["rooms_solved"]


def test_injected_env_failures_are_deterministic_and_about_as_frequent_as_asked():
    from tide_megatron.envs.latency import LatencyModel

    model = LatencyModel(LatencyConfig(enabled=True, error_prob=0.1, seed=3))
    draws = [model.step_fails("t", f"tr{i}", turn) for i in range(200) for turn in range(5)]
    assert draws == [model.step_fails("t", f"tr{i}", turn) for i in range(200) for turn in range(5)]
    assert 60 <= sum(draws) <= 140  # 10% of 1000, binomial spread
    assert not any(LatencyModel(LatencyConfig(enabled=True)).step_fails("t", "tr", k) for k in range(50))
