"""TIDE against every baseline at its own best, on random workloads none of the code was tuned on.

    python benchmarks/sim_robustness.py                          # 50 workloads, seed 0, 30 steps
    python benchmarks/sim_robustness.py --workloads 8 --seed 7   # another draw, quicker

Each workload is drawn from the distribution below (`draw_workload`), then simulated at 32 H100
under: VeRL-like sync; async_static (AReaL-like), stream (StreamRL-like, with each of its
executors VSO, VS and RA2P's colocated rounds) and elastic (verl-like dynamic scaling), each
over the rollout shares `SHARES`, kept at its best; TIDE as shipped (RA2P, ERS, CTB from its
fixed starting split); and TIDE without ERS, to see what ERS adds. Writes
benchmarks/results/sim_robustness.json (command, commit, machine, date, the distribution, every
workload's draw and runs) and prints the distribution of TIDE / best baseline.

The distribution (one task type per workload; log-normal [median, sigma] per trajectory, as
the repository's workload files are, with the median itself drawn log-uniformly in a range):
- kind: text (3 in 4; Qwen2.5-7B or -14B, even odds) or multimodal (1 in 4; Qwen3-VL-4B, each
  observation carries a screenshot of 500-3,000 image tokens);
- turns: median 2-20 (sigma 0.5), at most 3x the median (at least 4, at most 60);
- tokens per turn generated: median 30-600 (sigma 0.5); observed (text): 20-1,000 (sigma 0.6);
- prompt: 300-3,000 tokens (sigma 0.2);
- env step latency: median 0.05-10 s, tail sigma 0.2-1.2 (short tool calls to slow VMs); env
  reset 0.5-30 s (sigma 0.3);
- 32 or 64 groups of 8 per step (B_min half of it), 256 to 1,024 env slots, staleness bound 1,
  no evaluation phases (they are the same for every mode and only add noise).
The ranges span the paper's workloads and the ones the issue tried (coding-agent-like long
turns, short tool calls); nothing in them was chosen from a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import random
import statistics
import time

import bench_record

from tide_megatron.sim import run_simulation
from tide_megatron.sim.config import SimConfig, TaskTypeConfig
from tide_megatron.sim.loader import load_config

SHARES = (0.25, 0.375, 0.5, 0.625, 0.75)
SWEPT = ("async_static", "stream", "elastic")
STREAM_EXECUTORS = ("vso", "vs", "colocated")
SETUPS = {"Qwen2.5-7B": "text_32gpu", "Qwen2.5-14B": "text14b_32gpu", "Qwen3-VL-4B": "mm_32gpu"}
GOALS = {"min_tide_over_best_baseline": (">=", 0.97), "median_tide_over_best_baseline": (">=", 1.2),
         "min_ers_over_no_ers": (">=", 0.98)}
"""Issue 36: never below the best baseline by more than 3%, median at least 1.2x; ERS never below
TIDE without it by more than noise (2%, the spread of one configuration across seeds here)."""


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_workload(rng: random.Random) -> dict:
    """One workload's parameters (see the module docstring for the distribution)."""
    multimodal = rng.random() < 0.25
    model = "Qwen3-VL-4B" if multimodal else rng.choice(["Qwen2.5-7B", "Qwen2.5-14B"])
    turns = log_uniform(rng, 2, 20)
    image_tokens = round(log_uniform(rng, 500, 3000)) if multimodal else 0
    return {
        "model": model,
        "turns_median": round(turns, 2),
        "max_turns": int(min(60, max(4, round(3 * turns)))),
        "gen_tokens_median": round(log_uniform(rng, 30, 600)),
        "obs_text_tokens_median": round(log_uniform(rng, 20, 1000)),
        "image_tokens": image_tokens,
        "prompt_tokens_median": round(log_uniform(rng, 300, 3000)) + image_tokens,
        "env_step_s_median": round(log_uniform(rng, 0.05, 10), 3),
        "env_step_sigma": round(rng.uniform(0.2, 1.2), 2),
        "env_reset_s_median": round(log_uniform(rng, 0.5, 30), 2),
        "batch_groups": rng.choice([32, 64]),
        "env_concurrency": rng.choice([256, 512, 1024]),
    }


def workload_config(draw: dict, steps: int, seed: int) -> SimConfig:
    """The setup of the drawn model with the drawn workload in place of its own."""
    cfg = load_config(SETUPS[draw["model"]], [f"steps={steps}", f"seed={seed}", "plot=false",
                                             "record_timeline=false"])
    task = TaskTypeConfig(
        name="drawn", weight=1.0,
        prompt_tokens=[float(draw["prompt_tokens_median"]), 0.2],
        base_turns=[draw["turns_median"], 0.5], max_turns=draw["max_turns"], wrong_action_prob=0.15,
        gen_tokens_per_turn=[float(draw["gen_tokens_median"]), 0.5],
        obs_tokens_per_turn=[float(draw["obs_text_tokens_median"] + draw["image_tokens"]),
                             0.05 if draw["image_tokens"] else 0.6],
        env_step_s=[draw["env_step_s_median"], draw["env_step_sigma"]],
        env_reset_s=[draw["env_reset_s_median"], 0.3],
        max_context_tokens=65536 if draw["image_tokens"] else 32768)
    workload = dataclasses.replace(
        cfg.workload, name="drawn", task_types=[task], group_size=8, batch_groups=draw["batch_groups"],
        min_batch_groups=draw["batch_groups"] // 2, eval_every=0, env_concurrency=draw["env_concurrency"],
        staleness_bound=1)
    return dataclasses.replace(cfg, workload=workload)


