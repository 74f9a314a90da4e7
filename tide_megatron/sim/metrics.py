"""What a simulation run reports.

Goodput = generated tokens the trainer consumed / wall time to the end of the last step
(tokens of cancelled, stale-dropped, lost or evaluation trajectories do not count), read from
the core `GlobalBuffer`'s token ledger. Every run also carries the two goodput bounds of
`tide_megatron.sim.bounds` (perfect hardware use; what any schedule can attain).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Tuple

from tide_megatron.sim.bounds import goodput_bounds


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
    """(step, RAS tokens, arrival tokens/s, target rollout ranks, rollout ranks planned, RA2P mode, reason)."""
    # filled by finish()
    sim_time_s: float = 0.0
    goodput: float = 0.0
    ideal_hardware_goodput: float = 0.0
    """Goodput bound of perfect hardware use (`bounds`)."""
    ideal_attainable_goodput: float = 0.0
    """Goodput bound of any schedule under the workload's slots and the staleness rule (`bounds`)."""
    ideal_detail: dict = field(default_factory=dict)
    """The terms both bounds are made of (seconds, tokens, batch sizes)."""
    consumed_tokens: int = 0
    dropped_stale_tokens: int = 0
    """Tokens of completed groups dropped because they were past the staleness bound."""
    cancelled_tokens: int = 0
    """Tokens of groups cancelled in flight because they could no longer make their deadline."""
    wasted_tokens: int = 0
    """Generated for training and thrown away (dropped, cancelled, failed, lost)."""
    cancelled_groups: int = 0
    """Training groups cancelled in flight (cancel rule)."""
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
        self.cancelled_tokens = ledger.cancelled
        self.wasted_tokens = ledger.wasted
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
        self.ideal_hardware_goodput, self.ideal_attainable_goodput, self.ideal_detail = goodput_bounds(sim)

    @property
    def waiting_rank_s(self) -> float:
        return self.rwt_rank_s + self.twt_rank_s

    def summary(self) -> dict:
        """Scalar figures (no timelines)."""
        keys = ["mode", "n_gpus", "n_ranks", "sim_time_s", "goodput", "ideal_hardware_goodput",
                "ideal_attainable_goodput", "consumed_tokens",
                "dropped_stale_tokens", "cancelled_tokens", "wasted_tokens", "cancelled_groups", "lost_tokens", "eval_tokens", "generated_tokens", "kv_hit_rate",
                "recompute_tokens", "pauses", "migrations", "evictions", "mean_step_s", "twt_rank_s",
                "rwt_rank_s", "role_changes", "wall_s", "events", "trajectories_finished"]
        out = {k: getattr(self, k) for k in keys}
        out["steps_done"] = len(self.steps)
        out["fraction_of_ideal_hardware"] = (self.goodput / self.ideal_hardware_goodput
                                             if self.ideal_hardware_goodput else 0.0)
        out["fraction_of_ideal_attainable"] = (self.goodput / self.ideal_attainable_goodput
                                               if self.ideal_attainable_goodput else 0.0)
        out["ideal_detail"] = dict(self.ideal_detail)
        return out

    def to_dict(self) -> dict:
        d = self.summary()
        d["steps"] = [dict(asdict(s), duration=s.duration) for s in self.steps]
        d["roles"] = [list(r) for r in self.roles]
        d["ers_log"] = [list(r) for r in self.ers_log]
        return d
