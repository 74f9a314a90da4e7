"""Step metrics: one JSON line per step, TensorBoard scalars, and a console progress bar; on
request Weights & Biases and MLflow too (`metrics.loggers`, `utils/metric_sinks.py`).

Only rank 0 creates a `MetricsLogger`; every other rank reports to it through the
controller. Numeric values go to TensorBoard (and W&B, MLflow) under their key (`time/train_s`,
...); everything JSON-able goes to the JSONL file. Faults a user should see on the charts
(engine restart, quarantine, rejoin, retry burst, resume) are `event`s: one line each in
`events.jsonl` (`{"step", "event", "text", "time"}`; kept across resumes: they happened) and an
`events/<kind>` count in W&B and MLflow. `metrics.jsonl` holds step records only.

A resumed run holds each step once: the lines an earlier run wrote after the checkpoint it
resumes from are removed (`resume_step`), and TensorBoard hides their events (`purge_step`).
An evaluation line of step s (`eval/*` only) is written during step s+1, after step s's
checkpoint, and a resumed run evaluates its first model again: so evaluation lines of the
resumed step go too, and those of earlier steps stay.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from typing import Any, Optional, Sequence

from tide_megatron.utils import fault_injection
from tide_megatron.utils.atomic import write_atomic
from tide_megatron.utils.console import say

logger = logging.getLogger(__name__)


SINK_CLOSE_TIMEOUT_S = 120.0
"""How long `close` waits for W&B and MLflow to take what is queued for them."""

TIDE_COUNTERS = ("placement/admits", "placement/pauses", "placement/resumes", "ers/changes", "ers/moves")
"""Cumulative counters of a tide-mode run that its end-of-run summary reports."""

class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0,
                 jsonl: bool = True, tensorboard: bool = True, progress: bool = True,
                 resume_step: Optional[int] = None, *, loggers: Optional[Sequence[str]] = None,
                 sink_settings=None, run_config: Optional[dict[str, Any]] = None):
        """`resume_step`: this run continues an earlier one from that step (0: from scratch, as
        a restarted job with no checkpoint yet); later records of the earlier run are dropped.
        `loggers`: the sinks by name (`metrics.loggers`: jsonl, tensorboard, wandb, mlflow);
        None: jsonl and tensorboard as their flags say. A name in `loggers` whose flag
        (`jsonl`, `tensorboard`) is False stays off. `sink_settings` (a
        `metric_sinks.SinkSettings`) and `run_config` (the resolved job config, a dict) go to
        the W&B and MLflow runs."""
        os.makedirs(output_dir, exist_ok=True)
        names = list(dict.fromkeys(loggers)) if loggers is not None else ["jsonl", "tensorboard"]
        jsonl, tensorboard = jsonl and "jsonl" in names, tensorboard and "tensorboard" in names
        self._lock = threading.RLock()  # events come from the rollout thread, images from the timeline's
        self._last_step = start_step  # the last step logged; an event without a step is in the next
        self._event_counts: dict[str, int] = {}
        self.events_path = os.path.join(output_dir, "events.jsonl")
        self._summarized = False
        self.output_dir = output_dir
        self.resume_step = resume_step  # other files next to this log resume the same way (timeline)
        self.outputs: dict[str, str] = {}
        """Other files of the run the end-of-run summary names (label -> path, perhaps with a note)."""
        self._started = time.monotonic()
        self._steps: list[dict[str, float]] = []  # the few numbers the end-of-run summary needs
        self._tide: Optional[dict[str, Any]] = None  # what TIDE's mechanisms did (tide mode), for the summary
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is not None and jsonl:
            dropped = truncate_after(self.path, resume_step)
            if dropped:
                logger.info("metrics.jsonl: dropped %d records written after step %d", dropped, resume_step)
        self._jsonl = open(self.path, "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=purge)
        self._sinks: list[Any] = []
        external = [n for n in names if n not in ("jsonl", "tensorboard")]
        if external:
            from tide_megatron.utils import metric_sinks

            if resume_step is not None:  # counts go on where the earlier run's left them
                for record in _read_jsonl(self.events_path):
                    kind = str(record.get("event"))
                    self._event_counts[kind] = self._event_counts.get(kind, 0) + 1
            self._sinks = metric_sinks.open_sinks(
                external, output_dir, sink_settings or metric_sinks.SinkSettings(), run_config,
                resume=resume_step is not None)
        # W&B and MLflow are fed by one thread of their own, in order: a slow tracking server
        # never holds up a training step or the rollout thread that reports a fault
        self._sink_queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._sink_thread: Optional[threading.Thread] = None
        if self._sinks:
            self._sink_thread = threading.Thread(target=self._feed_sinks, name="metric-sinks", daemon=True)
            self._sink_thread.start()
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One training step's record; advances the progress bar."""
        self.log_at(step, metrics)
        self._steps.append({k: float(metrics[k]) for k in ("reward/mean", "goodput_tok_s", "consumed_tokens")
                            if isinstance(metrics.get(k), (int, float))})
        if metrics.get("mode") == "tide":
            self._note_tide(metrics)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                {k: f"{metrics[k]:.3g}" for k in ("reward/mean", "goodput_tok_s", "time/step_s") if k in metrics}
            )
        fault_injection.after_step_logged(step)

    def log_at(self, step: int, metrics: dict[str, Any]) -> None:
        """A record that belongs to `step` but arrives later (evaluation of that step's model)."""
        record = {"step": step, **metrics}
        with self._lock:
            self._last_step = max(self._last_step, step)
            if self._jsonl:
                self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
                self._jsonl.flush()
            values = scalars(metrics)
            if self._tb:
                for key, value in values.items():
                    self._tb.add_scalar(key, value, step)
                self._tb.flush()
            self._each_sink("log", step, values)

    def event(self, kind: str, text: str, step: Optional[int] = None) -> None:
        """A fault a user should see next to the charts (`engine_restart`, `quarantine`,
        `rejoin`, `retry_burst`, `resume`): a line in `events.jsonl` and an `events/<kind>`
        count in W&B and MLflow. `step`: default the step in progress. Any thread; never raises."""
        with self._lock:
            step = self._last_step + 1 if step is None else step
            self._event_counts[kind] = count = self._event_counts.get(kind, 0) + 1
            try:
                with open(self.events_path, "a") as f:
                    f.write(json.dumps({"step": step, "event": kind, "text": text, "time": time.time()}) + "\n")
            except OSError as exc:
                logger.warning("%s not written: %s", self.events_path, exc)
            self._each_sink("event", step, kind, text, count=count)

    def image(self, name: str, path: str, step: Optional[int] = None) -> None:
        """An image file rewritten over the run (the role timeline) to the sinks that show
        images (W&B, MLflow). `step`: default the last step logged. Any thread; never raises."""
        with self._lock:
            self._each_sink("image", self._last_step if step is None else step, name, path)

    def _each_sink(self, method: str, *args, **kwargs) -> None:
        if self._sink_thread is not None:
            self._sink_queue.put((method, args, kwargs))

    def _feed_sinks(self) -> None:
        """The sinks' thread. A sink that fails is warned about once and left out: a report
        must not end training."""
        while (item := self._sink_queue.get()) is not None:
            method, args, kwargs = item
            for sink in list(self._sinks):
                try:
                    getattr(sink, method)(*args, **kwargs)
                except Exception as exc:
                    logger.warning("metrics sink %s failed (%s: %s); the run goes on without it",
                                   sink.name, type(exc).__name__, exc)
                    self._sinks.remove(sink)
                    try:
                        sink.close(failed=True)
                    except Exception:
                        pass

    def write(self, message: str) -> None:
        """A line on the console that does not break the progress bar (and in rank 0's log)."""
        say(message)

    def mark_run_start(self) -> None:
        """The first dispatch: the run's goodput counts wall time from here (engine start-up excluded)."""
        self._started = time.monotonic()

    def _note_tide(self, metrics: dict[str, Any]) -> None:
        if self._tide is None:
            self._tide = {"modes": {}}
        modes = self._tide["modes"]
        if "ra2p/mode" in metrics:
            modes[metrics["ra2p/mode"]] = modes.get(metrics["ra2p/mode"], 0) + 1
        for key in TIDE_COUNTERS:  # cumulative counters: the latest is the run's
            if isinstance(metrics.get(key), (int, float)):
                self._tide[key] = max(float(metrics[key]), self._tide.get(key, 0.0))

    def tide_lines(self) -> list[str]:
        """What CTB, RA2P and ERS did over the run (a tide-mode run; nothing otherwise)."""
        t = self._tide
        if t is None:
            return []
        n = lambda key: int(t.get(key, 0))  # noqa: E731
        modes = ", ".join(f"{mode} {count}" for mode, count in sorted(t["modes"].items())) or "none"
        ers = (f"{n('ers/changes')} role changes, {n('ers/moves')} rank moves" if n("ers/changes")
               else "no role change")
        return [f"CTB: {n('placement/admits')} tasks admitted, {n('placement/pauses')} paused, "
                f"{n('placement/resumes')} resumed; RA2P steps by mode: {modes}; ERS: {ers}"]

    def summary(self, checkpoint_dir: str | None = None) -> list[str]:
        """The end-of-run lines: steps, wall time, goodput, reward first vs last, where outputs are."""
        wall = time.monotonic() - self._started
        lines = [f"done: {len(self._steps)} steps in {wall:.0f} s"]
        goodputs = [s["goodput_tok_s"] for s in self._steps if "goodput_tok_s" in s]
        consumed = sum(s.get("consumed_tokens", 0.0) for s in self._steps)
        if goodputs:
            lines.append(f"goodput: mean of steps {sum(goodputs) / len(goodputs):.1f} tok/s; "
                         f"whole run {consumed / wall:.1f} tok/s ({consumed:.0f} consumed tokens)")
        rewards = [s["reward/mean"] for s in self._steps if "reward/mean" in s]
        if rewards:
            lines.append(f"reward/mean: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
        lines.extend(self.tide_lines())
        if self._jsonl:
            lines.append(f"metrics: {self.path}")
        if self._tb:
            tb_dir = os.path.join(self.output_dir, "tensorboard")
            lines.append(f"tensorboard: {tb_dir}  (open: tensorboard --logdir {tb_dir})")
        for sink in self._sinks:
            lines.append(f"{sink.name}: {sink.where()}")
        lines.extend(f"{label}: {path}" for label, path in self.outputs.items())
        if checkpoint_dir:
            lines.append(f"checkpoints: {checkpoint_dir}")
        lines.append(f"logs: {os.path.join(self.output_dir, 'logs')}")
        self._summarized = True
        return lines

    def close(self, failed: Optional[bool] = None) -> None:
        """`failed`: how the W&B and MLflow runs end; default: failed unless `summary` was made
        (a run that ends by an exception closes without one)."""
        with self._lock:
            if self._jsonl:
                self._jsonl.close()
            if self._tb:
                self._tb.close()
            if self._bar is not None:
                self._bar.close()
            self._jsonl = self._tb = self._bar = None
            thread, self._sink_thread = self._sink_thread, None
        if thread is not None:
            self._sink_queue.put(None)  # what is queued goes out first
            thread.join(timeout=SINK_CLOSE_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("metrics sinks still busy after %.0f s; closing them anyway", SINK_CLOSE_TIMEOUT_S)
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close(failed=not self._summarized if failed is None else failed)
            except Exception as exc:
                logger.warning("metrics sink %s did not close cleanly: %s", sink.name, exc)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The values TensorBoard, W&B and MLflow chart: numbers, finite, not bools."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL file that parse (none when it is missing)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
    except OSError:
        pass
    return out


def is_eval_record(record: dict[str, Any]) -> bool:
    """A record of `log_at` for an evaluation: every key but `step` is under `eval/`."""
    keys = [k for k in record if k != "step"]
    return bool(keys) and all(k.startswith("eval/") for k in keys)


def truncate_after(path: str, resume_step: int) -> int:
    """Keep the records of `path` that a run resumed at `resume_step` will not write again:
    steps up to it, minus evaluation records of `resume_step` itself. Lines that do not parse
    (a write cut short by a crash) go too. Rewrites the file atomically; returns lines dropped."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if step < resume_step or (step == resume_step and not is_eval_record(record)):
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        write_atomic(path, "".join(kept).encode())
    return dropped


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
