"""One training step, padded vs packed micro-batches: tokens/s and peak activation memory (CPU).

    python benchmarks/trainer_throughput.py             # ~5 minutes on 2 cores
    python benchmarks/trainer_throughput.py --reps 1 --step-tokens 4096   # a smoke run

One process, one rank, the local layer spec, fp32, a small random Qwen2-shaped model
(`--hidden`, `--layers`). A step is `MegatronActor.train_step` over micro-batches of at most
`--mb-tokens` computed tokens (`trainer.batch.micro_batches_by_budget`: the sum of lengths when
packed, rows x longest when padded), the trajectories in length order (the RA2P planner's order,
which is padding's best case). Two length distributions, each padded and packed:

- `door_game`: the lengths of door-game episodes (the tiny recipe's environment) played by a
  uniformly random valid policy (a colour word per turn), tokenized with the recipe's tokenizer
  (the prompt, every observation and every action);
- `long_tail`: log-normal lengths (median 300 tokens, sigma 1.0) clipped to 100..4,000 tokens,
  the shape of agentic batches.

Each step's batch is drawn from the distribution (`--step-tokens` tokens, a fresh seed per
repetition, the same batch for both layouts). Layouts alternate within a repetition, the first
one alternating between repetitions, after one unmeasured step of each; medians over `--reps`. Activation memory is measured, not
modelled: the bytes of the distinct storages autograd holds for backward (`saved_tensors_hooks`),
peak over the step; the process RSS peak is recorded too. Writes
benchmarks/results/trainer_throughput.json.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import bench_record  # noqa: E402

LAYOUTS = ("padded", "packed")


def door_game_lengths(episodes: int, seed: int) -> list[int]:
    """Token lengths of door-game episodes played by a random valid policy."""
    from transformers import AutoTokenizer

    from tide_megatron.envs.door_game import COLOURS, DoorGameEnv
    from tide_megatron.envs.env_config import EnvConfig
    from tide_megatron.tokenizer import tokenizer_dir

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("tiny_bpe"))
    env, rng = DoorGameEnv(EnvConfig(name="door_game")), random.Random(seed)
    tasks = env.list_tasks("train")
    lengths = []
    for i in range(episodes):
        text = [env.reset(rng.choice(tasks).task_id, f"t{i}").observation]
        done = False
        while not done:
            action = rng.choice(COLOURS[:env._cfg.num_doors])
            result = env.step(action)
            text += [action, result.observation]
            done = result.done
        lengths.append(sum(len(tok(t)["input_ids"]) + 2 for t in text))  # + turn delimiters
    return lengths


def long_tail_lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(4000, max(100, int(rng.lognormvariate(0.0, 1.0) * 300))) for _ in range(count)]


def batch(lengths: list[int], vocab: int, seed: int):
    """Trajectories of these lengths, longest first: a prompt quarter, then generated tokens."""
    from tide_megatron.trainer.batch import TrajectoryTensors

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sorted(lengths, reverse=True):
        mask = torch.zeros(n)
        mask[max(1, n // 4):] = 1
        out.append(TrajectoryTensors(torch.randint(0, vocab, (n,), generator=g), mask,
                                     -torch.rand(n, generator=g) * mask, float(torch.randn((), generator=g))))
    return out


def draw(kind: str, step_tokens: int, pool: list[int], seed: int) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < step_tokens:
        lengths.append(rng.choice(pool) if kind == "door_game" else long_tail_lengths(1, rng.randrange(1 << 30))[0])
    return lengths


class SavedActivations:
    """Peak bytes of the distinct storages autograd saves for backward, while active."""

    def __init__(self):
        self.live: dict[int, list] = {}  # storage pointer -> [references, bytes]
        self.bytes = self.peak = 0

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.bytes += entry[1]
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        return _Held(self, key, t)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)


class _Held:
    def __init__(self, meter: SavedActivations, key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        entry = self.meter.live[self.key]
        entry[0] -= 1
        if entry[0] == 0:
            self.meter.bytes -= entry[1]
            del self.meter.live[self.key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mb-tokens", type=int, default=8192, help="computed-token budget of a micro-batch")
    parser.add_argument("--step-tokens", type=int, default=32768, help="real tokens per step")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="trainer_throughput")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from tide_megatron.utils.net import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.batch import BatchLayout, micro_batches_by_budget
    from tide_megatron.trainer.config import TrainerConfig

    init_parallel(tp_size=1, seed=0)
    model = ModelConfig(vocab_size=4096, hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4,
                        num_key_value_heads=2, ffn_hidden_size=args.hidden * 11 // 4, max_position_embeddings=8192)
    actor = MegatronActor(model, TrainerConfig(lr=1e-6, kl_coef=0.0, layer_spec="local"), None)
    pool = door_game_lengths(200, seed=0)
    print(f"door_game lengths: min {min(pool)} median {statistics.median(pool)} max {max(pool)}", flush=True)
    layouts = {"padded": BatchLayout(packed=False), "packed": BatchLayout(packed=True)}
    runs: dict = {(k, layout): [] for k in ("door_game", "long_tail") for layout in LAYOUTS}
    warm = batch(draw("door_game", args.mb_tokens, pool, seed=99), model.vocab_size, seed=99)
    for name in LAYOUTS:  # first-step costs (optimizer state, allocator) out of the timings
        actor.train_step(micro_batches_by_budget(warm, args.mb_tokens, layouts[name]))
    for rep in range(args.reps):
        for kind in ("door_game", "long_tail"):
            lengths = draw(kind, args.step_tokens, pool, seed=1000 * rep + (kind == "long_tail"))
            trajs = batch(lengths, model.vocab_size, seed=rep)
            order = LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]
            for name in order:
                mbs = micro_batches_by_budget(trajs, args.mb_tokens, layouts[name])
                meter = SavedActivations()
                t0 = time.perf_counter()
                with meter.hooks():
                    result = actor.train_step(mbs)
                secs = time.perf_counter() - t0
                computed = sum(mb.token_ids.numel() for mb in mbs)
                runs[(kind, name)].append(dict(seconds=secs, tokens=sum(lengths), computed_tokens=computed,
                                               micro_batches=len(mbs), activation_peak_bytes=meter.peak,
                                               loss=result.loss))
                print(f"rep {rep} {kind:9} {name:6} {secs:6.2f} s  {sum(lengths) / secs:8.0f} tok/s  "
                      f"{len(mbs)} micro-batches  activations {meter.peak / 2 ** 20:7.1f} MiB", flush=True)
    rows = []
    for (kind, name), reps in runs.items():
        secs = statistics.median(r["seconds"] for r in reps)
        tokens = statistics.median(r["tokens"] for r in reps)
        rows.append(dict(workload=kind, layout=name, step_s_median=round(secs, 3),
                         tokens_per_s=round(tokens / secs, 1),
                         padding_share=round(1 - sum(r["tokens"] for r in reps) / sum(r["computed_tokens"] for r in reps), 4),
                         activation_peak_mib=round(max(r["activation_peak_bytes"] for r in reps) / 2 ** 20, 1),
                         micro_batches=[r["micro_batches"] for r in reps], reps=reps))
    ratios = {}
    for kind in ("door_game", "long_tail"):
        padded, packed = (next(r for r in rows if r["workload"] == kind and r["layout"] == n) for n in LAYOUTS)
        ratios[kind] = dict(tokens_per_s_packed_over_padded=round(packed["tokens_per_s"] / padded["tokens_per_s"], 3),
                            activation_peak_packed_over_padded=round(
                                packed["activation_peak_mib"] / padded["activation_peak_mib"], 3))
    print(f"\n{'workload':10} {'layout':7} {'step s':>7} {'tok/s':>8} {'pad':>6} {'act MiB':>8}")
    for r in rows:
        print(f"{r['workload']:10} {r['layout']:7} {r['step_s_median']:>7} {r['tokens_per_s']:>8} "
              f"{r['padding_share']:>6} {r['activation_peak_mib']:>8}")
    for kind, r in ratios.items():
        print(f"{kind}: packed/padded tokens/s {r['tokens_per_s_packed_over_padded']}x, "
              f"activation peak {r['activation_peak_packed_over_padded']}x")
    goal = ratios["long_tail"]
    bench_record.write(args.out, {
        **bench_record.header("trainer_throughput", config=vars(args), threads=args.threads),
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "vocab_size": model.vocab_size},
        "mb_tokens": args.mb_tokens, "step_tokens": args.step_tokens, "reps": args.reps,
        "door_game_lengths": {"min": min(pool), "median": statistics.median(pool), "max": max(pool)},
        "results": rows, "ratios": ratios,
        "goal": {"long_tail_tokens_per_s_at_least_2x": goal["tokens_per_s_packed_over_padded"] >= 2.0,
                 "long_tail_activation_peak_at_most_half": goal["activation_peak_packed_over_padded"] <= 0.5},
        "process_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    })


if __name__ == "__main__":
    main()
