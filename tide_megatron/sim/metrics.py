"""What a simulation run reports, and the two ideal bounds it is compared with.

Goodput = generated tokens the trainer consumed / wall time to the end of the last step
(tokens of stale-dropped, lost or evaluation trajectories do not count), read from the core
`GlobalBuffer`'s token ledger.

Both bounds charge exactly the work the run's consumed trajectories (and its evaluation
trajectories, which must be generated too) require, and nothing else: no waiting, no prefix
recomputed, no model swapped, no weight sync. Each is a lower bound on the wall time T of any
schedule of that work; goodput bound = consumed tokens / T.

`ideal_hardware` (perfect hardware use): GPU-seconds / cluster size, where the GPU-seconds are
  - decode of every generated token at the largest batch the KV pool holds at the mean
    context, each token also reading its own context's KV;
  - prefill of every token once (the group's shared prompt once per group, each observation
    once, behind its cached context);
  - Ref forward and Actor forward+backward of every trained token.
  It ignores that the workload itself limits how many sequences exist to batch: on the text
  setup it decodes at ~358 sequences per rank (~11,500 across 32 GPUs) while at most
  `env_concurrency` (1,024) trajectories are ever in flight, about half of their time in the env.

`ideal_workload` (perfect cluster, the workload's own limits): the same cluster with no waiting,
no recomputation and no swaps, but subject to the cap every mode obeys, `env_concurrency` (C):
a trajectory holds an env slot from admission to its last env answer, and every mode's
dispatcher (request-level and CTB alike) admits only while fewer than C hold one. Derivation
(see `ideal_bounds`): let p_n be the share of decode tokens generated in engine iterations of n
running sequences (any schedule has such a distribution). Then T must satisfy, at once,
  (H) hardware:   G*T >= gpr*[tok*sum_n p_n*max(w, n*c)/n + kv*ctx_sum + prefill] + train
  (C) slots:      C*T >= env + prefill + kv*ctx_sum + tok*sum_n p_n*[max(w, n*c) + kv*(n-1)*f]
  (K) KV pool:    sum_n p_n * K/n >= ctx_sum/tok
with w the weight-read time of an iteration, c the per-sequence compute time, kv the per-token
KV read time, K the KV pool, f the shortest prompt submitted (a floor on any running context),
G GPUs, gpr GPUs per rank, env the reset + step latencies, prefill the prefill time of the
consumed work. (H) is Little's law on GPU time; (C) is Little's law on env slots: each
trajectory holds its slot through its env time, its own prefills (each freezes its engine) and
one decode iteration per generated token, and an iteration of n sequences lasts at least
max(w, n*c) + kv*(own context + (n-1)*f); (K) holds because an iteration's contexts fit the
pool. So bigger batches cost fewer GPU-seconds per token but make every token slower, which the
bounded number of slots cannot hide. T_workload = the smallest T of any distribution p (an LP,
bounded from below through its dual, so an inexact search still gives a valid bound), and never
below the hardware bound's T. Hence goodput <= ideal_workload <= ideal_hardware for every mode.
What it leaves out (so it stays an upper bound): training after the last rollout, the staleness
throttle, dropped or unfinished trajectories, the engine's prefill-over-decode freezes of others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import math
from typing import List, Tuple


@dataclass
class StepRecord:
    """One training step."""

    step: int
    start: float
    end: float
    trajectories: int
    tokens: int
    """Generated tokens consumed in this step."""
    rollout_ranks: int
    trainer_ranks: int
    ras: float
    tprm_s: float
    eval_wait_s: float
    rollout_s: float = 0.0
    train_s: float = 0.0
    wait_s: float = 0.0
    ra2p_mode: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RunMetrics:
    """Everything one run reports."""

    mode: str
    n_gpus: int
    n_ranks: int
    steps: List[StepRecord] = field(default_factory=list)
    roles: List[Tuple[float, int, int, int, str]] = field(default_factory=list)
    """(time, rollout ranks, actor ranks, dedicated ref ranks, RA2P mode) at every change."""
    twt_rank_s: float = 0.0
    rwt_rank_s: float = 0.0
    role_changes: int = 0
    ers_log: List[tuple] = field(default_factory=list)
    """(step, RAS, TPRM, break-even RAS, generation deficit, consumption deficit, reason)."""
    # filled by finish()
    sim_time_s: float = 0.0
    goodput: float = 0.0
    ideal_hardware_goodput: float = 0.0
    """Goodput bound of perfect hardware use (module docstring)."""
    ideal_workload_goodput: float = 0.0
    """Goodput bound of a perfect cluster under the workload's env-concurrency cap (module docstring)."""
    ideal_detail: dict = field(default_factory=dict)
    """The terms both bounds are made of (seconds, tokens, batch sizes)."""
    consumed_tokens: int = 0
    dropped_stale_tokens: int = 0
    """Tokens of groups that missed the staleness bound (cancelled in flight, or dropped)."""
    cancelled_groups: int = 0
    """Training groups cancelled in flight at their staleness deadline (cancel rule)."""
    lost_tokens: int = 0
    eval_tokens: int = 0
    generated_tokens: int = 0
    kv_hit_rate: float = 0.0
    recompute_tokens: int = 0
    pauses: int = 0
    migrations: int = 0
    evictions: int = 0
    mean_step_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0
    trajectories_finished: int = 0

    def finish(self, sim, end_time: float, wall_s: float) -> None:
        ledger = sim.buffer.ledger
        stats = sim.cluster.total_stats()
        self.sim_time_s = end_time
        self.consumed_tokens = ledger.consumed
        self.dropped_stale_tokens = ledger.dropped_stale
        self.cancelled_groups = sim.cancelled_groups
        self.lost_tokens = ledger.lost
        self.eval_tokens = ledger.evaluated
        self.generated_tokens = ledger.generated
        self.goodput = ledger.consumed / end_time if end_time > 0 else 0.0
        self.kv_hit_rate = stats.hit_rate
        self.recompute_tokens = stats.recompute_tokens
        self.evictions = stats.evictions
        self.rwt_rank_s = stats.idle_s
        self.pauses = sim.cluster.pauses
        self.migrations = sim.cluster.migrations
        self.mean_step_s = end_time / len(self.steps) if self.steps else 0.0
        self.wall_s = wall_s
        self.events = sim.loop.events_processed
        self.trajectories_finished = sim.trajectories_finished
        self.ideal_hardware_goodput, self.ideal_workload_goodput, self.ideal_detail = ideal_bounds(sim)

    @property
    def waiting_rank_s(self) -> float:
        return self.rwt_rank_s + self.twt_rank_s

    def summary(self) -> dict:
        """Scalar figures (no timelines)."""
        keys = ["mode", "n_gpus", "n_ranks", "sim_time_s", "goodput", "ideal_hardware_goodput",
                "ideal_workload_goodput", "consumed_tokens",
                "dropped_stale_tokens", "cancelled_groups", "lost_tokens", "eval_tokens", "generated_tokens", "kv_hit_rate",
                "recompute_tokens", "pauses", "migrations", "evictions", "mean_step_s", "twt_rank_s",
                "rwt_rank_s", "role_changes", "wall_s", "events", "trajectories_finished"]
        out = {k: getattr(self, k) for k in keys}
        out["steps_done"] = len(self.steps)
        out["fraction_of_ideal_hardware"] = (self.goodput / self.ideal_hardware_goodput
                                             if self.ideal_hardware_goodput else 0.0)
        out["fraction_of_ideal_workload"] = (self.goodput / self.ideal_workload_goodput
                                             if self.ideal_workload_goodput else 0.0)
        out["ideal_detail"] = dict(self.ideal_detail)
        return out

    def to_dict(self) -> dict:
        d = self.summary()
        d["steps"] = [dict(asdict(s), duration=s.duration) for s in self.steps]
        d["roles"] = [list(r) for r in self.roles]
        d["ers_log"] = [list(r) for r in self.ers_log]
        return d


