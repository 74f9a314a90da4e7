"""TIDE with changed scheduler settings, against a robustness record's stored baselines.

    python scripts/tide_variant_eval.py benchmarks/results/sim_robustness_seed1.json '{"ers_streaks": true}'

A policy change is judged on workloads it was not tuned on, but `benchmarks/sim_robustness.py`
re-runs every baseline at every share (28 simulations a workload, ~40 minutes for 50). The
baselines do not depend on TIDE's settings, so this re-runs only TIDE, twice per workload (as
the record's code would now run it, and with the given `scheduler` fields), on the record's
draws and seeds, and prints both against the stored best baseline and the variant against
TIDE as it is. A tool for policy work, not a result: it writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from sim_robustness import quantiles, workload_config  # noqa: E402

from tide_megatron.sim import run_simulation  # noqa: E402


def tide_goodput(job: tuple[dict, int, int, dict]) -> float:
    draw, steps, seed, fields = job
    base = workload_config(draw, steps, seed)
    cfg = dataclasses.replace(base, mode="tide", scheduler=dataclasses.replace(base.scheduler, **fields))
    return run_simulation(cfg).summary()["goodput"]


def summary(values: list[float]) -> str:
    q = quantiles(values)  # the benchmark's own figures
    return f"min {q['min']:.3f}  median {q['median']:.3f}  geomean {q['geomean']:.3f}"


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    record = json.loads(Path(sys.argv[1]).read_text())
    fields = json.loads(sys.argv[2]) if len(sys.argv) == 3 else {}
    steps, seed = record["config"]["steps"], record["config"]["seed"]
    workloads = record["workloads"]
    jobs = [(w["draw"], steps, seed + w["index"], f) for f in ({}, fields) for w in workloads]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        out = pool.map(tide_goodput, jobs)
    now, variant = out[:len(workloads)], out[len(workloads):]
    best = [w["goodput"][w["best_baseline"]] for w in workloads]
    print(f"{sys.argv[1]}: {len(workloads)} workloads, variant {fields}")
    for name, goodput in (("TIDE as it is", now), ("variant", variant)):
        ratios = [g / b for g, b in zip(goodput, best)]
        print(f"  {name:<14} / best baseline: {summary(ratios)}  below best by > 3%: {sum(r < 0.97 for r in ratios)}")
    change = [v / n for v, n in zip(variant, now)]
    print(f"  variant / TIDE as it is: {summary(change)}  max {max(change):.3f}")
    for w, c in zip(workloads, change):
        if abs(c - 1) > 0.03:
            print(f"    workload {w['index']}: {c:.3f}")


if __name__ == "__main__":
    main()
