"""One trainer (TP 1 or 2) and three real SGLang engines: every sync's weights, tensor by tensor.

    python weight_sync_worker.py --tp 2 --out DIR [--path broadcast]

Spawns `tp + 3` ranks (gloo). The trainer ranks hold a Megatron actor; rollout ranks run the real
`RolloutWorker` load path on a real engine. Rank 0 sends with `WeightSender` as the controller
does; the first rollout rank shares rank 0's node (it maps rank 0's shared buckets), the other two
stand for a second node (the lower is its relay, the other maps the relay's buckets). Three
syncs, each after the actor's weights changed: to all three rollout ranks, then to two (ERS has
moved the first into the trainer), then to all three again. After each sync every receiver's
engine saves its weights (SGLang's `save_sharded_model`), and rank 0 saves what the trainer
exported; the test compares them tensor by tensor.

`--path broadcast`: rank 0 streams each version through a weight update group with the
receivers instead (`UpdateGroupSender`, the controller's broadcast path): the group is formed
for the first sync, re-formed when the split changes (twice), and rank 0 writes the number of
formations and each one's seconds to `groups.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tide_megatron.testing import tiny_checkpoint

MODEL_KWARGS = dict(vocab_size=3072, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    ffn_hidden_size=128)
ROLLOUT = 3


def receivers_of(version: int, tp: int) -> list[int]:
    first = tp
    return [first + 1, first + 2] if version == 2 else [first, first + 1, first + 2]


def node_of(rank: int, tp: int) -> int:
    return 0 if rank <= tp else 1


def scenario(rank: int, world: int, tp: int, ckpt: str, out: str, path: str = "host") -> None:
    import torch.distributed as dist

    from tide_megatron.comm.mailbox import Mailbox
    from tide_megatron.comm.messages import JoinUpdateGroup, LoadWeights, WeightsLoaded
    from tide_megatron.comm.update_group import UpdateGroupSender
    from tide_megatron.comm.weight_sync import WeightSender, WeightSet, manifest_of
    from tide_megatron.models.megatron_gpt import init_parallel

    registry = init_parallel(tp_size=tp, seed=0)
    store = dist.PrefixStore("test", dist.distributed_c10d._get_default_store())
    mailbox = Mailbox(store, rank)
    job_group = dist.group.WORLD
    actor = worker = None
    if rank < tp:
        from tide_megatron.models.config import ModelConfig
        from tide_megatron.trainer.actor import MegatronActor
        from tide_megatron.trainer.config import TrainerConfig

        actor = MegatronActor(ModelConfig(**MODEL_KWARGS), TrainerConfig(), ckpt, groups=registry.actor_groups(1))
    else:
        from tide_megatron.envs.client import EnvClient
        from tide_megatron.envs.config import EnvClientConfig
        from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
        from tide_megatron.rollout.task_runner import TaskRunnerConfig
        from tide_megatron.rollout.worker import RolloutWorker, build_chat

        engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=2048, max_running_requests=8, seed=rank), ckpt)
        worker = RolloutWorker(rank, engine, TaskRunnerConfig(), build_chat(ckpt, None), EnvClient(EnvClientConfig()),
                               mailbox, job_group)
    sender = WeightSender(job_group, mailbox, rank=0, node_of=lambda r: node_of(r, tp)) if rank == 0 else None
    group = UpdateGroupSender(backend="gloo", device="cpu", engine_tp=1, timeout_s=120) \
        if rank == 0 and path == "broadcast" else None
    rebuilds = []
    sends = []
    dist.barrier()
    for version in (1, 2, 3):
        if actor is not None:
            with torch.no_grad():  # new weights: a different shift per version and parameter
                for i, p in enumerate(actor.module.parameters()):
                    p.add_(1e-3 * version * (i + 1))
            named = [(n, t.clone()) for n, t in actor.hf_weights()]  # collective over TP
            if rank == 0:
                torch.save(dict(named), os.path.join(out, f"trainer_v{version}.pt"))
                if group is None:
                    sends += sender.send(WeightSet(named, version, bucket_bytes=64 << 10), receivers_of(version, tp))
                else:
                    change = group.change_for(receivers_of(version, tp))
                    if change is not None:
                        for r, join in change.joins.items():
                            mailbox.post(r, join)
                        rebuilds.append(group.connect(change))
                    manifest = manifest_of(named, version, bucket_bytes=64 << 10)
                    for r, load in group.loads(manifest).items():
                        mailbox.post(r, load)
                    group.broadcast(iter(named), manifest)
                loaded, deadline = set(), time.monotonic() + 300
                while loaded != set(receivers_of(version, tp)):
                    assert time.monotonic() < deadline, f"version {version}: only {sorted(loaded)} loaded"
                    for msg in mailbox.poll():
                        if isinstance(msg, WeightsLoaded) and msg.version == version:
                            loaded.add(msg.src)
                    time.sleep(0.01)
        elif rank in receivers_of(version, tp):
            deadline = time.monotonic() + 300
            msg = None
            while msg is None:
                assert time.monotonic() < deadline, f"rank {rank}: no LoadWeights for version {version}"
                for m in mailbox.poll():  # a JoinUpdateGroup first, when the group is (re)formed
                    if isinstance(m, JoinUpdateGroup):
                        worker.engine.loop.run_until_complete(worker._handle(m))
                    elif isinstance(m, LoadWeights):
                        msg = m
                time.sleep(0.01)
            kind = "broadcast" if msg.group else "shared" if msg.shared else \
                ("relay" if msg.relay_to else "point to point")
            worker.engine.loop.run_until_complete(worker._handle(msg))
            path = os.path.join(out, f"engine{rank}_v{version}")
            os.makedirs(path)
            worker.engine._engine.save_sharded_model(path=path, pattern=None, max_size=None)
            with open(os.path.join(path, "kind"), "w") as f:
                f.write(kind)
        dist.barrier()
    del sends
    if group is not None:
        with open(os.path.join(out, "groups.json"), "w") as f:
            json.dump({"formations": group.rebuilds, "seconds": rebuilds}, f)
        group.close()
    if worker is not None:
        worker.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--path", choices=("host", "broadcast"), default="host")
    args = parser.parse_args()
    from tide_megatron.models.megatron_gpt import spawn_ranks

    ckpt = tiny_checkpoint(args.out, **MODEL_KWARGS)
    world = args.tp + ROLLOUT
    spawn_ranks(scenario, world, world, args.tp, ckpt, args.out, args.path)


if __name__ == "__main__":
    main()
