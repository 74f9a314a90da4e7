"""ctb_kv's top-level figures: geometric means over every vanilla/CTB pair, never one pair's."""

from __future__ import annotations

import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import ctb_kv  # noqa: E402


def _mode(hit, tps, step, ideal=0.8, pauses=0):
    return {"hit_rate": hit, "ideal_hit_rate": ideal, "gen_tokens_per_s": tps, "step_duration_s": step,
            "pauses": pauses}


def test_top_level_ratios_are_geomeans_over_all_pairs():
    pairs = [{"vanilla": _mode(0.2, 100, 10), "ctb": _mode(0.4, 200, 5, pauses=4)},
             {"vanilla": _mode(0.4, 100, 10), "ctb": _mode(0.4, 50, 20, pauses=2)}]
    figures, per_pair = ctb_kv.pair_figures(pairs)
    assert [pp["hit_rate_x"] for pp in per_pair] == [2.0, 1.0]
    assert [pp["order"] for pp in per_pair] == ["vanilla,ctb", "ctb,vanilla"]
    r = figures["ratios"]
    assert math.isclose(r["hit_rate_x"], math.sqrt(2.0))
    assert math.isclose(r["throughput_x"], 1.0) and math.isclose(r["step_duration_x"], 1.0)
    assert math.isclose(r["ctb_hit_vs_ideal"], 0.5)
    assert math.isclose(figures["modes"]["vanilla"]["hit_rate"], math.sqrt(0.08))
    assert figures["modes"]["ctb"]["pauses_mean"] == 3.0
    assert "2 pairs" in figures["aggregate"]
