"""Optional metric sinks beside `metrics.jsonl` and TensorBoard: Weights & Biases and MLflow.

`metrics.loggers=[jsonl,tensorboard,wandb,mlflow]` selects them; rank 0's `MetricsLogger`
(`utils/metrics.py`) fans out to each one it opened. Neither package is needed to install or run
the project: `import wandb` / `import mlflow` happen only when that sink is selected, and a
missing package is one error line at start-up that says what to install.

Every sink has the same small interface:

- `log(step, scalars)`: the step's numeric values (finite, not bool) under the names TensorBoard
  uses (`reward/mean`, `time/train_s`, ...);
- `image(step, name, path)`: an image file, rewritten over the run (the role timeline);
- `event(step, kind, text, count)`: a fault a user should see on the charts (`engine_restart`,
  `quarantine`, `rejoin`, `retry_burst`, `resume`): a metric `events/<kind>` (the count so far)
  at that step, plus the text;
- `close(failed)`: end the run (W&B exit code, MLflow status).

The resolved job config and the git commit go with the run (W&B `config`, MLflow params, tags
and a `config.json` artifact). Each sink stores its run id in `output_dir` (`wandb_run_id.txt`,
`mlflow_run_id.txt`): a resumed job (`run.resume=auto|true`) continues the same run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

SINKS = ("wandb", "mlflow")
"""The sinks this module opens (`metrics.loggers` also takes `jsonl` and `tensorboard`)."""

_PACKAGES = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow-skinny")}
WANDB_MODES = ("online", "offline", "disabled")


class MissingSinkPackage(ImportError):
    """A selected sink's package is not installed."""


@dataclass
class SinkSettings:
    """What the sinks need beyond the metrics: the `metrics.*` keys of the job config."""

    run_name: str = "tide"
    wandb_project: str = "tide-megatron"
    wandb_entity: str = ""
    wandb_mode: str = ""
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "tide-megatron"

    @classmethod
    def from_config(cls, metrics_cfg: Any, run_name: str) -> "SinkSettings":
        """From a `MetricsConfig` (its `run_name`, else the job's `run.name`)."""
        return cls(run_name=getattr(metrics_cfg, "run_name", "") or run_name,
                   wandb_project=metrics_cfg.wandb_project, wandb_entity=metrics_cfg.wandb_entity,
                   wandb_mode=metrics_cfg.wandb_mode, mlflow_tracking_uri=metrics_cfg.mlflow_tracking_uri,
                   mlflow_experiment=metrics_cfg.mlflow_experiment)


def check_available(names) -> None:
    """Raise one clear error for a selected sink whose package is missing (before start-up work)."""
    for name in names:
        if name in _PACKAGES:
            module, install = _PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise MissingSinkPackage(f"metrics.loggers has {name!r}, but the {module} package is not "
                                         f"installed: {install}")


def _import(name: str):
    module, install = _PACKAGES[name]
    try:
        return __import__(module)
    except ImportError as exc:
        raise MissingSinkPackage(f"metrics.loggers has {name!r}, but {module} does not import ({exc}): "
                                 f"{install}") from None


def open_sinks(names, output_dir: str, settings: SinkSettings, run_config: Optional[dict] = None,
               resume: bool = False) -> list["MetricSink"]:
    """The sinks of `names` that this module provides (others: jsonl, tensorboard, are skipped).
    `resume`: continue the run whose id is stored in `output_dir`, if any."""
    check_available(names)
    commit = git_commit()
    classes = {"wandb": WandbSink, "mlflow": MlflowSink}
    sinks: list[MetricSink] = []
    try:
        for name in names:
            if name in classes:
                sinks.append(classes[name](output_dir, settings, dict(run_config or {}), commit, resume))
    except BaseException:
        for sink in sinks:
            sink.close(failed=True)
        raise
    return sinks


class MetricSink:
    """The interface `MetricsLogger` fans out to."""

    name = "sink"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def image(self, step: int, name: str, path: str) -> None:
        raise NotImplementedError

    def event(self, step: int, kind: str, text: str, count: Optional[int] = None) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError

    def where(self) -> str:
        """Where the run is, for the end-of-run summary."""
        return ""


