"""One rollout engine started inside a process that already holds a torch.distributed group (as
a torchrun rank does), for test_sglang_fork.py: it reports which of the engine's children were
forked (an at-fork hook leaves a mark; a spawn runs no Python hook in its child), whether the
engine generates, and whether its shutdown leaves SGLang's load snapshot file behind."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tide_megatron.testing import tiny_checkpoint, worker_args


def main() -> None:
    args = worker_args("fork")
    marks = Path(args.out) / "forked"
    marks.mkdir()
    os.register_at_fork(after_in_child=lambda: (marks / str(os.getpid())).touch())

    import psutil
    import torch.distributed as dist

    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig

    ckpt = tiny_checkpoint(args.out)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(args.out, "rank_store"), rank=0,
                            world_size=1)
    engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=2048, max_running_requests=4, fork_children=bool(args.fork)),
                           ckpt)
    try:
        out = engine.loop.run_until_complete(
            engine.generate([1, 2, 3, 4], {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}))
        children = [p.pid for p in psutil.Process().children(recursive=True)]
        report = {"children": children, "forked": sorted(int(p.name) for p in marks.iterdir()),
                  "generated": len(out.output_ids), "rank_group_kept": dist.is_initialized(),
                  "children_forked": engine.children_forked,
                  "load_snapshot_file_while_up": os.path.exists(engine.load_snapshot_file)}
    finally:
        engine.shutdown()
    report["load_snapshot_file_after_shutdown"] = os.path.exists(engine.load_snapshot_file)
    (Path(args.out) / "results.json").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
