"""How fast the simulator and the core CTB decision are.

    python benchmarks/sim_speed.py            # all three measurements
    python benchmarks/sim_speed.py --skip-large

1. 100 steps of the 32-GPU text workload, TIDE and async_static, one process (goal: < 15 s on
   one core; wall and process CPU time are both recorded, the machine is shared).
2. A 1,024-GPU run of ~100,000 trajectories (wall time and peak memory via tracemalloc-free
   `resource.getrusage` max RSS).
3. One core `CTBScheduler.schedule` decision over 10,000 resident tasks on 64 ranks (median).
Writes benchmarks/results/sim_speed.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import bench_record

from tide_megatron.core.ctb import CTBConfig, CTBScheduler, RolloutTask, TaskState
from tide_megatron.sim import run_simulation
from tide_megatron.sim.loader import load_config


GOAL_TEXT_100_STEPS_S = 15.0


def text_100_steps(mode: str) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    m = run_simulation(load_config("text_32gpu", [f"mode={mode}"]))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"mode": mode, "wall_s": wall, "cpu_s": cpu, "goal_s": GOAL_TEXT_100_STEPS_S,
            "goal_met": cpu < GOAL_TEXT_100_STEPS_S, "events": m.events, "steps": len(m.steps), "goodput": m.goodput}


def large_run(mode: str) -> dict:
    """1,024 GPUs; 32x the text batch (2,048 groups x 8 = 16,384 trajectories per step); 6 steps
    plus in-flight work ~ 100k trajectories."""
    over = [f"mode={mode}", "n_gpus=1024", "steps=6", "workload.batch_groups=2048", "workload.min_batch_groups=1024",
            "workload.env_concurrency=32768", "workload.eval_tasks=4096", "record_timeline=false", "plot=false"]
    t0 = time.perf_counter()
    m = run_simulation(load_config("text_32gpu", over))
    return {"mode": mode, "wall_s": time.perf_counter() - t0, "events": m.events, "steps": len(m.steps),
            "trajectories_finished": m.trajectories_finished, "goodput": m.goodput, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def ctb_decision(n_tasks: int = 10_000, n_ranks: int = 64, repeats: int = 50) -> dict:
    """Steady state: 10k tasks resident (admitted), one more group queued, then repeated
    `schedule` calls (each sees usage changes, as after a batch of turn reports)."""
    cfg = CTBConfig(rank_token_budget=10**9, env_concurrency=n_tasks + 64, trainer_batch_trajectories=n_tasks,
                    staleness_throttle=False)
    sched = CTBScheduler(cfg, range(n_ranks))
    tasks = [RolloutTask(i, i // 8, "webshop" if i % 2 else "alfworld", 1000) for i in range(n_tasks)]
    sched.submit(tasks)
    for _ in range(20):  # probes first, then the rest of each group once probed
        for d in sched.schedule(0.0):
            sched.on_turn_started(d.task.task_id, 1500)
            sched.on_turn_finished(d.task.task_id, 1600)
    resident = len(sched.tasks_in(TaskState.RUNNING))
    steady, admit = [], []
    for k in range(repeats):
        tid = k % n_tasks
        sched.on_turn_started(tid, 1700 + k)
        t0 = time.perf_counter()
        sched.schedule(float(k))  # usage changed, nothing to admit: the common case
        steady.append(time.perf_counter() - t0)
        gid = n_tasks + k
        sched.submit([RolloutTask(10**9 + 8 * k + i, gid, "webshop", 1000) for i in range(8)])
        t0 = time.perf_counter()
        sched.schedule(float(k))  # a new group arrives: its probe is placed
        admit.append(time.perf_counter() - t0)
    return {"tasks": n_tasks, "ranks": n_ranks, "resident": resident,
            "median_ms": statistics.median(steady) * 1e3, "p90_ms": sorted(steady)[int(0.9 * repeats)] * 1e3,
            "admit_median_ms": statistics.median(admit) * 1e3,
            "admit_p90_ms": sorted(admit)[int(0.9 * repeats)] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    out = bench_record.header("sim_speed", config=vars(args))
    out["ctb_decision"] = ctb_decision()
    print("ctb decision", out["ctb_decision"], flush=True)
    out["text_100_steps"] = [text_100_steps(m) for m in ("tide", "async_static")]
    print("text 100 steps", out["text_100_steps"], flush=True)
    if not args.skip_large:
        out["large_1024gpu"] = large_run("tide")
        print("large", out["large_1024gpu"], flush=True)
    path = Path(__file__).resolve().parent / "results" / "sim_speed.json"
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
