"""Weight sync on one host: the earlier rank-0 relay, the shared-memory path and the broadcast path, real SGLang.

    python benchmarks/weight_sync.py [--models tiny,0.5b] [--engines 1,2,3] [--reps 3]

One spawned job per model: rank 0 holds the HF-named weights (as the trainer's gather leaves
them), ranks 1..E each run a real SGLang engine (`RolloutEngine`) on a random checkpoint of the
same shape. A sync is timed on rank 0 from its start to the moment the last engine has loaded
(a barrier after the loads):

- `relay` (the path before `comm/weight_sync.py`'s shared buckets): rank 0 packs the model into
  one host buffer and sends it over gloo to each receiver; each receiver loads it with
  `RolloutEngine.update_weights`, which serializes it for SGLang (a copy into shared memory).
- `shared` (the host path on one node, `scheduler.weight_sync_path=host`): rank 0 writes the
  model once into shared-memory buckets (`weight_sync.share_named`), the handles go to the
  receivers, each maps them and its engine loads from them (`RolloutEngine.load_serialized`),
  as `RolloutWorker` does.
- `broadcast` (`scheduler.weight_sync_path=broadcast`): rank 0 streams the tensors through a
  gloo weight update group with the receivers' engines (`UpdateGroupSender.broadcast`), each
  engine receiving every bucket through SGLang's `update_weights_from_distributed`
  (`RolloutEngine.load_broadcast`). The group is formed once per engine count, before the timed
  syncs; that formation is timed separately (`group_form_s`), as it recurs only when the split
  changes.

The three paths rotate, `--reps` times each, at every engine count; the first engines of the
job receive (the others idle). The paths of one rotation send the same weights (a perturbation
of the checkpoint's), and every sync is checked: each receiving engine's greedy log-probs on a
fixed prompt after each path's sync equal those after the relay sync of the same weights, and
differ from those before. Writes `benchmarks/results/weight_sync.json`, with a model of 7B and
14B bf16 on 32 H100 (`core/memory_estimate.py`'s formulas) for each path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import bench_record  # noqa: E402

MODELS = {
    # The tiny CPU recipe's model, fp32.
    "tiny": (dict(vocab_size=3072, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  ffn_hidden_size=128), "float32"),
    # A ~0.45B Qwen2-shaped model (the tiny vocabulary keeps the engines' KV and logits small), in
    # bf16 as GPU recipes send it: in fp32 the earlier path's copies (rank 0's buffer, each
    # receiver's buffer and its copy for SGLang, each engine's weights) overran 24 GB at 3 engines.
    "0.5b": (dict(vocab_size=3072, hidden_size=1024, num_layers=40, num_attention_heads=16, num_key_value_heads=2,
                  ffn_hidden_size=2816, max_position_embeddings=1024), "bfloat16"),
}
PATHS = ("relay", "shared", "broadcast")
PROMPT = list(range(10, 42))  # every engine's fingerprint of its weights: greedy log-probs after it


def _scenario(rank: int, world: int, args, ckpt: str, out: dict) -> None:
    import torch.distributed as dist

    from tide_megatron.comm.update_group import UpdateGroupSender
    from tide_megatron.models.hf_checkpoint import load_hf_state_dict

    dist.barrier()
    engine = None
    if rank:
        from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig

        engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=2048, max_running_requests=8, seed=rank,
                                                   dtype=args.dtype), ckpt)
    dtype = getattr(torch, args.dtype)
    base = [(n, t.to(dtype)) for n, t in load_hf_state_dict(ckpt).items()] if rank == 0 else None
    dist.barrier()
    runs = []
    version = 0
    # one sender for the whole run, as rank 0 has: each re-formation names a new group, and an
    # engine leaves its previous one when it joins the next
    sender = UpdateGroupSender(backend="gloo", device="cpu", engine_tp=1, timeout_s=600) if rank == 0 else None
    initial = [None] * world
    dist.all_gather_object(initial, _fingerprint(engine) if rank else None)
    before = initial[1]  # every engine starts from the same checkpoint
    for engines in args.engines:
        group = _form_group(rank, sender, engines, engine, base, args.bucket_mb << 20, out)
        for rep in range(args.reps):
            order = PATHS[rep % len(PATHS):] + PATHS[:rep % len(PATHS)]
            prints = {}
            if rank == 0:  # new weights for this pair, in place (a second copy would cost memory)
                for _, t in base:
                    t.add_(1e-3)
            for path in order:
                version += 1
                receivers = list(range(1, engines + 1))
                named = base  # the same weights for both paths of the pair
                dist.barrier()
                t0 = time.perf_counter()
                keep = _sync(rank, path, named, version, receivers, engine, args.bucket_mb << 20, group)
                dist.barrier()
                seconds = time.perf_counter() - t0
                mine = _fingerprint(engine) if rank in receivers else None
                gathered = [None] * world
                dist.all_gather_object(gathered, mine)
                prints[path] = gathered[1:engines + 1]
                if rank == 0:
                    runs.append({"path": path, "engines": engines, "rep": rep, "seconds": seconds})
                    print(f"{args.model:>5} {path:>6} engines={engines} rep={rep}: {seconds:.3f} s", flush=True)
                del keep
            if rank == 0:
                same = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for path in PATHS
                           for a, b in zip(prints["relay"], prints[path]))
                changed = all(abs(a - before) > 1e-6 for path in PATHS for a in prints[path])
                for run in runs[-len(PATHS):]:
                    run["verified"] = same and changed
                if not (same and changed):
                    print(f"  WEIGHTS DIFFER: {prints}", flush=True)
    if sender is not None:
        sender.close()
    if rank == 0:
        out.update(runs=runs, model_bytes=sum(t.numel() * t.element_size() for _, t in base))
        out.setdefault("group_form_s", {})
    dist.barrier()
    if engine is not None:
        engine.shutdown()


def _fingerprint(engine) -> float:
    """Sum of the greedy log-probs of 4 tokens after `PROMPT`: equal weights, equal sums."""
    gen = engine.loop.run_until_complete(engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.0}))
    return float(sum(gen.logprobs))


def _form_group(rank, sender, engines, engine, named, bucket_bytes, out):
    """Form the weight update group of rank 0 and the first `engines` engines, as the
    controller does (`UpdateGroupSender.change_for`, each receiver joins, rank 0 `connect`s);
    returns (rank 0's sender or None, the group's name, the weights' layout: names, shapes,
    dtype, the same every version). Rank 0 records the formation's seconds in `out`."""
    import torch.distributed as dist

    from tide_megatron.comm.weight_sync import manifest_of

    receivers = list(range(1, engines + 1))
    change = None
    box = [None]
    if rank == 0:
        change = sender.change_for(receivers)
        layout = manifest_of(named, 0, bucket_bytes)
        box = [(change.joins, change.name, (layout.names, layout.shapes, layout.dtype))]
    dist.broadcast_object_list(box, src=0)
    joins, name, layout = box[0]
    if rank == 0:
        t0 = time.perf_counter()
        sender.connect(change)
        out.setdefault("group_form_s", {})[engines] = time.perf_counter() - t0
    elif rank in receivers:
        join = joins[rank]
        engine.loop.run_until_complete(engine.join_update_group(
            join.address, join.port, join.rank_offset, join.world_size, join.group_name, join.backend, join.leave))
    return sender, name, layout


