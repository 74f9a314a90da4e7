"""What a simulation run reports, and the ideal bound it is compared with.

Goodput = generated tokens the trainer consumed / wall time to the end of the last step
(tokens of stale-dropped, lost or evaluation trajectories do not count), read from the core
`GlobalBuffer`'s token ledger.

Ideal bound: the goodput of a perfectly balanced cluster that never waits, never recomputes a
prefix and never swaps a model. It charges, in GPU-seconds, exactly the work the run's consumed
trajectories (and its evaluation trajectories, which must be generated too) require:
  - decode of every generated token at the largest batch the KV pool holds at the mean
    context, each token also reading its own context's KV;
  - prefill of every token once (the group's shared prompt once per group, each observation
    once, behind its cached context);
  - Ref forward and Actor forward+backward of every trained token;
and divides the GPU-seconds by the cluster size. No run can beat it except through the
decode-batch approximation (a run whose batches had shorter contexts than the mean).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
    ideal_goodput: float = 0.0
    consumed_tokens: int = 0
    dropped_stale_tokens: int = 0
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
        self.ideal_goodput = ideal_goodput(sim)

    @property
    def waiting_rank_s(self) -> float:
        return self.rwt_rank_s + self.twt_rank_s

    def summary(self) -> dict:
        """Scalar figures (no timelines)."""
        keys = ["mode", "n_gpus", "n_ranks", "sim_time_s", "goodput", "ideal_goodput", "consumed_tokens",
                "dropped_stale_tokens", "lost_tokens", "eval_tokens", "generated_tokens", "kv_hit_rate",
                "recompute_tokens", "pauses", "migrations", "evictions", "mean_step_s", "twt_rank_s",
                "rwt_rank_s", "role_changes", "wall_s", "events", "trajectories_finished"]
        out = {k: getattr(self, k) for k in keys}
        out["steps_done"] = len(self.steps)
        out["fraction_of_ideal"] = self.goodput / self.ideal_goodput if self.ideal_goodput else 0.0
        return out

    def to_dict(self) -> dict:
        d = self.summary()
        d["steps"] = [dict(asdict(s), duration=s.duration) for s in self.steps]
        d["roles"] = [list(r) for r in self.roles]
        d["ers_log"] = [list(r) for r in self.ers_log]
        return d


def ideal_goodput(sim) -> float:
    """See module docstring. GPU-seconds of the necessary work / GPUs -> tokens per second."""
    hw = sim.hw
    gpr = sim.gpus_per_rank
    trajs = list(sim.consumed_trajs)
    consumed_tokens = sum(t.generated_tokens for t in trajs)
    if not consumed_tokens:
        return 0.0
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
    per_token = hw.decode_base_s(n_batch) / n_batch
    rank_s = tok * per_token + ctx_sum * hw.decode_kv_s_per_token
    seen_groups = set()
    for t in everything:
        if t.group_id not in seen_groups:
            seen_groups.add(t.group_id)
            rank_s += hw.prefill_s(t.prompt_tokens)
        c = t.prompt_tokens
        for k, (g, o) in enumerate(zip(t.gen, t.obs)):
            c += g
            if k + 1 < len(t.gen):
                rank_s += hw.prefill_s(o, c)
            c += o
    train_tokens = sum(t.total_tokens for t in trajs)
    seq = sim.costs.mean_seq_len
    train_gpu_s = (hw.train_s(train_tokens, seq, False, 1) + hw.train_s(train_tokens, seq, True, 1))
    gpu_s = rank_s * gpr + train_gpu_s
    return consumed_tokens / (gpu_s / sim.cfg.n_gpus)
