"""RA2P micro-benchmark: one step over N ready micro-batches under VS, VSO, CM and DM.

Paper, "Extended Evaluation and Micro-Benchmarks": eight ready micro-batches (the high-RAS
regime), colocated mode (CM) and decoupled mode (DM) against vanilla streaming with (VSO) and
without (VS) model offloading; per-step time and the ratio to VSO.

    python benchmarks/ra2p_microbench.py                                   # CPU, ~30M params
    python benchmarks/ra2p_microbench.py --device cuda --model-size 1.5b --mb-tokens 8192

Each method runs in fresh processes (Megatron's CPU shims are process-wide): VS, VSO and CM in
one process (Ref and Actor colocated); DM in two, a Ref rank and an Actor rank, each its own
default group, with the log-probs streamed over a gloo group between them. On one machine DM
therefore uses two processes (two cores on CPU; two GPUs on CUDA, or both on GPU 0 when the
machine has one) where the others use one; the JSON notes say which. Timings: the executors' own (CUDA-synchronised on GPU); the step time is
the median over the measured steps after `--warmup` steps.
Writes benchmarks/results/ra2p_microbench.json (command, machine, date, figures).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import traceback
import warnings
from datetime import timedelta

import bench_record
import torch

from tide_megatron.utils.net import free_port

MODEL_SIZES = {
    # ~29M params: big enough that a swap (params + grad buffer, ~340 MB moved) is visible on CPU.
    "30m": dict(vocab_size=16384, hidden_size=512, num_layers=4, num_attention_heads=8,
                num_key_value_heads=4, ffn_hidden_size=1408, max_position_embeddings=4096),
    # Qwen2.5-1.5B's shape (random weights).
    "1.5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, ffn_hidden_size=8960, tie_word_embeddings=True,
                 max_position_embeddings=32768),
}
METHODS = ("VS", "VSO", "CM", "DM")


def make_micro_batches(num_mb: int, mb_tokens: int, seq_len: int, vocab: int, seed: int = 0):
    """`num_mb` micro-batches of mb_tokens // seq_len rows x seq_len tokens, half generated."""
    from tide_megatron.trainer.batch import TrajectoryTensors, collate

    g = torch.Generator().manual_seed(seed)
    rows = max(mb_tokens // seq_len, 1)
    out = []
    for _ in range(num_mb):
        trajs = []
        for _ in range(rows):
            mask = torch.zeros(seq_len)
            mask[seq_len // 2:] = 1
            trajs.append(TrajectoryTensors(torch.randint(0, vocab, (seq_len,), generator=g), mask,
                                    -torch.rand(seq_len, generator=g) * mask, float(torch.randn((), generator=g))))
        out.append(collate(trajs))
    return out


def _trainer_cfg(args):
    from tide_megatron.trainer.config import TrainerConfig

    return TrainerConfig(lr=1e-6, kl_coef=0.05, clip_grad=1.0, bf16=args.device == "cuda")


def _median_report(reports: list) -> dict:
    keys = ("wall_s", "ref_fwd_s", "actor_fwd_s", "actor_bwd_s", "swap_s", "ref_wait_s", "optimizer_s")
    out = {k: statistics.median(r[k] for r in reports) for k in keys}
    out.update(num_swaps=reports[-1]["num_swaps"], ref_rounds=reports[-1]["ref_rounds"],
               step_s_all=[r["wall_s"] for r in reports])
    return out


def run_colocated(args, hf_dir: str, method: str) -> dict:
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
    from tide_megatron.trainer.ra2p import ColocatedConfig, ColocatedExecutor, CostMeter

    cfg = ModelConfig(**MODEL_SIZES[args.model_size])
    ccfg = {"VS": ColocatedConfig.vanilla_streaming(offload=False),
            "VSO": ColocatedConfig.vanilla_streaming(offload=True),
            "CM": ColocatedConfig()}[method]
    meter = CostMeter()
    executor = ColocatedExecutor(MegatronActor(cfg, _trainer_cfg(args), hf_dir),
                                 ReferenceModel(cfg, hf_dir, bf16=args.device == "cuda"), ccfg, meter)
    reports = []
    for step in range(args.warmup + args.steps):
        mbs = make_micro_batches(args.num_mb, args.mb_tokens, args.seq_len, cfg.vocab_size, seed=step)
        _, report = executor.run_step(mbs)
        if step >= args.warmup:
            reports.append(report.as_dict())
    out = _median_report(reports)
    out["meter"] = dict(meter.values)
    out["swap_bytes"] = executor.actor_offloader.nbytes + executor.ref_offloader.nbytes
    return out


def run_decoupled(args, hf_dir: str, rank: int, stream_port: int) -> dict | None:
    """Stream rank 0 is the Ref, rank 1 the Actor."""
    import torch.distributed as dist

    from tide_megatron.models.config import ModelConfig
    from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
    from tide_megatron.trainer.ra2p import (CostMeter, DecoupledActorExecutor, DecoupledConfig, LogprobStream,
                                            RefStreamServer)

    cfg = ModelConfig(**MODEL_SIZES[args.model_size])
    store = dist.TCPStore("127.0.0.1", stream_port, 2, is_master=rank == 0, timeout=timedelta(seconds=600))
    stream = LogprobStream.create(store, rank, 2)
    dcfg = DecoupledConfig(ref_rank=0, actor_ranks=(1,))
    meter = CostMeter()
    reports = []
    if rank == 0:
        server = RefStreamServer(ReferenceModel(cfg, hf_dir, bf16=args.device == "cuda"), stream, dcfg, meter)
    else:
        executor = DecoupledActorExecutor(MegatronActor(cfg, _trainer_cfg(args), hf_dir), stream, dcfg, meter)
    for step in range(args.warmup + args.steps):
        mbs = make_micro_batches(args.num_mb, args.mb_tokens, args.seq_len, cfg.vocab_size, seed=step)
        stream.group.barrier().wait()  # both sides start the step together
        if rank == 0:
            server.serve_step({1: mbs})
        else:
            _, report = executor.run_step(mbs)
            if step >= args.warmup:
                reports.append(report.as_dict())
    # The Ref's measured forward goes to the Actor side (what the mode selector would merge).
    stream.group.barrier().wait()
    if rank == 0:
        torch.save(dict(meter.values), os.path.join(args.tmp, "dm_ref_meter.pt"))
    stream.group.barrier().wait()
    stream.close()
    if rank == 1:
        out = _median_report(reports)
        out["meter"] = dict(meter.values)
        out["ref_meter"] = torch.load(os.path.join(args.tmp, "dm_ref_meter.pt"))
        return out
    return None


def _worker(rank: int, args, hf_dir: str, method: str, ports: tuple[int, int]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from tide_megatron.models.megatron_gpt import destroy_parallel, init_parallel

    try:
        # Every process is its own single-rank default world (DM's two ranks meet on the stream
        # group only); on CUDA each DM rank gets its own GPU, or both share GPU 0 when there is one.
        if args.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
        init_parallel(tp_size=1, seed=0)
        if method == "DM":
            result = run_decoupled(args, hf_dir, rank, ports[1])
        else:
            result = run_colocated(args, hf_dir, method)
        if result is not None:
            torch.save(result, os.path.join(args.tmp, f"{method}.pt"))
    except Exception:
        traceback.print_exc()
        raise
    finally:
        destroy_parallel()



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="30m")
    parser.add_argument("--num-mb", type=int, default=8, help="ready micro-batches per step")
    parser.add_argument("--mb-tokens", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="measured steps per method")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ra2p_microbench.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from tide_megatron.core.ra2p import RA2PConfig
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.trainer.ra2p import CostMeter, ModeSelector, ModeSelectorConfig

    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        model_cfg = ModelConfig(**MODEL_SIZES[args.model_size])
        hf_dir = write_random_hf_checkpoint(os.path.join(tmp, "hf"), model_cfg, seed=0)
        results = {}
        for method in args.methods.split(","):
            nprocs = 2 if method == "DM" else 1
            torch.multiprocessing.spawn(_worker, args=(args, hf_dir, method, (free_port(), free_port())),
                                        nprocs=nprocs, join=True)
            results[method] = torch.load(os.path.join(tmp, f"{method}.pt"), weights_only=False)
            print(f"{method}: step {results[method]['wall_s']:.3f} s", flush=True)

    base = results.get("VSO", {}).get("wall_s")
    print(f"\n{'method':<6}{'step_s':>9}{'vs_VSO':>8}{'swaps':>7}{'swap_s':>8}{'ref_s':>8}{'fwd_s':>8}{'bwd_s':>8}{'wait_s':>8}")
    for method, r in results.items():
        ratio = r["wall_s"] / base if base else float("nan")
        r["ratio_vs_vso"] = ratio
        print(f"{method:<6}{r['wall_s']:>9.3f}{ratio:>8.3f}{r['num_swaps']:>7}{r['swap_s']:>8.3f}"
              f"{r['ref_fwd_s']:>8.3f}{r['actor_fwd_s']:>8.3f}{r['actor_bwd_s']:>8.3f}{r['ref_wait_s']:>8.3f}")

    # The mode the selector picks on these measured costs, for two readiness patterns.
    selection = {}
    if "CM" in results:
        meter = CostMeter()
        meter.merge(results["CM"]["meter"])
        # The cost model's micro-batch is this run's (mb_tokens per rank), on a 3-actor trainer.
        cost_model = RA2PConfig(pipeline_fill_s=0.0, tokens_per_rank=args.mb_tokens)
        selector = ModeSelector(ModeSelectorConfig(ra2p=cost_model), meter)
        per_mb = sum(meter.times(args.mb_tokens).__dict__.values())
        mb = cost_model.micro_batch_tokens(3)
        for label, (ras, tprm) in {"high_ras_short_tprm": (args.num_mb, 0.0),
                                   "low_ras_long_tprm": (1, 4 * per_mb)}.items():
            choice = selector.choose(3, ras_tokens=ras * mb, arrival_tokens_per_s=mb / tprm if tprm else math.inf,
                                     step_tokens=args.num_mb * mb, ref_ranks=cost_model.ref_ranks_for(3))
            selection[label] = dict(ras=ras, tprm_s=tprm, dp_size=3, mode=choice.mode.value,
                                    cost_decoupled=choice.cost_decoupled, cost_colocated=choice.cost_colocated)
        print("\nmode selection on measured costs:", {k: v["mode"] for k, v in selection.items()})

    record = {
        **bench_record.header("ra2p_microbench", torch=torch.__version__, device=args.device,
                              gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                              config={k: v for k, v in vars(args).items() if k != "tmp"}),
        "model": dict(MODEL_SIZES[args.model_size],
                      params=_param_count(MODEL_SIZES[args.model_size])),
        "results": results,
        "mode_selection_on_measured_costs": selection,
        "notes": [
            f"{args.device.upper()} figures, reported as measured; median of {args.steps} step(s) after {args.warmup} warm-up.",
            "VS, VSO, CM: one process, Ref and Actor colocated. DM: two processes (Ref rank, Actor rank) on "
            "one machine, log-probs streamed over a gloo group; it uses twice the cores/GPUs of the others.",
            "Swaps: Actor params + DDP grad buffer, Ref params (optimizer state stays resident). On CPU a swap "
            "is a copy into a separate host buffer, free, re-allocate and copy back (real memcpy cost).",
            ("CUDA run: pinned host buffers, side-stream copies, CUDA-synchronised timings. With one GPU, DM's "
             "Ref and Actor processes share it (two CUDA contexts on one device), so DM's overlap is bounded "
             "by one device's compute, unlike the paper's separate GPUs."
             if args.device == "cuda" and torch.cuda.device_count() < 2 else
             "CUDA run: pinned host buffers, side-stream copies, CUDA-synchronised timings; DM on two GPUs."
             if args.device == "cuda" else
             "GPU figures: see ra2p_microbench_cuda.json (--device cuda --model-size 1.5b --mb-tokens 8192)."),
        ],
    }
    bench_record.write(args.out, record)


def _param_count(kw: dict) -> int:
    h, f, v, layers = kw["hidden_size"], kw["ffn_hidden_size"], kw["vocab_size"], kw["num_layers"]
    kv = h // kw["num_attention_heads"] * kw["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f + 2 * h
    return layers * per_layer + v * h * (1 if kw.get("tie_word_embeddings") else 2) + h


if __name__ == "__main__":
    main()
