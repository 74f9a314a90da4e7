"""paper_scale's reading of an emulated run beside the simulator's: per-step tokens and train
time at the modelled speed, and the run goodput with the checkpoints' time left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import paper_scale  # noqa: E402


def row(tokens: int, train_s: float, checkpoint_s: float, run_goodput: float) -> dict:
    return {"consumed_tokens": tokens, "time/train_s": train_s, "time/checkpoint_s": checkpoint_s,
            "run_goodput_tok_s": run_goodput, "time/step_s": 2 * train_s + checkpoint_s, "twt_s": train_s,
            "placement/busiest_rank_share": 0.5}


def test_per_step_converts_to_the_modelled_speed_and_leaves_the_checkpoint_out():
    # 300 tokens in 30 wall seconds at dilation 2 (15 modelled s), 6 of them saving a checkpoint
    rows = [row(100, 4.0, 0.0, 10.0), row(200, 6.0, 6.0, 10.0)]
    out = paper_scale.per_step(rows, dilation=2.0)
    assert out["step_tokens"] == [100, 200] and out["step_train_s"] == [2.0, 3.0]
    assert out["step_s"] == [4.0, 9.0] and out["step_twt_s"] == [2.0, 3.0]
    assert out["step_busiest_rank_share"] == [0.5, 0.5]
    assert out["checkpoint_s"] == 3.0
    assert out["goodput_without_checkpoint_tok_s"] == pytest.approx(300 / 24 * 2)


def test_every_variant_runs_its_mode_and_split_on_both_sides():
    tide = paper_scale.variant("tide")
    assert paper_scale.real_overrides(tide) == ["scheduler.mode=tide", "ers.enabled=false"]
    assert "scheduler.ers=false" in paper_scale.sim_overrides(tide, 8)
    static = paper_scale.variant("async_static", 3)
    assert "cluster.rollout_ranks=3" in paper_scale.real_overrides(static)
    assert "scheduler.rollout_share=0.375" in paper_scale.sim_overrides(static, 8)
    assert paper_scale.rollout_splits(8) == list(range(1, 8))
