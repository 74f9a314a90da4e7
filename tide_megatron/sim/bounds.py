"""Two goodput bounds every run is compared with: perfect hardware use, and what any schedule
of this workload under these admission rules can attain.

Both charge exactly the work the run's consumed trajectories require (and its evaluation
trajectories, which must be generated too) and nothing else: no waiting, no prefix
recomputed, no model swapped, no weight sync. Each is a lower bound T on the wall time of any
schedule of that work; goodput bound = consumed generated tokens / T.

`hardware` (perfect hardware use): GPU-seconds / cluster size, where the GPU-seconds are
  - decode of every generated token at the largest batch the KV pool holds at the mean
    context (n_kv), each token also reading its own context's KV;
  - prefill of every token once (a group's shared prompt once, each observation once, behind
    its cached context);
  - Ref forward and Actor forward+backward of every trained token.
  It ignores that the workload limits how many sequences exist to batch.

`attainable`: the largest of these lower bounds on T (each holds for every mode the simulator
runs; `test_simulator` checks that no mode beats either bound):
  (split)   the best split of the cluster into x ranks decoding and N - x training, x real
            (time-sharing, as sync does, is a split on average): max(T_train, T_dec), with
            T_train(N - x) = trainer rank-seconds / (N - x), and T_dec(x) the larger of
              rate: tokens x g(min(S/x, n_kv)) / x, the decode rate of x ranks sharing the
                    S sequences that may be in flight (g(n) = max(w, n c) / n, rank-seconds
                    per token at batch n; the rate x/g(S/x) is concave in how sequences are
                    spread, so an even spread is the fastest), and
              busy: (tokens x g(min(S, n_kv)) + KV reads + prefill) / x, the rank-seconds
                    decode needs at the largest batch any rank can hold.
            S = min(env slots, (bound + 1) x B + evaluation tasks): admission never lets more
            trajectories exist (the staleness rule admits at most (bound + 1) x B training
            trajectories, see "group slots"). min over x of max(.) by bisection, kept on the
            safe side.
  (env)     Little's law on env slots: each trajectory holds a slot from admission to its last
            env answer, at least L(traj) = reset + env steps + its observations' prefill + one
            decode iteration per token of >= w + KV read of its own context.
            T >= sum L(traj) / env slots.
  (groups)  Little's law on group slots: a consumed group admitted at version v is consumed by
            the step of version v + bound, so at any moment the admitted, not yet consumed
            groups are consumed within the next bound + 1 steps: at most (bound + 1) x B
            trajectories. A group holds its G slots from admission to consumption, at least as
            long as its slowest member's L. T >= sum G x L(group) / ((bound + 1) x B).
  (deadline) the staleness floor: the groups admitted at version v finish within the window of
            steps v..v+bound, so that window lasts >= their slowest L; each step lies in at most
            bound + 1 windows, and a version admits at most (bound + 1) x Bg consumed groups.
            Sorting group latencies l_1 >= l_2 >= ..., the cheapest grouping costs
            sum_j l_(j c + 1), c = (bound + 1) x Bg, so T >= that / (bound + 1).
  and never below the hardware bound. It leaves out (so it stays a bound): training after the
  last rollout, queueing inside engines, swaps, syncs, cancelled work.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Tuple


def _safe_min_max(inc: Callable[[float], float], dec: Callable[[float], float], lo: float, hi: float,
                  iters: int = 60) -> float:
    """A lower bound on min_x max(inc(x), dec(x)) over (lo, hi), inc increasing, dec decreasing.

    Bisection keeps x_lo (inc < dec) and x_hi (inc >= dec); every x <= x_lo costs >= dec(x_lo),
    every x >= x_hi costs >= inc(x_hi), every x between costs >= max(inc(x_lo), dec(x_hi)).
    """
    a, b = lo, hi
    for _ in range(iters):
        m = (a + b) / 2
        if inc(m) < dec(m):
            a = m
        else:
            b = m
    return min(dec(a), inc(b), max(inc(a), dec(b)))


def goodput_bounds(sim) -> Tuple[float, float, dict]:
    """(hardware, attainable, terms) for a finished simulation (module docstring)."""
    hw, cfg = sim.hw, sim.cfg
    wl = cfg.workload
    trajs = list(sim.consumed_trajs)
    consumed_tokens = sum(t.generated_tokens for t in trajs)
    if not consumed_tokens:
        return 0.0, 0.0, {}
    w, c_tok, kv_s = hw.decode_weight_s, hw.decode_token_compute_s, hw.decode_kv_s_per_token
    # one pass: decode tokens, their contexts, prefill, and each trajectory's own latency floor
    tok = ctx_sum = 0
    prefill_s = 0.0
    seen_groups = set()
    latency = {}
    for t in trajs + list(sim.eval_trajs_done):
        if t.group_id not in seen_groups:
            seen_groups.add(t.group_id)
            prefill_s += hw.prefill_s(t.prompt_tokens)
        c = t.prompt_tokens
        own_ctx = 0.0
        own_prefill = 0.0
        n = len(t.gen)
        for k in range(n):
            g, o = t.gen[k], t.obs[k]
            own_ctx += g * (c + g / 2)
            tok += g
            c += g
            if k + 1 < n:
                p = hw.prefill_s(o, c)
                own_prefill += p
            c += o
        ctx_sum += own_ctx
        prefill_s += own_prefill
        latency[t.traj_id] = (t.reset_s + sum(t.env_s) + own_prefill + t.generated_tokens * w + kv_s * own_ctx)
    mean_ctx = ctx_sum / tok
    n_kv = max(1.0, float(hw.kv_capacity_tokens // max(1.0, mean_ctx)))
    train_tokens = sum(t.total_tokens for t in trajs)
    seq = sim.costs.mean_seq_len
    train_gpu_s = hw.train_s(train_tokens, seq, False, 1) + hw.train_s(train_tokens, seq, True, 1)
    gpr, n_gpus, n_ranks = sim.gpus_per_rank, cfg.n_gpus, sim.n_ranks
    kv_read_s = ctx_sum * kv_s

    def g(n: float) -> float:
        return max(w, n * c_tok) / n

    # ---- hardware: every GPU busy, decode at the KV pool's batch
    decode_rank_s_hw = tok * g(n_kv) + kv_read_s + prefill_s
    t_hardware = (decode_rank_s_hw * gpr + train_gpu_s) / n_gpus

    # ---- attainable
    bound = wl.staleness_bound
    b_traj = wl.batch_groups * wl.group_size
    eval_in_flight = wl.eval_tasks if wl.eval_every > 0 else 0
    slots = min(wl.env_concurrency, (bound + 1) * b_traj + eval_in_flight)
    n_cap = min(float(slots), n_kv)
    train_rank_s = train_gpu_s / gpr
    busy_rank_s = tok * g(n_cap) + kv_read_s + prefill_s

    def t_train(x: float) -> float:
        return train_rank_s / (n_ranks - x)

    def t_dec(x: float) -> float:
        return max(tok * g(min(slots / x, n_kv)), busy_rank_s) / x

    t_split = _safe_min_max(t_train, t_dec, 1e-9, n_ranks - 1e-9)
    env_trajs = trajs + list(sim.eval_trajs_done)
    t_env = sum(latency[t.traj_id] for t in env_trajs) / wl.env_concurrency
    group_latency = defaultdict(float)
    group_size = defaultdict(int)
    for t in trajs:
        group_latency[t.group_id] = max(group_latency[t.group_id], latency[t.traj_id])
        group_size[t.group_id] += 1
    t_groups = sum(group_size[gid] * lat for gid, lat in group_latency.items()) / ((bound + 1) * b_traj)
    chunk = (bound + 1) * wl.batch_groups
    ordered = sorted(group_latency.values(), reverse=True)
    t_deadline = sum(ordered[::chunk]) / (bound + 1)
    terms = {"hardware": t_hardware, "split": t_split, "env_slots": t_env, "group_slots": t_groups,
             "deadline": t_deadline}
    binding = max(terms, key=terms.get)
    t_attainable = terms[binding]
    detail = {
        "consumed_tokens": consumed_tokens, "decoded_tokens": tok, "mean_decode_context": mean_ctx,
        "hardware_decode_batch": n_kv, "slots_in_flight": slots, "train_gpu_s": train_gpu_s,
        "decode_rank_s_at_hardware_batch": decode_rank_s_hw, "prefill_s": prefill_s,
        "decode_weight_s": w, "mean_trajectory_latency_floor_s": sum(latency.values()) / len(latency),
        "mean_group_latency_floor_s": sum(ordered) / len(ordered),
        **{f"t_{k}_s": v for k, v in terms.items()}, "t_attainable_s": t_attainable, "binding": binding,
    }
    return consumed_tokens / t_hardware, consumed_tokens / t_attainable, detail
