"""End-to-end goodput of every scheduling mode on the real stack (real SGLang, real Megatron-core).

The same recipe, model, task stream, seeds, rank count and number of consumed groups for every
mode, with a long-tailed env latency on (rare slow steps, slow tasks, injected retry turns;
`--env-latency off` leaves the env instant, so compute alone bounds the run):

- sync (VeRL-like: every rank rolls out, then every rank trains; one configuration), and
  sync_split (the same turns on a fixed split), async_static (AReaL-like) and stream
  (StreamRL-like) at every split of the ranks the real system allows, and tide (CTB + RA2P);
- stream with each of its executors (`--stream-executors`, VSO, VS and CM by default): a user
  tunes the baseline, so its best executor in each repetition is what tide is compared with;
- `--reps` repetitions, in alternating order (forward, then reversed), so a drift of the shared
  machine's load does not favour one mode; repetition r runs every mode with seed `--seed + r`
  (a different task stream and different long-tail draws per repetition, the same for every
  mode within it); ratios are taken within each repetition.

Per run: run goodput (consumed generated tokens / wall time from the first dispatch to the end,
the final checkpoint included), mean step goodput, RWT + TWT, wasted-token share (dropped as
stale, cancelled, failed or lost over generated), prefix-cache hit rate, reward by step, and
the share of the host's core time that was busy while it trained (`cpu_busy.py`: every rank
shares these cores, so a split can only gain where cores sit idle).
Prints a table and writes benchmarks/results/e2e_goodput_cpu.json (command, machine, date,
figures).

    python benchmarks/e2e_goodput.py                 # 2 ranks, 10 steps, 3 repetitions
    python benchmarks/e2e_goodput.py --ranks 3 --steps 6 --reps 2
    python benchmarks/e2e_goodput.py --ranks 4 --modes tide --ers   # ERS on and off at every split
    python benchmarks/e2e_goodput.py --ranks 4 --modes tide --ers --env-latency off   # compute-bound
    python benchmarks/e2e_goodput.py --ranks 4 --modes tide --ers --splits r1f1 --reps 4   # one split, more reps
    python benchmarks/e2e_goodput.py --recipe tiny_vl_cpu   # the multimodal workload (Qwen3-VL, gui_desktop)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_record
from cpu_busy import CpuBusySampler

REPO = Path(__file__).resolve().parent.parent

# A long tail: per-task speed spread, rare 20x stalls, injected retry turns. Env waits dominate
# a turn's time, as with remote web/desktop environments.
LATENCY = ["envs.server.envs.0.latency.enabled=true", "envs.server.envs.0.latency.step_median_s=0.2",
           "envs.server.envs.0.latency.step_sigma=0.6", "envs.server.envs.0.latency.task_speed_sigma=0.6",
           "envs.server.envs.0.latency.slow_step_prob=0.02", "envs.server.envs.0.latency.slow_step_factor=20",
           "envs.server.envs.0.latency.extra_turns_mean=0.5", "envs.server.envs.0.latency.reset_median_s=0.1"]


def splits(mode: str, ranks: int) -> list[dict[str, int]]:
    """(rollout ranks, reference ranks) the real system runs for `mode` on `ranks` ranks (sync
    time-shares every rank: its start-up split does not matter)."""
    if mode == "sync":
        return [{"rollout": 1, "ref": 0, "actors": ranks - 1}]
    out = []
    for rollout in range(1, ranks):
        for ref in ((0, 1) if mode == "tide" else (0,)):
            actors = ranks - rollout - ref
            if actors < 1:
                continue
            out.append({"rollout": rollout, "ref": ref, "actors": actors})
    return out


def split_name(split: dict[str, int]) -> str:
    return f"r{split['rollout']}f{split['ref']}"


def configs(modes: list[str], ranks: int, ers: bool, only: frozenset[str] = frozenset(),
            stream_executors: tuple[str, ...] = ("vso",)) -> list[dict]:
    """Every mode at every split (those named in `only`, when given); stream with each of
    `stream_executors`; with `ers`, tide also with ERS on, starting from every split (ERS moves
    ranks between rollout and the trainer and re-plans the trainer's layout)."""
    out = []
    for mode in modes:
        for split in splits(mode, ranks):
            if only and split_name(split) not in only and mode != "sync":
                continue
            label = mode if len(splits(mode, ranks)) == 1 else f"{mode}[{split_name(split)}]"
            if mode == "stream":
                for executor in stream_executors:
                    out.append({"label": label.replace("stream", f"stream/{executor}", 1), "mode": mode, "ers": False,
                                "executor": executor, **split})
                continue
            out.append({"label": label, "mode": mode, "ers": False, **split})
            if ers and mode == "tide":
                out.append({"label": label.replace("tide", "tide+ers", 1), "mode": mode, "ers": True, **split})
    return out


def run_one(cfg: dict, args, out_dir: Path, seed: int) -> dict:
    overrides = [f"+recipe={args.recipe}", f"scheduler.mode={cfg['mode']}", f"cluster.rollout_ranks={cfg['rollout']}",
                 f"cluster.ref_ranks={cfg['ref']}", f"run.steps={args.steps}", "run.checkpoint_interval=0",
                 "metrics.progress=false", "metrics.tensorboard=false", f"run.output_dir={out_dir}",
                 f"scheduler.groups_per_step={args.groups_per_step}", f"run.seed={seed}",
                 f"envs.server.envs.0.latency.seed={seed}", *LATENCY,
                 *(["ers.enabled=true"] if cfg["ers"] else []),
                 *([f"ra2p.executor={cfg['executor']}"] if cfg.get("executor") else []), *args.overrides]
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", str(args.ranks),
           str(REPO / "launch" / "train.py"), *overrides]
    started = time.time()
    with CpuBusySampler() as cpu:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.time() - started
    if proc.returncode != 0:
        return {"label": cfg["label"], "failed": True, "wall_s": wall, "error": proc.stderr[-1500:]}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
            if "eval/mean_reward" not in line]
    last = rows[-1]
    cached = sum(r["prefix_cache/cached_tokens"] for r in rows)
    prompt = sum(r["prefix_cache/prompt_tokens"] for r in rows)
    return {
        "label": cfg["label"], "mode": cfg["mode"], "ers": cfg["ers"], "executor": cfg.get("executor"),
        "split": {k: cfg[k] for k in ("actors", "ref", "rollout")},
        "failed": False,
        "steps": len(rows),
        "consumed_tokens": sum(r["consumed_tokens"] for r in rows),
        "run_goodput_tok_s": last["run_goodput_tok_s"],
        "mean_step_goodput_tok_s": statistics.fmean(r["goodput_tok_s"] for r in rows),
        "rwt_plus_twt_s": sum(r["rwt_s"] + r["twt_s"] for r in rows),
        "rwt_s": sum(r["rwt_s"] for r in rows),
        "twt_s": sum(r["twt_s"] for r in rows),
        "wasted_share": last["ledger/wasted"] / last["ledger/generated"] if last["ledger/generated"] else 0.0,
        "wasted_tokens": last["ledger/wasted"],
        "generated_tokens": last["ledger/generated"],
        "lost_tokens": last["ledger/lost"],
        "running_at_exit_tokens": last["ledger/running_on_ranks"],
        "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
        "staleness_max": max(r["staleness/max"] for r in rows),
        "reward_by_step": [round(r["reward/mean"], 4) for r in rows],
        "ra2p_modes": [r["ra2p/mode"] for r in rows],
        "dp_size_by_step": [r["trainer/dp_size"] for r in rows],
        "role_changes": int(max((r.get("ers/changes", 0) for r in rows), default=0)),
        "rank_moves": int(max((r.get("ers/moves", 0) for r in rows), default=0)),
        "trainer_ranks_by_step": [int(r["ers/trainer_ranks"]) for r in rows if "ers/trainer_ranks" in r],
        # why ERS planned what it did after each step (held splits too): the run's metrics go
        # with its temporary folder
        "ers_reason_by_step": [r["ers/reason"] for r in rows if "ers/reason" in r],
        "tasks_moved": int(last.get("rollout/tasks_moved", 0)),
        "tasks_carried": int(last.get("rollout/tasks_carried", 0)),
        "carried_tokens": int(last.get("rollout/carried_tokens", 0)),
        "role_change_s": sum(r.get("ers/role_change_s", 0.0) for r in rows),
        "role_change_drain_s": sum(r.get("ers/role_change_drain_s", 0.0) for r in rows),
        "process_wall_s": round(wall, 1),
        # the share of the host's core time that was busy while the job trained (first dispatch
        # to the last step's end), and over the whole process (start-up and exit included)
        "cpu_busy_share": cpu.busy_share(*training_window(out_dir)),
        "cpu_busy_share_process": cpu.busy_share(),
    }


