"""The rank-0 controller: owns the global buffer, dispatches tasks, drives training.

`scheduler.mode=sync` is the synchronous baseline: dispatch a whole global batch of GRPO
groups, wait until every group is complete, train on it, push the new weights to every
rollout engine, repeat. The step is split into phases so that later modes (streaming,
elastic) replace the phases, not the loop: `_dispatch`, `_collect`, `_train`, `_sync`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from tide_megatron.config import JobConfig
from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.topology import Topology
from tide_megatron.controller.trainer_rank import TrainerRank
from tide_megatron.core.buffer import BufferConfig, GlobalBuffer
from tide_megatron.core.buffer import Trajectory as BufferTrajectory
from tide_megatron.rollout.task_runner import TaskAssignment, Trajectory
from tide_megatron.utils.metrics import MetricsLogger

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.01


class RunError(RuntimeError):
    """The run cannot go on; the message says why."""


@dataclass
class StepStats:
    """What the rollout side reported during one step."""

    trajectories: list[Trajectory] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)


class Controller:
    def __init__(self, cfg: JobConfig, topo: Topology, mailbox: Mailbox, trainer: TrainerRank,
                 metrics: MetricsLogger, tasks: list[dict[str, Any]], start_step: int = 0):
        self.cfg = cfg
        self.topo = topo
        self.mailbox = mailbox
        self.trainer = trainer
        self.metrics = metrics
        self.tasks = tasks
        self.step = start_step
        self.version = start_step  # the policy version equals the number of updates so far
        sched = cfg.scheduler
        batch = sched.groups_per_step * sched.group_size
        self.buffer = GlobalBuffer(BufferConfig(
            group_size=sched.group_size, b_min=batch, b_ideal=batch, max_staleness=sched.max_staleness))
        self._rng = random.Random(cfg.run.seed)
        self._inbox: dict[str, deque] = defaultdict(deque)
        self._retries: dict[str, int] = defaultdict(int)
        self._rollout_busy_s: dict[int, float] = {}  # per rollout rank, cumulative, at the last sync

    # -- messaging ------------------------------------------------------------------
    def _pump(self) -> None:
        for msg in self.mailbox.poll():
            self._inbox[msg["kind"]].append(msg)

    def _wait_for(self, kind: str, count: int, timeout_s: float) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            self._pump()
            while self._inbox[kind] and len(got) < count:
                got.append(self._inbox[kind].popleft())
            if len(got) < count:
                if time.monotonic() > deadline:
                    raise RunError(f"timed out after {timeout_s:.0f}s waiting for {count} '{kind}' messages "
                                   f"(got {len(got)})")
                time.sleep(POLL_INTERVAL_S)
        return got

    # -- the loop -------------------------------------------------------------------
    def run(self) -> None:
        self._wait_for("ready", len(self.topo.rollout_ranks), timeout_s=600)
        if self.version > 0:  # resumed: the engines still hold the initial weights
            _, self._rollout_busy_s = self._sync()
        while self.step < self.cfg.run.steps:
            t0 = time.perf_counter()
            assignments = self._sample_assignments()
            stats = self._collect(assignments)
            t1 = time.perf_counter()
            batch = self.buffer.fetch_batch(self.version, time.monotonic())
            if batch is None:
                raise RunError("the global batch was not complete after collection (bookkeeping bug)")
            result, phases = self._train(batch.trajectories)
            t2 = time.perf_counter()
            self.version += 1
            sync, busy = self._sync()
            t3 = time.perf_counter()
            self.step += 1
            self._log(stats, batch, result, phases, sync, busy, rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2)
            interval = self.cfg.run.checkpoint_interval
            if (interval and self.step % interval == 0) or self.step == self.cfg.run.steps:
                self._save()
        self.shutdown()

    def shutdown(self) -> None:
        for dest in range(1, self.topo.world_size):
            self.mailbox.post(dest, "stop")

    # -- phases ---------------------------------------------------------------------
    def _sample_assignments(self) -> list[TaskAssignment]:
        sched = self.cfg.scheduler
        out = []
        for g in range(sched.groups_per_step):
            task = self._rng.choice(self.tasks)
            group_id = f"s{self.step}g{g}"
            self.buffer.open_group(group_id, task["task_id"], time.monotonic())
            out += [TaskAssignment(task=task, group_id=group_id, index=i) for i in range(sched.group_size)]
        return out

    def _collect(self, assignments: list[TaskAssignment]) -> StepStats:
        """Dispatch every assignment, keep each rank at most `max_tasks_per_rank` busy,
        and wait until all trajectories are in. A whole group goes to one rank, so its
        members share the prompt's prefix in that rank's cache."""
        ranks = self.topo.rollout_ranks
        queue = deque(assignments)
        load = {r: 0 for r in ranks}
        home: dict[str, int] = {}
        outstanding = 0
        stats = StepStats()
        limit = self.cfg.scheduler.max_tasks_per_rank
        deadline_s = self.cfg.scheduler.stall_timeout_s
        last_progress = time.monotonic()
        while queue or outstanding:
            while queue:
                a = queue[0]
                rank = home[a.group_id] if a.group_id in home else min(ranks, key=lambda r: (load[r], r))
                if load[rank] >= limit:
                    rank = min(ranks, key=lambda r: (load[r], r))
                    if load[rank] >= limit:
                        break
                queue.popleft()
                home.setdefault(a.group_id, rank)
                self.mailbox.post(rank, "task", assignment=a.__dict__)
                load[rank] += 1
                outstanding += 1
            self._pump()
            progressed = False
            while self._inbox["trajectory"]:
                msg = self._inbox["trajectory"].popleft()
                traj = Trajectory.from_json(msg["trajectory"])
                load[msg["src"]] -= 1
                outstanding -= 1
                progressed = True
                stats.trajectories.append(traj)
                self._book(traj)
            while self._inbox["task_failed"]:
                msg = self._inbox["task_failed"].popleft()
                load[msg["src"]] -= 1
                outstanding -= 1
                progressed = True
                stats.failures.append(msg)
                self._retry_or_fail(msg, queue)
            if progressed:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > deadline_s:
                raise RunError(f"no trajectory finished for {deadline_s:.0f}s; {outstanding} still running")
            else:
                time.sleep(POLL_INTERVAL_S)
        return stats

    def _book(self, traj: Trajectory) -> None:
        self.buffer.add_trajectory(BufferTrajectory(
            group_id=traj.group_id, index=traj.index, task_id=traj.task["task_id"],
            policy_version=traj.policy_version, prompt_tokens=len(traj.token_ids) - traj.generated_tokens,
            generated_tokens=traj.generated_tokens, reward=traj.reward, started_at=traj.started_at,
            finished_at=traj.finished_at, is_eval=traj.is_eval, payload=traj,
        ), time.monotonic())

    def _retry_or_fail(self, msg: dict[str, Any], queue: deque) -> None:
        a = TaskAssignment(**msg["assignment"])
        self._retries[a.trajectory_id] += 1
        if self._retries[a.trajectory_id] > self.cfg.scheduler.max_task_retries:
            raise RunError(f"trajectory {a.trajectory_id} failed {self._retries[a.trajectory_id]} times; "
                           f"last error on rank {msg['src']}: {msg['error']}")
        logger.warning("retrying %s after: %s", a.trajectory_id, msg["error"])
        queue.append(a)

    def _train(self, trajectories: list[BufferTrajectory]):
        """Split the batch over DP ranks (TP peers get the same shard) and take one step."""
        tp = self.cfg.trainer.tp_size
        trainers = self.topo.trainer_ranks
        dp = len(trainers) // tp
        shards: list[list[dict[str, Any]]] = [[] for _ in range(dp)]
        totals = [0] * dp
        # Longest first onto the lightest shard: balanced tokens per DP rank.
        for traj in sorted(trajectories, key=lambda t: t.total_tokens, reverse=True):
            i = min(range(dp), key=lambda k: totals[k])
            item = traj.payload.to_json()
            item["advantage"] = traj.advantage
            shards[i].append(item)
            totals[i] += traj.total_tokens
        for rank in trainers[1:]:
            self.mailbox.post(rank, "train", trajectories=shards[rank // tp])
        result, phases = self.trainer.train(shards[0])
        if len(trainers) > 1:
            self._wait_for("trained", len(trainers) - 1, timeout_s=3600)
        return result, phases

    def _sync(self) -> tuple[dict[str, float], dict[int, float]]:
        """Push the new weights everywhere; returns phase times and each rollout rank's
        cumulative busy time."""
        t0 = time.perf_counter()
        for rank in self.topo.trainer_ranks[1:]:
            self.mailbox.post(rank, "push_weights", version=self.version)
        broadcast_s = self.trainer.push_weights(self.version, self.mailbox, self.topo.world_size)
        loaded = self._wait_for("weights_loaded", len(self.topo.rollout_ranks), timeout_s=600)
        return {
            "time/weight_gather_broadcast_s": time.perf_counter() - t0,
            "time/weight_broadcast_s": broadcast_s,
            "time/weight_load_s": max(m["load_s"] for m in loaded),
        }, {m["src"]: m["busy_s"] for m in loaded}

    def _save(self) -> None:
        for rank in self.topo.trainer_ranks[1:]:
            self.mailbox.post(rank, "save")
        path = self.trainer.save()
        self.metrics.write(f"checkpoint: {path}")

    # -- metrics --------------------------------------------------------------------
    def _log(self, stats, batch, result, phases, sync, busy, rollout_s, train_s, sync_s) -> None:
        trajs = stats.trajectories
        step_s = rollout_s + train_s + sync_s
        consumed = batch.generated_tokens
        prompt = sum(t.prompt_tokens for t in trajs)
        cached = sum(t.cached_tokens for t in trajs)
        rewards = [t.reward for t in trajs]
        prev, self._rollout_busy_s = self._rollout_busy_s, busy
        # A rollout rank waits whenever it runs no task: training, syncing, or idling.
        rwt = sum(step_s - (busy[r] - prev.get(r, 0.0)) for r in busy) / max(len(busy), 1)
        ledger = self.buffer.ledger
        record = {
            "version": self.version,
            "consumed_tokens": consumed,
            "consumed_total_tokens": batch.total_tokens,
            "goodput_tok_s": consumed / step_s,
            "generation_tok_s": consumed / rollout_s if rollout_s else 0.0,
            "time/step_s": step_s,
            "time/rollout_s": rollout_s,
            "time/train_s": train_s,
            "time/sync_s": sync_s,
            **phases,
            **sync,
            "rwt_s": rwt,
            "twt_s": rollout_s,  # the trainer waits for the whole global batch
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
            "prefix_cache/cached_tokens": cached,
            "prefix_cache/prompt_tokens": prompt,
            "tokens/context": sum(len(t.token_ids) for t in trajs),
            "tokens/image": sum(t.image_tokens for t in trajs),  # image pads of those contexts
            "reward/mean": sum(rewards) / len(rewards),
            "reward/max": max(rewards),
            "reward/min": min(rewards),
            "turns/mean": sum(t.turns for t in trajs) / len(trajs),
            "turns/max": max(t.turns for t in trajs),
            "truncated_frac": sum(t.truncated for t in trajs) / len(trajs),
            "env_wait_s/mean": sum(t.env_wait_s for t in trajs) / len(trajs),
            "staleness/max": batch.max_staleness,
            "task_failures": len(stats.failures),
            "loss": result.loss,
            "pg_loss": result.pg_loss,
            "kl": result.kl,
            "clip_frac": result.clip_frac,
            "grad_norm": result.grad_norm,
            **{f"ledger/{k}": v for k, v in dataclasses.asdict(ledger).items()},
        }
        self.metrics.log(self.step, record)
