"""`torchrun launch/train.py +recipe=tiny_cpu` end to end: train, checkpoint, resume, and the
errors a user gets for bad input. Two ranks: rank 0 trains (and controls), rank 1 rolls out."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tide_megatron.testing import checked_job, read_metrics, run_job
from tide_megatron.utils.net import free_port

pytestmark = pytest.mark.integration

FAST = ["scheduler.groups_per_step=2", "scheduler.group_size=2", "rollout.runner.max_turns=4"]

torchrun = functools.partial(run_job, recipe="tiny_cpu", timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return checked_job(tmp_path_factory.mktemp("tiny") / "run", *FAST, recipe="tiny_cpu", steps=2, timeout=600)


def test_run_writes_metrics_every_step(trained):
    rows = read_metrics(trained)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("consumed_tokens", "goodput_tok_s", "run_goodput_tok_s", "time/train_s", "time/sync_s",
                    "rwt_s", "twt_s", "prefix_cache_hit_rate", "reward/mean", "turns/mean"):
            assert key in r, key
        assert r["consumed_tokens"] > 0 and r["goodput_tok_s"] > 0
        # The ranks' own token counts agree with what was booked: nothing vanished, nothing wasted.
        assert r["ledger/lost"] == 0 and r["ledger/wasted"] == 0
        assert r["ledger/consumed"] == sum(x["consumed_tokens"] for x in rows[: r["step"]])
        # The recipe's mode, sync_split (test_every_mode runs the other modes): rank 0 trains
        # alone and waits for the whole batch every step, which is on-policy.
        assert r["mode"] == "sync_split" and r["trainer/dp_size"] == 1 and r["groups"] == 2
        assert r["twt_s"] > 0
        assert r["staleness/max"] == 0
        assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    assert rows[1]["version"] == 2
    assert any((trained / "tensorboard").iterdir())
    assert (trained / "config.json").exists()


def test_checkpoints_and_resume(trained):
    assert (trained / "checkpoints" / "latest").read_text().strip() == "step_000002"
    (trained / "STOP").touch()  # a stop file left by the earlier run does not stop this one
    checked_job(trained, "run.resume=true", *FAST, recipe="tiny_cpu", steps=3, timeout=600)
    assert [r["step"] for r in read_metrics(trained)] == [1, 2, 3]
    assert not (trained / "STOP").exists()
    assert f"removed {trained / 'STOP'}, left by an earlier run" in (trained / "logs" / "rank0.log").read_text()
    assert (trained / "checkpoints" / "latest").read_text().strip() == "step_000003"


def test_env_server_down_is_a_clear_error(tmp_path):
    port = free_port()
    proc = torchrun(f"run.output_dir={tmp_path}", "envs.external=true", f"envs.client.port={port}",
                    "envs.client.connect_timeout_s=2", timeout=300)
    assert proc.returncode != 0
    assert "EnvServerDown" in proc.stderr and f"127.0.0.1:{port}" in proc.stderr
    assert "(full log: " in proc.stderr  # one line naming the problem and where the traceback is


@pytest.mark.parametrize("override,message", [
    ("run.resume_from=/no/such/checkpoint", "run.resume_from='/no/such/checkpoint' does not exist"),
    ("model.path=/no/such/model", "model.path='/no/such/model' does not exist"),
])
def test_missing_paths_are_clear_errors(tmp_path, override, message):
    proc = torchrun(f"run.output_dir={tmp_path}", override, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_resume_without_checkpoint_names_the_path(tmp_path):
    proc = torchrun(f"run.output_dir={tmp_path}", "run.resume=true", timeout=300)
    assert proc.returncode != 0
    assert str(tmp_path / "checkpoints") in proc.stderr
