"""`scheduler.mode=tide`: rollout never stops; every step streams ready groups into RA2P.

Rank 0 runs two threads over one global buffer:

- `RolloutFeed` (a thread): polls the mailbox, books finished trajectories into the buffer,
  keeps rollout fed within the staleness bound, and while a step is open hands each newly
  completed group to the trainer as a micro-batch, the moment it completes. With CTB
  (`ctb.enabled`, see `ctb_remote.py`) tasks are admitted, paused and resumed task by task
  against each rank's KV budget; without it (request-level) whole groups go to the least
  loaded rank, so members share the prompt's prefix, and SGLang alone batches.
- Evaluation (`scheduler.eval_every`): right after the weights of step i are pushed, eval
  groups for that model go to the front of the dispatch queue and run during step i+1;
  before step i+1's weights are pushed the trainer waits for them (an eval that slipped
  would blur which model it measured) and logs their metrics under step i.
- `StreamingController.run` (the main thread, where Megatron's state lives): waits for
  ready work, measures RAS and the head-of-line age, chooses the RA2P mode from RAS and
  TPRM with costs the executors measured, plans the ready micro-batches with the core
  planner (smallest last when decoupled), runs the step with the chosen executor
  (colocated aggregation with offload, or decoupled streaming to a reference rank with
  the loss in backward), closes the step (TPRM), and pushes the new weights while
  rollout goes on. Trajectories keep the oldest policy version that produced any of
  their tokens; the buffer drops what exceeds the staleness bound, and the ledger says so.

This version trains one actor rank (TP=1) with at most one reference rank; ERS's role
changes in the real system are a later step (the simulator runs them).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import defaultdict, deque
from typing import Any

from tide_megatron.config import JobConfig
from tide_megatron.controller.controller import RunError
from tide_megatron.controller.ctb_remote import RemoteCTB
from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.topology import Topology
from tide_megatron.controller.trainer_rank import TrainerRank, micro_batch_of
from tide_megatron.core.buffer import BufferConfig, CompletedGroup, GlobalBuffer
from tide_megatron.core.buffer import Trajectory as BufferTrajectory
from tide_megatron.core.ra2p import MicroBatchTimes, RA2PMode, plan_microbatches
from tide_megatron.core.signals import SignalsConfig
from tide_megatron.rollout.eval_aggregator import EvalAggregator
from tide_megatron.rollout.task_runner import TaskAssignment, Trajectory
from tide_megatron.trainer.ra2p import (
    ArrivingSource,
    ColocatedConfig,
    ColocatedExecutor,
    CostMeter,
    DecoupledActorExecutor,
    DecoupledConfig,
    LogprobStream,
    ModeSelector,
    ModeSelectorConfig,
)
from tide_megatron.utils.metrics import MetricsLogger

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005
COLD_START_TPRM_S = 60.0  # no arrival history yet: assume sparse arrivals (the paper's cold start)


def _group_payload(group: CompletedGroup) -> list[dict[str, Any]]:
    return [dict(t.payload.to_json(), advantage=t.advantage) for t in group.trajectories]


class RolloutFeed(threading.Thread):
    """Rank 0's rollout side: dispatch, booking, and the stream of arrivals into a step."""

    def __init__(self, cfg: JobConfig, topo: Topology, mailbox: Mailbox, buffer: GlobalBuffer,
                 tasks: list[dict[str, Any]], start_version: int, images=None):
        super().__init__(name="rollout-feed", daemon=True)
        self.cfg, self.topo, self.mailbox, self.buffer = cfg, topo, mailbox, buffer
        self.images = images  # a vision-language policy's `TrajectoryImages`, else None
        self.lock = threading.Lock()
        self.version = start_version
        self.error: BaseException | None = None
        self._tasks = tasks
        self._rng = random.Random(cfg.run.seed)
        self._stopping = threading.Event()
        self._inbox: dict[str, deque] = defaultdict(deque)
        self._load = {r: 0 for r in topo.rollout_ranks}
        self._queue: deque[TaskAssignment] = deque()
        self._groups_started = 0
        self._retries: dict[str, int] = defaultdict(int)
        self.evals = EvalAggregator(pass_threshold=cfg.scheduler.eval_pass_threshold)
        self.ctb: RemoteCTB | None = None
        self._group_done: dict[str, int] = defaultdict(int)
        if cfg.ctb.enabled:
            sched = cfg.scheduler
            pool = cfg.rollout.engine.max_total_tokens
            budget = int(pool * cfg.ctb.kv_budget_fraction) if pool else cfg.ctb.policy.rank_token_budget
            # The policy's staleness throttle and turn limit are the job's, not defaults.
            ctb_cfg = dataclasses.replace(
                cfg.ctb, task_max_turns=cfg.rollout.runner.max_turns,
                policy=dataclasses.replace(cfg.ctb.policy, max_staleness=sched.max_staleness,
                                           trainer_batch_trajectories=sched.groups_per_step * sched.group_size))
            self.ctb = RemoteCTB(ctb_cfg, mailbox, {r: budget for r in topo.rollout_ranks})
        # The open step: where arrivals go and how many groups it still takes.
        self._sink: ArrivingSource | None = None
        self._sink_groups_left = 0
        self._on_micro_batch = None

    # -- main-thread API (all under the lock) ------------------------------------------
    def ready_groups(self) -> int:
        with self.lock:
            return len(self.buffer.ready_groups())

    def open_step(self, groups: int) -> tuple[float, float, list[CompletedGroup]]:
        """Start a step: measure RAS and HoL, take up to `groups` ready groups."""
        with self.lock:
            now = time.monotonic()
            hol = self.buffer.head_of_line_latency(now)
            ras = self.buffer.begin_step(now)
            taken = self.buffer.fetch(self.version, now, groups * self.cfg.scheduler.group_size)
            return ras, hol, taken

    def stream_into(self, sink: ArrivingSource, groups_left: int, on_micro_batch) -> None:
        """Arrivals of the open step go to `sink` (one group, one micro-batch)."""
        with self.lock:
            self._sink, self._sink_groups_left, self._on_micro_batch = sink, groups_left, on_micro_batch

    def close_step(self):
        with self.lock:
            self._sink, self._sink_groups_left, self._on_micro_batch = None, 0, None
            return self.buffer.end_step(time.monotonic())

    def set_version(self, version: int) -> None:
        with self.lock:
            self.version = version
            if self.ctb is not None:
                self.ctb.on_weight_sync()

    def submit_eval(self, version: int, tasks: list[dict[str, Any]]) -> None:
        """Eval groups for the model `version`, ahead of every queued training task."""
        sched = self.cfg.scheduler
        with self.lock:
            assignments = []
            for g in range(sched.eval_groups):
                task = self._rng.choice(tasks)
                group_id = f"eval_v{version}g{g}"
                self.buffer.open_group(group_id, task["task_id"], time.monotonic(), is_eval=True)
                assignments += [TaskAssignment(task=task, group_id=group_id, index=i, is_eval=True)
                                for i in range(sched.group_size)]
            self.evals.expect(version, assignments)
            if self.ctb is not None:
                self.ctb.submit(assignments)  # I_eval gives them the top priority
            else:
                self._queue.extendleft(reversed(assignments))

    def eval_ready(self, version: int) -> bool:
        with self.lock:
            return self.evals.ready(version)

    def pop_eval(self, version: int):
        with self.lock:
            self.buffer.pop_eval_groups()  # the aggregator keeps what is logged
            return self.evals.pop(version)

    def take(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            out = list(self._inbox[kind])
            self._inbox[kind].clear()
            return out

    def stop(self) -> None:
        self._stopping.set()

    # -- the thread ---------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                with self.lock:
                    self._pump()
                    self._dispatch()
                    self._feed_step()
                time.sleep(POLL_INTERVAL_S)
        except BaseException as exc:  # surfaced to the main thread, which stops the run
            self.error = exc

    def _pump(self) -> None:
        for msg in self.mailbox.poll():
            kind = msg["kind"]
            if kind == "trajectory":
                traj = Trajectory.from_json(msg["trajectory"])
                if self.ctb is None:
                    self._load[msg["src"]] -= 1
                else:
                    self.ctb.on_finished(f"{traj.group_id}/{traj.index}", len(traj.token_ids))
                    self._group_done[traj.group_id] += 1
                    if self._group_done[traj.group_id] == self.cfg.scheduler.group_size:
                        del self._group_done[traj.group_id]
                        self.ctb.forget_group(traj.group_id)
                self.buffer.add_trajectory(BufferTrajectory(
                    group_id=traj.group_id, index=traj.index, task_id=traj.task["task_id"],
                    policy_version=traj.policy_version, prompt_tokens=len(traj.token_ids) - traj.generated_tokens,
                    generated_tokens=traj.generated_tokens, reward=traj.reward, started_at=traj.started_at,
                    finished_at=traj.finished_at, is_eval=traj.is_eval, payload=traj),
                    time.monotonic(), consumer_version=self.version)
                self.evals.record(traj)
            elif kind == "turn" and self.ctb is not None:
                self.ctb.on_turn(msg)
            elif kind == "task_failed":
                self._load[msg["src"]] -= 1
                a = TaskAssignment(**msg["assignment"])
                if self.ctb is not None:  # CTB's policy has no retry of a half-run task yet
                    raise RunError(f"trajectory {a.trajectory_id} failed on rank {msg['src']}: {msg['error']}")
                self._retries[a.trajectory_id] += 1
                if self._retries[a.trajectory_id] > self.cfg.scheduler.max_task_retries:
                    raise RunError(f"trajectory {a.trajectory_id} failed on rank {msg['src']}: {msg['error']}")
                self._queue.append(a)
            else:
                self._inbox[kind].append(msg)

    def _dispatch(self) -> None:
        """Start groups while the unconsumed work stays within what the trainer can take
        before it goes stale: (max_staleness + 1) global batches."""
        sched = self.cfg.scheduler
        cap = (sched.max_staleness + 1) * sched.groups_per_step * sched.group_size
        while not self._queue and self.buffer.unconsumed_trajectories() + self._in_flight() + sched.group_size <= cap:
            task = self._rng.choice(self._tasks)
            group_id = f"v{self.version}g{self._groups_started}"
            self._groups_started += 1
            self.buffer.open_group(group_id, task["task_id"], time.monotonic())
            if self.ctb is not None:
                self.ctb.submit(TaskAssignment(task=task, group_id=group_id, index=i) for i in range(sched.group_size))
                continue
            rank = min(self._load, key=lambda r: (self._load[r], r))
            if self._load[rank] + sched.group_size > sched.max_tasks_per_rank:
                self._queue.extend(TaskAssignment(task=task, group_id=group_id, index=i)
                                   for i in range(sched.group_size))
                break
            for i in range(sched.group_size):
                self._send(TaskAssignment(task=task, group_id=group_id, index=i), rank)
        if self.ctb is not None:
            self.ctb.schedule(time.monotonic(), self.buffer.unconsumed_trajectories())
            return
        while self._queue:
            rank = min(self._load, key=lambda r: (self._load[r], r))
            if self._load[rank] >= sched.max_tasks_per_rank:
                break
            self._send(self._queue.popleft(), rank)

    def _in_flight(self) -> int:
        if self.ctb is not None:
            return len(self.ctb.assignments)
        return sum(self._load.values()) + len(self._queue)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return dict(self.ctb.stats) if self.ctb is not None else {}

    def _send(self, assignment: TaskAssignment, rank: int) -> None:
        self.mailbox.post(rank, "task", assignment=assignment.__dict__)
        self._load[rank] += 1

    def _feed_step(self) -> None:
        while self._sink is not None and self._sink_groups_left > 0:
            taken = self.buffer.fetch(self.version, time.monotonic(), self.cfg.scheduler.group_size)
            if not taken:
                return
            payload = _group_payload(taken[0])
            self._sink.put(micro_batch_of(payload, self.cfg.trainer.pad_to_multiple_of, self.images))
            self._on_micro_batch(taken[0], payload)
            self._sink_groups_left -= 1


class StreamingController:
    """The main thread of rank 0 in `scheduler.mode=tide`."""

    def __init__(self, cfg: JobConfig, topo: Topology, mailbox: Mailbox, trainer: TrainerRank,
                 metrics: MetricsLogger, tasks: list[dict[str, Any]], start_step: int = 0,
                 eval_tasks: list[dict[str, Any]] | None = None):
        self.cfg, self.topo, self.mailbox, self.trainer, self.metrics = cfg, topo, mailbox, trainer, metrics
        self.eval_tasks = eval_tasks or []
        self._eval_pending: int | None = None  # the model version whose eval is running
        self.step = start_step
        self.version = start_step
        sched = cfg.scheduler
        batch = sched.groups_per_step * sched.group_size
        self.buffer = GlobalBuffer(
            BufferConfig(group_size=sched.group_size, b_min=sched.group_size, b_ideal=batch,
                         max_staleness=sched.max_staleness),
            SignalsConfig(micro_batch_tokens=cfg.ra2p.cost_model.tokens_per_rank))
        self.feed = RolloutFeed(cfg, topo, mailbox, self.buffer, tasks, start_version=start_step,
                                images=trainer.images)
        self.meter = CostMeter()
        prior = MicroBatchTimes(cfg.ra2p.prior_ref_fwd_s, cfg.ra2p.prior_actor_fwd_s, cfg.ra2p.prior_actor_bwd_s)
        self.selector = ModeSelector(ModeSelectorConfig(ra2p=cfg.ra2p.cost_model, prior_times=prior), self.meter)
        executor = cfg.ra2p.executor
        colocated_cfg = {"vs": ColocatedConfig.vanilla_streaming(offload=False),
                         "vso": ColocatedConfig.vanilla_streaming(offload=True)}.get(executor, ColocatedConfig())
        self.colocated = ColocatedExecutor(trainer.actor, trainer.ref, colocated_cfg, self.meter)
        self.ref_rank = topo.ref_ranks[0] if topo.ref_ranks else None
        self.decoupled = None
        if self.ref_rank is not None:
            self.decoupled = DecoupledActorExecutor(
                trainer.actor, LogprobStream(topo.job_group),
                DecoupledConfig(ref_rank=self.ref_rank, actor_ranks=(topo.rank,)), self.meter)
        self._idle_s: dict[int, float] = {}  # per rollout rank, cumulative, as last reported

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        self.feed.start()
        try:
            self._wait_ready_ranks()
            if self.version > 0:
                self._push_weights()
            self._start_eval()
            while self.step < self.cfg.run.steps:
                self._one_step()
                self._check_feed()
            self._finish_eval()  # the last model's eval has no next step to hide behind
        finally:
            self.feed.stop()
            self.feed.join(timeout=10)
        self.shutdown()

    def shutdown(self) -> None:
        self.feed.stop()
        for dest in range(1, self.topo.world_size):
            self.mailbox.post(dest, "stop")

    def _check_feed(self) -> None:
        if self.feed.error is not None:
            raise RunError(f"rollout feed failed: {self.feed.error}") from self.feed.error
        if not self.feed.is_alive():
            raise RunError("rollout feed thread exited")

    def _wait_ready_ranks(self) -> None:
        deadline = time.monotonic() + 600
        ready: list[dict] = []
        while len(ready) < len(self.topo.rollout_ranks):
            self._check_feed()
            ready += self.feed.take("ready")
            if time.monotonic() > deadline:
                raise RunError("rollout ranks did not report ready within 600 s")
            time.sleep(POLL_INTERVAL_S)

    def _choose_mode(self, ras: float, n_mb: int):
        forced = self.cfg.ra2p.executor
        if forced != "auto":
            mode = RA2PMode.DECOUPLED if forced == "decoupled" else RA2PMode.COLOCATED
            return mode, None
        est = self.buffer.estimate()
        tprm = est.tprm_s if est.steps_observed else COLD_START_TPRM_S
        choice = self.selector.choose(ras, tprm, n_mb, dp_size=1, ref_rank_available=self.ref_rank is not None)
        return choice.mode, choice

    def _one_step(self) -> None:
        sched = self.cfg.scheduler
        t0 = time.perf_counter()
        deadline = time.monotonic() + sched.stall_timeout_s
        while self.feed.ready_groups() == 0:  # the trainer waits for ready work (TWT)
            self._check_feed()
            if time.monotonic() > deadline:
                raise RunError(f"no GRPO group completed for {sched.stall_timeout_s:.0f} s "
                               "(scheduler.stall_timeout_s): rollout is stuck")
            time.sleep(POLL_INTERVAL_S)
        twt = time.perf_counter() - t0
        ras, hol, ready = self.feed.open_step(sched.groups_per_step)
        t_start = time.perf_counter()
        est_n = len(ready) + (sched.groups_per_step - len(ready))
        mode, choice = self._choose_mode(ras, est_n)
        # The ready backlog is planned by the core (smallest micro-batch last when decoupled);
        # each group completing later is one more micro-batch, streamed as it completes.
        payload = {(g.group_id, i): traj for g in ready for i, traj in enumerate(_group_payload(g))}
        plan = plan_microbatches({k: len(v["token_ids"]) for k, v in payload.items()}, 1, mode,
                                 self.cfg.ra2p.cost_model)
        first = [[payload[k] for k in mb.shards[0]] for mb in plan.micro_batches if mb.shards[0]]
        n_mb = len(first) + sched.groups_per_step - len(ready)
        source = ArrivingSource(n_mb)
        consumed: list[CompletedGroup] = list(ready)
        decoupled = mode is RA2PMode.DECOUPLED
        if decoupled:
            self.mailbox.post(self.ref_rank, "ref_step", num_micro_batches=n_mb)
        for mb in first:
            source.put(micro_batch_of(mb, self.cfg.trainer.pad_to_multiple_of, self.trainer.images))
            if decoupled:
                self.mailbox.post(self.ref_rank, "ref_mb", trajectories=mb)

        def on_arrival(group: CompletedGroup, group_payload: list[dict]) -> None:  # feed thread, under its lock
            consumed.append(group)
            if decoupled:
                self.mailbox.post(self.ref_rank, "ref_mb", trajectories=group_payload)

        self.feed.stream_into(source, sched.groups_per_step - len(ready), on_arrival)
        executor = self.decoupled if decoupled else self.colocated
        result, report = executor.run_step(source)
        readiness = self.feed.close_step()
        train_s = time.perf_counter() - t_start
        if decoupled:
            self._merge_ref_costs()
        self.version += 1
        self.step += 1
        self.feed.set_version(self.version)
        t_sync = time.perf_counter()
        eval_wait_s = self._finish_eval()
        self._push_weights()
        self._start_eval()
        sync_s = time.perf_counter() - t_sync
        self._log(consumed, result, report, mode, choice, ras, hol, readiness, twt + eval_wait_s, train_s,
                  sync_s, step_s=time.perf_counter() - t0)
        interval = self.cfg.run.checkpoint_interval
        if (interval and self.step % interval == 0) or self.step == self.cfg.run.steps:
            self.metrics.write(f"checkpoint: {self.trainer.save()}")

    def _start_eval(self) -> None:
        every = self.cfg.scheduler.eval_every
        if every and self.eval_tasks and self.version % every == 0:
            self.feed.submit_eval(self.version, self.eval_tasks)
            self._eval_pending = self.version

    def _finish_eval(self) -> float:
        """Wait for the running eval, log it under the step whose model it measured; returns
        the seconds waited (trainer waiting time)."""
        if self._eval_pending is None:
            return 0.0
        version, self._eval_pending = self._eval_pending, None
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.scheduler.stall_timeout_s
        while not self.feed.eval_ready(version):
            self._check_feed()
            if time.monotonic() > deadline:
                raise RunError(f"evaluation of step {version} did not finish within "
                               f"{self.cfg.scheduler.stall_timeout_s:.0f} s")
            time.sleep(POLL_INTERVAL_S)
        waited = time.perf_counter() - t0
        metrics = self.feed.pop_eval(version)
        self.metrics.log_at(version, {**metrics.to_log(), "eval/wait_s": waited})
        self.metrics.write(f"eval of step {version}: mean reward {metrics.mean_reward:.3f}, "
                           f"best-of-{self.cfg.scheduler.group_size} {metrics.best_of_n_reward:.3f}, "
                           f"pass rate {metrics.pass_rate:.3f}")
        return waited

    def _merge_ref_costs(self) -> None:
        deadline = time.monotonic() + 600
        while True:
            done = self.feed.take("ref_done")
            if done:
                self.meter.merge({k: v for k, v in done[-1]["costs"].items() if k == "ref_fwd"})
                return
            if time.monotonic() > deadline:
                raise RunError("the reference rank did not finish its step within 600 s")
            self._check_feed()
            time.sleep(POLL_INTERVAL_S)

    def _push_weights(self) -> None:
        self.trainer.push_weights(self.version, self.mailbox, self.topo.world_size)

    # -- metrics ----------------------------------------------------------------------------
    def _log(self, consumed, result, report, mode, choice, ras, hol, readiness, twt, train_s, sync_s, step_s):
        trajs = [t for g in consumed for t in g.trajectories]
        payloads: list[Trajectory] = [t.payload for t in trajs]
        generated = sum(t.generated_tokens for t in trajs)
        prompt = sum(p.prompt_tokens for p in payloads)
        cached = sum(p.cached_tokens for p in payloads)
        # A rollout rank waits whenever it runs no task; ranks report their idle time at each
        # weight load, so this is the idle time since their previous report.
        idle: dict[int, float] = {}
        for msg in self.feed.take("weights_loaded"):
            rank = msg["src"]
            idle[rank] = idle.get(rank, 0.0) + msg["idle_s"] - self._idle_s.get(rank, 0.0)
            self._idle_s[rank] = msg["idle_s"]
        ledger = self.buffer.ledger
        record = {
            "version": self.version,
            "ra2p/mode": mode.value,
            "ras": ras,
            "tprm_s": readiness.tprm_s,
            "hol_latency_s": hol,
            "consumed_tokens": generated,
            "goodput_tok_s": generated / step_s,
            "time/step_s": step_s,
            "time/train_s": train_s,
            "time/sync_s": sync_s,
            "twt_s": twt + report.ref_wait_s,
            "rwt_s": sum(idle.values()) / len(idle) if idle else 0.0,
            "micro_batches": report.num_micro_batches,
            **{f"ra2p/{k}": v for k, v in report.as_dict().items() if isinstance(v, (int, float))},
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
            "tokens/context": sum(len(p.token_ids) for p in payloads),
            "tokens/image": sum(p.image_tokens for p in payloads),  # image pads of those contexts
            "reward/mean": sum(t.reward for t in trajs) / len(trajs),
            "turns/mean": sum(p.turns for p in payloads) / len(payloads),
            "staleness/max": max(self.version - 1 - t.policy_version for t in trajs),
            "loss": result.loss, "pg_loss": result.pg_loss, "kl": result.kl, "grad_norm": result.grad_norm,
            **{f"ledger/{k}": v for k, v in dataclasses.asdict(ledger).items()},
            **{f"ctb/{k}": v for k, v in self.feed.stats().items()},
        }
        if choice is not None:
            record.update({"ra2p/cost_decoupled": choice.cost_decoupled, "ra2p/cost_colocated": choice.cost_colocated,
                           "ra2p/break_even_ras": choice.break_even_ras})
        self.metrics.log(self.step, record)
        self.metrics.write(f"step {self.step}: RA2P mode {mode.value} (RAS {ras:.2f} micro-batches, "
                           f"TPRM {readiness.tprm_s:.2f} s, HoL {hol:.2f} s)")
