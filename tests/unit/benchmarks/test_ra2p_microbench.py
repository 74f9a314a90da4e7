"""The RA2P micro-benchmark's readiness regimes and its verdict on RA2P's auto mode."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import ra2p_microbench  # noqa: E402


def test_a_regime_gives_ras_ready_at_once_and_the_rest_one_every_tprm():
    items = list(range(5))
    source = ra2p_microbench.arriving(items, ras=2, tprm_s=0.2)
    started = time.perf_counter()
    assert source.take_ready(10) == [0, 1]
    arrivals = []
    while (taken := source.take_ready(10)):
        arrivals.append((taken, time.perf_counter() - started))
    assert [x for taken, _ in arrivals for x in taken] == [2, 3, 4]
    # the last arrives at 3 x TPRM after the start, never before
    assert arrivals[-1][1] >= 0.6 - 0.02
    assert ra2p_microbench.arriving(items, ras=5, tprm_s=1.0) is items  # all ready: a plain list


@pytest.mark.parametrize("regime", ra2p_microbench.REGIMES)
def test_regimes_span_high_and_low_ras_and_short_and_long_arrivals(regime):
    ras, tprm = ra2p_microbench.regime_readiness(regime, 8, 1.0)
    assert (ras >= 4) == regime.startswith("high_ras")
    if regime != "high_ras_short_tprm":
        assert (tprm > 1.0) == regime.endswith("long_tprm")


def _run(step: float) -> dict:
    return {"wall_s": step}


def test_auto_is_judged_by_rank_seconds_against_every_forced_executor():
    # DM is fastest by the clock but holds two ranks: CMR is the cheaper choice.
    regime = {"auto": {"method": "CMR"},
              "methods": {"VS": _run(1.1), "VSO": _run(2.0), "CMR": _run(1.0), "DM": _run(0.7)}}
    ra2p_microbench._summarise(regime)
    assert regime["methods"]["DM"]["rank_s"] == 1.4
    assert regime["best_fixed_by_rank_s"] == "CMR" and regime["auto_no_costlier_than_best_fixed"]
    assert regime["auto_vs"]["VSO"] == {"step": 0.5, "rank_s": 0.5}
    regime = {"auto": {"method": "DM"}, "methods": {"VS": _run(1.0), "VSO": _run(2.0), "DM": _run(0.7)}}
    ra2p_microbench._summarise(regime)
    assert regime["best_fixed_by_rank_s"] == "VS" and not regime["auto_no_costlier_than_best_fixed"]
