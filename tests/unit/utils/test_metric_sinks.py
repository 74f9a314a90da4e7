"""W&B and MLflow as metric sinks (`metrics.loggers`), each run read back from what it wrote.

W&B runs offline (`WANDB_MODE=offline`, everything under tmp_path, no login, no network): the
run's `.wandb` file is read back record by record (`read_wandb_records`). MLflow writes a local
file store (`file:` URI under tmp_path), read back through `MlflowClient`.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from tide_megatron.utils import metric_sinks  # noqa: E402
from tide_megatron.utils.metric_sinks import SinkSettings, git_commit, mlflow_key, open_sinks  # noqa: E402
from tide_megatron.utils.metrics import MetricsLogger  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CONFIG = {"run": {"name": "t", "steps": 3, "output_dir": "out"}, "metrics": {"loggers": ["jsonl", "wandb", "mlflow"]},
          "trainer": {"lr": 1e-5, "betas": [0.9, 0.95]}}


@pytest.fixture(autouse=True)
def local_only(tmp_path, monkeypatch):
    """No network, no login, nothing outside tmp_path; the W&B service process ends after the test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (the sink sets it for a file: URI; restored here)
    yield
    wandb.teardown()


def settings(tmp_path: Path) -> SinkSettings:
    return SinkSettings(run_name="t", wandb_project="tide-test", mlflow_tracking_uri=f"file:{tmp_path}/mlruns",
                        mlflow_experiment="tide-test")


def png(path: Path, color: str = "red") -> str:
    from PIL import Image

    Image.new("RGB", (8, 4), color).save(path)
    return str(path)


