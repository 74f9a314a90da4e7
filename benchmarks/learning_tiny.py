"""Learning check: does GRPO on the tiny CPU recipe raise the door game's reward?

Runs `torchrun --nproc-per-node 2 launch/train.py +recipe=tiny_cpu` for STEPS steps (random
init, real SGLang rollout, real Megatron trainer), then compares the mean reward of the first
and last K steps. Prints a short table and writes benchmarks/results/learning_tiny.json.

    python benchmarks/learning_tiny.py [--steps 40] [--window 5] [extra overrides ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A bigger batch, a high learning rate and short actions make the signal of a random-init model
# usable within minutes; full near-miss credit makes the door game's reward dense.
DEFAULTS = ["scheduler.groups_per_step=8", "scheduler.group_size=8", "trainer.lr=5e-3", "trainer.kl_coef=0.0",
            "rollout.runner.max_new_tokens=4", "run.checkpoint_interval=0",
            "envs.server.envs.0.door_game.near_miss_credit=1.0"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--output-dir", default="outputs/learning_tiny")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    out_dir = Path(args.output_dir)
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    overrides = DEFAULTS + [f"run.steps={args.steps}", f"run.output_dir={out_dir}", "run.name=learning_tiny",
                            *args.overrides]
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
           str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"training failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    k = args.window
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    result = {
        "command": " ".join(["python", "benchmarks/learning_tiny.py", f"--steps {args.steps}",
                             f"--window {k}", *args.overrides]),
        "launcher": " ".join(cmd[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, CPU only",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "steps": len(rows),
        "wall_time_s": round(wall, 1),
        "train_time_s": round(sum(r["time/step_s"] for r in rows), 1),
        "mean_reward_first_steps": round(first, 4),
        "mean_reward_last_steps": round(last, 4),
        "window_steps": k,
        "reward_per_step": [round(x, 4) for x in rewards],
    }
    dest = REPO / "benchmarks" / "results" / "learning_tiny.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'steps':>6} {'wall s':>8} {'reward first':>13} {'reward last':>12}")
    print(f"{len(rows):>6} {wall:>8.0f} {first:>13.3f} {last:>12.3f}")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
