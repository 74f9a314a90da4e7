"""CTB vs request-level scheduling on the real SGLang engine (CPU): KV prefix-cache hit rate,
generation throughput and step duration for many concurrent multi-turn tasks.

Two in-process SGLang engines (rollout ranks) serve a random Qwen2 (default 6 layers, h384, tiny
BPE tokenizer; sized so that prefill recomputation costs real time, see SETUP_RATIONALE); door-game tasks run against the env server with emulated latency, so tasks
wait for their env between turns; each engine's KV pool holds well under the working set.
The same tasks (same seed) run twice on the same engines (cache flushed in between):
  vanilla: every task dispatched at once, whole context resent each turn (request level);
  ctb:     CTBDispatcher with the in-process carrier (token-aware admission, pausing,
           resumption, sessions) + the `tide_ctb` SGLang plugin in each scheduler.
Hit rate = sum(cached_tokens) / sum(prompt_tokens) over all turns; the ideal re-uses every
token of a task's earlier turns (all but each turn's new observation) and, for every member of
a GRPO group after the first, the group's shared prompt.

Each run records where time goes (`Timeline`: per task admission wait / env / paused / in-engine
generate; per engine busy time, requests in flight, estimated prefill share). The KV pool is
--pool-fraction (0.3) of the peak live context per engine, measured first in a vanilla run with an
ample pool (own process); the modes then run in --pairs pairs of alternating order. The JSON's
top-level figures (ratios, modes) are geometric means over all pairs; each pair's own are in 'pairs'.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ctb_kv.py            # ~8 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ctb_kv.py --tasks 32 --no-write   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import bench_record


def ideal_cached(token_ids: list[int], loss_mask: list[int]) -> tuple[int, int]:
    """(ideal cached tokens, context tokens) summed over a trajectory's turns.

    Turn k's context is everything before its action; ideally all of it but the newest
    observation (everything up to the end of action k-1) is already in the cache."""
    starts, ends = [], []
    for i, m in enumerate(loss_mask):
        if m and (i == 0 or not loss_mask[i - 1]):
            starts.append(i)
        if m and (i + 1 == len(loss_mask) or not loss_mask[i + 1]):
            ends.append(i + 1)
    context = sum(starts)
    cached = sum(ends[k - 1] for k in range(1, len(starts)))
    return cached, context


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(name: str, trajectories: list, wall_s: float, dispatcher) -> dict:
    prompt = sum(t.engine_prompt_tokens for t in trajectories)  # context the engine needed over all turns
    cached = sum(t.cached_tokens for t in trajectories)
    generated = sum(t.generated_tokens for t in trajectories)
    ideal_c = ideal_ctx = 0
    first_prompt: dict = {}
    for t in sorted(trajectories, key=lambda t: (t.group_id, t.index)):
        c, x = ideal_cached(t.token_ids, t.loss_mask)
        ideal_c, ideal_ctx = ideal_c + c, ideal_ctx + x
        # Members of a GRPO group share their prompt: after the first, it is ideally cached too.
        first = t.token_ids[: t.loss_mask.index(1)] if 1 in t.loss_mask else t.token_ids
        if t.group_id in first_prompt:
            ideal_c += _common_prefix(first_prompt[t.group_id], first)
        else:
            first_prompt[t.group_id] = first
    return {
        "mode": name,
        "tasks": len(trajectories),
        "turns": sum(t.turns for t in trajectories),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": generated,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ideal_hit_rate": ideal_c / ideal_ctx if ideal_ctx else 0.0,
        "gen_tokens_per_s": generated / wall_s,
        "step_duration_s": wall_s,
        "mean_reward": sum(t.reward for t in trajectories) / len(trajectories),
        "pauses": sum(int(t.info.get("ctb_pauses", 0)) for t in trajectories),
        "moves": sum(int(t.info.get("ctb_moves", 0)) for t in trajectories),
        "resumes": dispatcher.stats["resumes"],
        "dispatcher": dict(dispatcher.stats),
        "engine_reports": {str(r): {k: v for k, v in rep.items() if k != "hooks_called"}
                           for r, rep in dispatcher.rank_kv.items()},
    }


PAIR_KEYS = ("hit_rate", "ideal_hit_rate", "gen_tokens_per_s", "step_duration_s", "pauses")


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and min(values) > 0 else float("nan")


def pair_figures(pairs: list) -> tuple:
    """(figures, per_pair) of the vanilla/CTB pairs (each {"vanilla": summary, "ctb": summary}).

    per_pair: each pair's order, both modes' main figures and its CTB/vanilla ratios. figures:
    the geometric mean over every pair of each ratio (hit_rate_x, throughput_x, step_duration_x,
    ctb_hit_vs_ideal) and of each mode's figures: no single pair (one may have hit a load spike
    of the shared machine) stands for the run."""
    per_pair = []
    for i, pr in enumerate(pairs):
        v, c = pr["vanilla"], pr["ctb"]
        per_pair.append({
            "order": "vanilla,ctb" if i % 2 == 0 else "ctb,vanilla",
            **{mode: {k: pr[mode][k] for k in PAIR_KEYS} for mode in ("vanilla", "ctb")},
            "hit_rate_x": c["hit_rate"] / v["hit_rate"] if v["hit_rate"] else float("inf"),
            "throughput_x": c["gen_tokens_per_s"] / v["gen_tokens_per_s"],
            "step_duration_x": c["step_duration_s"] / v["step_duration_s"],
            "ctb_hit_vs_ideal": c["hit_rate"] / c["ideal_hit_rate"] if c["ideal_hit_rate"] else 0.0,
        })
    ratios = {k: geomean(pp[k] for pp in per_pair)
              for k in ("hit_rate_x", "throughput_x", "step_duration_x", "ctb_hit_vs_ideal")}
    modes = {mode: {k: geomean(pp[mode][k] for pp in per_pair) for k in PAIR_KEYS if k != "pauses"}
             for mode in ("vanilla", "ctb")}
    for mode in modes:
        modes[mode]["pauses_mean"] = sum(pp[mode]["pauses"] for pp in per_pair) / len(per_pair)
    aggregate = (f"geometric mean over all {len(per_pair)} pairs (pauses: arithmetic mean); "
                 "each pair's figures and full records under 'pairs'")
    return {"ratios": ratios, "modes": modes, "aggregate": aggregate}, per_pair


class Timeline:
    """Where each task's lifetime goes, the live context over time and each engine's busy time.

    Per task (monotonic clock), between its runner's start and its end:
      admission_wait  from the rollout's start until the dispatcher first made it runnable;
      env             waiting for the env (reset before turn 1, step after every turn);
      paused_wait     ready for its next turn (env answered) but not runnable: paused by CTB
                      (or resumed while its pause's session release was still under way);
      session_overhead  runnable, before/after the generate call (lock, session open/close);
      generate        inside the engine's generate call: SGLang queueing + prefill + decode,
                      batched with other requests.
    Per engine: busy time (at least one generate call in flight), in-flight requests averaged
    over busy time, and the uncached prompt tokens it had to prefill."""

    def __init__(self, ranks):
        self.t0 = time.monotonic()
        self.tasks: dict = {}
        self.live: dict = {}
        self.live_rank: dict = {}
        self.peak_live = 0
        self.peak_live_rank = {r: 0 for r in ranks}
        self.inflight = {r: 0 for r in ranks}
        self.busy_s = {r: 0.0 for r in ranks}
        self.inflight_s = {r: 0.0 for r in ranks}
        self.last = {r: self.t0 for r in ranks}
        self.uncached = {r: 0 for r in ranks}
        self.requests = {r: 0 for r in ranks}

    def rec(self, tid):
        return self.tasks.setdefault(tid, {"admission_wait": 0.0, "env": 0.0, "paused_wait": 0.0,
                                           "session_overhead": 0.0, "generate": 0.0, "mark": None})

    def set_live(self, tid, tokens, rank):
        self.live[tid] = tokens
        if rank is not None:
            self.live_rank[tid] = rank
        self.peak_live = max(self.peak_live, sum(self.live.values()))
        for r in self.peak_live_rank:
            s = sum(v for t, v in self.live.items() if self.live_rank.get(t) == r)
            self.peak_live_rank[r] = max(self.peak_live_rank[r], s)

    def engine_edge(self, rank, delta):
        now = time.monotonic()
        n = self.inflight[rank]
        if n > 0:
            self.busy_s[rank] += now - self.last[rank]
            self.inflight_s[rank] += n * (now - self.last[rank])
        self.last[rank] = now
        self.inflight[rank] = n + delta

    def summary(self, wall_s: float, prefill_ms_per_token: float) -> dict:
        keys = ("admission_wait", "env", "paused_wait", "session_overhead", "generate")
        task_s = {k: sum(r[k] for r in self.tasks.values()) for k in keys}
        total = sum(task_s.values())
        engines = {}
        for r in self.busy_s:
            busy = self.busy_s[r]
            pre = self.uncached[r] * prefill_ms_per_token / 1e3
            engines[str(r)] = {
                "busy_s": busy, "busy_fraction": busy / wall_s,
                "mean_inflight_when_busy": self.inflight_s[r] / busy if busy else 0.0,
                "requests": self.requests[r], "uncached_prompt_tokens": self.uncached[r],
                "prefill_s_est": pre, "prefill_share_of_busy_est": pre / busy if busy else 0.0,
                "decode_and_other_s_est": max(busy - pre, 0.0)}
        return {
            "task_seconds": task_s,
            "task_share": {k: v / total for k, v in task_s.items()} if total else {},
            "mean_tasks_in_state": {k: v / wall_s for k, v in task_s.items()},
            "engines": engines,
            "peak_live_context_tokens": self.peak_live,
            "peak_live_context_tokens_per_rank": {str(r): v for r, v in self.peak_live_rank.items()},
        }


def timed_runner_class():
    """CTBTaskRunner with a Timeline (benchmark instrumentation; the runner itself is untouched)."""
    from tide_megatron.rollout import ctb_task_runner as mod

    original_generate = mod.generate_tagged

    class TimedRunner(mod.CTBTaskRunner):
        timeline: Timeline

        async def run(self, assignment, handle, listener):
            tl = self.timeline
            rec = tl.rec(handle.task_id)
            await handle.runnable.wait()
            rec["mark"] = time.monotonic()
            rec["admission_wait"] += rec["mark"] - tl.t0  # queued since the rollout began
            traj = await super().run(assignment, handle, listener)
            end = time.monotonic()
            rec["env"] += end - rec["mark"]  # the last env step (and the env session's close)
            tl.live.pop(handle.task_id, None)
            return traj

        async def _generate_turn(self, ep, pending, previous_rid, remaining, handle, listener):
            tl = self.timeline
            rec = tl.rec(handle.task_id)
            enter = time.monotonic()
            rec["env"] += enter - rec["mark"]
            tl.set_live(handle.task_id, len(ep.tokens), handle.rank if handle.rank is not None else handle.last_rank)
            await handle.runnable.wait()
            ready = time.monotonic()
            rec["paused_wait"] += ready - enter
            g0 = ep.generate_s
            out = await super()._generate_turn(ep, pending, previous_rid, remaining, handle, listener)
            gen = out[0]  # (generation, weight version)
            rec["mark"] = time.monotonic()
            rec["generate"] += ep.generate_s - g0
            rec["session_overhead"] += (rec["mark"] - ready) - (ep.generate_s - g0)
            tl.set_live(handle.task_id, len(ep.tokens) + len(gen.output_ids), handle.last_rank)
            return out

    async def timed_generate(engine, input_ids, sampling_params, tag, session_params, image_data=None):
        tl = TimedRunner.timeline
        rank = next(r for r, e in tl_engines.items() if e is engine)
        tl.engine_edge(rank, +1)
        try:
            gen, report = await original_generate(engine, input_ids, sampling_params, tag, session_params, image_data)
        finally:
            tl.engine_edge(rank, -1)
        tl.requests[rank] += 1
        tl.uncached[rank] += gen.prompt_tokens - gen.cached_tokens
        return gen, report

    mod.generate_tagged = timed_generate
    return TimedRunner


tl_engines: dict = {}


SETUP_RATIONALE = (
    "CTB saves prefill recomputation; that is worth something only where recomputing a task's prefix costs "
    "more than the per-step scheduling overhead it competes with (true for the paper's 7B model on an H100). "
    "The previous setup (2 layers, hidden 64) made prefill almost free on CPU, so request-level recompute won. "
    "The model is sized so that re-prefilling a typical 300-token context costs several decode steps "
    "(cost_probe.recompute_300_in_decode_steps); the KV pool per engine stays far below the working set of "
    "the concurrent tasks. Nothing else was tuned: same tasks, seed, engines and env latency for both modes.")


async def measure_costs(engine, context: int = 300, new_tokens: int = 33, reps: int = 3) -> dict:
    """Prefill vs decode cost of the benchmark model on this machine (one request, cache flushed)."""
    import statistics

    prompt = [(i * 7) % 3000 + 20 for i in range(context)]
    prefill, full = [], []
    for _ in range(reps):
        await engine.flush_cache()
        t0 = time.perf_counter()
        await engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0})
        prefill.append(time.perf_counter() - t0)
        await engine.flush_cache()
        t0 = time.perf_counter()
        await engine.generate(prompt, {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
        full.append(time.perf_counter() - t0)
    await engine.flush_cache()
    p, f = statistics.median(prefill), statistics.median(full)
    step = max(f - p, 1e-9) / (new_tokens - 1)
    return {"context_tokens": context, "prefill_s": p, "prefill_ms_per_token": 1e3 * p / context,
            "decode_step_ms": 1e3 * step, "recompute_300_in_decode_steps": p / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=128, help="trajectories (group size --group)")
    p.add_argument("--group", type=int, default=4, help="GRPO group size")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool (max_total_tokens) per engine; default: --pool-fraction of the peak live context "
                        "per engine, measured in a vanilla run with an ample pool (--ample-kv-tokens)")
    p.add_argument("--pool-fraction", type=float, default=0.3,
                   help="pool / peak live context per engine (0.3: the reference measurement in "
                        "shared/notes/cpu-stack.md, 'Plain SGLang and multi-turn tasks under KV pressure')")
    p.add_argument("--ample-kv-tokens", type=int, default=None,
                   help="pool of the sizing run; default tasks/engines x max_context_tokens (nothing is ever evicted)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--step-median-s", type=float, default=0.3, help="env step latency median")
    p.add_argument("--resident", type=int, default=24, help="CTB: most resident tasks per rank")
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the random Qwen2 model")
    p.add_argument("--hidden", type=int, default=384, help="hidden size (heads of 64, ffn 4x)")
    p.add_argument("--probe-only", action="store_true", help="only measure prefill vs decode cost")
    p.add_argument("--kv-budget-fraction", type=float, default=None,
                   help="CTB rank budget / KV pool; default 1 - resident x max_new_tokens / kv_tokens: the headroom "
                        "holds the tokens every resident task may generate before its footprint is reported")
    p.add_argument("--reuse-sizing", default=None,
                   help="take pool_sizing (and kv_tokens) from an earlier ctb_kv.json instead of re-measuring; "
                        "its CTB run is kept in the new JSON as previous_ctb")
    p.add_argument("--pairs", type=int, default=2,
                   help="vanilla/CTB pairs, alternating order (V C, C V, ...), so that load from other processes on "
                        "a shared machine and run order hit both modes alike")
    p.add_argument("--sizing-out", default=None,
                   help=argparse.SUPPRESS)  # internal: run only the ample-pool sizing run, write its JSON here
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/tide_ctb_kv")
    p.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/ctb_kv.json")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from tide_megatron.core.ctb import CTBConfig
    from tide_megatron.envs.client import EnvClient
    from tide_megatron.envs.config import DoorGameConfig, EnvConfig, EnvServerConfig, LatencyConfig
    from tide_megatron.envs.server_process import EnvServerProcess
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.rollout.ctb_config import CTBDispatchConfig
    from tide_megatron.rollout.ctb_rollout import LocalCTBRollout
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunnerConfig
    from tide_megatron.rollout.worker import build_chat
    from tide_megatron.tokenizer import write_tokenizer

    TimedRunner = timed_runner_class()

    tok = write_tokenizer(os.path.join(args.work_dir, "tok"), kind="tiny_bpe")
    heads = max(1, args.hidden // 64)
    model_cfg = ModelConfig(vocab_size=3072, hidden_size=args.hidden, num_layers=args.layers,
                            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                            ffn_hidden_size=4 * args.hidden)
    ckpt = write_random_hf_checkpoint(os.path.join(args.work_dir, f"hf_l{args.layers}_h{args.hidden}"), model_cfg,
                                      seed=args.seed, tokenizer_dir=tok)
    env_cfg = EnvConfig(name="door_game", door_game=DoorGameConfig(min_rooms=2, max_rooms=4, extra_attempts=1),
                        latency=LatencyConfig(enabled=True, seed=args.seed, reset_median_s=0.1,
                                              step_median_s=args.step_median_s))
    runner_cfg = TaskRunnerConfig(max_turns=args.max_turns, max_context_tokens=768,
                                  max_new_tokens=args.max_new_tokens, temperature=1.0)
    # Each open session holds a request row, and a turn needs one free: rows exceed the resident cap.
    slots = max(64, args.resident * 2)
    ample = args.ample_kv_tokens or -(-args.tasks // args.engines) * runner_cfg.max_context_tokens
    sizing = None
    previous = None
    if args.reuse_sizing:
        with open(args.reuse_sizing) as f:
            previous = json.load(f)
        sizing = dict(previous["pool_sizing"], reused_from=previous.get("date"))
        args.kv_tokens = sizing["kv_tokens"]
    if args.kv_tokens is None and not args.probe_only and not args.sizing_out:
        # The sizing run gets its own process: SGLang's Engine.shutdown kills every child process
        # of its parent, the env server included.
        import subprocess
        import tempfile

        out = os.path.join(tempfile.mkdtemp(), "sizing.json")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--sizing-out", out]
        subprocess.run(cmd)
        if not os.path.exists(out):
            raise RuntimeError("the ample-pool sizing run failed (see its output above)")
        with open(out) as f:
            sizing = json.load(f)
        args.kv_tokens = sizing["kv_tokens"]
        print(f"sizing: peak live context per rank {sizing['peak_live_context_tokens_per_rank']} "
              f"-> kv_tokens {args.kv_tokens}", flush=True)
    with EnvServerProcess(EnvServerConfig(envs=[env_cfg])) as server:
        chat = build_chat(ckpt, None)
        client = EnvClient(server.client_config())

        def start_engines(kv_tokens: int):
            t = time.time()
            engines = {r: RolloutEngine(RolloutEngineConfig(max_total_tokens=kv_tokens, max_running_requests=slots,
                                                            seed=args.seed), ckpt) for r in range(args.engines)}
            tl_engines.clear()
            tl_engines.update(engines)
            return engines, time.time() - t

        async def one_run(engines, enabled: bool, prefill_ms_per_token: float):
            await client.connect()
            specs = await client.list_tasks("door_game", "train", limit=args.tasks // args.group)
            assignments = [TaskAssignment(task=s.to_json(), group_id=f"g{i}", index=j)
                           for i, s in enumerate(specs) for j in range(args.group)]
            for e in engines.values():
                await e.flush_cache()
            # The pool must hold what pausing allows (budget x hard_water; the dispatcher checks it).
            # Vanilla runs (the sizing run among them, before the budget is known) use no budget.
            fraction = budget_fraction if enabled else 1.0
            hard_water = min(CTBConfig().hard_water, 1.0 / fraction)
            cfg = CTBDispatchConfig(
                enabled=enabled, max_resident_tasks_per_rank=args.resident, kv_budget_fraction=fraction,
                turn_reserve_tokens=args.max_new_tokens + 48,
                policy=CTBConfig(probe_turn_reserve_tokens=args.max_new_tokens + 48, staleness_throttle=False,
                                 context_norm_tokens=runner_cfg.max_context_tokens, task_max_turns=args.max_turns,
                                 hard_water=hard_water))
            runner = TimedRunner(runner_cfg, dict(engines), chat, client, use_sessions=enabled)
            rollout = LocalCTBRollout(cfg, runner)
            TimedRunner.timeline = timeline = Timeline(sorted(engines))
            t0 = time.monotonic()
            trajectories = await rollout.run(assignments, prompt_tokens=120)
            wall = time.monotonic() - t0
            await client.close()
            res = summarize("ctb" if enabled else "vanilla", trajectories, wall, rollout.dispatcher)
            res["time_breakdown"] = timeline.summary(wall, prefill_ms_per_token)
            return res

        if args.sizing_out:
            engines, _ = start_engines(ample)
            cost = engines[0].loop.run_until_complete(measure_costs(engines[0]))
            res = engines[0].loop.run_until_complete(one_run(engines, False, cost["prefill_ms_per_token"]))
            peak = max(int(v) for v in res["time_breakdown"]["peak_live_context_tokens_per_rank"].values())
            args.kv_tokens = int(round(args.pool_fraction * peak))
            sizing = {
                "principle": (f"KV pool per engine = {args.pool_fraction} x the peak live context per engine, as in the "
                              "reference measurement (shared/notes/cpu-stack.md, 'Plain SGLang and multi-turn tasks "
                              "under KV pressure': a pool holding about 30% of the peak live context). Live context "
                              "= sum of the current context lengths of the tasks that have started and not finished, "
                              "sampled at every turn start and end; measured in a vanilla run on the same tasks and "
                              "seed with an ample pool (tasks per engine x max_context_tokens), where nothing is "
                              "evicted."),
                "ample_kv_tokens": ample,
                "peak_live_context_tokens": res["time_breakdown"]["peak_live_context_tokens"],
                "peak_live_context_tokens_per_rank": res["time_breakdown"]["peak_live_context_tokens_per_rank"],
                "kv_tokens": args.kv_tokens,
                "ample_vanilla_run": {k: res[k] for k in ("hit_rate", "ideal_hit_rate", "gen_tokens_per_s",
                                                          "step_duration_s", "time_breakdown")},
            }
            with open(args.sizing_out, "w") as f:
                json.dump(sizing, f)
            for e in engines.values():
                e.shutdown()
            os._exit(0)  # the env server went down with the engines' children; nothing left to clean
        kv = args.kv_tokens or ample
        # Headroom for tokens generated before a footprint is reported: at most every resident task
        # generating max_new_tokens at once (an observation is reported when its turn starts).
        budget_fraction = (args.kv_budget_fraction if args.kv_budget_fraction is not None
                           else 1.0 - args.resident * args.max_new_tokens / kv)
        engines, startup_s = start_engines(kv)
        loop = engines[0].loop
        cost = loop.run_until_complete(measure_costs(engines[0]))
        print(f"cost probe: {json.dumps(cost)}", flush=True)
        pairs = []
        for i in range(0 if args.probe_only else args.pairs):
            pair = {}
            for enabled in ((False, True) if i % 2 == 0 else (True, False)):
                pair["ctb" if enabled else "vanilla"] = res = loop.run_until_complete(
                    one_run(engines, enabled, cost["prefill_ms_per_token"]))
                print(f"pair {i} {res['mode']}: {res['step_duration_s']:.1f}s, hit {res['hit_rate']:.3f}, "
                      f"breakdown {json.dumps(res['time_breakdown'])}", flush=True)
            pairs.append(pair)
        for e in engines.values():
            e.shutdown()
    if args.probe_only:
        return

    figures, per_pair = pair_figures(pairs)
    m = figures["modes"]
    print(f"\n{'geomean over ' + str(len(pairs)) + ' pairs':24}{'vanilla':>12}{'ctb':>12}{'ctb/vanilla':>14}")
    for key, label in (("hit_rate", "prefix hit rate"), ("ideal_hit_rate", "ideal hit rate"),
                       ("gen_tokens_per_s", "gen tokens/s"), ("step_duration_s", "step duration (s)")):
        v, c = m["vanilla"][key], m["ctb"][key]
        print(f"{label:24}{v:>12.3f}{c:>12.3f}{c / v if v else float('nan'):>14.2f}")
    r = figures["ratios"]
    print(f"CTB hit rate / ideal: {r['ctb_hit_vs_ideal']:.3f}  (paper: 1.58x hit rate, 1.15x throughput)")
    record = {
        **bench_record.header("ctb_kv", config=vars(args)),
        "engine_startup_s": startup_s,
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": heads, "ffn": 4 * args.hidden,
                  "vocab": 3072},
        "cost_probe": cost,
        "pool_sizing": sizing,
        "ctb_budget": {"kv_budget_fraction": budget_fraction,
                       "rank_budget_tokens": int(args.kv_tokens * budget_fraction),
                       "principle": "headroom = resident x max_new_tokens: the most tokens the resident tasks can "
                                    "generate before their footprints are reported (each turn's observation is "
                                    "reported when the turn starts); low_water 0.85 (hysteresis) unchanged; "
                                    "hard_water capped at 1 / kv_budget_fraction so the pool holds what pausing allows"},
        "previous": previous and {"date": previous.get("date"), "command": previous.get("command"),
                                  "ratios": previous.get("ratios")},
        "setup_rationale": SETUP_RATIONALE,
        # top-level figures: geometric means over every measured pair; each pair's own figures
        # (and full records, time breakdowns included) in "pairs"
        "ratios": r, "modes": m, "aggregate": figures["aggregate"],
        "pairs": [{**pp, "records": pr} for pp, pr in zip(per_pair, pairs)],
    }
    if not args.no_write:
        bench_record.write("ctb_kv", record)


if __name__ == "__main__":
    main()
