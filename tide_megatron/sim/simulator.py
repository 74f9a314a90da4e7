"""The simulator: one cluster, one workload, one scheduling mode.

Modes share every mechanism (engines, KV cache, env, buffer, trainer costs) and differ only in
scheduling, as in the paper's comparison (the trainer processes live in `sim/trainers.py`):

- `sync` (VeRL-like): every rank rolls out the global batch; barrier; every rank swaps the
  engine out and the training state in, trains (Ref, Actor), syncs weights, swaps back.
- `async_static` (AReaL-like): a fixed rollout share; the trainer waits for a full global
  batch, runs Ref over it, then the Actor (one aggregation round per step).
- `stream` (StreamRL-like): fixed share; micro-batches are trained as they arrive, by
  `scheduler.stream_executor` (VSO: a Ref->Actor model swap over PCIe per micro-batch; VS;
  or RA2P's colocated rounds).

A colocated trainer swaps Ref and Actor between its passes only with
`scheduler.offload_idle_model` (the real `ra2p.offload_idle_model`); by default both stay
resident in every mode, and only VSO swaps.
- `elastic` (verl-like dynamic scaling, `sim/verl_elastic.py`): a fixed standalone rollout
  share; after each weight sync the trainer's own ranks roll out while the trainer would wait,
  when the expected gain exceeds the measured switch cost, with an adaptive deactivate ratio.
- `tide`: streaming plus, cumulatively, RA2P (mode choice, just-in-time micro-batches,
  aggregation rounds sized by the cost model, decoupled pipeline), ERS (the closed-loop split,
  preemptive loans, and with `ers_retention` adaptive data retention: steps paced toward B_min
  after a rollout scale-down, sized when they open as on the real stack) and CTB (task-level
  rollout scheduling), through the core objects: `GlobalBuffer`, `CTBScheduler`,
  `trainer_layout`/`should_feed`/`plan_microbatches`, `ERSController`. Nothing here re-decides what those objects decide.

Staleness (`SimSchedulerConfig.staleness_rule`, shared by every mode): by default a group admitted
at version v must be consumed by the step that trains version v + bound; its trajectories run
across weight updates (the flush at every sync makes their next turn re-prefill), and when a
step's consumption closes, every group that can no longer be fresh is cancelled at once
(`GlobalBuffer.doomed_groups` decides, `cancel_group` books its tokens as wasted); with CTB,
its deadline-aware admission (fed the trainer's clock) also starts only groups predicted to
make their deadline and cancels doomed ones itself. Ready groups are taken earliest deadline
first, with room kept for groups on their last chance (the buffer's fetch).
The fixed-split feed keeps (bound + 1) x B trajectories of live groups in the pipeline.

Counters. The buffer-side quantities read on every dispatch or trainer wake-up (ready volume,
finished-but-unconsumed trajectories, live and admitted groups) are kept here as O(1)
counters, updated where groups enter, leave or are cancelled, instead of scanning the buffer.

Waiting times: TWT counts trainer rank-seconds spent waiting for ready data (or for the eval
phase that anchors the weight sync); RWT counts rollout rank-seconds with nothing to decode
or prefill (starved by the staleness throttle, the barrier or the env).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from tide_megatron.core.buffer import BufferConfig, CompletedGroup, GlobalBuffer
from tide_megatron.core.trajectory import Trajectory
from tide_megatron.core.ctb import CTBConfig
from tide_megatron.core.ctb_deadline import ConsumptionMeter, TrainerClock
from tide_megatron.core.ers import ERSConfig, ERSController, ERSMeasurements
from tide_megatron.core.ra2p import LatencyCorrection, RA2PConfig, trainer_layout
from tide_megatron.core.roles import RA2PMode, Role, RolePlan
from tide_megatron.core.signals import SignalsConfig
from tide_megatron.sim.config import MODES, SimConfig
from tide_megatron.sim.ctb_policy import CTBPolicy
from tide_megatron.sim.events import EventLoop, WaitUntil
from tide_megatron.sim.hardware import HardwareModel
from tide_megatron.sim.metrics import RunMetrics, StepRecord, record_rank_roles, step_figures
from tide_megatron.sim.rollout_cluster import RequestLevelPolicy, RolloutCluster
from tide_megatron.sim.trainer_model import TrainerCosts
from tide_megatron.sim.workload import Group, SimTrajectory, WorkloadModel

CTB_BUDGET_FRACTION = 0.9
"""CTB's per-rank token budget as a share of the engine's KV pool: the rest is headroom for the
tokens a turn generates beyond its reported context (CTBConfig: "below the physical capacity")."""


@dataclass
class Window:
    """What the ERS controller reads, accumulated since its previous plan."""

    start: float
    trainer_ranks: int
    rollout_ranks: int
    rollout_stats: tuple
    """(kv_token_s, decode_s, batch_seq_s, iterations, live trajectory-seconds, idle rank-seconds)
    of the cluster at the window's start."""
    trained_tokens: int = 0
    busy_s: float = 0.0
    starved_s: float = 0.0
    fresh_tokens: int = 0
    eval_tokens: int = 0
    slots_full_s: float = 0.0
    rollout_resized: bool = False
    """The rollout ranks changed as the window opened (`ERSMeasurements.rollout_resized`)."""