def ideal_bounds(sim) -> Tuple[float, float, dict]:
    """(ideal_hardware, ideal_workload, terms): see the module docstring."""
    hw = sim.hw
    gpr = sim.gpus_per_rank
    trajs = list(sim.consumed_trajs)
    consumed_tokens = sum(t.generated_tokens for t in trajs)
    if not consumed_tokens:
        return 0.0, 0.0, {}
    everything = trajs + list(sim.eval_trajs_done)
    # token-weighted mean context during decode sets the largest batch the KV pool holds
    ctx_sum = tok = 0
    for t in everything:
        c = t.prompt_tokens
        for g, o in zip(t.gen, t.obs):
            ctx_sum += g * (c + g / 2)
            tok += g
            c += g + o
    mean_ctx = ctx_sum / tok if tok else 1.0
    n_batch = max(1, int(hw.kv_capacity_tokens // max(1.0, mean_ctx)))
    prefill_s = 0.0
    seen_groups = set()
    for t in everything:
        if t.group_id not in seen_groups:
            seen_groups.add(t.group_id)
            prefill_s += hw.prefill_s(t.prompt_tokens)
        c = t.prompt_tokens
        for k, (g, o) in enumerate(zip(t.gen, t.obs)):
            c += g
            if k + 1 < len(t.gen):
                prefill_s += hw.prefill_s(o, c)
            c += o
    train_tokens = sum(t.total_tokens for t in trajs)
    seq = sim.costs.mean_seq_len
    train_gpu_s = (hw.train_s(train_tokens, seq, False, 1) + hw.train_s(train_tokens, seq, True, 1))
    n_gpus = sim.cfg.n_gpus
    kv_s = hw.decode_kv_s_per_token
    w, c_tok = hw.decode_weight_s, hw.decode_token_compute_s

    def t_hw(n: float) -> float:
        """(H): wall time if every token is decoded at batch n and the cluster is never idle."""
        rank_s = tok * max(w, n * c_tok) / n + ctx_sum * kv_s + prefill_s
        return (rank_s * gpr + train_gpu_s) / n_gpus

    # ---- ideal_hardware: the decode batch the KV pool holds at the mean context
    t_hardware = t_hw(n_batch)
    ideal_hardware = consumed_tokens / t_hardware

    # ---- ideal_workload: the LP of the module docstring, through its dual
    slots = sim.cfg.workload.env_concurrency
    env_s = sum(t.reset_s + sum(t.env_s) for t in everything)
    floor_ctx = sim.min_prompt_tokens if math.isfinite(sim.min_prompt_tokens) else 1
    kv_cap = hw.kv_capacity_tokens
    n_max = int(max(1, min(slots, kv_cap // max(1, floor_ctx))))
    classes = _context_classes(everything)
    h0 = (gpr * (ctx_sum * kv_s + prefill_s) + train_gpu_s) / n_gpus
    c0 = (env_s + prefill_s) / slots
    ridge = w / c_tok  # iterations of more sequences than this are compute bound

    def phi(n: int, ctx: float, mu: float, nu: float) -> float:
        """Per-token dual cost of a token whose context is >= ctx, decoded at batch n."""
        it = max(w, n * c_tok)
        return (mu * gpr * it / n / n_gpus + (1 - mu) * (it + kv_s * n * ctx) / slots
                + nu * (ctx - kv_cap / n))

    def best_n(ctx: float, mu: float, nu: float) -> int:
        """argmin_n phi exactly: below the ridge phi = A/n + B*n + const (convex when A > 0),
        above it phi increases with n, so the minimum is at one of these few integers."""
        a_ = mu * gpr * w / n_gpus - nu * kv_cap
        b_ = (1 - mu) * kv_s * ctx / slots
        cand = {1, n_max, min(n_max, max(1, int(ridge))), min(n_max, int(ridge) + 1)}
        if a_ > 0 and b_ > 0:
            r = math.sqrt(a_ / b_)
            cand.update({min(n_max, max(1, int(r))), min(n_max, int(r) + 1)})
        return min(cand, key=lambda n: (phi(n, ctx, mu, nu), n))

    def dual(mu: float, nu: float) -> float:
        """Weak duality: for mu in [0, 1], nu >= 0 this is <= T of every feasible schedule."""
        return mu * h0 + (1 - mu) * c0 + sum(k_tok * phi(best_n(ctx, mu, nu), ctx, mu, nu)
                                             for ctx, k_tok in classes)

    def golden_max(f, lo: float, hi: float, iters: int = 50) -> Tuple[float, float]:
        """Maximise a concave f on [lo, hi]; returns (argmax, max) of the points it tried."""
        g = (math.sqrt(5) - 1) / 2
        a, b = lo, hi
        x1, x2 = b - g * (b - a), a + g * (b - a)
        f1, f2 = f(x1), f(x2)
        best = max((f(lo), lo), (f(hi), hi), (f1, x1), (f2, x2))
        for _ in range(iters):
            if f1 < f2:
                a, x1, f1 = x1, x2, f2
                x2 = a + g * (b - a)
                f2 = f(x2)
                best = max(best, (f2, x2))
            else:
                b, x2, f2 = x2, x1, f1
                x1 = b - g * (b - a)
                f1 = f(x1)
                best = max(best, (f1, x1))
        return best[1], best[0]

    # a nu beyond the whole per-token (H) gain of batching, per token of KV room, only lowers it
    nu_hi = 2 * gpr * w / n_gpus / max(1e-9, kv_cap * (1 - 1 / n_max)) if n_max > 1 else 0.0
    inner = {}

    def over_nu(mu: float) -> float:
        nu, val = golden_max(lambda x: dual(mu, x), 0.0, nu_hi, 40) if nu_hi > 0 else (0.0, dual(mu, 0.0))
        inner[mu] = nu
        return val

    mu_star, t_dual = golden_max(over_nu, 0.0, 1.0, 40)
    t_workload = max(t_dual, t_hardware)
    ideal_workload = consumed_tokens / t_workload
    nu_star = inner[mu_star]
    # the decode batch the optimum leans on (token-weighted over context classes), for the record
    n_star = sum(k * best_n(ctx, mu_star, nu_star) for ctx, k in classes) / tok
    t_slots_batch1 = c0 + sum(k * (w + kv_s * ctx) for ctx, k in classes) / slots
    detail = {
        "consumed_tokens": consumed_tokens, "decoded_tokens": tok, "mean_decode_context": mean_ctx,
        "hardware_decode_batch": n_batch, "t_hardware_s": t_hardware, "train_gpu_s": train_gpu_s,
        "decode_rank_s_at_hardware_batch": tok * max(w, n_batch * c_tok) / n_batch + ctx_sum * kv_s,
        "env_concurrency": slots, "env_latency_s": env_s, "prefill_s": prefill_s,
        "decode_weight_s": w, "floor_context_tokens": floor_ctx, "max_batch_considered": n_max,
        "t_slots_at_batch1_s": t_slots_batch1, "t_workload_dual_s": t_dual, "t_workload_s": t_workload,
        "dual_mu": mu_star, "dual_nu": nu_star, "workload_decode_batch": n_star, "context_classes": len(classes),
        "binding": "hardware" if t_hardware >= t_dual else "workload",
    }
    return ideal_hardware, ideal_workload, detail


def _context_classes(trajs, n_classes: int = 48) -> List[Tuple[float, int]]:
    """Decode tokens grouped by context: [(a floor on the context of every token in the class,
    tokens)]. Each turn's tokens go to the class of the turn's starting context, and a class's
    floor is the smallest starting context in it, so every token's own context is >= its floor."""
    turns = []
    for t in trajs:
        c = t.prompt_tokens
        for g, o in zip(t.gen, t.obs):
            turns.append((c, g))
            c += g + o
    turns.sort()
    out: List[Tuple[float, int]] = []
    per = max(1, len(turns) // n_classes)
    for i in range(0, len(turns), per):
        chunk = turns[i:i + per]
        out.append((float(chunk[0][0]), sum(g for _, g in chunk)))
    return out
