"""Start-up cost of the trainer's process-group layout (comm/groups.py) against the rank count.

    python benchmarks/group_startup.py        # threads: W = 8..32 eager, 8..64 lazy; processes: W = 8, 16
    python benchmarks/group_startup.py --thread-worlds 32 --lazy-thread-worlds 64 --tps 1,8 --process-worlds 8

Every group a role change may need is created once at start-up, so their number and their
creation time must stay reasonable as the job grows. Two measurements:

- threads: W ranks as threads of one process over one gloo `HashStore`, each building its
  `GroupRegistry` with groups constructed directly (`ProcessGroupGloo`, eager full-mesh
  connection of each group's members, the dominant cost). The whole job's sockets then live in
  one process: past W = 32 with TP = 1 they exceed this machine's open-file limit, so W = 64 runs
  with gloo's lazy connection (`TORCH_GLOO_LAZY_INIT=1`, pairs connect on first use, as NCCL
  groups always do) in a child process.
- processes: W real processes, `init_process_group(gloo)` then the production path
  (`torch.distributed.new_group` for every group of the layout, in one order). Costs one Python
  + torch per rank, so only small W here; it calibrates the thread figures.

Writes benchmarks/results/group_startup.json (command, machine, date, figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta

import bench_record
import torch
import torch.distributed as dist

from tide_megatron.comm.groups import GroupLayout, GroupRegistry, GroupSpec
from tide_megatron.utils.net import free_port


def layout_figures(layout: GroupLayout) -> dict:
    specs = layout.group_specs()
    per_rank = [len(layout.groups_of(r)) for r in range(layout.world_size)]
    return {"groups": layout.num_groups, "groups_per_rank_max": max(per_rank),
            "groups_per_rank_mean": statistics.mean(per_rank),
            "gloo_pairs": sum(len(s.ranks) * (len(s.ranks) - 1) // 2 for s in specs)}


def run_threads(world: int, tp: int, timeout_s: float) -> dict:
    layout = GroupLayout(world, tp)
    store = dist.HashStore()
    seconds: dict[int, float] = {}
    errors: list[BaseException] = []

    def factory(rank: int):
        def create(spec: GroupSpec):
            if rank not in spec.ranks:
                return None
            return dist.ProcessGroupGloo(dist.PrefixStore(spec.name, store), spec.ranks.index(rank),
                                         len(spec.ranks), timedelta(seconds=timeout_s))
        return create

    def run(rank: int) -> None:
        try:
            seconds[rank] = GroupRegistry.build(layout, rank, factory(rank)).startup_s
        except BaseException as exc:  # noqa: BLE001 - reported in the figures
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"W={world} TP={tp}: {errors[0]!r}")
    return {"mode": "threads", "world": world, "tp": tp, **layout_figures(layout), "wall_s": wall,
            "rank_s_max": max(seconds.values())}


def _process_rank(rank: int, world: int, tp: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    started = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    init_s = time.perf_counter() - started
    registry = GroupRegistry.build(GroupLayout(world, tp), rank)
    dist.barrier()
    torch.save({"init_s": init_s, "groups_s": registry.startup_s, "groups": len(registry.groups)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_processes(world: int, tp: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        torch.multiprocessing.spawn(_process_rank, args=(world, tp, free_port(), tmp), nprocs=world, join=True)
        wall = time.perf_counter() - started
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    return {"mode": "processes", "world": world, "tp": tp, **layout_figures(GroupLayout(world, tp)),
            "wall_s_incl_spawn_and_import": wall, "init_process_group_s_max": max(r["init_s"] for r in ranks),
            "rank_s_max": max(r["groups_s"] for r in ranks)}


def run_lazy_threads(worlds: str, tps: str, timeout_s: float) -> list[dict]:
    """The thread measurement in a child process with gloo's lazy connection switched on."""
    import subprocess

    env = dict(os.environ, TORCH_GLOO_LAZY_INIT="1")
    proc = subprocess.run([sys.executable, __file__, "--thread-worlds", worlds, "--lazy-thread-worlds", "",
                           "--process-worlds", "", "--tps", tps, "--timeout-s", str(timeout_s), "--rows-only"],
                          check=True, env=env, capture_output=True, text=True)
    return [dict(r, mode="threads_lazy") for r in json.loads(proc.stdout.splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thread-worlds", default="8,16,32")
    parser.add_argument("--lazy-thread-worlds", default="8,16,32,64")
    parser.add_argument("--process-worlds", default="8,16")
    parser.add_argument("--tps", default="1,2,8")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--name", default="group_startup", help="results file: benchmarks/results/NAME.json")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # the lazy child
    args = parser.parse_args()
    tps = [int(t) for t in args.tps.split(",")]
    rows = []
    for world in [int(w) for w in args.thread_worlds.split(",") if w]:
        rows += [run_threads(world, tp, args.timeout_s) for tp in tps if tp <= world]
    if args.rows_only:
        print(json.dumps(rows))
        return
    if args.lazy_thread_worlds:
        rows += run_lazy_threads(args.lazy_thread_worlds, args.tps, args.timeout_s)
    for world in [int(w) for w in args.process_worlds.split(",") if w]:
        rows += [run_processes(world, tp) for tp in tps if tp <= world]
    print(f"{'mode':<13}{'W':>4}{'TP':>4}{'groups':>8}{'per rank':>9}{'gloo pairs':>11}{'rank s':>9}{'wall s':>9}")
    for r in rows:
        wall = r.get("wall_s", r.get("wall_s_incl_spawn_and_import"))
        print(f"{r['mode']:<13}{r['world']:>4}{r['tp']:>4}{r['groups']:>8}{r['groups_per_rank_max']:>9}"
              f"{r['gloo_pairs']:>11}{r['rank_s_max']:>9.3f}{wall:>9.2f}")
    record = {
        "benchmark": "group_startup",
        **bench_record.header("group_startup", config=vars(args)),
        "host": {"cpu_count": os.cpu_count(), "load_avg_1_5_15": os.getloadavg(), "torch": torch.__version__},
        "results": rows,
        "notes": [
            "groups: unique groups of the layout (W single-rank, W/TP TP blocks, (W/TP-1)*TP DP, W/TP-1 "
            "all-actor groups; TP=1 merges them), not counting the default group. A subset-per-"
            "configuration design would need 2^W - 1.",
            "rank s: the slowest rank's time to create its groups (gloo connects each group's members "
            "eagerly: gloo_pairs TCP pairs in all). wall s: all ranks done (threads), or spawn + imports + "
            "init_process_group + groups (processes).",
            "threads share one process and 2 cores: every gloo pair of the job is connected inside one "
            "process, so the thread figure is the whole job's connection work serialised on this machine, "
            "an upper bound for one rank of a real job. threads_lazy: the same with TORCH_GLOO_LAZY_INIT=1 "
            "(no connection until first use).",
            "64 real processes were not run on this shared 24 GiB machine (about 150 MB private memory per "
            "torch process); the process rows calibrate the thread rows at small W.",
            "With a GPU, comm/topology.py creates these groups NCCL-only; NCCL connects a group on its "
            "first collective, so their start-up cost is bookkeeping (the threads_lazy rows are the "
            "closer CPU analogue).",
        ],
    }
    bench_record.write(args.name, record)


if __name__ == "__main__":
    main()
