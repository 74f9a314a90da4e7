"""Learning check: does GRPO on the tiny CPU recipe raise the door game's reward, in each mode?

Runs `torchrun --nproc-per-node 2 launch/train.py +recipe=tiny_cpu scheduler.mode=MODE` for
STEPS steps per mode (random init, real SGLang rollout, real Megatron trainer, the same seeds and
settings), then compares the mean reward of the first and last K steps and the wall time. The
question for `tide`: does it reach at least sync's reward at the same step count, in less wall
time? (`sync` time-shares both ranks, VeRL-like; results measured before `sync_split` existed
ran today's `sync_split`.) Prints a short table and writes benchmarks/results/learning_tiny.json with both curves.

    python benchmarks/learning_tiny.py [--modes sync,tide] [--steps 80] [--window 10] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_record

REPO = Path(__file__).resolve().parent.parent
# A bigger batch, a high learning rate and short actions make the signal of a random-init model
# usable within minutes; full near-miss credit makes the door game's reward dense. A small KL
# keeps the reference in the loop (tide pipelines it) without changing what is learned much.
DEFAULTS = ["scheduler.groups_per_step=8", "scheduler.group_size=8", "trainer.lr=5e-3", "trainer.kl_coef=0.001",
            "rollout.runner.max_new_tokens=4", "run.checkpoint_interval=0", "metrics.progress=false",
            "envs.server.envs.0.door_game.near_miss_credit=1.0"]


def run(mode: str, args) -> dict:
    out_dir = Path(args.output_dir) / mode
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    overrides = DEFAULTS + [f"scheduler.mode={mode}", f"run.steps={args.steps}", f"run.output_dir={out_dir}",
                            f"run.name=learning_tiny_{mode}", *args.overrides]
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
           str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: training failed (exit {proc.returncode}); see {out_dir}/logs")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
            if "eval/mean_reward" not in line]
    rewards = [r["reward/mean"] for r in rows]
    k = args.window
    return {
        "launcher": " ".join(cmd[1:]),
        "steps": len(rows),
        "process_wall_s": round(wall, 1),
        # The controller logs consumed tokens / wall time since the first dispatch: recover the time.
        "run_wall_s": round(sum(r["consumed_tokens"] for r in rows) / rows[-1]["run_goodput_tok_s"], 1),
        "mean_reward_first_steps": round(statistics.fmean(rewards[:k]), 4),
        "mean_reward_last_steps": round(statistics.fmean(rewards[-k:]), 4),
        "reward_per_step": [round(x, 4) for x in rewards],
        "staleness_max": max(r["staleness/max"] for r in rows),
        "wasted_tokens": rows[-1]["ledger/wasted"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,tide")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    parser.add_argument("--output-dir", default="outputs/learning_tiny")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every mode")
    args = parser.parse_args()

    results = {mode: run(mode, args) for mode in args.modes.split(",")}
    comparison = {}
    if "sync" in results and "tide" in results:
        s, t = results["sync"], results["tide"]
        comparison = {
            "tide_reward_at_least_sync": t["mean_reward_last_steps"] >= s["mean_reward_last_steps"],
            "tide_wall_over_sync": round(t["run_wall_s"] / s["run_wall_s"], 3),
        }
    record = {
        **bench_record.header("learning_tiny", device="cpu", config={**vars(args), "defaults": DEFAULTS}),
        "window_steps": args.window,
        "settings": DEFAULTS,
        "results": results,
        "comparison": comparison,
        "notes": ["run_wall_s: wall time from the first dispatch to the last step (engine start-up excluded), "
                  "from the run goodput logged by the controller; process_wall_s includes start-up."],
    }
    dest = REPO / "benchmarks" / "results" / "learning_tiny.json"
    dest.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n{'mode':<8}{'steps':>6}{'run wall s':>11}{'reward first':>13}{'reward last':>12}")
    for mode, r in results.items():
        print(f"{mode:<8}{r['steps']:>6}{r['run_wall_s']:>11.0f}{r['mean_reward_first_steps']:>13.3f}"
              f"{r['mean_reward_last_steps']:>12.3f}")
    if comparison:
        print(f"tide reward >= sync: {comparison['tide_reward_at_least_sync']}; "
              f"tide wall / sync wall: {comparison['tide_wall_over_sync']}")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
