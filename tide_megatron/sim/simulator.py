"""The simulator: one cluster, one workload, one scheduling mode.

Modes share every mechanism (engines, KV cache, env, buffer, trainer costs) and differ only in
scheduling, as in the paper's comparison:

- `sync` (VeRL-like): every rank rolls out the global batch; barrier; every rank swaps the
  engine out and the training state in, trains (Ref, swap, Actor), syncs weights, swaps back.
- `async_static` (AReaL-like): a fixed rollout share; the trainer waits for a full global
  batch, runs Ref over it, swaps, runs the Actor (one aggregation round per step).
- `stream` (StreamRL-like): fixed share; micro-batches are trained as they arrive, each with
  a Ref->Actor model alternation over PCIe.
- `tide`: streaming plus, cumulatively, RA2P (mode choice, aggregation, decoupled pipeline),
  ERS (role changes, elastic batch) and CTB (task-level rollout scheduling), through the core
  objects: `GlobalBuffer`, `CTBScheduler`, `choose_mode`/`plan_microbatches`, `ERSPlanner`.

Staleness (`SchedulerConfig.staleness_rule`, shared by every mode): by default a group admitted
at version v must be consumed by the step that trains version v + bound; its trajectories run
across weight updates (the flush at every sync makes their next turn re-prefill), and when a
step's consumption closes, every group that can no longer be fresh is cancelled at once
(`GlobalBuffer.doomed_groups` decides, `abandon_group(stale=True)` books its tokens as wasted).
The fixed-split feed keeps (bound + 1) x B trajectories of live groups in the pipeline.

Waiting times: TWT counts trainer rank-seconds spent waiting for ready data (or for the eval
phase that anchors the weight sync); RWT counts rollout rank-seconds with nothing to decode
or prefill (starved by the staleness throttle, the barrier or the env).
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

from tide_megatron.core.buffer import BufferConfig, GlobalBuffer
from tide_megatron.core.buffer import Trajectory as BufferTrajectory
from tide_megatron.core.ctb import CTBConfig
from tide_megatron.core.ra2p import RA2PConfig, break_even_ras, choose_mode
from tide_megatron.core.ers import ERSConfig, ERSPlanner
from tide_megatron.core.roles import RA2PMode, Role, RolePlan
from tide_megatron.core.signals import SignalsConfig, detect_deficits
from tide_megatron.sim.config import MODES, SimConfig
from tide_megatron.sim.ctb_policy import CTBPolicy
from tide_megatron.sim.events import EventLoop, WaitUntil
from tide_megatron.sim.hardware import HardwareModel
from tide_megatron.sim.metrics import RunMetrics, StepRecord
from tide_megatron.sim.rollout_cluster import RequestLevelPolicy, RolloutCluster
from tide_megatron.sim.trainer_model import (
    DecoupledPipeline, TrainerCosts, aggregated_round, per_microbatch_alternation, sequence_lengths)
from tide_megatron.sim.workload import Group, Trajectory, WorkloadModel

CTB_BUDGET_FRACTION = 0.9
"""CTB's per-rank token budget as a share of the engine's KV pool: the rest is headroom for the
tokens a turn generates beyond its reported context (CTBConfig: "below the physical capacity")."""


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
        self.elastic = self.tide and sched.ers
        self.ra2p_cfg = RA2PConfig(tokens_per_rank=sched.microbatch_tokens, actors_per_ref=sched.ref_actor_ratio)
        self.costs = TrainerCosts(self.hw, self.gpus_per_rank, stats["total_tokens"])
        self.ra2p_cfg.swap_cost_s = self.costs.swap_s(max(1, self.n_ranks // 2))
        self.loop = EventLoop()
        b_min = wl.min_batch_groups * self.G if self.elastic else self.B
        self.signals = SignalsConfig(micro_batch_tokens=sched.microbatch_tokens * max(1, self.n_ranks // 2),
                                     hol_tau=sched.ers_tau)
        self.buffer = GlobalBuffer(BufferConfig(group_size=self.G, b_min=b_min, b_ideal=self.B,
                                                max_staleness=wl.staleness_bound), self.signals)
        if self.tide and sched.ctb:
            ctb_cfg = CTBConfig(
                rank_token_budget=int(self.hw.kv_capacity_tokens * CTB_BUDGET_FRACTION),
                env_concurrency=wl.env_concurrency, max_staleness=wl.staleness_bound,
                trainer_batch_trajectories=self.B,
                context_norm_tokens=max(t.max_context_tokens for t in wl.task_types))
            policy = CTBPolicy(ctb_cfg, ctb_cfg.rank_token_budget, self.buffer.unconsumed_trajectories)
        else:
            policy = RequestLevelPolicy()
        self.cluster = RolloutCluster(self.loop, self.hw, policy, wl.env_concurrency, self._on_trajectory_done,
                                      self._on_admit)
        self.version = 0
        self.cancel_rule = sched.staleness_rule == "cancel"
        self.groups: Dict[int, Group] = {}
        self.live_groups = 0
        """Training groups submitted and not yet consumed, cancelled or dropped (O(1) counter:
        the feed cap and the group-slot measurements read it instead of scanning)."""
        self.cancelled_groups = 0
        self.trajectories_finished = 0
        self.min_prompt_tokens = math.inf
        """Shortest prompt of any trajectory ever submitted (a floor on every running context;
        the ideal-workload bound reads it)."""
        self.eval_outstanding = 0
        self.eval_pending_phase = False
        self.metrics = RunMetrics(mode=self._label(), n_gpus=cfg.n_gpus, n_ranks=self.n_ranks)
        self.consumed_trajs: List[Trajectory] = []
        self.eval_trajs_done: List[Trajectory] = []
        self.trainer_ranks = 0
        self.plan: Optional[RolePlan] = None
        self.ers: Optional[ERSPlanner] = None
        self.sync_s = self.hw.weight_sync_s(cfg.n_gpus)

    def _label(self) -> str:
        s = self.cfg.scheduler
        if self.mode == "tide":
            return "tide" + ("+ra2p" if s.ra2p else "") + ("+ers" if s.ers else "") + ("+ctb" if s.ctb else "")
        if self.mode in ("async_static", "stream"):
            return f"{self.mode}@{s.rollout_share:g}"
        return self.mode

    # ================================================================= task stream & buffer
    def _new_groups(self, n: int) -> List[Group]:
        out = []
        for _ in range(n):
            g = self.workload.next_train_group()
            self.groups[g.group_id] = g
            self.live_groups += 1
            out.append(g)
        return out

    def _submit(self, groups: List[Group]) -> None:
        for g in groups:
            self.min_prompt_tokens = min(self.min_prompt_tokens, min(t.prompt_tokens for t in g.trajectories))
            self.buffer.open_group(g.group_id, g.group_id, self.loop.now, size=g.size, is_eval=g.is_eval)
        self.cluster.submit([t for g in groups for t in g.trajectories])

    def _feed_async(self) -> None:
        """Keep the rollout fed within the staleness bound. Without CTB: at most (bound + 1) * B
        trajectories of *live* groups (submitted, not yet consumed, cancelled or dropped), AReaL's
        admission rule; counting groups that were ever started instead would shrink the pipeline
        for good with every dropped group. CTB throttles by itself; it is handed groups ahead of
        need."""
        wl = self.cfg.workload
        if isinstance(self.cluster.policy, CTBPolicy):
            while self.cluster.policy.backlog() < 2 * self.B:
                self._submit(self._new_groups(1))
            return
        n = (wl.staleness_bound + 1) * wl.batch_groups - self.live_groups
        if n > 0:
            self._submit(self._new_groups(n))

    def _on_admit(self, traj: Trajectory) -> None:
        """A trajectory took an env slot: fix the version its staleness is measured from."""
        group = self.groups[traj.group_id]
        if not self.cancel_rule or traj.is_eval:
            traj.version = self.version
            return
        if group.version < 0:
            # the group's deadline: consumed by the step that trains version + bound
            group.version = self.version
            self.buffer.record_tokens(group.group_id, traj.index, 0, policy_version=group.version)
        traj.version = group.version

    def _consumed(self, groups) -> None:
        self.live_groups -= len(groups)

    def _expire(self, next_consumer_version: int) -> None:
        """The consumption of a step is closed: every training group that can no longer be fresh
        for the next step is cancelled now (cancel rule: in flight ones stop at once, their
        tokens booked as wasted) and stale ready groups are dropped, freeing their slots."""
        now = self.loop.now
        self.live_groups -= len(self.buffer.drop_stale(next_consumer_version, now))
        if not self.cancel_rule:
            return
        for gid in self.buffer.doomed_groups(next_consumer_version):
            group = self.groups.pop(gid)
            for traj in group.trajectories:
                tokens = self.cluster.cancel(traj, now)
                if tokens:
                    self.buffer.record_tokens(gid, traj.index, tokens)
            self.buffer.abandon_group(gid, now, stale=True, consumer_version=next_consumer_version)
            self.live_groups -= 1
            self.cancelled_groups += 1
        self._consumed_kick()

    def _start_eval_phase(self) -> None:
        wl = self.cfg.workload
        groups = [self.workload.next_eval_group() for _ in range(wl.eval_tasks)]
        for g in groups:
            self.groups[g.group_id] = g
        self.eval_outstanding += len(groups)
        self.eval_pending_phase = True
        self._submit(groups)

    def _on_trajectory_done(self, traj: Trajectory) -> None:
        now = self.loop.now
        rec = BufferTrajectory(
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
        entered = self.buffer.add_trajectory(rec, now, consumer_version=self.version)
        if group.complete:
            del self.groups[traj.group_id]
            if group.is_eval:
                self.eval_outstanding -= 1
            elif entered is None:  # already stale at completion (drop rule)
                self.live_groups -= 1
        self.loop.notify()
        if self.mode != "sync":
            self._feed_async()

    def _consumed_kick(self) -> None:
        """Data left the buffer: CTB's staleness throttle reads the unconsumed volume, so the
        dispatcher must look again. Without this, a rollout whose every task had finished and
        whose admissions were throttled stayed idle until some unrelated event (a role change)
        woke it, or forever (observed: the run stalled with 32 admissible tasks queued)."""
        if isinstance(self.cluster.policy, CTBPolicy):
            self.cluster.kick()

    # ====================================================================== role handling
    def _set_rollout(self, ranks: List[int], stall_s: float) -> None:
        now = self.loop.now
        current = set(self.cluster.active)
        for r in sorted(current - set(ranks)):
            self.cluster.remove_rank(r, now)
        for r in sorted(set(ranks) - current):
            self.cluster.add_rank(r, now, stall_s)

    def _record_roles(self, n_ref: int = 0, mode: str = "") -> None:
        self.metrics.roles.append((self.loop.now, len(self.cluster.active), self.trainer_ranks - n_ref, n_ref, mode))

    # ======================================================================= trainer loops
    def _wait_for(self, predicate, label: str):
        """Yield a wait and account it as trainer waiting time."""
        t0 = self.loop.now
        yield WaitUntil(predicate, label)
        self.metrics.twt_rank_s += (self.loop.now - t0) * self.trainer_ranks
        return self.loop.now - t0

    def _finish_step(self, step: int, start: float, consumed: int, tokens: int, extra: dict):
        """Deadlines, version bump, eval anchoring, ERS plan, weight sync and cache flush."""
        readiness = self.buffer.end_step(self.loop.now)
        self._expire(self.version + 1)
        self.version += 1
        eval_wait = 0.0
        if self.eval_pending_phase:
            # the model under evaluation must stay on the rollout ranks until its eval is done
            eval_wait = yield from self._wait_for(lambda: self.eval_outstanding == 0, "eval anchor")
            self.eval_pending_phase = False
        stall = self.sync_s
        if self.elastic:
            stall = max(stall, self._apply_ers_plan(step))
        yield stall
        self.cluster.version = self.version
        self.cluster.flush_all(self.loop.now, 0.0)  # the rollout ranks stalled with the trainer
        if self.workload.is_eval_step(step + 1):
            self._start_eval_phase()
        self._feed_async()
        rec = StepRecord(step=step, start=start, end=self.loop.now, trajectories=consumed, tokens=tokens,
                         rollout_ranks=len(self.cluster.active), trainer_ranks=self.trainer_ranks,
                         ras=readiness.ras, tprm_s=readiness.tprm_s, eval_wait_s=eval_wait, **extra)
        self.metrics.steps.append(rec)

    def _trainer_sync(self):
        """VeRL-like: rollout on every rank, barrier, swap, train on every rank, swap back."""
        all_ranks = list(range(self.n_ranks))
        self._set_rollout(all_ranks, 0.0)
        self.trainer_ranks = 0
        self._record_roles(mode="sync-rollout")
        wl = self.cfg.workload
        for step in range(self.cfg.steps):
            start = self.loop.now
            self.buffer.begin_step(start)
            groups = self._new_groups(wl.batch_groups)
            if self.workload.is_eval_step(step) and step > 0:
                self._start_eval_phase()
            self._submit(groups)
            yield WaitUntil(lambda: self.buffer.ready_trajectories() >= self.B and self.eval_outstanding == 0)
            self.eval_pending_phase = False
            rollout_end = self.loop.now
            batch = self.buffer.fetch_batch(self.version, self.loop.now)
            self._consumed(batch.groups)
            lengths = sequence_lengths(batch.groups)
            switch = self.hw.colocate_switch_s(self.n_ranks)
            train = aggregated_round(self.costs, lengths, self.n_ranks, self.ra2p_cfg)
            # engines sleep (KV released) through switch + train + local reshard + switch back
            busy = 2 * switch + train + self.sync_s
            self.cluster.flush_all(self.loop.now, busy)
            self.trainer_ranks = self.n_ranks
            self._record_roles(mode="sync-train")
            yield busy
            self.trainer_ranks = 0
            self.buffer.end_step(self.loop.now)
            self.version += 1
            self.cluster.version = self.version
            self._record_roles(mode="sync-rollout")
            self.metrics.steps.append(StepRecord(
                step=step, start=start, end=self.loop.now, trajectories=batch.num_trajectories,
                tokens=batch.generated_tokens, rollout_ranks=self.n_ranks, trainer_ranks=self.n_ranks,
                ras=0.0, tprm_s=0.0, eval_wait_s=0.0, rollout_s=rollout_end - start, train_s=busy,
                ra2p_mode="colocated"))
            self.consumed_trajs.extend(t.payload for t in batch.trajectories)

    def _static_split(self) -> tuple:
        n_roll = min(self.n_ranks - 1, max(1, round(self.cfg.scheduler.rollout_share * self.n_ranks)))
        return list(range(self.n_ranks - n_roll, self.n_ranks)), self.n_ranks - n_roll

    def _trainer_barrier(self):
        """AReaL-like: fixed split; wait for the whole global batch, Ref over it, swap, Actor."""
        rollout, self.trainer_ranks = self._static_split()
        self._set_rollout(rollout, 0.0)
        self._record_roles(mode="colocated")
        self._feed_async()
        for step in range(self.cfg.steps):
            start = self.loop.now
            self.buffer.begin_step(start)
            wait, batch = 0.0, None
            while batch is None:  # a fetch may drop stale groups and fall short: wait again
                wait += yield from self._wait_for(lambda: self.buffer.ready_trajectories() >= self.B, "batch")
                batch = self.buffer.fetch_batch(self.version, self.loop.now)
            self._consumed(batch.groups)
            self._consumed_kick()
            lengths = sequence_lengths(batch.groups)
            dur = aggregated_round(self.costs, lengths, self.trainer_ranks, self.ra2p_cfg)
            yield dur
            self.consumed_trajs.extend(t.payload for t in batch.trajectories)
            yield from self._finish_step(step, start, batch.num_trajectories, batch.generated_tokens,
                                         dict(rollout_s=0.0, train_s=dur, wait_s=wait, ra2p_mode="colocated"))

    def _choose_fixed_mode(self) -> tuple:
        """RA2P without ERS: pick the mode for the fixed trainer ranks from the estimate."""
        t = self.trainer_ranks
        f = self.ra2p_cfg.ref_ranks_for(max(1, t - 1))
        est = self.buffer.estimate()
        if not self.cfg.scheduler.ra2p or est.steps_observed == 0 or t < 2:
            return RA2PMode.COLOCATED, t, 0
        n_mb = max(1, math.ceil(self.B * self.costs.mean_seq_len / (self.ra2p_cfg.tokens_per_rank * (t - f))))
        times = self.costs.microbatch_times(self.ra2p_cfg.tokens_per_rank)
        choice = choose_mode(est.ras, est.tprm_s, n_mb, times, self.ra2p_cfg, t - f)
        if choice.mode is RA2PMode.DECOUPLED:
            return RA2PMode.DECOUPLED, t - f, f
        return RA2PMode.COLOCATED, t, 0

    def _trainer_stream(self):
        """StreamRL-like streaming, and TIDE (RA2P / ERS / CTB on top)."""
        sched = self.cfg.scheduler
        if self.elastic:
            self._init_ers()
        else:
            rollout, self.trainer_ranks = self._static_split()
            self._set_rollout(rollout, 0.0)
        self._record_roles(mode="colocated")
        self._feed_async()
        for step in range(self.cfg.steps):
            start = self.loop.now
            self.buffer.begin_step(start)
            if self.elastic:
                mode = self.plan.mode
                dp = len(self.plan.ranks_with(Role.ACTOR, Role.ACTOR_REF))
                n_ref = len(self.plan.ranks_with(Role.REF))
            elif self.tide and sched.ra2p:
                mode, dp, n_ref = self._choose_fixed_mode()
            else:
                mode, dp, n_ref = RA2PMode.COLOCATED, self.trainer_ranks, 0
            vanilla = not (self.tide and sched.ra2p)
            pipeline = DecoupledPipeline(self.costs, dp, n_ref, self.ra2p_cfg, self.ra2p_cfg.pipeline_fill_s) \
                if mode is RA2PMode.DECOUPLED else None
            consumed = tokens = 0
            busy_until = self.loop.now
            wait_total = compute = 0.0
            b_min = self.buffer.config.b_min
            mb_volume = dp * self.ra2p_cfg.tokens_per_rank
            while consumed < self.B:
                ready = self.buffer.ready_trajectories()
                if ready and not vanilla and self.buffer.ready_tokens() < mb_volume and \
                        ready < self.B - consumed and self.loop.now >= busy_until:
                    # RA2P forms saturating micro-batches: accumulate until one is full (or the
                    # remainder of the batch is all that is left to come)
                    wait_total += yield from self._wait_for(
                        lambda: self.buffer.ready_tokens() >= mb_volume
                        or self.buffer.ready_trajectories() >= self.B - consumed, "micro-batch")
                    continue
                if ready == 0:
                    if self.elastic and consumed >= b_min and self.loop.now >= busy_until:
                        break  # elastic batch: train on what arrived instead of idling
                    if self.loop.now < busy_until:
                        # the pipeline is still busy: wake on new data or when it drains
                        until = busy_until
                        self.loop.at(until, self.loop.notify)
                        yield WaitUntil(lambda: self.buffer.ready_trajectories() > 0 or self.loop.now >= until)
                        continue
                    wait_total += yield from self._wait_for(lambda: self.buffer.ready_trajectories() > 0, "data")
                    continue
                groups = self.buffer.fetch(self.version, self.loop.now, self.B - consumed)
                if not groups:  # the head group does not fit the remaining batch: take it anyway
                    groups = self.buffer.fetch(self.version, self.loop.now, self.B)
                self._consumed(groups)
                self._consumed_kick()
                lengths = sequence_lengths(groups)
                consumed += sum(len(g) for g in groups)
                tokens += sum(g.generated_tokens for g in groups)
                self.consumed_trajs.extend(t.payload for g in groups for t in g.trajectories)
                if pipeline is not None:
                    busy_until = pipeline.submit(self.loop.now, lengths)
                    compute = busy_until - start - wait_total
                    continue
                dur = per_microbatch_alternation(self.costs, lengths, dp, self.ra2p_cfg) if vanilla \
                    else aggregated_round(self.costs, lengths, dp, self.ra2p_cfg)
                compute += dur
                yield dur
                busy_until = self.loop.now
            if self.loop.now < busy_until:
                yield busy_until - self.loop.now
            yield from self._finish_step(step, start, consumed, tokens, dict(
                rollout_s=0.0, train_s=compute, wait_s=wait_total, ra2p_mode=mode.value))

    # =============================================================================== ERS
    def _init_ers(self) -> None:
        sched = self.cfg.scheduler
        min_train = max(1, round((1 - sched.max_rollout_share) * self.n_ranks))
        min_roll = max(1, round(sched.min_rollout_share * self.n_ranks))
        self.ers = ERSPlanner(ERSConfig(min_rollout_ranks=min_roll, min_trainer_ranks=min_train,
                                        max_trainer_scale_up_per_step=sched.ers_max_moves,
                                        actors_per_ref=sched.ref_actor_ratio), self.n_ranks)
        # start from the fixed prior split (no sweep informs it), colocated
        n_roll = min(self.n_ranks - min_train, max(min_roll, round(sched.initial_rollout_share * self.n_ranks)))
        roles = {r: (Role.ACTOR_REF if r < self.n_ranks - n_roll else Role.ROLLOUT) for r in range(self.n_ranks)}
        self.plan = RolePlan(roles, RA2PMode.COLOCATED, reason="initial", step=-1, changed=True)
        self._apply_roles(self.plan, 0.0)

    def _apply_roles(self, plan: RolePlan, stall_s: float) -> None:
        self._set_rollout(plan.rollout_ranks, stall_s)
        self.trainer_ranks = len(plan.trainer_ranks)
        self._record_roles(len(plan.ranks_with(Role.REF)), plan.mode.value)

    def _apply_ers_plan(self, step: int) -> float:
        """Plan after the actor update; roles switch with the weight sync. Returns the stall."""
        est = self.buffer.estimate()
        dp = len(self.plan.actor_ranks)
        n_mb = max(1, math.ceil(est.batch_trajectories * self.costs.mean_seq_len / (self.ra2p_cfg.tokens_per_rank * dp)))
        times = self.costs.microbatch_times(self.ra2p_cfg.tokens_per_rank)
        be = break_even_ras(est.tprm_s, n_mb, times, self.ra2p_cfg, dp) if self.cfg.scheduler.ra2p else math.inf
        ready_mb = self.buffer.ready_tokens() / self.signals.micro_batch_tokens
        deficits = detect_deficits(est, self.buffer.head_of_line_latency(self.loop.now), b_ideal=self.B,
                                   break_even_ras=be, hol_tau=self.cfg.scheduler.ers_tau,
                                   ready_micro_batches=ready_mb)
        load = {r: float(self.cluster.ranks[r].footprint) for r in self.cluster.active}
        plan = self.ers.plan(self.plan, deficits, step=step, eval_phase=False, rollout_load=load)
        self.metrics.ers_log.append((step, est.ras, est.tprm_s, be, deficits.generation, deficits.consumption,
                                     plan.reason))
        if not self.cfg.scheduler.ra2p and plan.mode is RA2PMode.DECOUPLED:
            plan = self.plan  # without RA2P there is no decoupled mode to move to
        stall = 0.0
        if plan.changed:
            before = len(self.plan.rollout_ranks)
            # a new REF rank loads the reference while the others broadcast (overlapped)
            new_refs = [r for r in plan.ranks_with(Role.REF) if self.plan.roles[r] is not Role.REF]
            if new_refs:
                stall = self.hw.swap_s(0, self.hw.ref_state_bytes_per_gpu)
            self.buffer.notify_rollout_scaled(len(plan.rollout_ranks) - before)
            self.plan = plan
            self._apply_roles(plan, self.sync_s)
            self.metrics.role_changes += 1
        self.plan = plan
        return stall

    # =============================================================================== run
    def run(self) -> RunMetrics:
        wall0 = time.perf_counter()
        trainer = {"sync": self._trainer_sync, "async_static": self._trainer_barrier,
                   "stream": self._trainer_stream, "tide": self._trainer_stream}[self.mode]
        proc = self.loop.spawn(trainer(), "trainer")
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
