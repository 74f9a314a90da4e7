"""What a simulation run reports.

Goodput = generated tokens the trainer consumed / wall time to the end of the last step
(tokens of cancelled, stale-dropped, lost or evaluation trajectories do not count), read from
the core `GlobalBuffer`'s token ledger. Every run also carries the two goodput bounds of
`tide_megatron.sim.bounds` (perfect hardware use; what any schedule can attain).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

from tide_megatron.core.roles import RA2PMode
from tide_megatron.sim.bounds import goodput_bounds
from tide_megatron.utils.timeline import IDLE, Timeline, TimelineStep


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
    rwt_s: float = 0.0
    """Mean idle seconds per rollout rank in the step (the real run's `rwt_s`)."""
    staleness_mean: float = 0.0
    """Policy-version lag of the trajectories the step consumed."""
    staleness_max: int = 0
    ref_ranks: int = 0
    """Dedicated reference ranks of the step's layout (counted in `trainer_ranks` too)."""

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
    timeline: Timeline = field(default_factory=lambda: Timeline(source="sim"))
    """The role of every rank over time (recorded as roles change) and, after `finish`, one
    record per step: the same schema and plot as a real run's `timeline.json`."""
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
        self.timeline.label = self.mode
        self.timeline.steps = [timeline_step(s) for s in self.steps]
        self.timeline.close(end_time)

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


def timeline_step(s: StepRecord) -> TimelineStep:
    """A simulated step in the timeline schema: TWT is the trainer's data wait plus the wait for
    an evaluation to finish (as the real controller books it)."""
    return TimelineStep(step=s.step, start=s.start, end=s.end, twt_s=s.wait_s + s.eval_wait_s, rwt_s=s.rwt_s,
                        ra2p_mode=s.ra2p_mode, staleness_mean=s.staleness_mean, staleness_max=s.staleness_max,
                        rollout_ranks=s.rollout_ranks, trainer_ranks=s.trainer_ranks - s.ref_ranks,
                        ref_ranks=s.ref_ranks)


def record_rank_roles(sim, mode: RA2PMode = RA2PMode.COLOCATED, actors: Optional[int] = None, refs: int = 0) -> None:
    """Every rank's role now, into `sim.metrics.timeline` (a no-op for ranks that keep theirs).

    With ERS the plan names every rank's role. Otherwise the simulator keeps counts: the
    cluster's active ranks roll out, and the trainer's `sim.trainer_ranks` are the lowest ranks
    that do not roll out, then (sync's training phase) ranks whose engines sleep through it;
    `actors`/`refs` split them by the step's RA2P layout (decoupled: actors then dedicated
    references, the rest idle; colocated: all actor+ref)."""
    if not sim.cfg.record_timeline:
        return
    if sim.plan is not None and sim.elastic:
        roles = {r: role.value for r, role in sim.plan.roles.items()}
    else:
        active = set(sim.cluster.active)
        ranks = range(sim.n_ranks)
        trainers = ([r for r in ranks if r not in active] + sorted(active))[:sim.trainer_ranks]
        roles = {r: ("rollout" if r in active else IDLE) for r in ranks}
        if mode is RA2PMode.DECOUPLED:
            n_act = len(trainers) if actors is None else actors
            roles.update({r: ("actor" if i < n_act else "ref" if i < n_act + refs else IDLE)
                          for i, r in enumerate(trainers)})
        else:
            roles.update({r: "actor_ref" for r in trainers})
    for rank, role in sorted(roles.items()):
        sim.metrics.timeline.set_role(rank, role, sim.loop.now)


def step_figures(sim) -> dict:
    """RWT (mean idle seconds per rollout rank since the previous call) and the staleness of the
    trajectories consumed since then; call at the step's end, before the version moves."""
    now = sim.loop.now
    idle = sim.cluster.idle_s_at(now)
    idle_before, consumed_before = sim.timeline_marks
    fresh = sim.consumed_trajs[consumed_before:]
    sim.timeline_marks = (idle, len(sim.consumed_trajs))
    lags = [sim.version - t.version for t in fresh]
    return {"rwt_s": (idle - idle_before) / max(1, len(sim.cluster.active)),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0, "staleness_max": max(lags, default=0)}
