"""What a trajectory costs on its way through the mailbox: JSON lists against the packed form.

Rank 0 decodes every trajectory a rollout rank sends (`TrajectoryDone`) and encodes it again for
the trainer rank that trains it (`TrainMicroBatch`); at 32 ranks that was a third of its rollout
thread's samples (docs/emulation.md). This times both wire forms of the same records, in one
process, in alternating order, repeated:

- `lists`: `Trajectory.to_json` (token ids, mask and log-probs as JSON lists; the form before);
- `packed`: `Trajectory.to_wire` (the same three as base64 of int32, byte and float64 arrays).

Each side is a whole mailbox line, `json.dumps` of a `TrainMicroBatch` of `--batch` trajectories
and `decode(json.loads(...))` back to typed records, at three trajectory lengths: the door game's
(~300 tokens), the paper's text workload (~3,200) and a long one (16,000). A trajectory is one
prompt-and-observation token in `--generated-every` generated (log-prob drawn, 0.0 elsewhere, as
the rollout records them). Prints a short table and writes benchmarks/results/trajectory_wire.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_record  # noqa: E402

from tide_megatron.comm.messages import TrainMicroBatch, decode  # noqa: E402
from tide_megatron.core.trajectory import Trajectory  # noqa: E402

LENGTHS = {"door_game": 300, "text_workload": 3_200, "long": 16_000}


def trajectory(n: int, generated_every: int, rng: random.Random, index: int) -> Trajectory:
    mask = [1 if i % generated_every == generated_every - 1 else 0 for i in range(n)]
    return Trajectory.from_tokens([rng.randrange(150_000) for _ in range(n)], mask,
                                  [-rng.random() * 5 if m else 0.0 for m in mask], index=index, group_id="train/7v3")


def line(batch: list[Trajectory], packed: bool) -> str:
    """The mailbox's line for a micro-batch, with the trajectories in one wire form."""
    body = TrainMicroBatch(batch).to_wire() if packed else {"trajectories": [t.to_json() for t in batch]}
    return json.dumps({"kind": TrainMicroBatch.KIND, "src": 0, **body}, separators=(",", ":"), allow_nan=False)


def time_side(batch: list[Trajectory], packed: bool, loops: int) -> tuple[float, float, int]:
    """Seconds per trajectory to encode and to decode, and the line's size."""
    started = time.perf_counter()
    for _ in range(loops):
        text = line(batch, packed)
    encode_s = (time.perf_counter() - started) / (loops * len(batch))
    started = time.perf_counter()
    for _ in range(loops):
        msg = decode(json.loads(text))
    decode_s = (time.perf_counter() - started) / (loops * len(batch))
    assert msg.trajectories == batch, "the wire form lost something"
    return encode_s, decode_s, len(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="trajectories per micro-batch message")
    parser.add_argument("--generated-every", type=int, default=8, help="one generated token in this many")
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions of both sides")
    parser.add_argument("--min-s", type=float, default=0.2, help="least time each side runs per repetition")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = []
    print(f"{'trajectory':<15}{'tokens':>7}{'form':>8}{'KB/traj':>9}{'encode us':>11}{'decode us':>11}")
    for name, n in LENGTHS.items():
        rng = random.Random(args.seed)
        batch = [trajectory(n, args.generated_every, rng, i) for i in range(args.batch)]
        loops = max(1, round(args.min_s / (time_side(batch, False, 1)[0] * args.batch)))
        samples = {False: [], True: []}
        for rep in range(args.reps):
            for packed in ((False, True) if rep % 2 == 0 else (True, False)):
                samples[packed].append(time_side(batch, packed, loops))
        out = {"trajectory": name, "tokens": n, "batch": args.batch, "loops": loops}
        for packed, label in ((False, "lists"), (True, "packed")):
            enc = statistics.median(s[0] for s in samples[packed])
            dec = statistics.median(s[1] for s in samples[packed])
            size = samples[packed][0][2] / args.batch
            out[label] = {"encode_us": enc * 1e6, "decode_us": dec * 1e6, "bytes_per_trajectory": size,
                          "encode_us_reps": [s[0] * 1e6 for s in samples[packed]],
                          "decode_us_reps": [s[1] * 1e6 for s in samples[packed]]}
            print(f"{name:<15}{n:>7}{label:>8}{size / 1024:>9.1f}{enc * 1e6:>11.0f}{dec * 1e6:>11.0f}")
        out["encode_speedup"] = out["lists"]["encode_us"] / out["packed"]["encode_us"]
        out["decode_speedup"] = out["lists"]["decode_us"] / out["packed"]["decode_us"]
        out["size_ratio"] = out["packed"]["bytes_per_trajectory"] / out["lists"]["bytes_per_trajectory"]
        rows.append(out)
    print("packed over lists: " + "; ".join(f"{r['trajectory']} encode {r['encode_speedup']:.1f}x, decode "
                                           f"{r['decode_speedup']:.1f}x, size {r['size_ratio']:.2f}" for r in rows))
    bench_record.write(str(Path(bench_record.RESULTS_DIR) / "trajectory_wire.json"),
                       {**bench_record.header("trajectory_wire", config=vars(args)), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
