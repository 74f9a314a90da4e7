"""Soak: a long tide-mode run of the tiny recipe under random faults, and what it survived.

One job (`launch/torchrun.py`, tide mode, CTB on, long-tailed env latency with injected env
failures) runs for `--minutes`; meanwhile this script kills, at random (exponential) intervals:

- a rollout rank's SGLang scheduler (the rank must replace its engine; its tasks are retried);
- the env server (its supervisor must restart it on the same address; clients reconnect).

The env itself fails `--env-error-prob` of its steps (tasks retry). Afterwards the script reads
the run's metrics and logs and reports: faults injected and survived (the run went on and
finished), the time from each kill to its detection, groups lost (ledger tokens lost, groups
given up), staleness violations (consumed trajectories beyond the bound). Prints a table and
writes benchmarks/results/soak_cpu.json.

    python benchmarks/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

import bench_record

REPO = Path(__file__).resolve().parent.parent
LATENCY = ["envs.server.envs.0.latency.enabled=true", "envs.server.envs.0.latency.step_median_s=0.2",
           "envs.server.envs.0.latency.slow_step_prob=0.02", "envs.server.envs.0.latency.extra_turns_mean=0.5"]


def job_processes(root: psutil.Process, marker: str) -> list[psutil.Process]:
    out = []
    for p in root.children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


class Injector(threading.Thread):
    """Kills engines and the env server at exponential intervals until stopped."""

    def __init__(self, root: psutil.Process, rng: random.Random, engine_every_s: float, env_every_s: float,
                 warmup_s: float):
        super().__init__(daemon=True)
        self.root, self.rng = root, rng
        self.rates = {"engine": 1.0 / engine_every_s, "env_server": 1.0 / env_every_s}
        self.warmup_s = warmup_s
        self.stop = threading.Event()
        self.faults: list[dict] = []

    def run(self) -> None:
        if self.stop.wait(self.warmup_s):
            return
        total = sum(self.rates.values())
        while not self.stop.wait(self.rng.expovariate(total)):
            kind = self.rng.choices(list(self.rates), weights=list(self.rates.values()))[0]
            marker = "sglang::scheduler" if kind == "engine" else "tide_megatron.envs.server"
            victims = job_processes(self.root, marker)
            if not victims:
                continue
            victim = self.rng.choice(victims)
            try:
                victim.send_signal(signal.SIGKILL)
            except psutil.Error:
                continue
            self.faults.append({"kind": kind, "pid": victim.pid, "at": time.time()})
            print(f"[soak] {time.strftime('%H:%M:%S')} killed {kind} pid {victim.pid}", flush=True)


def detections(run_dir: Path, faults: list[dict]) -> None:
    """Time from each kill to the log line that shows the job noticed it."""
    patterns = {"engine": re.compile(r"an SGLang subprocess of this rollout rank died"),
                "env_server": re.compile(r"restarting the env server")}
    stamps = {k: [] for k in patterns}
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        for line in log.read_text(errors="replace").splitlines():
            for kind, pat in patterns.items():
                if pat.search(line):
                    m = re.match(r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)
                    if m:
                        stamps[kind].append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")))
    for f in faults:
        later = [t for t in stamps[f["kind"]] if t >= int(f["at"])]
        f["detected_after_s"] = round(min(later) - f["at"], 1) if later else None
        if later:
            stamps[f["kind"]].remove(min(later))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--ranks", type=int, default=3, help="1 actor rank, the rest roll out")
    parser.add_argument("--engine-kill-every-s", type=float, default=300.0, help="mean interval")
    parser.add_argument("--env-kill-every-s", type=float, default=400.0, help="mean interval")
    parser.add_argument("--env-error-prob", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak_cpu.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="soak_"))
    overrides = ["+recipe=tiny_cpu", "scheduler.mode=tide", f"cluster.rollout_ranks={args.ranks - 1}",
                 "run.steps=1000000", f"run.max_wall_minutes={args.minutes}", "run.checkpoint_interval=100",
                 "metrics.progress=false", "metrics.tensorboard=false", f"run.output_dir={run_dir}",
                 f"run.seed={args.seed}", f"envs.server.envs.0.latency.error_prob={args.env_error_prob}",
                 "scheduler.max_task_retries=2", *LATENCY, *args.overrides]
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", str(args.ranks),
           str(REPO / "launch" / "train.py"), *overrides]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    injector = Injector(psutil.Process(proc.pid), random.Random(args.seed), args.engine_kill_every_s,
                        args.env_kill_every_s, warmup_s=90.0)
    injector.start()
    # The last few minutes stay quiet so the run's end is not a fault's recovery.
    quiet = threading.Timer(max(60.0 * args.minutes - 120.0, 0.0), injector.stop.set)
    quiet.start()
    output = proc.communicate(timeout=60.0 * args.minutes + 1800)[0]
    injector.stop.set()
    quiet.cancel()
    wall = time.time() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "eval/mean_reward" not in line] if (run_dir / "metrics.jsonl").exists() else []
    detections(run_dir, injector.faults)
    bound = 1
    last = rows[-1] if rows else {}
    result = {
        "finished": proc.returncode == 0,
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "steps": len(rows),
        "faults_injected": len(injector.faults),
        "faults_by_kind": {k: sum(f["kind"] == k for f in injector.faults) for k in ("engine", "env_server")},
        "faults_survived": len(injector.faults) if proc.returncode == 0 else None,
        "detect_s": [f["detected_after_s"] for f in injector.faults],
        "undetected": sum(f["detected_after_s"] is None for f in injector.faults),
        "groups_given_up": last.get("rollout/groups_failed", 0),
        "groups_cancelled": last.get("rollout/groups_cancelled", 0),
        "task_failures": last.get("rollout/task_failures", 0),
        "retries": last.get("rollout/retries", 0),
        "lost_tokens": last.get("ledger/lost"),
        "wasted_share": last["ledger/wasted"] / last["ledger/generated"] if rows else None,
        "staleness_violations": sum(r["staleness/max"] > bound for r in rows),
        "incomplete_steps": sum(r["groups"] != rows[0]["groups"] for r in rows),
        "goodput_tok_s_last": last.get("run_goodput_tok_s"),
        "faults": injector.faults,
        "tail_of_output": output[-3000:] if proc.returncode else "",
    }
    record = {
        **bench_record.header("soak", device="cpu", config={**vars(args), "launcher": " ".join(cmd[1:])}),
        "result": result,
    }
    bench_record.write(args.out, record)
    print(f"\n{'finished':>9}{'steps':>7}{'faults':>7}{'survived':>9}{'lost tok':>9}{'given up':>9}"
          f"{'stale':>6}{'max detect s':>13}")
    det = [d for d in result["detect_s"] if d is not None]
    print(f"{str(result['finished']):>9}{result['steps']:>7}{result['faults_injected']:>7}"
          f"{str(result['faults_survived']):>9}{str(result['lost_tokens']):>9}{result['groups_given_up']:>9}"
          f"{result['staleness_violations']:>6}{(max(det) if det else float('nan')):>13.1f}")
    print(f"wrote {args.out}")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