def training_window(run_dir: Path) -> tuple[float, float]:
    """Unix times of the run's first dispatch and its last step's end, from timeline.json
    (the whole run when a mode writes none)."""
    path = run_dir / "timeline.json"
    if not path.is_file():
        return float("-inf"), float("inf")
    timeline = json.loads(path.read_text())
    origin = timeline["origin_unix"]
    return origin, origin + timeline["steps"][-1]["end"]


def alternate(variants: list[tuple[str, list[str]]], cfg: dict, args, tmp: Path, describe) -> list[dict]:
    """Every variant (label, its Hydra overrides on top of `args.overrides`) once per repetition,
    in alternating order (reversed every other repetition); seed `args.seed + rep` for all the
    runs of a repetition. `describe(result)` is printed after each run."""
    base, runs = list(args.overrides), []
    for rep in range(args.reps):
        for label, overrides in (variants if rep % 2 == 0 else list(reversed(variants))):
            args.overrides = [*base, *overrides]
            name = "".join(c if c.isalnum() else "_" for c in label)
            result = run_one({**cfg, "label": label}, args, tmp / f"rep{rep}_{name}", args.seed + rep)
            result["rep"] = rep
            runs.append(result)
            print(f"rep {rep} {label:<20} " + ("FAILED" if result["failed"] else describe(result)), flush=True)
    args.overrides = base
    return runs


