"""A real job logs to W&B (offline) and MLflow (a local file store) beside its JSONL: the same
per-step metrics reach both, with the config and the role timeline. The sinks themselves are
tested in tests/unit/utils/test_metric_sinks.py; this is the path a user takes
(`metrics.loggers=[jsonl,wandb,mlflow]` on the command line)."""

from __future__ import annotations

import pytest

from tide_megatron.testing import child_env, read_metrics, run_job

pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.integration


def test_a_tide_run_logs_every_step_to_wandb_and_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading it back here (the job's sink sets it)
    run_dir = tmp_path / "run"
    env = dict(child_env(), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb_data"))
    env.pop("WANDB_API_KEY", None)
    proc = run_job("scheduler.mode=tide", "run.steps=2", "run.checkpoint_interval=0", "metrics.tensorboard=false",
                   "metrics.loggers=[jsonl,wandb,mlflow]", f"run.output_dir={run_dir}", env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]

    uri = f"file:{run_dir}/mlruns"
    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["scheduler.mode"] == "tide"
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward/mean"])) for r in rows]
    assert "timeline.png" in {a.path for a in client.list_artifacts(run_id)}

    wandb_files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(wandb_files) == 1 and wandb_files[0].stat().st_size > 0
    assert (run_dir / "wandb_run_id.txt").read_text().strip() in wandb_files[0].name
