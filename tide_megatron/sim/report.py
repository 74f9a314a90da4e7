"""Files a run leaves behind: metrics JSON and the timeline (`<tag>_timeline.json`, `<tag>.png`:
the schema and plot of a real run's `timeline.json` / `timeline.png`, `utils/timeline.py`);
and the benchmarks' comparison plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tide_megatron.sim.config import SimConfig  # noqa: E402
from tide_megatron.sim.metrics import RunMetrics  # noqa: E402
from tide_megatron.utils.timeline import plot_timeline  # noqa: E402


def write_outputs(metrics: RunMetrics, cfg: SimConfig) -> None:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = metrics.mode.replace("@", "_").replace("+", "_")
    (out / f"{tag}.json").write_text(json.dumps({"config": asdict(cfg), "metrics": metrics.to_dict()}, indent=1))
    if cfg.record_timeline:
        metrics.timeline.save(str(out / f"{tag}_timeline.json"))
    if cfg.plot:
        plot_timeline(metrics.timeline, out / f"{tag}.png",
                      title=f"simulated {metrics.mode}, {cfg.n_gpus} GPUs: {len(metrics.steps)} steps")


def plot_runs_comparison(runs: Dict[str, RunMetrics], path, title: str = "") -> None:
    """Several runs on one plot: rollout ranks over time (top) and per-step duration (bottom)."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), dpi=80)
    for name, m in runs.items():
        if m.roles:
            end = m.sim_time_s
            times = [r[0] for r in m.roles] + [end]
            rollout = [r[1] for r in m.roles] + [m.roles[-1][1]]
            ax1.step(times, rollout, where="post", label=name)
        ax2.plot([s.step for s in m.steps], [s.duration for s in m.steps], label=name, lw=1)
    ax1.set_ylabel("rollout ranks")
    ax1.set_xlabel("simulated time (s)")
    ax1.legend(fontsize=7)
    ax2.set_ylabel("step time (s)")
    ax2.set_xlabel("step")
    ax2.set_yscale("log")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_goodput_bars(rows: Sequence[tuple], path, title: str) -> None:
    """Bar chart of (label, goodput) with the ideal bound as a line."""
    labels = [r[0] for r in rows if r[0] != "ideal"]
    values = [r[1] for r in rows if r[0] != "ideal"]
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=80)
    ax.bar(range(len(values)), values)
    ideal = [r[1] for r in rows if r[0] == "ideal"]
    if ideal:
        ax.axhline(ideal[0], color="k", ls="--", lw=1, label="attainable bound")
        ax.legend(fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("goodput (tokens/s)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