def runs_of() -> list[tuple[str, str, dict]]:
    """(key, mode, scheduler fields) of every run a workload gets."""
    out = [("sync", "sync", {})]
    for mode in SWEPT:
        for executor in (STREAM_EXECUTORS if mode == "stream" else (None,)):
            for share in SHARES:
                fields = {"rollout_share": share, **({"stream_executor": executor} if executor else {})}
                out.append((f"{mode}/{executor}@{share}" if executor else f"{mode}@{share}", mode, fields))
    out.append(("tide", "tide", {}))
    out.append(("tide-no-ers", "tide", {"ers": False}))
    return out


def simulate_workload(job: tuple[int, dict, int, int]) -> dict:
    index, draw, steps, seed = job
    base = workload_config(draw, steps, seed)
    t0 = time.perf_counter()
    goodput, steps_s = {}, {}
    for key, mode, fields in runs_of():
        cfg = dataclasses.replace(base, mode=mode, scheduler=dataclasses.replace(base.scheduler, **fields))
        s = run_simulation(cfg).summary()
        goodput[key], steps_s[key] = s["goodput"], s["mean_step_s"]
    best = {m: max((k for k in goodput if k.startswith(m)), key=goodput.get) for m in ("sync", *SWEPT)}
    best_baseline = max(best.values(), key=goodput.get)
    return {"index": index, "draw": draw, "goodput": goodput, "mean_step_s": steps_s, "best_setting": best,
            "best_baseline": best_baseline,
            "tide_over_best_baseline": goodput["tide"] / goodput[best_baseline],
            "ers_over_no_ers": goodput["tide"] / goodput["tide-no-ers"],
            "wall_s": time.perf_counter() - t0}


def quantiles(values: list[float]) -> dict:
    v = sorted(values)
    q = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else v * 9
    return {"min": v[0], "p10": q[0], "median": statistics.median(v), "p90": q[-1], "max": v[-1],
            "geomean": math.exp(statistics.fmean(math.log(x) for x in v))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="draws the workloads (and seeds each simulation)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per simulation")
    ap.add_argument("--workers", type=int, default=2, help="simulations in parallel (processes)")
    ap.add_argument("--out", default="sim_robustness", help="result name under benchmarks/results/ (or a .json path)")
    args = ap.parse_args()
    if args.workloads < 1 or args.steps < 1 or args.workers < 1:
        ap.error("--workloads, --steps and --workers must be >= 1")
    rng = random.Random(args.seed)
    jobs = [(i, draw_workload(rng), args.steps, args.seed + i) for i in range(args.workloads)]
    n_runs = len(runs_of())
    print(f"{args.workloads} workloads x {n_runs} simulations of {args.steps} steps, {args.workers} workers", flush=True)
    t0 = time.perf_counter()
    results = []
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for r in pool.imap_unordered(simulate_workload, jobs):
            results.append(r)
            d = r["draw"]
            print(f"  [{len(results):>3}/{args.workloads}] #{r['index']:<3} {d['model']:<12} turns {d['turns_median']:5.1f} "
                  f"gen {d['gen_tokens_median']:>4} env {d['env_step_s_median']:6.2f}s  best {r['best_baseline']:<22} "
                  f"TIDE/best {r['tide_over_best_baseline']:.3f}  ERS {r['ers_over_no_ers']:.3f}  ({r['wall_s']:.0f}s)",
                  flush=True)
    results.sort(key=lambda r: r["index"])
    ratio = quantiles([r["tide_over_best_baseline"] for r in results])
    ers = quantiles([r["ers_over_no_ers"] for r in results])
    figures = {
        "tide_over_best_baseline": ratio, "ers_over_no_ers": ers,
        "workloads_below_best_by_more_than_3pct": sum(r["tide_over_best_baseline"] < 0.97 for r in results),
        "workloads_where_ers_costs_more_than_2pct": sum(r["ers_over_no_ers"] < 0.98 for r in results),
        "best_baseline_counts": {m: sum(r["best_baseline"].startswith(m) for r in results) for m in ("sync", *SWEPT)},
    }
    values = {"min_tide_over_best_baseline": ratio["min"], "median_tide_over_best_baseline": ratio["median"],
              "min_ers_over_no_ers": ers["min"]}
    ops = {">=": lambda a, b: a >= b}
    figures["goals"] = {k: {"goal": f"{op} {v}", "value": values[k], "met": ops[op](values[k], v)}
                        for k, (op, v) in GOALS.items()}
    record = {**bench_record.header("sim_robustness", config=vars(args)), "wall_s": time.perf_counter() - t0,
              "distribution": "The distribution" + __doc__.split("The distribution")[1].split("The ranges")[0].rstrip(),
              "shares": SHARES, "stream_executors": STREAM_EXECUTORS, "figures": figures, "workloads": results}
    path = bench_record.write(args.out, record)
    print(f"\n{'':<26}{'min':>7}{'p10':>7}{'median':>8}{'p90':>7}{'max':>7}")
    for name, q in (("TIDE / best baseline", ratio), ("TIDE / TIDE without ERS", ers)):
        print(f"{name:<26}{q['min']:>7.3f}{q['p10']:>7.3f}{q['median']:>8.3f}{q['p90']:>7.3f}{q['max']:>7.3f}")
    print("best baseline:", figures["best_baseline_counts"])
    for k, g in figures["goals"].items():
        print(f"{k:<34}{g['value']:>8.3f}  goal {g['goal']:<8} {'met' if g['met'] else 'MISSED'}")
    print("wrote", path)


if __name__ == "__main__":
    main()
