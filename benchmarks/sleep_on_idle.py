"""Does an idle SGLang scheduler that polls its sockets slow a CPU run down?

tide mode on the real stack (the e2e goodput benchmark's runner, recipe and long-tailed env
latency), one split, with `rollout.engine.sleep_on_idle` on and off, in alternating order,
repeated; ratios are taken within each repetition. On a machine with fewer cores than
processes a polling scheduler takes a core from the ranks that work whenever its rank waits
(for the env, or for the trainer between steps).

    python benchmarks/sleep_on_idle.py                      # 4 ranks, 2 rollout, 6 steps, 2 repetitions
    python benchmarks/sleep_on_idle.py --rollout-ranks 1 --reps 3

Prints a table and writes benchmarks/results/sleep_on_idle_cpu.json (command, machine, date, figures).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from e2e_goodput import LATENCY, REPO, alternate, geomean, paired_ratios, ratio_record, summarize  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rollout-ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sleep_on_idle_cpu.json"))
    args = parser.parse_args()
    args.recipe, args.groups_per_step = "tiny_cpu", 4
    split = {"rollout": args.rollout_ranks, "ref": 0, "actors": args.ranks - args.rollout_ranks}
    variants = [("sleep_on_idle=true", ["rollout.engine.sleep_on_idle=true"]),
                ("sleep_on_idle=false", ["rollout.engine.sleep_on_idle=false"])]
    args.overrides = []
    tmp = Path(tempfile.mkdtemp(prefix="sleep_on_idle_"))
    try:
        runs = alternate(variants, {"mode": "tide", "ers": False, **split}, args, tmp,
                         lambda r: f"{r['run_goodput_tok_s']:.1f} tok/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in runs if not r["failed"]]
    summary = summarize(runs, [label for label, _ in variants], ("run_goodput_tok_s", "mean_step_goodput_tok_s", "rwt_plus_twt_s"))
    ratios = paired_ratios(runs, variants[0][0], variants[1][0])
    print(f"\n{'variant':<22}{'run tok/s':>10}{'step tok/s':>11}{'RWT+TWT s':>10}")
    for label, s in summary.items():
        print(f"{label:<22}{s['run_goodput_tok_s']:>10.1f}{s['mean_step_goodput_tok_s']:>11.1f}{s['rwt_plus_twt_s']:>10.1f}")
    if ratios:
        print(f"run goodput, on / off: {geomean(ratios):.3f}x (per repetition {[round(x, 3) for x in ratios]})")
    record = {
        **bench_record.header("sleep_on_idle", device="cpu", config={
            **vars(args), "split": split, "variants": variants, "latency_overrides": LATENCY}),
        "summary": summary,
        "run_goodput_ratio_on_over_off": ratio_record(ratios),
        "runs": runs,
    }
    bench_record.write(args.out, record)
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
