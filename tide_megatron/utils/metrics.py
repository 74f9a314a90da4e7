"""Step metrics: one JSON line per step, TensorBoard scalars, and a console progress bar.

Only rank 0 creates a `MetricsLogger`; every other rank reports to it through the
controller. Numeric values go to TensorBoard under their key (`time/train_s`, ...);
everything JSON-able goes to the JSONL file.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0,
                 jsonl: bool = True, tensorboard: bool = True, progress: bool = True):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._jsonl = open(self.path, "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One training step's record; advances the progress bar."""
        self.log_at(step, metrics)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                {k: f"{metrics[k]:.3g}" for k in ("reward/mean", "goodput_tok_s", "time/step_s") if k in metrics}
            )

    def log_at(self, step: int, metrics: dict[str, Any]) -> None:
        """A record that belongs to `step` but arrives later (evaluation of that step's model)."""
        record = {"step": step, **metrics}
        if self._jsonl:
            self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
            self._jsonl.flush()
        if self._tb:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def write(self, message: str) -> None:
        """A line on the console that does not break the progress bar."""
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
