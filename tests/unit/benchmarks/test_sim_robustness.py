"""The robustness benchmark's draws (benchmarks/sim_robustness.py): within the documented
ranges, reproducible from the seed, and each a valid simulator config that runs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import sim_robustness  # noqa: E402


def test_draws_stay_in_the_documented_ranges_and_the_seed_decides():
    rng = random.Random(11)
    draws = [sim_robustness.draw_workload(rng) for _ in range(400)]
    assert draws[:20] == [sim_robustness.draw_workload(r) for r in [random.Random(11)] for _ in range(20)]
    for d in draws:
        assert 2 <= d["turns_median"] <= 20 and 4 <= d["max_turns"] <= 60
        assert 30 <= d["gen_tokens_median"] <= 600 and 20 <= d["obs_text_tokens_median"] <= 1000
        assert 0.05 <= d["env_step_s_median"] <= 10 and 0.2 <= d["env_step_sigma"] <= 1.2
        assert (d["model"] == "Qwen3-VL-4B") == (d["image_tokens"] > 0)
        assert d["image_tokens"] == 0 or 500 <= d["image_tokens"] <= 3000
    share_mm = sum(d["model"] == "Qwen3-VL-4B" for d in draws) / len(draws)
    assert 0.18 < share_mm < 0.32  # 1 in 4 multimodal


def test_a_drawn_workload_replaces_the_setup_workload_and_simulates():
    draw = sim_robustness.draw_workload(random.Random(0))
    cfg = sim_robustness.workload_config(draw, steps=2, seed=5)
    (task,) = cfg.workload.task_types
    assert task.gen_tokens_per_turn[0] == draw["gen_tokens_median"]
    assert cfg.workload.eval_every == 0 and cfg.workload.batch_groups == draw["batch_groups"]
    assert cfg.model.name.startswith(draw["model"].split("-")[0])
    keys = [k for k, _, _ in sim_robustness.runs_of()]
    assert len(keys) == len(set(keys)) and {"sync", "tide", "tide-no-ers"} <= set(keys)
    assert sum(k.startswith("stream/") for k in keys) == len(sim_robustness.SHARES) * 3
    r = sim_robustness.simulate_workload((0, draw, 2, 5))
    assert r["goodput"]["tide"] > 0 and r["best_baseline"] in r["goodput"]
    assert r["tide_over_best_baseline"] == r["goodput"]["tide"] / max(
        r["goodput"][k] for k in r["goodput"] if not k.startswith("tide"))