def summarize(runs: list[dict], labels: list[str], keys) -> dict[str, dict[str, float]]:
    """Per variant that ran, the mean of each of `keys` over its runs."""
    ok = [r for r in runs if not r["failed"]]
    return {label: {k: statistics.fmean(r[k] for r in ok if r["label"] == label) for k in keys}
            for label in labels if any(r["label"] == label for r in ok)}


def paired_ratios(runs: list[dict], a: str, b: str, key: str = "run_goodput_tok_s") -> list[float]:
    """`key` of variant `a` over that of `b`, per repetition where both ran."""
    ok = {(r["rep"], r["label"]): r for r in runs if not r["failed"]}
    reps = sorted({rep for rep, _ in ok})
    return [ok[rep, a][key] / ok[rep, b][key] for rep in reps if (rep, a) in ok and (rep, b) in ok]


def ratio_record(xs: list[float], **extra) -> dict:
    """Per-repetition ratios and their geometric mean, as the records keep them."""
    return {"per_rep": [round(x, 3) for x in xs], "geomean": round(geomean(xs), 3) if xs else None, **extra}


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="sync,sync_split,async_static,stream,tide")
    parser.add_argument("--stream-executors", default="vso,vs,colocated",
                        help="the executors stream runs with (its best per repetition is the baseline)")
    parser.add_argument("--ers", action="store_true", help="also run tide with ers.enabled=true")
    parser.add_argument("--splits", default="",
                        help="comma-separated splits to run, as labelled (r1f1: 1 rollout rank, 1 reference "
                             "rank); default: every split; the ERS ratios then compare with the best of these")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--env-latency", choices=("longtail", "off"), default="longtail",
                        help="off: the env answers at once, so rollout and training compute bound the run")
    parser.add_argument("--recipe", default="tiny_cpu",
                        help="tiny_cpu (door game), or tiny_vl_cpu (the multimodal workload: Qwen3-VL, gui_desktop)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/e2e_goodput_cpu.json "
                                                    "(e2e_goodput_vl_cpu.json with --recipe tiny_vl_cpu)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    if args.env_latency == "off":  # after LATENCY, so it wins (run_one is shared with other benchmarks)
        args.overrides.append("envs.server.envs.0.latency.enabled=false")
    if args.out is None:
        name = "e2e_goodput_cpu.json" if args.recipe == "tiny_cpu" else f"e2e_goodput_{args.recipe.removeprefix('tiny_')}.json"
        args.out = str(REPO / "benchmarks" / "results" / name)

    only = frozenset(filter(None, args.splits.split(",")))
    known = {split_name(s) for mode in args.modes.split(",") for s in splits(mode, args.ranks)}
    if only - known:
        parser.error(f"--splits {','.join(sorted(only - known))}: not a split of {args.ranks} ranks "
                     f"(those are {','.join(sorted(known))})")
    cfgs = configs(args.modes.split(","), args.ranks, args.ers, only, tuple(args.stream_executors.split(",")))
    runs: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="e2e_goodput_"))
    try:
        for rep in range(args.reps):
            order = cfgs if rep % 2 == 0 else list(reversed(cfgs))
            for cfg in order:
                run_dir = tmp / f"rep{rep}_{cfg['label'].replace('[', '_').replace(']', '')}"  # Hydra-safe
                result = run_one(cfg, args, run_dir, args.seed + rep)
                result["rep"], result["seed"] = rep, args.seed + rep
                if cfg["ers"] and (run_dir / "timeline.png").is_file():
                    result["timeline_png"] = (run_dir / "timeline.png").read_bytes()
                runs.append(result)
                status = "FAILED" if result["failed"] else f"{result['run_goodput_tok_s']:.1f} tok/s"
                print(f"rep {rep} {cfg['label']:<22} {status}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ok = [r for r in runs if not r["failed"]]
    timelines = {id(r): r.pop("timeline_png") for r in runs if "timeline_png" in r}
    labels = [c["label"] for c in cfgs]
    summary = {}
    for label in labels:
        mine = [r for r in ok if r["label"] == label]
        if not mine:
            summary[label] = {"failed_runs": len([r for r in runs if r["label"] == label])}
            continue
        summary[label] = {k: statistics.fmean(r[k] for r in mine) for k in
                          ("run_goodput_tok_s", "mean_step_goodput_tok_s", "rwt_plus_twt_s", "wasted_share",
                           "prefix_cache_hit_rate", "rank_moves", "role_changes")}
        busy = [r["cpu_busy_share"] for r in mine if r["cpu_busy_share"] is not None]
        summary[label]["cpu_busy_share"] = round(statistics.fmean(busy), 3) if busy else None
        summary[label]["runs"] = len(mine)
        summary[label]["failed_runs"] = len([r for r in runs if r["label"] == label]) - len(mine)
    # Ratios within each repetition (same machine load), then their geometric mean.
    ratios = {}

    def per_rep(label_a: str, pick_b) -> list[float]:
        out = []
        for rep in range(args.reps):
            a = [r for r in ok if r["rep"] == rep and r["label"] == label_a]
            b = pick_b(rep)
            if a and b:
                out.append(a[0]["run_goodput_tok_s"] / b)
        return out

    def best_of(mode: str):
        def pick(rep: int):
            xs = [r["run_goodput_tok_s"] for r in ok if r["rep"] == rep and r["mode"] == mode]
            return max(xs) if xs else None
        return pick

    tide_labels = [c["label"] for c in cfgs if c["mode"] == "tide"]
    best_tide = max(tide_labels, key=lambda lbl: summary.get(lbl, {}).get("run_goodput_tok_s", 0.0)) if tide_labels else None
    # sync is the paper's synchronous baseline (VeRL-like); sync_split has no goal of its own
    goals = {"sync": 3.0, "sync_split": None, "async_static": 1.3, "stream": 2.0}
    if best_tide:
        for base, goal in goals.items():
            xs = per_rep(best_tide, best_of(base))
            if xs:
                ratios[f"tide_vs_best_{base}"] = ratio_record(
                    xs, goal=goal, met=None if goal is None else geomean(xs) >= goal)
    for label in [c["label"] for c in cfgs if c.get("executor")]:  # each stream executor on its own
        xs = per_rep(best_tide, lambda rep, label=label: next(
            (r["run_goodput_tok_s"] for r in ok if r["rep"] == rep and r["label"] == label), None)) if best_tide else []
        if xs:
            ratios[f"tide_vs_{label}"] = ratio_record(xs, goal=None, met=None)

    if any(c["ers"] for c in cfgs):
        # The check: ERS's best against the best static split (tide, ERS off), per repetition.
        gain, waits = [], []
        for rep in range(args.reps):
            static = [r for r in ok if r["rep"] == rep and r["mode"] == "tide" and not r["ers"]]
            ers = [r for r in ok if r["rep"] == rep and r["ers"]]
            if static and ers:
                s_best = max(static, key=lambda r: r["run_goodput_tok_s"])
                e_best = max(ers, key=lambda r: r["run_goodput_tok_s"])
                gain.append(e_best["run_goodput_tok_s"] / s_best["run_goodput_tok_s"])
                waits.append(e_best["rwt_plus_twt_s"] / s_best["rwt_plus_twt_s"] if s_best["rwt_plus_twt_s"] else math.nan)
        if gain:
            ratios["ers_vs_best_static_tide_goodput"] = ratio_record(gain, goal=1.0, met=geomean(gain) >= 1.0)
            ratios["ers_vs_best_static_tide_rwt_twt"] = ratio_record(waits, goal="<= 0.3", met=geomean(waits) <= 0.3)

    print(f"\n{'config':<22}{'run tok/s':>10}{'step tok/s':>11}{'RWT+TWT s':>10}{'wasted':>8}{'hit':>7}{'moves':>7}"
          f"{'cpu busy':>9}")
    for label in labels:
        s = summary[label]
        if "run_goodput_tok_s" not in s:
            print(f"{label:<22}{'failed':>10}")
            continue
        print(f"{label:<22}{s['run_goodput_tok_s']:>10.1f}{s['mean_step_goodput_tok_s']:>11.1f}"
              f"{s['rwt_plus_twt_s']:>10.1f}{s['wasted_share']:>8.3f}{s['prefix_cache_hit_rate']:>7.3f}"
              f"{s['rank_moves']:>7.1f}{'-' if s['cpu_busy_share'] is None else format(s['cpu_busy_share'], '.3f'):>9}")
    for name, r in ratios.items():
        goal = "" if r["goal"] is None else f"; goal {r['goal']}x"
        print(f"{name}: {r['geomean']}x (per repetition {r['per_rep']}{goal})")

    record = {
        **bench_record.header("e2e_goodput", device="cpu", config={
            **vars(args), "splits": sorted(only) or "all", "latency_overrides": LATENCY}),
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the timeline goes there first
    ers_runs = [r for r in ok if r["ers"] and id(r) in timelines]
    if ers_runs:  # the best ERS run's timeline, beside the JSON: what ERS did, at a glance
        best = max(ers_runs, key=lambda r: r["run_goodput_tok_s"])
        png = Path(args.out).with_name(Path(args.out).stem + "_timeline.png")
        png.write_bytes(timelines[id(best)])
        record["timeline_png"] = {"file": png.name, "run": best["label"], "rep": best["rep"]}
    bench_record.write(args.out, record)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
