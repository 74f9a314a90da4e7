"""Weight sync of a 1.5B model between two processes of one machine, in buckets (issue 33).

    python benchmarks/gpu_weight_sync.py                    # on a GPU machine
    python benchmarks/gpu_weight_sync.py --device cpu       # gloo only (what CI's machine can run)

A sender holds Qwen2.5-1.5B-shaped random bf16 weights under their HF names (as the trainer's
gather leaves them) and a receiver holds a model of the same shape (as an engine does); a sync
moves every tensor into the receiver's copy, bucket by bucket (`--bucket-mb`), and is timed
from the sender's first bucket to the receiver's last copy. Each receiver checks, after each
method, that its weights equal the sender's (a checksum per tensor). Methods, alternating, each
`--reps` times after one warm-up:

- `nccl_broadcast`: `comm/bucket_broadcast.py` over an NCCL group of the two processes, the
  path between GPUs. Both processes sit on the one GPU here, which NCCL may refuse ("Duplicate
  GPU detected"); the record says what happened.
- `cuda_ipc`: the sender fills GPU buckets (two, alternating) and hands the receiver a CUDA IPC
  handle of each (`torch.multiprocessing`), which copies the bucket into its weights: the path
  where trainer and engine share a GPU (SGLang's `update_weights_from_tensor`).
- `gloo_broadcast`: `comm/bucket_broadcast.py` over gloo between host buffers, the CPU path.

Writes benchmarks/results/gpu_weight_sync.json (or `--out`).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import bench_record  # noqa: E402

# Qwen2.5-1.5B's shape.
QWEN2_5_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def hf_shapes(model: dict) -> list[tuple[str, list[int]]]:
    """Every parameter of a Qwen2 causal LM of this shape, by HF name (nothing allocated)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        m = Qwen2ForCausalLM(Qwen2Config(**model))
    return [(n, list(p.shape)) for n, p in m.named_parameters()]