# -- reading a W&B offline run back --------------------------------------------------------------
def read_wandb_records(path: Path) -> list:
    """The protobuf `Record`s of a `.wandb` file: a 7-byte header (`:W&B`, magic 0xBEE1, version),
    then LevelDB-log framing (32 KiB blocks; each chunk a 7-byte header: CRC32C, length, type
    FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    records, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(tmp_path: Path, run_id: str) -> dict:
    """Every offline run of `run_id` under tmp_path (a resumed run writes another), in order:
    its history rows, config and summary as plain values. The W&B service writes the file on its
    own time, after `finish()` returns: `teardown()` waits for it to end (the next run starts
    another)."""
    wandb.teardown()
    files = sorted(tmp_path.glob(f"**/wandb/offline-run-*-{run_id}/run-{run_id}.wandb"), key=lambda f: f.stat().st_mtime)
    assert files, list(tmp_path.rglob("*.wandb"))
    out = {"runs": len(files), "history": [], "config": {}, "run_ids": []}
    for f in files:
        for r in read_wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                row: dict = {}
                for item in r.history.item:  # a media value comes as nested keys: timeline.path, ...
                    *parents, last = list(item.nested_key) or [item.key]
                    node = row
                    for key in parents:
                        node = node.setdefault(key, {})
                    node[last] = json.loads(item.value_json)
                out["history"].append(row)
            elif kind == "run":
                out["run_ids"].append(r.run.run_id)
                out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "config":
                out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
    return out


def values(history: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in history if key in row}


def test_wandb_offline_run_holds_metrics_config_commit_image_and_events(tmp_path, monkeypatch):
    (sink,) = open_sinks(["wandb"], str(tmp_path), settings(tmp_path), CONFIG)
    run_id = (tmp_path / "wandb_run_id.txt").read_text().strip()
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": step / 10, "time/train_s": 2.0 * step})
    sink.image(3, "timeline", png(tmp_path / "timeline.png"))
    sink.event(2, "quarantine", "rollout rank 3 quarantined: silent for 60 s")
    sink.event(3, "rejoin", "rollout rank 3 rejoined with the weights of version 2")
    sink.close()

    run = wandb_run(tmp_path, run_id)
    assert values(run["history"], "reward/mean") == {1: 0.1, 2: 0.2, 3: 0.3}
    assert values(run["history"], "time/train_s") == {1: 2.0, 2: 4.0, 3: 6.0}
    assert values(run["history"], "events/quarantine") == {2: 1}
    assert values(run["history"], "events/rejoin") == {3: 1}
    tables = [row["events/log"] for row in run["history"] if "events/log" in row]
    assert [t["_type"] for t in tables] == ["incremental-table-file"] * 2
    rows = [json.loads((f.parent / "files" / t["path"]).read_text())["data"] for t in tables
            for f in (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")]
    assert rows == [[[2, "quarantine", "rollout rank 3 quarantined: silent for 60 s"]],
                    [[3, "rejoin", "rollout rank 3 rejoined with the weights of version 2"]]]
    images = [row["timeline"] for row in run["history"] if "timeline" in row]
    assert images and images[0]["_type"] == "image-file"
    assert run["config"]["run"] == CONFIG["run"] and run["config"]["trainer"] == CONFIG["trainer"]
    assert run["config"]["git_commit"] == git_commit()

    # A resumed job continues the same run (its id is kept in the output directory). Its offline
    # files go elsewhere here: W&B names them by the second, and this one may start in the same.
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "resumed"))
    (again,) = open_sinks(["wandb"], str(tmp_path), settings(tmp_path), CONFIG, resume=True)
    again.log(4, {"reward/mean": 0.4})
    again.close()
    run = wandb_run(tmp_path, run_id)
    assert run["runs"] == 2 and set(run["run_ids"]) == {run_id}
    assert values(run["history"], "reward/mean") == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}


def test_mlflow_file_store_run_holds_metrics_params_tags_artifacts_and_events(tmp_path):
    uri = f"file:{tmp_path}/mlruns"
    (sink,) = open_sinks(["mlflow"], str(tmp_path), settings(tmp_path), CONFIG)
    run_id = (tmp_path / "mlflow_run_id.txt").read_text().strip()
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": step / 10, "eval/pass@4": 0.5})
    sink.image(3, "timeline", png(tmp_path / "timeline.png"))
    sink.event(2, "engine_restart", "rollout rank 1 restarted its engine (restart 1)")
    sink.event(3, "engine_restart", "rollout rank 2 restarted its engine (restart 1)")
    sink.close()

    client = MlflowClient(uri)
    history = {m.step: m.value for m in client.get_metric_history(run_id, "reward/mean")}
    assert history == {1: 0.1, 2: 0.2, 3: 0.3}
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval/pass_4")} == {1: 0.5, 2: 0.5, 3: 0.5}
    assert {m.step: m.value for m in client.get_metric_history(run_id, "events/engine_restart")} == {2: 1, 3: 2}
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert run.data.params["run.name"] == "t" and run.data.params["run.steps"] == "3"
    assert run.data.params["trainer.betas"] == "[0.9, 0.95]"
    assert run.data.tags.get("git_commit", "") == git_commit()
    assert run.data.tags["events.last_engine_restart"].startswith("step 3: rollout rank 2")
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.json", "timeline.png", "events.txt"}
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path / "dl"))).read_text())
    assert config["trainer"] == CONFIG["trainer"] and config["git_commit"] == git_commit()

    (again,) = open_sinks(["mlflow"], str(tmp_path), settings(tmp_path), CONFIG, resume=True)
    assert again.run_id == run_id
    again.log(4, {"reward/mean": 0.4})
    again.close(failed=True)
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3, 4]
    assert client.get_run(run_id).info.status == "FAILED"
    (fresh,) = open_sinks(["mlflow"], str(tmp_path), settings(tmp_path), CONFIG)  # run.resume=false: a new run
    assert fresh.run_id != run_id
    fresh.close()


def test_metrics_logger_sends_the_same_metric_names_to_every_sink(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=3, progress=False, loggers=["jsonl", "wandb", "mlflow"],
                           sink_settings=settings(tmp_path), run_config=CONFIG)
    record = {"reward/mean": 0.5, "time/step_s": 1.5, "groups": 4, "mode": "tide", "ok": True,
              "kl": float("nan"), "ra2p/mode": "colocated"}
    logger.log(1, record)
    logger.log_at(1, {"eval/mean_reward": 0.25})
    logger.event("quarantine", "rollout rank 2 quarantined")  # the step in progress: 2
    logger.image("timeline", png(tmp_path / "timeline.png"))
    logger.log(2, {**record, "reward/mean": 0.75})
    lines = logger.summary()
    logger.close()
    assert any(line.startswith("wandb: ") for line in lines) and any(line.startswith("mlflow: ") for line in lines)

    charted = {"reward/mean", "time/step_s", "groups", "eval/mean_reward"}  # numeric, finite, not bool
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 1, 2] and all("event" not in r for r in jsonl)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["event"], e["text"]) for e in events] == [(2, "quarantine", "rollout rank 2 quarantined")]
    assert not (tmp_path / "tensorboard").exists()  # not in loggers

    run = wandb_run(tmp_path, (tmp_path / "wandb_run_id.txt").read_text().strip())
    metric_rows = [row for row in run["history"] if not any(k.startswith(("events/", "timeline")) for k in row)]
    assert set().union(*metric_rows) - {"step"} - {k for k in set().union(*metric_rows) if k.startswith("_")} \
        == charted
    assert values(run["history"], "reward/mean") == {1: 0.5, 2: 0.75}
    assert values(run["history"], "events/quarantine") == {2: 1}

    client = MlflowClient(f"file:{tmp_path}/mlruns")
    mlrun = client.get_run((tmp_path / "mlflow_run_id.txt").read_text().strip())
    assert set(mlrun.data.metrics) - {"events/quarantine"} == charted
    assert mlrun.info.status == "FINISHED"  # closed after its summary
    assert {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "events/quarantine")} == {2: 1}

    # A resumed logger continues the runs and the event counts.
    resumed = MetricsLogger(str(tmp_path), total_steps=3, start_step=2, progress=False, resume_step=2,
                            loggers=["jsonl", "mlflow"], sink_settings=settings(tmp_path), run_config=CONFIG)
    resumed.event("resume", "resumed from step 2")
    resumed.event("quarantine", "rollout rank 2 quarantined again")
    resumed.close(failed=False)
    assert {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "events/quarantine")} == \
        {2: 1, 3: 2}


def test_a_failing_sink_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    logger = MetricsLogger(str(tmp_path), total_steps=2, progress=False, loggers=["jsonl", "mlflow"],
                           sink_settings=settings(tmp_path), run_config=CONFIG)
    (sink,) = logger._sinks

    def broken(step, scalars):
        raise OSError("disk full")

    sink.log = broken
    logger.log(1, {"reward/mean": 0.5})
    logger.log(2, {"reward/mean": 0.6})
    logger.close()
    assert "metrics sink mlflow failed (OSError: disk full)" in caplog.text
    assert logger._sinks == [] and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_mlflow_keys_keep_slashes_and_lose_what_mlflow_rejects():
    assert mlflow_key("reward/mean") == "reward/mean"
    assert mlflow_key("eval/pass@4") == "eval/pass_4"
    assert mlflow_key("a//b/./c/../d:e") == "a/b/c/d_e"
    assert mlflow_key("/") == "_" and len(mlflow_key("x" * 300)) == 250


def test_a_missing_package_is_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(metric_sinks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(metric_sinks.MissingSinkPackage, match=r"the wandb package is not installed: pip install wandb"):
        metric_sinks.check_available(["jsonl", "wandb"])
    with pytest.raises(metric_sinks.MissingSinkPackage, match=r"pip install mlflow-skinny"):
        metric_sinks.check_available(["mlflow"])


# -- the config keys -----------------------------------------------------------------------------
@pytest.fixture()
def compose_job():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    sys.path.insert(0, str(REPO / "launch"))
    import hydra_schema

    hydra_schema.register()
    GlobalHydra.instance().clear()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=hydra_schema.CONFIG_DIR, version_base="1.3"):
            return hydra_schema.to_job_config(compose(config_name="config", overrides=list(overrides)))

    yield _compose
    GlobalHydra.instance().clear()


def test_loggers_override_and_the_older_switches(compose_job):
    from tide_megatron.config import METRIC_LOGGERS, validate

    assert set(METRIC_LOGGERS) == {"jsonl", "tensorboard", *metric_sinks.SINKS}
    assert compose_job().metrics.active_loggers == ["jsonl", "tensorboard"]
    job = compose_job("metrics.loggers=[jsonl,tensorboard,wandb]", "metrics.wandb_mode=online")
    assert job.metrics.loggers == ["jsonl", "tensorboard", "wandb"] and job.metrics.wandb_mode == "online"
    validate(job, 2)
    assert compose_job("metrics.tensorboard=false").metrics.active_loggers == ["jsonl"]
    assert compose_job("metrics.loggers=[mlflow,jsonl]", "metrics.jsonl=false").metrics.active_loggers == ["mlflow"]
    assert SinkSettings.from_config(job.metrics, job.run.name).run_name == job.run.name


@pytest.mark.parametrize("override,message", [
    ("metrics.loggers=[jsonl,wandbb]", r"metrics.loggers=\['jsonl', 'wandbb'\]: unknown logger\(s\) \['wandbb'\]; "
                                       r"expected any of \('jsonl', 'tensorboard', 'wandb', 'mlflow'\)"),
    ("metrics.wandb_mode=cloud", "metrics.wandb_mode='cloud': expected one of"),
])
def test_unknown_logger_names_fail_naming_the_allowed_ones(compose_job, override, message):
    from tide_megatron.config import validate

    with pytest.raises(ValueError, match=message):
        validate(compose_job(override), 2)