def _sync(rank, path, named, version, receivers, engine, bucket_bytes, update_group=None):
    """One sync on this rank; returns what must outlive it (the sender's buffers)."""
    import torch.distributed as dist

    from tide_megatron.comm import bucket_broadcast, weight_sync

    group = dist.group.WORLD
    if path == "broadcast":
        sender, name, layout = update_group
        manifest = weight_sync.WeightManifest(version, *layout, bucket_bytes)
        if rank == 0:
            sender.broadcast(iter(named), manifest)
        elif rank in receivers:
            engine.loop.run_until_complete(engine.load_broadcast(
                bucket_broadcast.bucket_specs(manifest), manifest.dtype, name, version))
        return None
    if path == "relay":
        if rank == 0:
            manifest, flat = weight_sync.pack(named, version)
            works = [group.send([flat], r, version) for r in receivers]
            dist.broadcast_object_list([manifest.to_json()], src=0)
            return works, flat
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if rank in receivers:
            manifest = weight_sync.WeightManifest.from_json(box[0])
            flat, _ = weight_sync.receive_flat(group, manifest, 0, 600.0)
            engine.loop.run_until_complete(engine.update_weights(weight_sync.unpack(manifest, flat), version))
        return None
    if rank == 0:
        manifest, flat = weight_sync.share_named(named, version, bucket_bytes)
        per_receiver = {r: weight_sync.bucket_handles(manifest, flat) for r in receivers}
        dist.broadcast_object_list([per_receiver], src=0)
        return flat
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if rank in receivers:  # as `RolloutWorker` does: map the sender's buckets, hand the engine handles of its own
        mapped = weight_sync.map_buckets(box[0][rank])
        engine.loop.run_until_complete(engine.load_serialized(weight_sync.serialize_buckets(mapped), version))
        return mapped
    return None


