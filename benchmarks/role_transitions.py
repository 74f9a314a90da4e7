"""How long each trainer-side role change takes (ERS's seamless scaling, the trainer half).

    python benchmarks/role_transitions.py                     # tiny_cpu's model, CPU, 3 ranks
    python benchmarks/role_transitions.py --model-size 30m --repeats 2

Three ranks (TP = 1, gloo), each a `TrainerWorker`; every rank runs the same program (a step,
then `apply` of the next assignment), which is what the controller's messages make them do:

    start      rank 0 actor (+ reference), ranks 1, 2 rollout; one step (Adam state exists)
    cold join    rank 1 rollout -> actor: builds its actor, receives weights + optimizer state
    cold ref on  rank 2 rollout -> reference (decoupled): builds it and loads it from disk;
                 actors park theirs in host memory
    ref off      rank 2 reference -> rollout (drops it); actors restore theirs from host memory
    then `--repeats` times:
      leave      rank 1 actor -> rollout: drops its state, parks its reference in host memory
      warm join  rank 1 rollout -> actor: restores its storages, receives the state
      ref on     rank 2 rollout -> reference: reloads it from the checkpoint on disk
      ref off    as above
    with a step after each change (the state is then in use).

Each rank reports the parts of its own change (`TrainerWorker.apply`); the critical path of a
change is the slowest rank. Writes benchmarks/results/role_transitions.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings

import bench_record
import torch

from tide_megatron.utils.net import free_port

MODEL_SIZES = {
    # The tiny_cpu recipe's model (its tiny_bpe vocabulary rounded up for sharding).
    "tiny": dict(vocab_size=3136, hidden_size=64, num_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, ffn_hidden_size=128),
    "30m": dict(vocab_size=16384, hidden_size=512, num_layers=4, num_attention_heads=8,
                num_key_value_heads=4, ffn_hidden_size=1408),
}
WORLD = 3


def make_batch(seed: int, vocab: int, n: int = 8, seq_len: int = 64) -> list:
    from tide_megatron.core.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(seq_len)
    mask[seq_len // 2:] = 1
    return [Trajectory.from_tokens(torch.randint(0, vocab, (seq_len,), generator=g).tolist(), mask.tolist(),
                                   (-torch.rand(seq_len, generator=g) * mask).tolist(),
                                   advantage=float(torch.randn((), generator=g)), index=i) for i in range(n)]


def spmd_step(worker, batch: list, mode: str) -> None:
    """Every rank's part of one step, computed locally from the same global batch."""
    from tide_megatron.core.roles import Role
    from tide_megatron.trainer.assignment import split_by_dp
    from tide_megatron.trainer.payload import micro_batch_of
    from tide_megatron.trainer.ra2p import ReadySource

    a = worker.assignment
    shards = split_by_dp(batch, a.dp_size)
    mbs = {dp: [micro_batch_of(shard[i:i + 2]) for i in range(0, len(shard), 2)] for dp, shard in enumerate(shards)}
    if worker.role in (Role.ACTOR, Role.ACTOR_REF):
        worker.run_step(mode, mbs[a.dp_rank(worker.rank)])
    elif worker.role is Role.REF and mode == "decoupled":
        worker.serve_ref_step({dp: ReadySource(mbs[dp]) for dp in a.served_dp_ranks(worker.rank)})


