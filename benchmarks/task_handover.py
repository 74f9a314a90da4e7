"""What does handing tasks over save when ERS moves a loaded rollout rank to the trainer?

tide mode on the real stack (the e2e goodput benchmark's runner, recipe and long-tailed env
latency), 3 ranks, ERS's split drill every step (a rollout rank joins the actors, serves as
the reference, returns to rollout, and again: moves under load whatever the signals say), with
`ers.hand_over_tasks` on (a leaving rank's tasks go on elsewhere, env session and all) and off
(they start afresh, their tokens wasted), in alternating order, repeated; ratios within each
repetition.

    python benchmarks/task_handover.py                  # 6 steps, 2 repetitions
    python benchmarks/task_handover.py --steps 8 --reps 3

Prints a table and writes benchmarks/results/task_handover_cpu.json (command, machine, date, figures).
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

FIGURES = ("wasted_tokens", "wasted_share", "tasks_moved", "tasks_carried", "carried_tokens", "role_change_drain_s",
           "run_goodput_tok_s", "rwt_plus_twt_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "task_handover_cpu.json"))
    args = parser.parse_args()
    args.recipe, args.groups_per_step, args.ranks = "tiny_cpu", 4, 3
    split = {"rollout": 2, "ref": 0, "actors": 1}
    drill = ["ers.drill=split", "ers.drill_every=1"]
    variants = [("hand over", ["ers.hand_over_tasks=true"]), ("start afresh", ["ers.hand_over_tasks=false"])]
    args.overrides = list(drill)
    tmp = Path(tempfile.mkdtemp(prefix="task_handover_"))
    try:
        runs = alternate(variants, {"mode": "tide", "ers": True, **split}, args, tmp, lambda r: (
            f"wasted {r['wasted_tokens']} of {r['generated_tokens']} tokens, {r['tasks_carried']}/{r['tasks_moved']} "
            f"moved tasks carried, {r['run_goodput_tok_s']:.1f} tok/s"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in runs if not r["failed"]]
    summary = summarize(runs, [label for label, _ in variants], FIGURES)
    ratios = paired_ratios(runs, variants[0][0], variants[1][0])
    print(f"\n{'variant':<14}{'wasted':>8}{'share':>7}{'moved':>7}{'carried':>8}{'drain s':>8}{'tok/s':>8}")
    for label, s in summary.items():
        print(f"{label:<14}{s['wasted_tokens']:>8.0f}{s['wasted_share']:>7.3f}{s['tasks_moved']:>7.1f}"
              f"{s['tasks_carried']:>8.1f}{s['role_change_drain_s']:>8.2f}{s['run_goodput_tok_s']:>8.1f}")
    if ratios:
        print(f"run goodput, hand over / start afresh: {geomean(ratios):.3f}x (per repetition "
              f"{[round(x, 3) for x in ratios]})")
    record = {
        **bench_record.header("task_handover", device="cpu", config={
            **vars(args), "split": split, "drill": drill, "variants": variants, "latency_overrides": LATENCY}),
        "summary": summary,
        "run_goodput_ratio_hand_over_over_afresh": ratio_record(ratios),
        "runs": runs,
    }
    bench_record.write(args.out, record)
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
