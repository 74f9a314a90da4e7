"""What a hollow (emulated) rank costs in memory, with its rank forked from the preloaded server
and started as a fresh interpreter (issue 37's budget: 250 MB of PSS a rank, so that 64 fit on
a 24 GiB host).

Each run is the emulated paper text workload (`emulated_runs.py`: the real rank code, device work
from the cost model) on N ranks. `TIDE_PRELOAD_RANKS=1` forks every rank from a server that
imported torch, Megatron-core, Hydra and SGLang once (`tide_megatron/utils/forked_ranks.py`);
`=0` starts each rank as torchrun does. Both variants run at each size, alternating which goes
first over the repetitions. Per run: each rank's peak PSS and USS (`rank_memory_sampler.py`;
rank 0 also hosts the controller and is the largest), the job's peak total PSS over its ranks,
and the wall time.

    python benchmarks/rank_memory.py                     # 8 and 16 ranks, 2 reps
    python benchmarks/rank_memory.py --ranks 8 --reps 1  # a quick look

Writes benchmarks/results/rank_memory.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import bench_record
from emulated_runs import run_emulated

VARIANTS = {"forked": "1", "started": "0"}
BUDGET_MB = 250.0


def run_one(ranks: int, variant: str, rep: int, args) -> dict:
    run = run_emulated(ranks, args.dilation, [f"run.steps={args.steps}",
                                              f"scheduler.groups_per_step={args.groups_per_rank * ranks}"],
                       args.timeout, env={"TIDE_PRELOAD_RANKS": VARIANTS[variant]})
    record = {"ranks": ranks, "variant": variant, "rep": rep, "command": run["command"],
              "process_wall_s": run["process_wall_s"], "failed": run["failed"], "memory": run["memory"],
              "cpu_busy_share_process": run["cpu_busy_share_process"]}
    if run["failed"]:
        record["error"] = run["error"]
    m = run["memory"] or {}
    print(f"{ranks} ranks, {variant}, rep {rep}: {'FAILED' if run['failed'] else 'ok'}, "
          f"rank PSS median {m.get('rank_pss_mb_median')} MB, max {m.get('rank_pss_mb_max')} MB, "
          f"wall {run['process_wall_s']} s", flush=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,16")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups-per-rank", type=int, default=2)
    parser.add_argument("--dilation", type=float, default=4.0)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--out", default="rank_memory", help="results name (benchmarks/results/NAME.json)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]

    runs = []
    for ranks in sizes:
        for rep in range(args.reps):
            order = list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]
            runs += [run_one(ranks, variant, rep, args) for variant in order]

    keys = ("rank_pss_mb_median", "rank_pss_mb_max", "rank_uss_mb_median", "job_pss_mb_per_rank", "job_pss_mb_peak")
    table = []
    for ranks in sizes:
        for variant in VARIANTS:
            mine = [r for r in runs if r["ranks"] == ranks and r["variant"] == variant and r["memory"]]
            if not mine:
                continue
            row = {"ranks": ranks, "variant": variant, "runs": len(mine),
                   **{k: round(statistics.fmean(r["memory"][k] for r in mine), 1) for k in keys},
                   "process_wall_s": round(statistics.fmean(r["process_wall_s"] for r in mine), 1)}
            row["within_budget"] = row["rank_pss_mb_median"] <= BUDGET_MB
            table.append(row)

    print(f"\n{'ranks':>5} {'variant':>8}{'runs':>5}{'PSS med':>9}{'PSS max':>9}{'USS med':>9}{'job/rank':>9}"
          f"{'job MB':>8}{'wall s':>8}")
    for r in table:
        print(f"{r['ranks']:>5} {r['variant']:>8}{r['runs']:>5}{r['rank_pss_mb_median']:>9.0f}{r['rank_pss_mb_max']:>9.0f}"
              f"{r['rank_uss_mb_median']:>9.0f}{r['job_pss_mb_per_rank']:>9.0f}{r['job_pss_mb_peak']:>8.0f}"
              f"{r['process_wall_s']:>8.0f}")
    bench_record.write(args.out, {**bench_record.header("rank_memory", config=vars(args)),
                                  "budget_mb": BUDGET_MB, "goal": "a hollow rank's PSS at most 250 MB",
                                  "means": table, "runs": runs})
    return 0 if all(not r["failed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