def _worker(rank: int, world: int, port: int, args, ckpt: str, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    from tide_megatron.models.megatron_gpt import spawned_rank

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    with spawned_rank(rank, world, port):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        out: dict = {}
        _scenario(rank, world, args, ckpt, out)
        if rank == 0:
            torch.save(out, out_path)


def run_model(name: str, args) -> dict:
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.tokenizer import write_tokenizer
    from tide_megatron.utils.net import free_port

    with tempfile.TemporaryDirectory(prefix="tide-wsync-") as tmp:
        tok = write_tokenizer(os.path.join(tmp, "tok"), kind="tiny_bpe")
        ckpt = write_random_hf_checkpoint(os.path.join(tmp, "hf"), ModelConfig(**MODELS[name][0]), seed=0, tokenizer_dir=tok)
        out_path = os.path.join(tmp, "out.pt")
        args.model, args.dtype = name, MODELS[name][1]
        world = 1 + max(args.engines)
        torch.multiprocessing.spawn(_worker, args=(world, free_port(), args, ckpt, out_path), nprocs=world, join=True)
        return torch.load(out_path, weights_only=False)


def summarise(name: str, result: dict) -> list[dict]:
    rows = []
    gb = result["model_bytes"] / 1e9
    for engines in sorted({r["engines"] for r in result["runs"]}):
        row = {"model": name, "dtype": MODELS[name][1], "model_gb": round(gb, 3), "engines": engines}
        for path in PATHS:
            secs = [r["seconds"] for r in result["runs"] if r["engines"] == engines and r["path"] == path]
            row[f"{path}_s"] = statistics.median(secs)
            row[f"{path}_gb_per_s"] = gb * engines / statistics.median(secs)
        row["speedup"] = row["relay_s"] / row["shared_s"]
        row["broadcast_speedup"] = row["relay_s"] / row["broadcast_s"]
        row["broadcast_over_shared"] = row["shared_s"] / row["broadcast_s"]
        row["group_form_s"] = result["group_form_s"][engines]
        row["verified"] = all(r["verified"] for r in result["runs"] if r["engines"] == engines)
        rows.append(row)
    return rows


def cluster_model() -> dict:
    """7B and 14B bf16 on 32 H100 (4 nodes x 8), the shipped 32-GPU split (8 engines on the last
    node) and 24 engines (3 nodes), by `core/memory_estimate.py`'s formulas and `LinkModel`."""
    from tide_megatron.core.memory_estimate import (LinkModel, broadcast_sync_seconds, node_sync_seconds,
                                                    relay_sync_seconds)

    link = LinkModel()
    out = {"link": link.__dict__, "goal_s": 2.0, "cases": []}
    for model, params, tp in (("Qwen2.5-7B", 7.62e9, 4), ("Qwen2.5-14B", 14.8e9, 8)):
        for engines, by_node in ((8, {3: 8}), (24, {1: 8, 2: 8, 3: 8})):
            b = params * 2
            shared = node_sync_seconds(b, by_node, 0, tp, link)
            broadcast = broadcast_sync_seconds(b, any(node != 0 for node in by_node), tp, link)
            out["cases"].append({"model": model, "engines": engines, "engine_nodes": len(by_node),
                                 "relay_s": round(relay_sync_seconds(b, engines, tp, link), 2),
                                 "shared_s": round(shared, 2), "broadcast_s": round(broadcast, 2),
                                 "meets_goal": broadcast <= 2.0})
    out["formula"] = ("shared: gather (TP-1)/TP*B/nvlink + B/pcie (to host shm) + relays*B/gloo (one per other node "
                      "with engines, serially from rank 0) + B/pcie (engines load, a node's in parallel); relay: "
                      "gather + B/pcie + engines*B/gloo + B/pcie; broadcast (meets_goal): gather + B/nic (one NCCL "
                      "broadcast, pipelined along its ring or tree; NVLink instead of the NIC within a node)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,0.5b")
    parser.add_argument("--engines", default="1,2,3")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--out", default="weight_sync")
    args = parser.parse_args()
    args.engines = [int(e) for e in args.engines.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    record = bench_record.header("weight_sync", config=vars(args))
    rows, raw = [], {}
    for name in args.models.split(","):
        raw[name] = run_model(name, args)
        rows += summarise(name, raw[name])
    print(f"{'model':>6} {'GB':>6} {'engines':>7} {'relay s':>8} {'shared s':>8} {'bcast s':>8} "
          f"{'shared x':>8} {'bcast x':>8} {'form s':>7}")
    for r in rows:
        print(f"{r['model']:>6} {r['model_gb']:>6.2f} {r['engines']:>7} {r['relay_s']:>8.3f} {r['shared_s']:>8.3f} "
              f"{r['broadcast_s']:>8.3f} {r['speedup']:>8.2f} {r['broadcast_speedup']:>8.2f} "
              f"{r['group_form_s']:>7.3f}{'' if r['verified'] else '  WEIGHTS DIFFER'}")
    record.update(summary=rows, runs={k: v["runs"] for k, v in raw.items()}, cluster_model=cluster_model())
    bench_record.write(args.out, record)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
