"""What forking saves on CPU: SGLang's children, then the ranks themselves.

Each variant pair in alternating order, repeated:
- engine (`rollout.engine.fork_children` on and off): one `RolloutEngine` for the tiny model,
  each start in a fresh interpreter (so both pay the same imports before it); seconds from the
  constructor's call to a ready engine, and the CPU seconds its process tree (the rank and
  SGLang's scheduler and detokenizer) has used by then;
- job (the same setting): the end-to-end test tier's ERS drill job (4 ranks: 2 actors, a
  reference, a rollout rank; tide mode, roles change every step, 5 steps), its wall time from
  launch to exit;
- rank job (`TIDE_PRELOAD_RANKS` 1 and 0, SGLang's children forked in both): the same job with
  its ranks forked from the launcher's preloaded server (`tide_megatron/utils/forked_ranks.py`)
  or each started as a fresh interpreter, as torchrun does.

Every process runs one intra-op thread (OMP_NUM_THREADS=1, as under torchrun), and each run
records whether SGLang's children were in fact forked (`compat.sglang_fork.fork_hazard`).

    python benchmarks/engine_start.py                     # 3 engine reps, 2 reps of each job
    python benchmarks/engine_start.py --engine-reps 5 --job-reps 0 --rank-job-reps 0

Prints a table and writes benchmarks/results/engine_start.json (command, commit, machine, figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402

REPO = Path(bench_record.REPO)
# As torchrun gives every rank unless told otherwise (and CI sets): one intra-op thread, so that
# forking is safe (`compat.sglang_fork.fork_hazard`).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
VARIANTS = (("fork", True), ("spawn", False))
RANK_VARIANTS = (("forked", True), ("started", False))
JOB = ("scheduler.mode=tide", "cluster.rollout_ranks=1", "cluster.ref_ranks=1", "ers.enabled=true",
       "ers.drill_every=1", "run.steps=5")


def engine_worker(out: Path, fork: bool) -> None:
    """Runs in its own interpreter: start one engine, print its figures as JSON."""
    import psutil

    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.testing import tiny_checkpoint

    ckpt = tiny_checkpoint(out)
    t0 = time.perf_counter()
    engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=2048, max_running_requests=4, fork_children=fork), ckpt)
    ready_s = time.perf_counter() - t0
    tree = [psutil.Process(), *psutil.Process().children(recursive=True)]
    cpu_s = sum(t.user + t.system for t in (p.cpu_times() for p in tree))
    engine.shutdown()
    print(json.dumps({"ready_s": ready_s, "tree_cpu_s": cpu_s, "processes": len(tree),
                      "children_forked": engine.children_forked}))


def run_engine(tmp: Path, fork: bool, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--engine-worker", str(tmp), "--fork", str(int(fork))],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ONE_THREAD)
    if proc.returncode != 0:
        return {"failed": True, "error": proc.stderr[-2000:]}
    return {"failed": False, **json.loads(proc.stdout.splitlines()[-1])}


def run_job(tmp: Path, fork: bool, timeout: float, ranks_forked: bool = True) -> dict:
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "4", str(REPO / "launch" / "train.py"),
           "+recipe=tiny_cpu",
           "metrics.progress=false", f"run.output_dir={tmp}", *JOB, f"rollout.engine.fork_children={str(fork).lower()}"]
    env = {**ONE_THREAD, "TIDE_PRELOAD_RANKS": str(int(ranks_forked))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"failed": True, "wall_s": wall, "error": proc.stderr[-2000:]}
    ready = re.findall(r"SGLang's children (forked|spawned)", "".join(p.read_text() for p in (tmp / "logs").glob("rank*.log")))
    return {"failed": False, "wall_s": wall, "children": ready}


def alternating(reps: int, measure, tmp: Path, what: str, variants=VARIANTS) -> list[dict]:
    runs = []
    for rep in range(reps):
        for label, fork in (variants if rep % 2 == 0 else variants[::-1]):
            where = tmp / f"{what}_{rep}_{label}"
            result = {"rep": rep, "variant": label, **measure(where, fork)}
            shutil.rmtree(where, ignore_errors=True)
            runs.append(result)
            shown = "FAILED" if result["failed"] else ", ".join(
                f"{k} {v:.1f}" for k, v in result.items() if k.endswith("_s"))
            print(f"{what} rep {rep} {label:<6} {shown}", flush=True)
    return runs


def summary(runs: list[dict], key: str, variants=VARIANTS) -> dict:
    """Per variant the mean of `key`; the ratio second/first variant (spawn/fork, started/forked)
    per repetition where both ran."""
    ok = {(r["rep"], r["variant"]): r[key] for r in runs if not r["failed"]}
    means = {label: statistics.fmean(v for (_, lab), v in ok.items() if lab == label)
             for label, _ in variants if any(lab == label for _, lab in ok)}
    (first, _), (second, _) = variants
    reps = sorted({rep for rep, _ in ok})
    ratios = [ok[rep, second] / ok[rep, first] for rep in reps if (rep, second) in ok and (rep, first) in ok]
    return {"variants": [first, second], "mean": means, f"{second}_over_{first}": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-reps", type=int, default=3)
    parser.add_argument("--job-reps", type=int, default=2)
    parser.add_argument("--rank-job-reps", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine_start.json"))
    parser.add_argument("--engine-worker", help=argparse.SUPPRESS)
    parser.add_argument("--fork", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_worker:
        engine_worker(Path(args.engine_worker), bool(args.fork))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="engine_start_"))
    try:
        engine_runs = alternating(args.engine_reps, lambda d, f: run_engine(d, f, args.timeout), tmp, "engine")
        job_runs = alternating(args.job_reps, lambda d, f: run_job(d, f, args.timeout), tmp, "job")
        rank_job_runs = alternating(args.rank_job_reps, lambda d, forked: run_job(d, True, args.timeout, forked), tmp,
                                    "rank job", RANK_VARIANTS)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {"engine_ready_s": summary(engine_runs, "ready_s"), "engine_tree_cpu_s": summary(engine_runs, "tree_cpu_s")}
    if job_runs:
        figures["job_wall_s"] = summary(job_runs, "wall_s")
    if rank_job_runs:
        figures["rank_job_wall_s"] = summary(rank_job_runs, "wall_s", RANK_VARIANTS)
    print(f"\n{'figure':<18}{'variant':>9}{'mean':>7}{'variant':>9}{'mean':>7}  second / first per rep")
    for name, s in figures.items():
        a, b = s["variants"]
        print(f"{name:<18}{a:>9}{s['mean'].get(a, float('nan')):>7.1f}{b:>9}{s['mean'].get(b, float('nan')):>7.1f}  "
              f"{[round(x, 2) for x in s[f'{b}_over_{a}']]}")
    record = {**bench_record.header("engine_start", device="cpu", config={**vars(args), "job_overrides": JOB}),
              "figures": figures, "engine_runs": engine_runs, "job_runs": job_runs, "rank_job_runs": rank_job_runs}
    bench_record.write(args.out, record)
    failed = [r for r in engine_runs + job_runs + rank_job_runs if r["failed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
