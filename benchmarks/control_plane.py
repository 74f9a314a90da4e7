"""What the real control plane costs rank 0 as the job grows: 8, 16, 32 ranks on emulated devices.

Each size runs the paper's text workload (`recipes/recipe/text_emulated.yaml`: TIDE with CTB,
RA2P and ERS; the real controller, mailbox, process groups and weight-sync protocol; device work
from the simulator's cost model) with the batch scaled to the ranks (`--groups-per-rank` groups
of 8 per rank and step; the paper's 64 x 8 at 32 ranks is 2), so that every rank carries the same
load and only the number of ranks grows. Per step, rank 0 records (`control/*` metrics,
`tide_megatron/controller/control_meter.py`): its CPU time (the whole process; the rollout
service's thread, which is the control plane proper; the step loop's thread), the messages it sent
and read, and the latency of its placement passes and ERS plans.

Reported per size: those figures per step, their growth with ranks (the log-log slope from the
smallest size to the largest: 1 is linear), and the control plane's CPU time as a share of the
modelled step (the mean step time / dilation: a 7B step on H100s). Every rank shares this host's
cores: `--dilations` slows the modelled devices so that the host keeps up (its busy share is
recorded). CPU time is not dilated, but part of it is per wall second (heartbeats, and the
rollout loop's idle passes, `control/loops`), so the CPU time per step at dilation d holds up to
d times the per-second part a dedicated cluster (d = 1) would spend: the shares of the step are
upper bounds.

    python benchmarks/control_plane.py                       # 8, 16, 32 ranks, dilation 4
    python benchmarks/control_plane.py --ranks 8 --dilations 1 --steps 2   # a quick look
    python benchmarks/control_plane.py --ranks 16 --dilations 4 --polls 0.005,0.02 --reps 2 \
        --out control_plane_poll      # what rank 0's pass interval (scheduler.control_poll_s) costs
    python benchmarks/control_plane.py --ranks 16 --dilations 4 --reps 2 --baseline db666fc \
        --out control_plane_mailbox   # what a change costs: this checkout against an older commit

64 ranks fit this 24 GiB host's memory (ranks forked from a preloaded server: 115-160 MB each,
`rank_memory.py`), but their idle CPU time (per wall second) adds up on its 2 cores whatever the
dilation; `benchmarks/decision_latency.py` times the same placement and ERS decisions in one
process up to 128 ranks. Writes benchmarks/results/control_plane.json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_record
from emulated_runs import REPO, modelled, run_emulated

PER_STEP = ("control/cpu_process_s", "control/cpu_rollout_thread_s", "control/cpu_main_thread_s",
            "control/loops", "control/messages_sent", "control/messages_received", "control/placement_passes")


def figures(rows: list[dict], dilation: float) -> dict:
    """Per-step means of rank 0's control figures, the placement latency (median of the steps'
    p50s, worst p99), ERS plan latency over the steps that planned, and the shares of a step."""
    out = {k.removeprefix("control/"): statistics.fmean(r[k] for r in rows) for k in PER_STEP}
    out["messages_per_step"] = out["messages_sent"] + out["messages_received"]
    # all of the thread's CPU time over the messages: idle passes and placement included
    out["rollout_thread_us_per_message"] = 1e6 * out["cpu_rollout_thread_s"] / max(1.0, out["messages_per_step"])
    passes = [r for r in rows if r["control/placement_passes"]]
    out["placement_p50_ms"] = statistics.median(r["control/placement_p50_ms"] for r in passes) if passes else None
    out["placement_p99_ms"] = max((r["control/placement_p99_ms"] for r in passes), default=None)
    plans = sorted(r["control/ers_plan_ms"] for r in rows if r["control/ers_plan_ms"] > 0)
    out["ers_plan_p50_ms"] = statistics.median(plans) if plans else None
    out["ers_plan_max_ms"] = plans[-1] if plans else None
    step_s = statistics.fmean(r["time/step_s"] for r in rows) / dilation  # the modelled step
    out["modelled_step_s"] = step_s
    out["rollout_thread_share_of_step"] = out["cpu_rollout_thread_s"] / step_s
    out["process_share_of_step"] = out["cpu_process_s"] / step_s
    return out


def slope(xs: list[float], ys: list[float]) -> float | None:
    """The log-log slope from the first point to the last (1: linear growth)."""
    if len(xs) < 2 or ys[0] is None or ys[-1] is None or min(ys[0], ys[-1]) <= 0:
        return None
    return math.log(ys[-1] / ys[0]) / math.log(xs[-1] / xs[0])


def run_size(ranks: int, dilation: float, poll: float, rep: int, args, tree: str = "current",
             repo: Path = REPO) -> dict:
    run = run_emulated(ranks, dilation, [f"run.steps={args.steps}",
                                         f"scheduler.groups_per_step={args.groups_per_rank * ranks}",
                                         f"scheduler.control_poll_s={poll}", *args.overrides], args.timeout, repo=repo)
    record = {"tree": tree, "ranks": ranks, "dilation": dilation, "control_poll_s": poll, "rep": rep,
              "command": run["command"], "process_wall_s": run["process_wall_s"], "failed": run["failed"]}
    label = f"{ranks} ranks, poll {poll:g} s" + ("" if tree == "current" else f", {tree}")
    if run["failed"]:
        record["error"] = run["error"]
        print(f"{label}: FAILED ({run['error'][:300]})", flush=True)
        return record
    record.update(control=figures(run["rows"], dilation), run=modelled(run, ranks, dilation),
                  per_step=[{k.removeprefix("control/"): r[k] for k in r if k.startswith("control/")}
                            for r in run["rows"]])
    c = record["control"]
    print(f"{label}: rollout thread {c['cpu_rollout_thread_s']:.2f} s/step, "
          f"{c['messages_per_step']:.0f} messages/step, host busy {run['cpu_busy_share']}", flush=True)
    return record


@contextlib.contextmanager
def baseline_tree(rev: str | None):
    """A temporary git worktree of `rev` (None: no baseline), removed afterwards."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="control_plane_baseline_") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def mean_of(records: list[dict], part: str, key: str) -> float | None:
    values = [r[part][key] for r in records if r[part][key] is not None]
    return statistics.fmean(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,16,32")
    parser.add_argument("--dilations", default="4,4,4",
                        help="one per rank count; the same for all, so that idle polling (per wall second) "
                             "weighs the same in every size's CPU time per step")
    parser.add_argument("--polls", default="0.02",
                        help="scheduler.control_poll_s values to compare (each size runs each, in alternating "
                             "order over the repetitions)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups-per-rank", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run every size on commit REV (a temporary git worktree), alternating with this "
                             "checkout: what a change to the control plane costs, measured in one run")
    parser.add_argument("--out", default="control_plane", help="results name (benchmarks/results/NAME.json)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    dilations = [float(x) for x in args.dilations.split(",")]
    polls = [float(x) for x in args.polls.split(",")]
    if len(dilations) != len(sizes):
        parser.error(f"--dilations needs one value per rank count ({len(sizes)}), got {len(dilations)}")

    results = []
    with baseline_tree(args.baseline) as baseline:
        trees = [("current", REPO)] + ([(f"baseline {args.baseline}", baseline)] if baseline else [])
        for ranks, dilation in zip(sizes, dilations):
            for rep in range(args.reps):
                runs = [(poll, tree) for poll in polls for tree in trees]
                for poll, (tree, repo) in (runs if rep % 2 == 0 else runs[::-1]):
                    results.append(run_size(ranks, dilation, poll, rep, args, tree, repo))

    ok = [r for r in results if not r["failed"]]
    keys = ("cpu_process_s", "cpu_rollout_thread_s", "messages_per_step", "rollout_thread_us_per_message", "loops",
            "placement_p50_ms", "placement_p99_ms", "ers_plan_p50_ms")
    table, growth = [], {}
    for tree in dict.fromkeys(r["tree"] for r in results):
        for poll in polls:
            rows = []
            for ranks, dilation in zip(sizes, dilations):
                mine = [r for r in ok if r["tree"] == tree and r["ranks"] == ranks and r["control_poll_s"] == poll]
                if mine:
                    rows.append({"tree": tree, "ranks": ranks, "dilation": dilation, "control_poll_s": poll,
                                 "runs": len(mine), "control": {k: mean_of(mine, "control", k) for k in mine[0]["control"]},
                                 "goodput_tok_s": mean_of(mine, "run", "goodput_tok_s"),
                                 "cpu_busy_share": mean_of(mine, "run", "cpu_busy_share")})
            table += rows
            growth[f"{tree}, poll {poll}"] = {k: slope([r["ranks"] for r in rows], [r["control"][k] for r in rows])
                                              for k in keys}

    print(f"\n{'tree':>22}{'ranks':>6}{'dil':>5}{'poll s':>7}{'runs':>5}{'proc cpu s':>11}{'ro thr s':>9}{'msgs':>7}{'us/msg':>7}"
          f"{'loops':>7}{'place p50':>10}{'p99 ms':>8}{'ers ms':>8}{'step s':>8}{'ro/step':>8}{'tok/s':>8}{'busy':>6}")
    for r in table:
        c = r["control"]

        def ms(v):
            return "-" if v is None else f"{v:.2f}"
        print(f"{r['tree'][:22]:>22}{r['ranks']:>6}{r['dilation']:>5g}{r['control_poll_s']:>7g}{r['runs']:>5}{c['cpu_process_s']:>11.2f}"
              f"{c['cpu_rollout_thread_s']:>9.2f}{c['messages_per_step']:>7.0f}{c['rollout_thread_us_per_message']:>7.0f}"
              f"{c['loops']:>7.0f}{ms(c['placement_p50_ms']):>10}{ms(c['placement_p99_ms']):>8}"
              f"{ms(c['ers_plan_p50_ms']):>8}{c['modelled_step_s']:>8.1f}{c['rollout_thread_share_of_step']:>8.3f}"
              f"{r['goodput_tok_s']:>8.0f}{r['cpu_busy_share'] or 0:>6.2f}")
    for name, g in growth.items():
        print(f"growth with ranks ({name} s; log-log slope, 1 = linear):",
              {k: None if v is None else round(v, 2) for k, v in g.items()})
    bench_record.write(args.out, {**bench_record.header("control_plane", config=vars(args)),
                                  "growth_log_log_slope": growth, "goal": "growth at most linear; "
                                  "under 1% of a 7B step at 128 ranks", "means": table, "runs": results})
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
