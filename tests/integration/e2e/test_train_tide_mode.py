"""`scheduler.mode=tide` end to end: rollout never stops, each step streams ready groups into
RA2P, the mode is chosen (or forced) per step and logged with RAS and TPRM, and weights move
while rollout goes on. Three ranks: actor (+ controller), a dedicated reference rank, rollout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tide_megatron.testing import read_metrics, run_job

pytestmark = pytest.mark.integration


def run_tide(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_job("scheduler.mode=tide", "cluster.ref_ranks=1", "scheduler.groups_per_step=3",
                   "scheduler.group_size=2", "run.steps=3", "run.checkpoint_interval=0", f"run.output_dir={run_dir}",
                   *overrides, nproc=3, timeout=900)


def rows(run_dir: Path, eval_rows: bool = False) -> list[dict]:
    return [r for r in read_metrics(run_dir) if ("eval/mean_reward" in r) == eval_rows]


@pytest.mark.parametrize("executor", ["auto", "decoupled"])
def test_tide_mode_streams_and_logs_the_ra2p_choice(tmp_path, executor):
    # auto: CTB on a KV pool small enough to pause tasks, with evaluation during training;
    # decoupled: request-level scheduling (the vanilla baseline).
    extra = (["scheduler.eval_every=1", "scheduler.eval_groups=1", "rollout.engine.max_total_tokens=2048"]
             if executor == "auto" else ["ctb.enabled=false"])
    proc = run_tide(tmp_path, f"ra2p.executor={executor}", *extra)
    assert proc.returncode == 0, proc.stderr[-8000:]
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["ra2p/mode"] in ("colocated", "decoupled")
        assert r["micro_batches"] >= 1 and r["consumed_tokens"] > 0 and r["groups"] == 3
        assert r["rwt_s"] >= 0.0 and r["twt_s"] >= 0.0
        assert r["staleness/max"] <= 1  # scheduler.max_staleness
        assert r["kl"] >= 0.0
        assert r["ledger/lost"] == 0
    if executor == "decoupled":
        assert {r["ra2p/mode"] for r in steps} == {"decoupled"}
        # the reference rank streamed its log-probs: a KL term exists after the first update
        assert steps[-1]["kl"] > 0.0 and steps[-1]["ra2p/num_swaps"] == 0
        assert "placement/admits" not in steps[-1]  # request-level scheduling
    else:
        # The choice is the cost model's: both costs are logged and the cheaper mode ran.
        for r in steps:
            cheaper = "decoupled" if r["ra2p/cost_decoupled"] < r["ra2p/cost_colocated"] else "colocated"
            assert r["ra2p/mode"] == cheaper
        # every model, the initial one included, was evaluated during the next step and logged under its own step
        evaluated = rows(tmp_path, eval_rows=True)
        assert [r["step"] for r in evaluated] == [0, 1, 2, 3]
        for r in evaluated:
            assert r["eval/complete"] == 1.0 and r["eval/trajectories"] == 2.0
            assert 0.0 <= r["eval/mean_reward"] <= r["eval/best_of_n_reward"] <= 1.0
        assert steps[-1]["ledger/evaluated"] > 0
        assert steps[-1]["placement/admits"] >= 3 * 2  # every trajectory was admitted by CTB
        assert steps[-1]["placement/resumes"] <= steps[-1]["placement/pauses"]
