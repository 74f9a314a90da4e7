"""How SGLang's request rows are held by streaming sessions and turns (the fact CTB's row cap rests on).

SGLang 0.5.23 gives every request a row of its `req_to_token_pool`; a streaming session takes
the row of its first turn and keeps it until it is closed; every later turn borrows it. The
scheduler admits waiting requests only while `get_num_allocatable_reqs` > 0, i.e. while some row
is FREE, even for a turn that would borrow its own session's row. This script measures, on one
real engine (CPU, tiny random Qwen2, `tide_ctb` plugin reporting the row counts):

  1. rows_total against `max_running_requests`;
  2. rows free after a one-shot request (does it keep a row?);
  3. rows free after each session's first turn (one row per open session?);
  4. with rows_total - 1 sessions open: do all next turns run, concurrently?
  5. with rows_total sessions open (no free row): does a session's next turn stall, and does it
     run as soon as another session closes?

It prints a table and writes benchmarks/results/ctb_rows.json.

    flock /tmp/tide-heavy.lock timeout 900 nice -n 5 env OMP_NUM_THREADS=1 PYTHONPATH=$PWD \\
        .venv/bin/python benchmarks/ctb_rows.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import bench_record
GREEDY = {"max_new_tokens": 4, "temperature": 0}


async def measure(engine, stall_s: float) -> dict:
    from sglang_patches.task_tag import ADMIT, TURN, TaskTag
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    def tag(kind, tid):
        return TaskTag(kind, tid, tid.split("/")[0], False, 1.0, 64, 16)

    def prompt(k):
        return [(k * 37 + i) % 3000 + 20 for i in range(24)]

    out: dict = {}
    _g, rep = await generate_tagged(engine, prompt(0), GREEDY, tag(ADMIT, "plain/0"), None)
    out["rows_total"] = rep["rows_total"]
    out["rows_free_reported_with_a_one_shot_request"] = rep["rows_free"]
    _g, rep = await generate_tagged(engine, prompt(1), GREEDY, tag(ADMIT, "plain/1"), None)
    out["rows_free_after_a_one_shot_request"] = rep["rows_free"]

    rows = out["rows_total"]
    sessions: list[tuple[str, str]] = []  # (session id, rid of its last turn)
    out["rows_free_after_nth_session_first_turn"] = []
    for k in range(rows - 1):
        sid = await engine.open_session(4096)
        g, rep = await generate_tagged(engine, prompt(10 + k), GREEDY, tag(ADMIT, f"s{k}/0"), {"id": sid})
        sessions.append((sid, g.rid))
        out["rows_free_after_nth_session_first_turn"].append(rep["rows_free"])

    async def next_turn(k):
        sid, rid = sessions[k]
        g, rep = await generate_tagged(engine, [5, 6, 7], GREEDY, tag(TURN, f"s{k}/0"), {"id": sid, "rid": rid})
        sessions[k] = (sid, g.rid)
        return rep["rows_free"]

    t0 = time.monotonic()
    free = await asyncio.gather(*(next_turn(k) for k in range(len(sessions))))
    out["with_rows_minus_1_sessions_open"] = {
        "sessions": len(sessions), "next_turns_completed": len(free), "rows_free_reported": sorted(set(free)),
        "seconds": round(time.monotonic() - t0, 2)}

    # The last free row goes to one more session: now no row is free.
    sid = await engine.open_session(4096)
    g, rep = await generate_tagged(engine, prompt(99), GREEDY, tag(ADMIT, "last/0"), {"id": sid})
    last = (sid, g.rid)
    stalled = asyncio.get_running_loop().create_task(next_turn(0))
    done, _ = await asyncio.wait([stalled], timeout=stall_s)
    out["with_rows_sessions_open"] = {"sessions": len(sessions) + 1, "rows_free_after_last_first_turn": rep["rows_free"],
                                      f"next_turn_completed_within_{stall_s:g}s": bool(done)}
    t0 = time.monotonic()
    await engine.close_session(last[0])
    done, _ = await asyncio.wait([stalled], timeout=stall_s)
    out["with_rows_sessions_open"]["next_turn_completed_after_one_session_closed"] = bool(done)
    out["with_rows_sessions_open"]["seconds_from_close_to_completion"] = round(time.monotonic() - t0, 2)
    for sid, _rid in sessions:
        await engine.close_session(sid)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-running-requests", type=int, default=4)
    p.add_argument("--stall-s", type=float, default=10.0, help="how long a turn must not run to count as stalled")
    p.add_argument("--work-dir", default="/tmp/tide_ctb_rows")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.tokenizer import write_tokenizer

    tok = write_tokenizer(os.path.join(args.work_dir, "tok"), kind="tiny_bpe")
    ckpt = write_random_hf_checkpoint(os.path.join(args.work_dir, "hf"), ModelConfig(vocab_size=3072), seed=0,
                                      tokenizer_dir=tok)
    engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=4096, max_running_requests=args.max_running_requests),
                           ckpt)
    try:
        figures = engine.loop.run_until_complete(measure(engine, args.stall_s))
    finally:
        engine.shutdown()
    figures["max_running_requests"] = args.max_running_requests
    for key, value in figures.items():
        print(f"{key:48} {value}")
    record = {**bench_record.header("ctb_rows", config=vars(args)), "sglang": __import__("importlib.metadata").metadata.version("sglang"),
              "figures": figures}
    if not args.no_write:
        bench_record.write("ctb_rows", record)

if __name__ == "__main__":
    main()