class Simulator:
    """Runs `cfg.steps` training steps of one mode and returns `RunMetrics`."""

    def __init__(self, cfg: SimConfig):
        sched = cfg.scheduler
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        if cfg.model.train_gpus_per_rank != cfg.model.rollout_tp:
            raise ValueError("a rank is one schedulable slot: rollout_tp must equal train_gpus_per_rank")
        self.cfg = cfg
        self.mode = cfg.mode
        self.hw = HardwareModel(cfg.hardware, cfg.model)
        self.gpus_per_rank = cfg.model.rollout_tp
        self.n_ranks = cfg.n_gpus // self.gpus_per_rank
        if self.n_ranks < 2 and self.mode != "sync":
            raise ValueError("asynchronous modes need at least two ranks")
        wl = cfg.workload
        self.workload = WorkloadModel(wl, cfg.seed)
        stats = self.workload.sample_stats()
        self.G = wl.group_size
        self.B = wl.batch_groups * wl.group_size
        self.tide = self.mode == "tide"
        self.continuous_rollout = self.mode not in ("sync", "sync_split")
        """Tasks are offered as the staleness window allows; else each step submits its batch."""
        self.elastic = self.tide and sched.ers
        self.ra2p_cfg = RA2PConfig(tokens_per_rank=sched.microbatch_tokens, actors_per_ref=sched.ref_actor_ratio)
        self.costs = TrainerCosts(self.hw, self.gpus_per_rank, stats["total_tokens"])
        self.latency_correction = LatencyCorrection()
        """RA2P's latency model error per mode, learned from the steps (core `LatencyCorrection`)."""
        self.predicted_step_s = math.nan
        """The chosen layout's predicted latency for the running step (NaN: no prediction)."""
        self.offload = sched.offload_idle_model
        """Colocated trainers swap Ref and Actor (a swap pair per round); else both stay resident."""
        self.ra2p_cfg.swap_cost_s = self.costs.swap_s(max(1, self.n_ranks // 2)) if self.offload else 0.0
        self.loop = EventLoop()
        b_min = wl.min_batch_groups * self.G if self.elastic and sched.ers_retention else self.B
        self.buffer = GlobalBuffer(BufferConfig(group_size=self.G, b_min=b_min, b_ideal=self.B,
                                                max_staleness=wl.staleness_bound),
                                   SignalsConfig(micro_batch_tokens=sched.microbatch_tokens))
        self.kv_budget = self.hw.kv_capacity_tokens
        if self.tide and sched.ctb:
            self.kv_budget = int(self.hw.kv_capacity_tokens * CTB_BUDGET_FRACTION)
            ctb_cfg = CTBConfig(
                rank_token_budget=self.kv_budget, env_concurrency=wl.env_concurrency,
                max_staleness=wl.staleness_bound, trainer_batch_trajectories=self.B,
                context_norm_tokens=max(t.max_context_tokens for t in wl.task_types),
                deadline_admission=sched.ctb_deadline_admission,
                throttle_from_consumption=sched.ctb_throttle_from_consumption)
            policy = CTBPolicy(ctb_cfg, ctb_cfg.rank_token_budget, lambda: self.finished_unconsumed,
                               clock_fn=self._trainer_clock, on_group_cancelled=self._cancel_group)
        else:
            policy = RequestLevelPolicy()
        self.cluster = RolloutCluster(self.loop, self.hw, policy, wl.env_concurrency, self._on_trajectory_done,
                                      self._on_admit)
        self.version = 0
        self.cancel_rule = sched.staleness_rule == "cancel"
        self.groups: Dict[int, Group] = {}
        # ---- O(1) counters (module docstring)
        self.live_groups = 0
        """Training groups submitted and not yet consumed, cancelled or dropped."""
        self.admitted_groups = 0
        """Live training groups with at least one member admitted (they hold throttle slots)."""
        self.ready_trajectories = 0
        self.ready_tokens = 0
        """Trainer-work tokens of the ready training groups."""
        self.finished_unconsumed = 0
        """Finished training trajectories not yet consumed, cancelled or dropped."""
        self.taken_groups_this_step = 0
        """Trajectories the trainer took since the current step began."""
        self.ready_changes = 0
        """Bumped whenever a group becomes ready (a trainer the buffer's fetch held back waits
        for this to move: its room was kept for groups still running on their last chance)."""
        self.step_started_at = 0.0
        self.consumption = ConsumptionMeter()
        self._ready_size: Dict[int, tuple] = {}
        self._slots_full_since: Optional[float] = None
        self.cancelled_groups = 0
        self.trajectories_finished = 0
        self.eval_outstanding = 0
        self.eval_pending_phase = False
        self.eval_started_at = 0.0
        self.eval_duration_s = 0.0
        """How long the last evaluation phase took (ERS sizes the next eval loan with it)."""
        self.metrics = RunMetrics(mode=self._label(), n_gpus=cfg.n_gpus, n_ranks=self.n_ranks)
        self.consumed_trajs: List[SimTrajectory] = []
        self.timeline_marks = (0.0, 0)
        """(rollout idle seconds, consumed trajectories) at the last step's end (`step_figures`)."""
        self.eval_trajs_done: List[SimTrajectory] = []
        self.trainer_ranks = 0
        self.plan: Optional[RolePlan] = None
        """The role plan in force (TIDE: possibly a preemptive loan)."""
        self.base_plan: Optional[RolePlan] = None
        """TIDE with ERS: the reactive plan loans return to."""
        self.ers: Optional[ERSController] = None
        self.window: Optional[Window] = None
        self.sync_s = self.hw.weight_sync_s(cfg.n_gpus)

    def _label(self) -> str:
        s = self.cfg.scheduler
        if self.mode == "tide":
            return "tide" + ("+ra2p" if s.ra2p else "") + ("+ers" if s.ers else "") + ("+ctb" if s.ctb else "")
        if self.mode in ("sync_split", "async_static", "stream", "elastic"):
            return f"{self.mode}@{s.rollout_share:g}"
        return self.mode

    # ================================================================= task stream & buffer
    def new_groups(self, n: int) -> List[Group]:
        out = []
        for _ in range(n):
            g = self.workload.next_train_group()
            self.groups[g.group_id] = g
            self.live_groups += 1
            out.append(g)
        self._slots_changed()
        return out

    def submit(self, groups: List[Group]) -> None:
        for g in groups:
            self.buffer.open_group(g.group_id, g.group_id, self.loop.now, size=g.size, is_eval=g.is_eval)
        self.cluster.submit([t for g in groups for t in g.trajectories])

    def _trainer_clock(self, now: float) -> Optional[TrainerClock]:
        """What CTB's deadline admission needs, measured here as the real controller would."""
        est = self.buffer.estimate()
        if est.steps_observed == 0 or est.step_time_s <= 0:
            return None  # cold start: CTB's staleness throttle alone
        return TrainerClock(version=self.cluster.version, step_time_s=est.step_time_s,
                            next_sync_at=max(now, self.step_started_at + est.step_time_s),
                            consumed_per_s=self.consumption.rate())

    def begin_step(self, now: float) -> None:
        """A step starts: its consumption window reopens (the feed refills it)."""
        self.taken_groups_this_step = 0
        self.step_started_at = now
        if self.continuous_rollout:
            self.feed()
        self._slots_changed()
        self._consumed_kick()
        self.buffer.begin_step(now)

    def feed(self) -> None:
        """Offer the rollout the groups the staleness window has room for
        (`GlobalBuffer.admission_room`, as the real controller asks). The same for every mode;
        CTB decides, within what is offered, which groups start (its deadline admission) and
        where."""
        n = self._admission_room()
        if n > 0:
            self.submit(self.new_groups(n))

    def _admission_room(self) -> int:
        return self.buffer.admission_room(self.B // self.G, self.cluster.version,
                                          live_groups=self.live_groups,
                                          consumed_groups=self.taken_groups_this_step)

    def _on_admit(self, traj: SimTrajectory) -> None:
        """A trajectory took an env slot: fix the version its staleness is measured from (the
        weights the engines serve now)."""
        group = self.groups[traj.group_id]
        engine_version = self.cluster.version
        if traj.is_eval:
            traj.version = engine_version
            return
        if not group.admitted:
            group.admitted = True
            self.admitted_groups += 1
            self._slots_changed()
            if self.cancel_rule:
                # the group's deadline: consumed by the step that trains version + bound
                group.version = engine_version
                self.buffer.note_admitted(group.group_id, group.version)
        traj.version = group.version if self.cancel_rule else engine_version

    def _on_trajectory_done(self, traj: SimTrajectory) -> None:
        now = self.loop.now
        rec = Trajectory(
            group_id=traj.group_id, index=traj.index, task_id=traj.group_id, policy_version=traj.version,
            # observations are prompt-side tokens for the trainer (loss-masked, but processed)
            prompt_tokens=traj.total_tokens - traj.generated_tokens, generated_tokens=traj.generated_tokens,
            reward=float(traj.traj_id % 3 == 0), started_at=traj.start_time, finished_at=now,
            is_eval=traj.is_eval, payload=traj)
        self.trajectories_finished += 1
        group = self.groups[traj.group_id]
        group.done += 1
        if traj.is_eval:
            self.eval_trajs_done.append(traj)
            if self.window is not None and self._slots_full_since is None:
                self.window.eval_tokens += traj.total_tokens
        else:
            self.finished_unconsumed += 1
        entered = self.buffer.add_trajectory(rec, now, consumer_version=self.version)
        if group.complete:
            del self.groups[traj.group_id]
            if group.is_eval:
                self.eval_outstanding -= 1
                if self.eval_outstanding == 0:
                    self.eval_duration_s = now - self.eval_started_at
            elif entered is None:  # already stale at completion (drop rule)
                self.finished_unconsumed -= group.size
                self._left(admitted=True)
            else:
                tokens = entered.total_tokens
                self._ready_size[group.group_id] = (len(entered), tokens)
                self.ready_trajectories += len(entered)
                self.ready_tokens += tokens
                self.ready_changes += 1
                if self.window is not None and self._slots_full_since is None:
                    self.window.fresh_tokens += tokens
        self.loop.notify()
        if self.continuous_rollout:
            self.feed()

    def _left(self, admitted: bool, n: int = 1) -> None:
        """`n` live training groups left the pipeline (consumed, cancelled or dropped)."""
        self.live_groups -= n
        if admitted:
            self.admitted_groups -= n
        self._slots_changed()

    def _unready(self, gid) -> None:
        trajs, tokens = self._ready_size.pop(gid)
        self.ready_trajectories -= trajs
        self.ready_tokens -= tokens
        self.finished_unconsumed -= trajs

    def open_stream(self) -> tuple[List[CompletedGroup], int]:
        """A streaming step opens on its first ready data: the groups it takes now, and the
        trajectories it trains in all (`GlobalBuffer.open_stream`, as on the real stack)."""
        groups, n_groups = self.buffer.open_stream(self.version, self.loop.now, self.B // self.G)
        self._taken(groups)
        return groups, n_groups * self.G

    def take(self, max_trajectories: int) -> List[CompletedGroup]:
        """Streaming fetch for the trainer (whole fresh groups, oldest first)."""
        groups = self.buffer.fetch(self.version, self.loop.now, max_trajectories)
        self._taken(groups)
        return groups

    def take_batch(self):
        """The elastic batch [B_min, B_ideal], or None."""
        batch = self.buffer.fetch_batch(self.version, self.loop.now)
        if batch is not None:
            self._taken(list(batch.groups))
        return batch

    def _taken(self, groups: List[CompletedGroup]) -> None:
        if not groups:
            return
        for g in groups:
            self._unready(g.group_id)
            self.consumed_trajs.extend(t.payload for t in g.trajectories)
            if self.window is not None:
                self.window.trained_tokens += g.total_tokens
        self.taken_groups_this_step += len(groups)
        self._left(admitted=True, n=len(groups))
        self._consumed_kick()

    def expire(self, next_consumer_version: int) -> None:
        """The consumption of a step is closed: every training group that can no longer be fresh
        for the next step is cancelled now (cancel rule: in flight ones stop at once, their
        tokens booked as wasted) and stale ready groups are dropped, freeing their slots."""
        now = self.loop.now
        dropped = self.buffer.drop_stale(next_consumer_version, now)
        for rec in dropped:
            self._unready(rec.group_id)
        self._left(admitted=True, n=len(dropped))
        if self.cancel_rule:
            for gid in self.buffer.doomed_groups(next_consumer_version):
                self._cancel_group(gid, next_consumer_version)
        self._consumed_kick()

    def _cancel_group(self, gid: int, consumer_version: int = -1) -> None:
        """Stop every trajectory of a doomed training group now and book its tokens as wasted."""
        group = self.groups.pop(gid, None)
        if group is None or not self.buffer.is_pending(gid):
            return
        now = self.loop.now
        for traj in group.trajectories:
            tokens = self.cluster.cancel(traj, now)
            if tokens:
                self.buffer.record_tokens(gid, traj.index, tokens)
        self.buffer.cancel_group(gid, now, consumer_version)
        self.finished_unconsumed -= group.done
        self._left(admitted=group.admitted)
        self.cancelled_groups += 1

    def start_eval_phase(self) -> None:
        wl = self.cfg.workload
        groups = [self.workload.next_eval_group() for _ in range(wl.eval_tasks)]
        for g in groups:
            self.groups[g.group_id] = g
        self.eval_outstanding += len(groups)
        self.eval_pending_phase = True
        self.eval_started_at = self.loop.now
        self.submit(groups)

    def _consumed_kick(self) -> None:
        """Data left the buffer: CTB's staleness throttle reads the unconsumed volume, so the
        dispatcher must look again. Without this, a rollout whose every task had finished and
        whose admissions were throttled stayed idle until some unrelated event (a role change)
        woke it, or forever (observed: the run stalled with 32 admissible tasks queued)."""
        if isinstance(self.cluster.policy, CTBPolicy):
            self.cluster.kick()

    def _slots_changed(self) -> None:
        """Integrate the time the staleness window keeps new groups out."""
        now = self.loop.now
        if self._slots_full_since is not None and self.window is not None:
            self.window.slots_full_s += now - max(self._slots_full_since, self.window.start)
        # full: the window has no room for one more group, and every group offered is admitted
        # (so nothing but the throttle holds the next one back)
        full = self._admission_room() == 0 and self.live_groups == self.admitted_groups
        self._slots_full_since = now if full else None

    # ====================================================================== roles
    def set_rollout(self, ranks: List[int], stall_s: float) -> None:
        now = self.loop.now
        current = set(self.cluster.active)
        for r in sorted(current - set(ranks)):
            self.cluster.remove_rank(r, now)
        for r in sorted(set(ranks) - current):
            self.cluster.add_rank(r, now, stall_s)

    def record_roles(self, n_ref: int = 0, mode: str = "") -> None:
        self.metrics.roles.append((self.loop.now, len(self.cluster.active), self.trainer_ranks - n_ref, n_ref, mode))
        record_rank_roles(self)

    def static_split(self) -> tuple:
        """(rollout ranks, trainer rank count) of the fixed-share modes."""
        share = self.cfg.scheduler.initial_rollout_share if self.tide else self.cfg.scheduler.rollout_share
        n_roll = min(self.n_ranks - 1, max(1, round(share * self.n_ranks)))
        return list(range(self.n_ranks - n_roll, self.n_ranks)), self.n_ranks - n_roll

    def apply_plan(self, plan: RolePlan, stall_s: float) -> None:
        self.set_rollout(plan.rollout_ranks, stall_s)
        self.trainer_ranks = len(plan.trainer_ranks)
        self.plan = plan
        self.record_roles(len(plan.ranks_with(Role.REF)), plan.mode.value)

    def layout(self) -> tuple:
        """(RA2P mode, actor ranks, dedicated Ref ranks, colocated round size) of the next step."""
        self.predicted_step_s = math.nan
        if self.plan is not None and self.elastic:
            extras = self.plan.extras
            k = int(extras.get("round_micro_batches", 1) or 1)
            self.predicted_step_s = extras.get(f"latency_{self.plan.mode.value}_s", math.nan)
            return self.plan.mode, len(self.plan.actor_ranks), len(self.plan.ranks_with(Role.REF)), k
        t = self.trainer_ranks
        est = self.buffer.estimate()
        if not (self.tide and self.cfg.scheduler.ra2p) or est.steps_observed == 0:
            return RA2PMode.COLOCATED, t, 0, 1
        lay = trainer_layout(t, ras_tokens=self.ready_tokens, arrival_tokens_per_s=est.arrival_tokens_per_s,
                             step_tokens=self.B * self.costs.mean_seq_len,
                             times=self.costs.microbatch_times(self.ra2p_cfg.tokens_per_rank), cfg=self.ra2p_cfg,
                             correction=self.latency_correction)
        self.predicted_step_s = lay.latency_decoupled_s if lay.mode is RA2PMode.DECOUPLED else lay.latency_colocated_s
        return lay.mode, lay.actor_ranks, lay.ref_ranks, lay.round_micro_batches

    # ======================================================================= step boundary
    def wait_for(self, predicate, label: str):
        """Yield a wait and account it as trainer waiting time."""
        t0 = self.loop.now
        yield WaitUntil(predicate, label)
        self.metrics.twt_rank_s += (self.loop.now - t0) * self.trainer_ranks
        return self.loop.now - t0

    def finish_step(self, step: int, start: float, consumed: int, tokens: int, extra: dict):
        """Deadlines, version bump, eval anchoring, ERS plan, weight sync and cache flush."""
        readiness = self.buffer.end_step(self.loop.now)
        figures = step_figures(self)
        self.expire(self.version + 1)
        self.version += 1
        eval_wait = 0.0
        if self.eval_pending_phase:
            # the model under evaluation must stay on the rollout ranks until its eval is done
            eval_wait = yield from self.wait_for(lambda: self.eval_outstanding == 0, "eval anchor")
            self.eval_pending_phase = False
        eval_next = self.workload.is_eval_step(step + 1)
        stall = self.sync_s
        if self.elastic:
            stall = max(stall, self._ers_boundary(step, eval_next))
        yield stall
        self.consumption.record_step(self.step_started_at, self.loop.now, consumed)
        self.cluster.version = self.version
        self.cluster.flush_all(self.loop.now, 0.0)  # the rollout ranks stalled with the trainer
        if eval_next:
            self.start_eval_phase()
        if self.continuous_rollout:
            self.feed()
        rec = StepRecord(step=step, start=start, end=self.loop.now, trajectories=consumed, tokens=tokens,
                         rollout_ranks=len(self.cluster.active), trainer_ranks=self.trainer_ranks,
                         ras=readiness.ras, tprm_s=readiness.tprm_s, eval_wait_s=eval_wait, **figures, **extra)
        self.metrics.steps.append(rec)

    # =============================================================================== ERS
    def ers_start(self) -> None:
        """Initial split (a fixed prior), with a preemptive cold-start loan when enabled."""
        sched = self.cfg.scheduler
        min_train = max(1, round((1 - sched.max_rollout_share) * self.n_ranks))
        min_roll = max(1, round(sched.min_rollout_share * self.n_ranks))
        self.ers = ERSController(ERSConfig(min_rollout_ranks=min_roll, min_trainer_ranks=min_train,
                                           max_moves_per_step=sched.ers_max_moves,
                                           failed_move_hold_steps=sched.ers_failed_move_hold_steps,
                                           payoff_windows=sched.ers_payoff_windows,
                                           streaks=sched.ers_streaks),
                                 self.n_ranks, self.ra2p_cfg)
        self.base_plan = self.ers.initial_plan(sched.initial_rollout_share)
        first = self.base_plan
        if sched.ers_preemptive:
            first = self.ers.preemptive_plan(self.base_plan, keep_trainer_ranks=min_train, reason="cold start")
        self.apply_plan(first, 0.0)
        self.open_window()

    def end_cold_start(self):
        """The trainer's first micro-batch is ready: lent ranks return to the trainer (they drop
        their engine and load the training state; their tasks re-dispatch elsewhere)."""
        if self.plan is self.base_plan:
            return
        load = self.hw.swap_s(0, self.hw.actor_state_bytes_per_gpu(len(self.base_plan.actor_ranks)))
        self.apply_plan(self.base_plan, 0.0)
        self.open_window(rollout_resized=True)
        yield load

    def open_window(self, rollout_resized: bool = False) -> None:
        self.window = Window(self.loop.now, self.trainer_ranks, len(self.cluster.active), self._rollout_totals(),
                             rollout_resized=rollout_resized)
        self._slots_changed()

    def _rollout_totals(self) -> tuple:
        st = self.cluster.total_stats()
        now = self.loop.now
        return (st.kv_token_s, st.decode_s, st.batch_seq_s, st.iterations, self.cluster.live_s_at(now),
                self.cluster.idle_s_at(now))

    def _measurements(self) -> ERSMeasurements:
        self._slots_changed()  # close the running slots-full interval
        w, est = self.window, self.buffer.estimate()
        kv, dec, seq, iters, live, idle = (a - b for a, b in zip(self._rollout_totals(), w.rollout_stats))
        span = max(1e-9, self.loop.now - w.start)
        busy = max(0.0, span * w.rollout_ranks - idle)  # prefill and decode (pauses too)
        return ERSMeasurements(
            window_s=span, trainer_ranks=w.trainer_ranks, trainer_busy_s=min(span, w.busy_s),
            trainer_starved_s=min(span, w.starved_s), trained_tokens=w.trained_tokens,
            rollout_ranks=w.rollout_ranks, fresh_tokens=w.fresh_tokens, eval_tokens=w.eval_tokens,
            slots_full_s=min(span, w.slots_full_s),
            kv_used_fraction=kv / (span * max(1, w.rollout_ranks) * self.kv_budget),
            ras_tokens=est.ras_tokens, arrival_tokens_per_s=est.arrival_tokens_per_s,
            decode_iteration_s=dec / iters if iters > 0 else 0.0, decode_floor_s=self.hw.decode_base_s(1),
            mean_decode_batch=seq / dec if dec > 0 else 0.0, decode_seq_s=seq, tasks_in_flight_s=live,
            rollout_busy_s=busy, rollout_resized=w.rollout_resized)

    def _ers_boundary(self, step: int, eval_next: bool) -> float:
        """Plan after the actor update; roles switch with the weight sync. Returns the stall."""
        sched = self.cfg.scheduler
        m = self._measurements()
        load = {r: float(self.cluster.ranks[r].footprint) for r in self.cluster.active}
        times = self.costs.microbatch_times(self.ra2p_cfg.tokens_per_rank)
        plan = self.ers.plan(self.base_plan, m, times, step=step, rollout_load=load,
                             correction=self.latency_correction)
        if not sched.ra2p and plan.mode is RA2PMode.DECOUPLED:  # no decoupled mode without RA2P
            plan = RolePlan({r: (Role.ACTOR_REF if role.is_trainer else role) for r, role in plan.roles.items()},
                            RA2PMode.COLOCATED, plan.reason, plan.step, plan.changed, plan.extras)
        self.base_plan = plan
        if eval_next and sched.ers_preemptive:
            keep = self.ers.eval_trainer_ranks(self.eval_duration_s)
            plan = self.ers.preemptive_plan(plan, keep_trainer_ranks=keep, reason="evaluation phase", rollout_load=load)
        self.metrics.ers_log.append((step, m.ras_tokens, m.arrival_tokens_per_s,
                                     plan.extras.get("target_rollout_ranks", float("nan")),
                                     len(plan.rollout_ranks), plan.mode.value, plan.reason))
        stall = 0.0
        resized = plan.rollout_ranks != self.plan.rollout_ranks
        if any(plan.roles[r] is not self.plan.roles[r] for r in plan.roles) or plan.mode is not self.plan.mode:
            before = len(self.plan.rollout_ranks)
            joining = [r for r in plan.trainer_ranks if self.plan.roles[r] is Role.ROLLOUT]
            new_refs = [r for r in plan.ranks_with(Role.REF) if self.plan.roles[r] is not Role.REF]
            # a rank joining the trainer loads the training state, a new Ref rank the reference,
            # both while the others broadcast the new weights
            if joining:
                stall = self.hw.swap_s(0, self.hw.actor_state_bytes_per_gpu(len(plan.actor_ranks)))
            if new_refs:
                stall = max(stall, self.hw.swap_s(0, self.hw.ref_state_bytes_per_gpu))
            self.buffer.notify_rollout_scaled(len(plan.rollout_ranks) - before)
            self.apply_plan(plan, self.sync_s)
            self.metrics.role_changes += 1
        self.plan = plan
        self.open_window(rollout_resized=resized)
        return stall

    # =============================================================================== run
    def run(self) -> RunMetrics:
        from tide_megatron.sim import trainers

        wall0 = time.perf_counter()
        proc = self.loop.spawn(trainers.process_for(self), "trainer")
        self.cluster.version = 0

        def stop_when_done():
            if proc.finished:
                self.loop.stop()
            else:
                self.loop.after(1.0, stop_when_done)

        self.loop.after(1.0, stop_when_done)
        self.loop.run(self.cfg.max_sim_time_s)
        self.cluster.settle(self.loop.now)
        end = self.metrics.steps[-1].end if self.metrics.steps else self.loop.now
        m = self.metrics
        m.finish(self, end, time.perf_counter() - wall0)
        problems = self.buffer.audit()
        if problems:
            raise AssertionError(f"buffer invariants broken: {problems[:3]}")
        return m