def make_weights(shapes, device: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [(n, torch.randn(s, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16))
            for n, s in shapes]


def checksums(named) -> list[float]:
    return [float(t.float().sum()) for _, t in named]


def _broadcast(rank: int, method: str, args, shapes, results) -> None:
    """One process of a broadcast method."""
    import torch.distributed as dist

    from tide_megatron.comm.bucket_broadcast import broadcast_weights, receive_weights
    from tide_megatron.comm.weight_sync import manifest_of

    device = "cuda" if method == "nccl_broadcast" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=2, timeout=timedelta(seconds=120))
    mine = make_weights(shapes, device, seed=rank)  # the receiver's start differs from the sender's
    manifest = manifest_of(mine, 1, args.bucket_mb << 20)
    params = dict(mine)
    times = []
    for rep in range(1 + args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            broadcast_weights(None, iter(mine), manifest, 0, device)
        else:
            receive_weights(None, manifest, 0, device, lambda views: [params[n].copy_(t) for n, t in views])
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()  # timed until both sides are done
        if rep:
            times.append(time.perf_counter() - t0)
    results.put((rank, times, checksums(mine) if rank == 0 else checksums(list(params.items()))))
    dist.destroy_process_group()


def _cuda_ipc(rank: int, args, shapes, q_in, q_out, results) -> None:
    """Two GPU buckets alternate; the receiver copies each into its weights and hands the slot
    back. `q_in` is what this rank reads, `q_out` what the other one reads."""
    from tide_megatron.comm.weight_sync import bucket_ranges

    torch.cuda.set_device(0)
    mine = make_weights(shapes, "cuda", seed=rank)
    numels = [t.numel() for _, t in mine]
    ranges = bucket_ranges([n * 2 for n in numels], args.bucket_mb << 20)
    largest = max(sum(numels[lo:hi]) for lo, hi in ranges)
    times = []
    for rep in range(1 + args.reps):
        if rank == 0:
            bufs = [torch.empty(largest, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            q_in.get()  # the receiver is listening: start the clock
            t0 = time.perf_counter()
            for b, (lo, hi) in enumerate(ranges):
                if b >= 2:
                    q_in.get()  # the receiver is done with this slot's previous bucket
                buf, offset = bufs[b % 2], 0
                for k in range(lo, hi):
                    buf[offset: offset + numels[k]].copy_(mine[k][1].reshape(-1))
                    offset += numels[k]
                torch.cuda.current_stream().synchronize()
                q_out.put(buf[:offset])
            for _ in range(min(2, len(ranges))):
                q_in.get()
            if rep:
                times.append(time.perf_counter() - t0)
            del bufs
        else:
            q_out.put("go")
            for lo, hi in ranges:
                flat, offset = q_in.get(), 0
                for k in range(lo, hi):
                    mine[k][1].copy_(flat[offset: offset + numels[k]].view(mine[k][1].shape))
                    offset += numels[k]
                torch.cuda.current_stream().synchronize()
                del flat
                q_out.put("done")
    results.put((rank, times, checksums(mine)))


def _child(rank: int, method: str, args, shapes, queues, results) -> None:
    try:
        if method == "cuda_ipc":
            _cuda_ipc(rank, args, shapes, queues[rank], queues[1 - rank], results)
        else:
            _broadcast(rank, method, args, shapes, results)
    except Exception:
        traceback.print_exc()
        results.put((rank, "error", traceback.format_exc(limit=3)[-600:]))


def run_method(method: str, args, shapes) -> dict:
    """Two fresh processes; the sender's timings and both sides' checksums."""
    from tide_megatron.utils.net import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    args.port = free_port()
    results = ctx.Queue()
    queues = [ctx.Queue(), ctx.Queue()]  # queues[r]: what rank r reads (cuda_ipc only)
    procs = [ctx.Process(target=_child, args=(r, method, args, shapes, queues, results)) for r in range(2)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + args.timeout_s
    while len(out) < 2 and time.monotonic() < deadline and all(p.is_alive() or p.exitcode == 0 for p in procs):
        try:
            item = results.get(timeout=1)
        except queue.Empty:
            continue
        out[item[0]] = item
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [v[2] for v in out.values() if v[1] == "error"]
    if errors or len(out) < 2:
        return {"method": method, "ok": False,
                "error": errors[0] if errors else f"no result within {args.timeout_s} s (exit codes "
                                                  f"{[p.exitcode for p in procs]})"}
    (_, sent_times, sent_sums), (_, _, got_sums) = out[0], out[1]
    gb = sum(int(torch.Size(s).numel()) * 2 for _, s in shapes) / 1e9
    med = statistics.median(sent_times)
    return {"method": method, "ok": True, "equal": sent_sums == got_sums, "gb": round(gb, 3),
            "seconds_median": round(med, 4), "seconds_all": [round(t, 4) for t in sent_times],
            "gb_per_s": round(gb / med, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: every method; cpu: gloo_broadcast only")
    parser.add_argument("--model", choices=("1.5b", "small"), default="1.5b")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240, help="per method, both processes")
    parser.add_argument("--out", default="gpu_weight_sync")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu)")
    shapes = hf_shapes(QWEN2_5_1_5B if args.model == "1.5b" else SMALL)
    methods = ["nccl_broadcast", "cuda_ipc", "gloo_broadcast"] if args.device == "cuda" else ["gloo_broadcast"]
    rows = []
    for method in methods:
        t0 = time.perf_counter()
        row = run_method(method, args, shapes)
        print(f"{method}: {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append(row)
    print(f"{'method':16} {'ok':>3} {'equal':>5} {'GB':>6} {'s/sync':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['method']:16} {str(r['ok'])[0]:>3} {str(r.get('equal', '-'))[0]:>5} {r.get('gb', '-'):>6} "
              f"{r.get('seconds_median', '-'):>8} {r.get('gb_per_s', '-'):>7}")
    machine = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None}
    bench_record.write(args.out, {
        **bench_record.header("gpu_weight_sync", config=vars(args), **machine),
        "model": args.model, "bucket_mb": args.bucket_mb, "reps": args.reps, "results": rows,
        "notes": ["Two processes on one machine; on cuda both use GPU 0. Timed on the sender from its first "
                  "bucket to the receiver's last copy (a barrier or the last slot handed back), median of "
                  "--reps after one warm-up; 'equal': the receiver's checksums equal the sender's."],
    })


if __name__ == "__main__":
    main()
