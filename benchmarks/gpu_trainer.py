"""The Megatron trainer's step on one GPU: tokens/s, model FLOPs utilisation, peak memory.

    python benchmarks/gpu_trainer.py                       # Qwen2.5-1.5B shape, random weights
    python benchmarks/gpu_trainer.py --device cpu --model small --steps 1   # a smoke run

One process, one rank (TP 1, DP 1), the local layer spec (Transformer Engine is not installed on
the lent GPU machine), bf16, Megatron's own random init. A step is `MegatronActor.train_step`
over `--micro-batches` budgets of `--mb-tokens` tokens (`trainer.batch.micro_batches_by_budget`).
`--configs` lists WORKLOAD:LAYOUT:RECOMPUTE triples:

- workloads: `uniform`, trajectories of `--seq-len` tokens (no padding either way), and
  `varied`, lengths drawn log-uniformly between 300 and `--mb-tokens` tokens, as in agentic
  batches;
- layouts: `padded` (rows padded to the longest, dense causal mask) and `packed` (one row,
  attention per trajectory: `torch.nn.functional.scaled_dot_product_attention`, flash on CUDA);
  tokens/s counts real tokens only;
- recompute: none / selective / full (`trainer.recompute`);
- an optional fourth field rounds each micro-batch's computed length up to a multiple
  (`trainer.pad_to_multiple_of`; packed: a masked filler segment).

Model FLOPs per real token: 6 x (matmul parameters, the output layer included) + 6 x layers x
hidden x sequence length (causal attention: half of PaLM's 12 L H T, since a causal score
matrix is half-used); MFU against `--peak-tflops` (H200 dense bf16: 989). Timings are
CUDA-synchronised, median over `--steps` after `--warmup`; each configuration runs in a
process of its own (its memory peak is its own; one that fails is recorded with its error). Writes
benchmarks/results/gpu_trainer.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import bench_record  # noqa: E402

MODELS = {
    # Qwen2.5-1.5B's shape.
    "1.5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, ffn_hidden_size=8960, tie_word_embeddings=True,
                 max_position_embeddings=32768),
    "small": dict(vocab_size=4096, hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  ffn_hidden_size=704, max_position_embeddings=8192),
}


def matmul_params(m: dict) -> int:
    h, f, layers = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"]
    head = h // m["num_attention_heads"]
    qkv = h * (h + 2 * m["num_key_value_heads"] * head)
    return layers * (qkv + h * h + 3 * h * f) + m["vocab_size"] * h  # + the output layer


def flops_per_token(m: dict, seq_len: float) -> float:
    return 6 * matmul_params(m) + 6 * m["num_layers"] * m["hidden_size"] * seq_len


def workload(kind: str, args, vocab: int, seed: int):
    """(trajectories, their lengths) for one step."""
    from tide_megatron.trainer.batch import TrajectoryTensors

    g = torch.Generator().manual_seed(seed)
    total = args.micro_batches * args.mb_tokens
    lengths: list[int] = []
    if kind == "uniform":
        lengths = [args.seq_len] * (total // args.seq_len)
    else:
        while sum(lengths) < total:
            u = float(torch.rand((), generator=g))
            lengths.append(int(math.exp(math.log(300) + u * (math.log(args.mb_tokens) - math.log(300)))))
        lengths[-1] -= sum(lengths) - total
        lengths = [n for n in lengths if n >= 16]
    trajs = []
    for n in lengths:
        mask = torch.zeros(n)
        mask[n // 4:] = 1  # a prompt, then generated tokens
        trajs.append(TrajectoryTensors(torch.randint(0, vocab, (n,), generator=g), mask,
                                -torch.rand(n, generator=g) * mask, float(torch.randn((), generator=g))))
    return trajs, lengths


def run_config(args, kind: str, layout: str, recompute: str, pad: str = "1") -> dict:
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.batch import BatchLayout, micro_batches_by_budget
    from tide_megatron.trainer.config import TrainerConfig

    m = MODELS[args.model]
    cuda = args.device == "cuda"
    actor = MegatronActor(ModelConfig(**m), TrainerConfig(lr=1e-6, kl_coef=0.0, bf16=cuda, recompute=recompute,
                                                          layer_spec="local"), None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, tokens, padded, attn = [], 0, 0, 0.0
    for step in range(args.warmup + args.steps):
        trajs, lengths = workload(kind, args, m["vocab_size"], seed=step)
        mbs = micro_batches_by_budget(trajs, args.mb_tokens, BatchLayout(packed=layout == "packed", pad_to_multiple_of=int(pad)))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = actor.train_step(mbs)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            tokens += sum(lengths)
            padded += sum(mb.token_ids.numel() for mb in mbs)
            attn += sum(n * n for n in lengths)
        assert math.isfinite(result.loss), result
    secs = sum(times)
    flops = 6 * matmul_params(m) * tokens + 6 * m["num_layers"] * m["hidden_size"] * attn
    out = {"workload": kind, "layout": layout, "recompute": recompute, "pad_to_multiple_of": int(pad), "step_s_median": round(statistics.median(times), 4),
           "tokens_per_s": round(tokens / secs, 1), "padding_share": round(1 - tokens / padded, 4),
           "micro_batches_per_step": len(mbs), "tflops": round(flops / secs / 1e12, 2),
           "mfu": round(flops / secs / 1e12 / args.peak_tflops, 4) if cuda else None,
           "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None}
    del actor
    if cuda:
        torch.cuda.empty_cache()
    return out


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "Error" in line] or stderr.splitlines() or ["no output"]
    return lines[-1].strip()[:400]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    parser.add_argument("--mb-tokens", type=int, default=8192, help="token budget of a micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="token budgets per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="row length of the uniform workload")
    parser.add_argument("--configs", default="uniform:packed:none,varied:padded:none,varied:packed:none,"
                        "varied:packed:selective,varied:packed:full", help="WORKLOAD:LAYOUT:RECOMPUTE[:PAD_TO_MULTIPLE_OF],...")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak")
    parser.add_argument("--out", default="gpu_trainer")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # one config, in a child
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu)")
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tide_megatron.utils.net import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from tide_megatron.models.megatron_gpt import init_parallel

    try:
        import transformer_engine  # noqa: F401
        te = True
    except ImportError:
        te = False
    if args.one:  # one configuration in this process (its own memory peak)
        init_parallel(tp_size=1, seed=0)
        print("RESULT " + json.dumps(run_config(args, *args.one.split(":"))), flush=True)
        return
    rows = []
    for config in args.configs.split(","):
        kind, layout, recompute, *pad = config.split(":")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, *sys.argv, "--one", config], capture_output=True, text=True)
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        rows.append(json.loads(found[0]) if found and proc.returncode == 0 else
                    {"workload": kind, "layout": layout, "recompute": recompute,
                     "pad_to_multiple_of": int(pad[0]) if pad else 1, "error": _last_error(proc.stderr)})
        print(f"{rows[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{'workload':9} {'layout':7} {'recompute':10} {'to':>3} {'step s':>7} {'tok/s':>9} {'pad':>5} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'peak GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:9} {r['layout']:7} {r['recompute']:10} {r['error']}")
            continue
        print(f"{r['workload']:9} {r['layout']:7} {r['recompute']:10} {r['pad_to_multiple_of']:>3} {r['step_s_median']:>7} {r['tokens_per_s']:>9} "
              f"{r['padding_share']:>5} {r['tflops']:>8} {str(r['mfu']):>6} {str(r['peak_memory_gb']):>8}")
    machine = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "transformer_engine": te}
    bench_record.write(args.out, {
        **bench_record.header("gpu_trainer", config=vars(args), **machine),
        "model": args.model, "model_shape": MODELS[args.model], "matmul_params": matmul_params(MODELS[args.model]),
        "mb_tokens": args.mb_tokens, "micro_batches": args.micro_batches, "layer_spec": "local",
        "peak_tflops": args.peak_tflops, "results": rows,
        "notes": ["padded: rows padded to the longest of their micro-batch, a dense causal mask; packed: one "
                  "row per micro-batch, attention per trajectory (trainer.batch.pack).",
                  "flops_per_token(seq) = 6 x matmul_params + 6 x layers x hidden x seq; TFLOP/s and MFU count "
                  "real tokens only."],
    })


if __name__ == "__main__":
    main()
