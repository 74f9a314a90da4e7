"""RA2P micro-benchmark: one step under VS, VSO, CM, CMR and DM, in four readiness regimes.

Paper, "Extended Evaluation and Micro-Benchmarks": colocated mode (CM) and decoupled mode (DM)
against vanilla streaming with (VSO) and without (VS) model offloading; per-step time and the
ratio to VSO. CMR is colocated mode with both models resident (`ra2p.offload_idle_model=false`,
the default: what RA2P's colocated mode runs when the memory plan holds the reference on the
GPU, as the baselines' executors do).

A regime is how ready the step's N micro-batches are: RAS of them at the start, the rest
arriving one every TPRM (pushed by a producer thread, as the global buffer's reader does in a
real run). The four regimes, with c the measured compute of one micro-batch (Ref forward +
Actor forward and backward, CMR in the first regime):
    high_ras_short_tprm   RAS = N                (all ready: the paper's setting)
    high_ras_long_tprm    RAS = N/2, TPRM = 2c
    low_ras_short_tprm    RAS = 1,   TPRM = c/2
    low_ras_long_tprm     RAS = 1,   TPRM = 2c
RA2P's auto mode chooses, before each regime, between its colocated mode (CMR) and DM by the core
cost model (`ModeSelector`, the real runs' selector) on costs measured in the first regime; its
result is the chosen executor's measured run. Cost is rank-seconds (step time x ranks: DM runs
a Ref rank beside its Actor rank), the quantity RA2P minimises; step time is reported too.

    python benchmarks/ra2p_microbench.py                                   # CPU, ~30M params
    python benchmarks/ra2p_microbench.py --device cuda --model-size 1.5b --mb-tokens 8192

Each method runs in fresh processes (Megatron's CPU shims are process-wide): VS, VSO, CM and CMR
in one process (Ref and Actor colocated); DM in two, a Ref rank and an Actor rank, each its own
default group, with the log-probs streamed over a gloo group between them. On one machine DM
therefore uses two processes (two cores on CPU; two GPUs on CUDA, or both on GPU 0 when the
machine has one) where the others use one; the JSON notes say which. Timings: the executors' own
(CUDA-synchronised on GPU); a run's step time is the median over its measured steps after
`--warmup` steps, and with `--reps` the methods run in alternating order, the figure being the
median over repetitions.
Writes benchmarks/results/ra2p_microbench.json (command, machine, date, figures).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
import time
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
METHODS = ("VS", "VSO", "CM", "CMR", "DM")
RANKS = {"DM": 2}  # ranks a method occupies (DM: a Ref rank beside the Actor rank)
REGIMES = ("high_ras_short_tprm", "high_ras_long_tprm", "low_ras_short_tprm", "low_ras_long_tprm")


def regime_readiness(regime: str, num_mb: int, compute_s: float) -> tuple[int, float]:
    """(RAS, TPRM seconds) of a regime for `num_mb` micro-batches of `compute_s` compute each
    (module docstring)."""
    return {"high_ras_short_tprm": (num_mb, 0.0),
            "high_ras_long_tprm": (max(1, num_mb // 2), 2 * compute_s),
            "low_ras_short_tprm": (1, compute_s / 2),
            "low_ras_long_tprm": (1, 2 * compute_s)}[regime]


def arriving(micro_batches: list, ras: int, tprm_s: float):
    """The step's micro-batches as a real step feed gives them: `ras` ready now, the rest pushed
    one every `tprm_s` by a producer thread. All ready (a plain list) when ras covers them."""
    from tide_megatron.trainer.ra2p.source import ArrivingSource

    if ras >= len(micro_batches):
        return micro_batches
    source = ArrivingSource(len(micro_batches), timeout_s=600.0)
    for mb in micro_batches[:ras]:
        source.put(mb)
    started = time.perf_counter()

    def produce() -> None:
        for k, mb in enumerate(micro_batches[ras:], start=1):
            time.sleep(max(0.0, started + k * tprm_s - time.perf_counter()))
            source.put(mb)

    threading.Thread(target=produce, daemon=True).start()
    return source


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
            "CM": ColocatedConfig(),
            "CMR": ColocatedConfig(offload=False, name="colocated_resident")}[method]
    meter = CostMeter()
    executor = ColocatedExecutor(MegatronActor(cfg, _trainer_cfg(args), hf_dir),
                                 ReferenceModel(cfg, hf_dir, bf16=args.device == "cuda"), ccfg, meter)
    reports = []
    for step in range(args.warmup + args.steps):
        mbs = make_micro_batches(args.num_mb, args.mb_tokens, args.seq_len, cfg.vocab_size, seed=step)
        _, report = executor.run_step(arriving(mbs, args.ras, args.tprm_s))
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
        stream.group.barrier().wait()  # both sides start the step (and its arrivals) together
        if rank == 0:
            server.serve_step({1: arriving(mbs, args.ras, args.tprm_s)})
        else:
            _, report = executor.run_step(arriving(mbs, args.ras, args.tprm_s))
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



def _run_method(args, hf_dir: str, method: str) -> dict:
    nprocs = RANKS.get(method, 1)
    torch.multiprocessing.spawn(_worker, args=(args, hf_dir, method, (free_port(), free_port())),
                                nprocs=nprocs, join=True)
    return torch.load(os.path.join(args.tmp, f"{method}.pt"), weights_only=False)


def _auto_choice(args, meter_values: dict, ras: int, tprm_s: float) -> dict:
    """RA2P's choice for this microbenchmark's layout (one Actor rank; a Ref rank beside it for
    DM) from costs measured in the first regime: the real runs' `ModeSelector` with the swap
    cost of colocated mode with both models resident (0)."""
    from tide_megatron.core.ra2p import RA2PConfig
    from tide_megatron.trainer.ra2p import CostMeter, ModeSelector, ModeSelectorConfig

    meter = CostMeter()
    meter.merge(meter_values)
    cost_model = RA2PConfig(pipeline_fill_s=0.0, swap_cost_s=0.0, tokens_per_rank=args.mb_tokens)
    selector = ModeSelector(ModeSelectorConfig(ra2p=cost_model), meter)
    rate = args.mb_tokens / tprm_s if tprm_s > 0 else math.inf
    choice = selector.choose(1, ras_tokens=ras * args.mb_tokens, arrival_tokens_per_s=rate,
                             step_tokens=args.num_mb * args.mb_tokens, ref_ranks=1)
    return dict(method="DM" if choice.mode.value == "decoupled" else "CMR", mode=choice.mode.value,
                cost_decoupled=choice.cost_decoupled, cost_colocated=choice.cost_colocated)


TOLERANCE = 0.05
"""Auto counts as no costlier than the best fixed executor within this share: the same executor
measured twice on this shared host differs by a few percent."""


def _summarise(regime: dict) -> None:
    """Adds rank-seconds, ratios to VSO, and auto against each fixed executor, in place."""
    runs = regime["methods"]
    for method, r in runs.items():
        r["rank_s"] = r["wall_s"] * RANKS.get(method, 1)
        r["ratio_vs_vso"] = r["wall_s"] / runs["VSO"]["wall_s"] if "VSO" in runs else None
    auto = runs.get(regime["auto"]["method"])
    if auto is None:
        return
    regime["auto"].update(step_s=auto["wall_s"], rank_s=auto["rank_s"])
    regime["auto_vs"] = {m: dict(step=auto["wall_s"] / r["wall_s"], rank_s=auto["rank_s"] / r["rank_s"])
                         for m, r in runs.items()}
    # Every method is an executor a user can force (`ra2p.executor`; CMR is `colocated`).
    best = min(runs, key=lambda m: runs[m]["rank_s"])
    regime["best_fixed_by_rank_s"] = best
    regime["auto_no_costlier_than_best_fixed"] = auto["rank_s"] <= runs[best]["rank_s"] * (1 + TOLERANCE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="30m")
    parser.add_argument("--num-mb", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--mb-tokens", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="measured steps per method")
    parser.add_argument("--reps", type=int, default=1, help="repetitions, methods in alternating order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ra2p_microbench.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    methods, regimes = args.methods.split(","), args.regimes.split(",")
    for name, given, known in (("--methods", methods, METHODS), ("--regimes", regimes, REGIMES)):
        if not set(given) <= set(known):
            sys.exit(f"{name}: unknown {sorted(set(given) - set(known))}; expected some of {','.join(known)}")
    if regimes[0] != REGIMES[0] or "CMR" not in methods:
        sys.exit(f"--regimes must start with {REGIMES[0]} and --methods include CMR: the other regimes' "
                 "arrival times and RA2P's costs are measured there")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint

    out_regimes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        model_cfg = ModelConfig(**MODEL_SIZES[args.model_size])
        hf_dir = write_random_hf_checkpoint(os.path.join(tmp, "hf"), model_cfg, seed=0)
        calibration: dict = {}
        for regime in regimes:
            if regime == REGIMES[0]:
                ras, tprm = args.num_mb, 0.0
            else:
                ras, tprm = regime_readiness(regime, args.num_mb, calibration["compute_s"])
            args.ras, args.tprm_s = ras, tprm
            auto = _auto_choice(args, calibration["meter"], ras, tprm) if calibration else None
            reps: dict[str, list[dict]] = {m: [] for m in methods}
            for rep in range(args.reps):
                for method in (methods if rep % 2 == 0 else methods[::-1]):
                    result = _run_method(args, hf_dir, method)
                    reps[method].append(result)
                    print(f"{regime} rep {rep}: {method} step {result['wall_s']:.3f} s", flush=True)
            runs = {}
            for method, results in reps.items():
                runs[method] = dict(results[len(results) // 2] if len(results) % 2 else results[0])
                runs[method]["wall_s"] = statistics.median(r["wall_s"] for r in results)
                runs[method]["wall_s_reps"] = [r["wall_s"] for r in results]
            if not calibration:
                cmr = runs["CMR"]
                meter = dict(cmr["meter"])
                if "DM" in runs:  # the Ref rank's forward, as the selector merges it in real runs
                    meter.update({k: v for k, v in runs["DM"]["ref_meter"].items() if k not in meter})
                calibration = dict(meter=meter, compute_s=(cmr["ref_fwd_s"] + cmr["actor_fwd_s"]
                                                           + cmr["actor_bwd_s"]) / args.num_mb)
                auto = _auto_choice(args, calibration["meter"], ras, tprm)
            out_regimes[regime] = dict(ras=ras, tprm_s=tprm, auto=auto, methods=runs)
            _summarise(out_regimes[regime])

    print(f"\n{'regime':<21}{'method':<7}{'step_s':>8}{'rank_s':>8}{'vs_VSO':>8}{'swaps':>6}{'wait_s':>8}")
    for regime, x in out_regimes.items():
        for method, r in x["methods"].items():
            vso = f"{r['ratio_vs_vso']:>8.3f}" if r["ratio_vs_vso"] is not None else f"{'-':>8}"
            print(f"{regime:<21}{method:<7}{r['wall_s']:>8.3f}{r['rank_s']:>8.3f}{vso}{r['num_swaps']:>6}"
                  f"{r['ref_wait_s']:>8.3f}")
        vs = ", ".join(f"{m} {v['rank_s']:.2f}x" for m, v in x.get("auto_vs", {}).items())
        print(f"{'':<21}auto -> {x['auto']['method']} (rank-s vs {vs}); no costlier than the best fixed "
              f"({x.get('best_fixed_by_rank_s')}): {x.get('auto_no_costlier_than_best_fixed')}")

    record = {
        **bench_record.header("ra2p_microbench", torch=torch.__version__, device=args.device,
                              gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                              config={k: v for k, v in vars(args).items() if k not in ("tmp", "ras", "tprm_s")}),
        "model": dict(MODEL_SIZES[args.model_size],
                      params=_param_count(MODEL_SIZES[args.model_size])),
        "results": out_regimes[REGIMES[0]]["methods"],
        "regimes": out_regimes,
        "auto_tolerance": TOLERANCE,
        "notes": [
            f"{args.device.upper()} figures, reported as measured; per run the median of {args.steps} step(s) "
            f"after {args.warmup} warm-up, the median over {args.reps} repetition(s) in alternating order.",
            "VS, VSO, CM, CMR: one process, Ref and Actor colocated. DM: two processes (Ref rank, Actor rank) on "
            "one machine, log-probs streamed over a gloo group; it uses twice the cores/GPUs of the others, "
            "which its rank_s counts.",
            "`results` is the first regime's (every micro-batch ready), the paper's setting.",
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
