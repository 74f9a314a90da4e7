"""A real job logs to W&B (offline) and MLflow (a local file store) beside its JSONL: the same
per-step metrics reach both, with the config and the role timeline. The sinks themselves are
tested in tests/unit/utils/test_metric_sinks.py; this is the path a user takes
(`metrics.loggers=[jsonl,wandb,mlflow]` on the command line), checked on test_every_mode's tide
run rather than on a job of its own (each job is half a minute of start-up)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from tide_megatron.testing import child_env

OVERRIDES = ("metrics.loggers=[jsonl,wandb,mlflow]",)


def job_env(tmp_path: Path) -> dict[str, str]:
    """The job's environment: W&B offline, writing under `tmp_path`, with no account."""
    env = dict(child_env(), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb_data"))
    env.pop("WANDB_API_KEY", None)
    return env


def check_logged(tmp_path: Path, run_dir: Path, rows: list[dict], mode: str) -> None:
    """Every step's JSONL row reached MLflow, with the config and the timeline; one W&B run."""
    from mlflow.tracking import MlflowClient

    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    with mock.patch.dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true"):  # reading it back (the job's sink sets it)
        client = MlflowClient(tracking_uri=f"file:{run_dir}/mlruns")
        run = client.get_run(run_id)
        history = client.get_metric_history(run_id, "reward/mean")
        artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert run.info.status == "FINISHED"
    assert run.data.params["scheduler.mode"] == mode
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward/mean"])) for r in rows]
    assert "timeline.png" in artifacts

    wandb_files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(wandb_files) == 1 and wandb_files[0].stat().st_size > 0
    assert (run_dir / "wandb_run_id.txt").read_text().strip() in wandb_files[0].name
