"""The paper's text workload on 8 ranks with emulated devices (`recipes/recipe/text_emulated.yaml`):
the real rank code (controller, CTB, RA2P, ERS, weight sync, env server) with engine stand-ins
and modelled trainer time. One job for the module."""

from __future__ import annotations

import pytest

from tide_megatron.testing import read_metrics, run_job

pytestmark = pytest.mark.integration

DILATION = 0.2
STEPS = 3


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("emulated")
    proc = run_job("metrics.tensorboard=false", f"run.output_dir={run_dir}", f"run.steps={STEPS}",
                   "scheduler.groups_per_step=8", "scheduler.group_size=4", f"cluster.emulation.dilation={DILATION}",
                   recipe="text_emulated", nproc=8, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return read_metrics(run_dir)


def test_an_eight_rank_tide_run_with_ers_keeps_its_ledger(rows):
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    buckets = ("in_flight", "ready", "consumed", "dropped_stale", "cancelled", "failed", "lost", "evaluated")
    for r in rows:
        assert r["groups"] == 8 and r["staleness/max"] <= 1 and r["ledger/lost"] == 0
        assert r["ledger/generated"] == sum(r[f"ledger/{b}"] for b in buckets)
    assert all(r["ers/trainer_ranks"] >= 1 for r in rows[:-1])  # ERS planned after every step but the last
    assert rows[-1]["ledger/wasted"] <= 0.02 * rows[-1]["ledger/generated"]


def test_trainer_passes_take_the_cost_models_time_for_whole_trajectories(rows):
    """RA2P counts the trajectories' full tokens (not the small model's trimmed tails), and each
    step trains at least as long as the cost model's forward+backward of them on its DP ranks
    (attention left out: a lower bound), dilated."""
    from tide_megatron.sim.loader import load_hardware_model

    cost = load_hardware_model("h100_sxm", "qwen2_5_7b")
    for r in rows:
        trajectories = r["groups"] * 4
        assert r["ra2p/tokens"] > 16 * trajectories  # a trimmed tail is 8 tokens; every prompt has >= 16
        floor = cost.train_s(r["ra2p/tokens"] / r["trainer/dp_size"], 0, True, 1) * DILATION
        assert r["time/train_s"] >= floor, (r["step"], r["time/train_s"], floor)