def _rank(rank: int, args, hf_dir: str, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    from tide_megatron.comm.groups import GroupLayout
    from tide_megatron.models.megatron_gpt import init_parallel, spawned_rank
    from tide_megatron.trainer.assignment import TrainerAssignment
    from tide_megatron.trainer.config import TrainerConfig
    from tide_megatron.trainer.offload import ModelOffloader, OffloadConfig
    from tide_megatron.trainer.worker import TrainerWorker

    with spawned_rank(rank, WORLD, port, args.threads):
        registry = init_parallel(tp_size=1, seed=0)
        layout = GroupLayout(WORLD, 1)
        alone, pair = TrainerAssignment(layout, 1), TrainerAssignment(layout, 2)
        decoupled = TrainerAssignment(layout, 2, ref_ranks=(2,), actors_hold_ref=False)
        import torch.distributed as dist

        cfg = TrainerConfig(lr=1e-5, kl_coef=0.05, clip_grad=1.0)
        worker = TrainerWorker(cfg, hf_dir, os.path.join(out_dir, "ckpt"), registry, alone, dist.group.WORLD,
                               ref_release="drop" if rank == 2 else "host")
        vocab = MODEL_SIZES[args.model_size]["vocab_size"]
        spmd_step(worker, make_batch(0, vocab), "colocated")
        plan = [("cold join", pair, "colocated"), ("cold ref on", decoupled, "decoupled"),
                ("ref off", pair, "colocated")]
        for _ in range(args.repeats):
            plan += [("leave", alone, "colocated"), ("warm join", pair, "colocated"),
                     ("ref on", decoupled, "decoupled"), ("ref off", pair, "colocated")]
        records = []
        for i, (name, new, mode) in enumerate(plan):
            dist.barrier()  # every rank starts the change together, as at the post-update boundary
            times = worker.apply(new)
            records.append({"transition": name, "times": times})
            spmd_step(worker, make_batch(i + 1, vocab), mode)
        sizes = {}
        if worker.actor is not None:  # resident between steps: weights, grad buffer, Adam state
            sizes["actor_state_bytes"] = ModelOffloader(worker.actor.model, OffloadConfig(optimizer_state=True),
                                                        optimizer=worker.actor.optimizer).nbytes
        if worker.ref is not None:  # counted from shapes: it may be parked (storages freed) now
            sizes["ref_bytes"] = sum(p.numel() * p.element_size() for p in worker.ref.model.parameters())
        torch.save({"records": records, "sizes": sizes}, os.path.join(out_dir, f"rank{rank}.pt"))


def summarise(ranks: list[dict]) -> list[dict]:
    """Per transition: each rank's parts (median over repeats) and the critical path."""
    names = list(dict.fromkeys(r["transition"] for r in ranks[0]["records"]))
    rows = []
    for name in names:
        per_rank = {}
        for rank, data in enumerate(ranks):
            runs = [r["times"] for r in data["records"] if r["transition"] == name]
            keys = dict.fromkeys(k for t in runs for k in t if k != "total_s")
            parts = {k: statistics.median(t.get(k, 0.0) for t in runs) for k in keys}
            per_rank[rank] = {k: v for k, v in parts.items() if v > 0} | {
                "total_s": statistics.median(t["total_s"] for t in runs)}
        totals = [max(data["records"][i]["times"]["total_s"] for data in ranks)
                  for i, r in enumerate(ranks[0]["records"]) if r["transition"] == name]
        rows.append({"transition": name, "repeats": len(totals), "critical_path_s_median": statistics.median(totals),
                     "critical_path_s_max": max(totals), "per_rank": per_rank})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="role_transitions", help="results file: benchmarks/results/NAME.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_random_hf_checkpoint(os.path.join(tmp, "hf"), ModelConfig(**MODEL_SIZES[args.model_size]), seed=0)
        torch.multiprocessing.spawn(_rank, args=(args, hf_dir, free_port(), tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    rows = summarise([{"records": r["records"]} for r in ranks])
    print(f"{'transition':<12}{'critical s':>11}  per rank (median parts, s)")
    for row in rows:
        parts = "; ".join(f"r{rank}: " + ", ".join(f"{k[:-2]} {v:.4f}" for k, v in p.items())
                          for rank, p in row["per_rank"].items() if len(p) > 1)
        print(f"{row['transition']:<12}{row['critical_path_s_median']:>11.4f}  {parts}")
    record = {
        "benchmark": "role_transitions",
        **bench_record.header("role_transitions", config=vars(args)),
        "host": {"cpu_count": os.cpu_count(), "load_avg_1_5_15": os.getloadavg(), "torch": torch.__version__,
                 "device": "cpu"},
        "model": MODEL_SIZES[args.model_size],
        "sizes": {f"rank{r}": data["sizes"] for r, data in enumerate(ranks)},
        "results": rows,
        "notes": [
            "CPU, gloo, 3 ranks on a shared 2-core machine; each rank reports its own parts of a change "
            "(TrainerWorker.apply); the critical path of a change is its slowest rank.",
            "Parts: actor_release (drop weights, grads and optimizer state: other DP ranks hold them), "
            "actor_build (a rank that never held an actor builds one, no weights loaded), actor_restore "
            "(re-allocate the dropped storages), dp_switch (select the new DP size's pre-made groups), "
            "state_send / state_recv (weights + Adam state over the new DP group, point to point), "
            "ref_release (host: copy to host memory; drop: free), ref_build_load (build + load from the "
            "HF checkpoint on disk), ref_restore_host, ref_reload_disk.",
            "On CPU a 'device' copy is a host memcpy; on GPU the same parts are PCIe copies (parks, "
            "restores) and NCCL point-to-point (state transfer).",
        ],
    }
    bench_record.write(args.name, record)


if __name__ == "__main__":
    main()
