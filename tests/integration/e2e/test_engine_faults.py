"""A rollout rank's SGLang engine dies mid-run (its scheduler is killed, as by a crash or the OOM
killer): the rank survives, its tasks are retried, a new engine takes the current weights, and the
run completes with every step whole and no token lost. Sync and tide mode."""

from __future__ import annotations


import pytest

from tide_megatron.rollout.worker import FAULT_KILL_ENGINE_ENV
from tide_megatron.testing import child_env, read_metrics, run_job

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["sync", "tide"])
def test_the_run_survives_a_dead_engine(tmp_path, mode):
    proc = run_job("metrics.tensorboard=false", "run.checkpoint_interval=0", f"scheduler.mode={mode}", "run.steps=4",
                   "scheduler.stall_timeout_s=180", f"run.output_dir={tmp_path}", timeout=900,
                   env=child_env(**{FAULT_KILL_ENGINE_ENV: "after_version:2"}))
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["groups"] == 4 for r in rows)  # every step trained whole groups
    assert rows[-1]["ledger/lost"] == 0
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "fault injection: killing SGLang scheduler" in log and "restarting its engine" in log