# -- helpers ------------------------------------------------------------------------------------
def git_commit(path: Optional[str] = None) -> str:
    """The commit of the checkout this package runs from (`-dirty` with uncommitted tracked
    changes); "" outside a git checkout."""
    where = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head}-dirty" if head and dirty else head


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{"run": {"name": x}}` -> `{"run.name": x}`; lists stay values."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


_MLFLOW_BAD = re.compile(r"[^/\w.\- ]")  # MLflow takes alphanumerics, _ - . space / (and : off Windows)


def mlflow_key(key: str) -> str:
    """A metric, param or tag name MLflow accepts: other characters become `_`, empty, `.` and
    `..` path segments go (MLflow rejects names that normalise to another path), at most 250
    characters. `/` stays: `reward/mean` is `reward/mean`."""
    parts = [p for p in _MLFLOW_BAD.sub("_", key).split("/") if p not in ("", ".", "..")]
    return ("/".join(parts) or "_")[:250]


def _read_id(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _write_id(path: str, run_id: str) -> None:
    with open(path, "w") as f:
        f.write(run_id + "\n")


# -- Weights & Biases ---------------------------------------------------------------------------
class WandbSink(MetricSink):
    """A W&B run. Values are logged against the metric `step` (`define_metric`), not W&B's own
    step counter, so an evaluation record that arrives after its step, and a resumed run that
    logs a step again, are kept. `metrics.wandb_mode`: empty follows `WANDB_MODE`, else offline
    (nothing leaves the machine; `wandb sync <output_dir>/wandb/offline-run-*` uploads later)."""

    name = "wandb"
    ID_FILE = "wandb_run_id.txt"

    def __init__(self, output_dir: str, settings: SinkSettings, run_config: dict, commit: str, resume: bool):
        wandb = _import("wandb")
        self._wandb = wandb
        self.mode = settings.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        id_path = os.path.join(output_dir, self.ID_FILE)
        run_id = (_read_id(id_path) if resume else "") or uuid.uuid4().hex[:16]
        self.run = wandb.init(
            project=settings.wandb_project or None, entity=settings.wandb_entity or None, name=settings.run_name,
            id=run_id, resume="allow", mode=self.mode, dir=os.environ.get("WANDB_DIR") or output_dir,
            config={**run_config, "git_commit": commit}, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True))
        _write_id(id_path, run_id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._counts: dict[str, int] = {}
        # each log of it writes the rows added since the last (an immutable table would be whole)
        self._events = wandb.Table(columns=["step", "event", "text"], log_mode="INCREMENTAL")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if scalars:
            self.run.log({**scalars, "step": step})

    def image(self, step: int, name: str, path: str) -> None:
        self.run.log({name: self._wandb.Image(path), "step": step})

    def event(self, step: int, kind: str, text: str, count: Optional[int] = None) -> None:
        self._counts[kind] = count if count is not None else self._counts.get(kind, 0) + 1
        self._events.add_data(step, kind, text)
        self.run.log({f"events/{kind}": self._counts[kind], "events/log": self._events, "step": step})

    def where(self) -> str:
        return f"{self.run.dir} ({self.mode})" if self.mode == "offline" else (self.run.url or self.run.dir)

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


# -- MLflow -------------------------------------------------------------------------------------
class MlflowSink(MetricSink):
    """An MLflow run through `MlflowClient` (no global active run). `metrics.mlflow_tracking_uri`
    empty: `file:<output_dir>/mlruns`, a local store (`mlflow ui --backend-store-uri` shows it;
    MLflow 3 keeps file stores behind `MLFLOW_ALLOW_FILE_STORE=true`, which this sets for a
    `file:` URI unless it is set already). The config goes as flattened params (first run only:
    MLflow params cannot change) and whole as the artifact `config.json`."""

    name = "mlflow"
    ID_FILE = "mlflow_run_id.txt"

    def __init__(self, output_dir: str, settings: SinkSettings, run_config: dict, commit: str, resume: bool):
        uri = settings.mlflow_tracking_uri or f"file:{os.path.abspath(os.path.join(output_dir, 'mlruns'))}"
        if uri.startswith("file:") or ("://" not in uri and not uri.startswith("databricks")):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _import("mlflow")
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = client = MlflowClient(uri)
        id_path = os.path.join(output_dir, self.ID_FILE)
        self.run_id = ""
        if resume and (old := _read_id(id_path)):
            try:
                client.get_run(old)
                self.run_id = old
                client.update_run(old, status="RUNNING")
            except MlflowException:
                logger.warning("MLflow run %s (from %s) not found at %s: a new run", old, id_path, uri)
        tags = {"git_commit": commit, "mlflow.source.git.commit": commit} if commit else {}
        if not self.run_id:
            name = settings.mlflow_experiment or "Default"
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
            self.run_id = client.create_run(exp_id, run_name=settings.run_name, tags=tags).info.run_id
            params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flatten(run_config).items()]
            for i in range(0, len(params), 100):
                client.log_batch(self.run_id, params=params[i:i + 100])
        else:
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        _write_id(id_path, self.run_id)
        if run_config:
            client.log_text(self.run_id, json.dumps({**run_config, "git_commit": commit}, indent=2, default=str),
                            "config.json")
        self._counts: dict[str, int] = {}
        self._events: list[str] = []

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def image(self, step: int, name: str, path: str) -> None:
        """The latest copy, as an artifact (`timeline.png`, overwritten each time)."""
        self.client.log_artifact(self.run_id, path)

    def event(self, step: int, kind: str, text: str, count: Optional[int] = None) -> None:
        self._counts[kind] = count if count is not None else self._counts.get(kind, 0) + 1
        self.client.log_metric(self.run_id, mlflow_key(f"events/{kind}"), self._counts[kind],
                               int(time.time() * 1000), step)
        self.client.set_tag(self.run_id, mlflow_key(f"events.last_{kind}"), f"step {step}: {text}"[:8000])
        self._events.append(f"step {step}\t{kind}\t{text}")
        self.client.log_text(self.run_id, "\n".join(self._events) + "\n", "events.txt")

    def where(self) -> str:
        return f"{self.uri} (run {self.run_id})"

    def close(self, failed: bool = False) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self.run_id = ""
