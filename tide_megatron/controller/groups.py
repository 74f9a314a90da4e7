"""The rollout side's groups: which are running, each task's attempts, and how each ends.

A GRPO group is trained whole or not at all, so the bookkeeping is per group: it is started
(a task drawn, its members queued on the placement), its members end one by one (a trajectory
into the buffer, a failure retried up to `scheduler.max_task_retries` times, a cancellation),
and it ends once complete, or given up (a member failed past its retries, or it can no longer
be consumed within the staleness bound: its tokens are then failed or wasted). Starting is
where staleness is bounded: continuous modes start groups only while what is admitted can be
consumed within the bound; sync mode starts what the step asked for (and a replacement for
each group given up, so a batch is never trained partially).

A task handed over by a rank leaving rollout carries the tokens it generated there; they are
booked with its end, whichever way it ends (`carry`, `take_carried`). Every booking here names
its event for the ledger's per-account audit (`ledger_keys.py`).

Owned by the rollout service's thread; the service routes each task end here unless the
hand-over or the quarantine takes care of it.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Optional

from tide_megatron.comm.messages import TaskAssignment, TaskCancelled, TaskFailed, TrajectoryDone
from tide_megatron.controller import ledger_keys
from tide_megatron.controller.errors import RunError
from tide_megatron.controller.eval_aggregator import EvalAggregator
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import ModePolicy
from tide_megatron.controller.rollout_meter import RolloutMeter
from tide_megatron.core.buffer import GlobalBuffer

logger = logging.getLogger(__name__)


class GroupBook:
    def __init__(self, *, buffer: GlobalBuffer, placement, health: RolloutHealth, mode: ModePolicy,
                 meter: RolloutMeter, evals: EvalAggregator, counters: dict[str, int],
                 tasks: list[dict[str, Any]], rng: random.Random, group_size: int, groups_per_step: int,
                 max_task_retries: int, max_failed_groups: int, version: int, task_order: str = "random"):
        self.buffer, self.placement, self.health, self.mode = buffer, placement, health, mode
        self.meter, self.evals = meter, evals
        self.counters = counters  # groups started / failed / cancelled, retries, task failures
        self.tasks, self.rng = tasks, rng  # the task sampler (run_state saves and restores it)
        self.task_order = task_order  # `scheduler.task_order`
        self.drawn = 0
        """Training tasks drawn in the whole run: where `sequential` goes on (run_state restores it)."""
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.max_task_retries, self.max_failed_groups = max_task_retries, max_failed_groups
        self.version = version
        """The policy version groups are admitted under now (the weights last sent)."""
        self.started = 0
        """Groups drawn in the whole run: the next group id's number (run_state restores it)."""
        self._requested = 0  # sync mode: groups the current rollout phase still has to start
        self._live: dict[str, list[TaskAssignment]] = {}  # training/eval groups started, not yet ended
        self._live_training = 0  # of `_live`, the training groups (read every pass of the rollout loop)
        self._attempts: dict[str, int] = {}
        self._consecutive_failed = 0
        self._eval_groups: dict[str, int] = {}  # eval group -> the model version it evaluates
        self._unadmitted: set[str] = set()  # training groups started, none of their tasks on a rank yet
        self._carried: dict[str, tuple[int, str]] = {}
        """Tokens of a handed-over task generated on the ranks it left, booked with its end, and
        the carry's name in the ledger (`ledger_keys.carry`) should they be booked without one."""
        placement.on_group_started = self._on_group_started

    # -- starting -----------------------------------------------------------------------------
    def request(self, n: int) -> None:
        """Sync mode: start `n` training groups now (replacements follow failures)."""
        self._requested += n

    def start_due(self, consumed_this_step: int) -> None:
        """Start the groups the mode allows now (one loop turn)."""
        if self.mode.continuous_rollout:
            room = self.buffer.admission_room(self.groups_per_step, self.version,
                                              live_groups=self.live_training_groups(),
                                              consumed_groups=consumed_this_step)
            for _ in range(room):
                self.start()
            # full: no room for one more group, and every group started is admitted on a rank
            # (so nothing but the throttle holds the next one back)
            self.meter.note_slots(time.monotonic(), full=not self._unadmitted)
        else:
            while self._requested > 0:
                self._requested -= 1
                self.start()

    def live_training_groups(self) -> int:
        """Training groups started and not yet consumed or ended: running, or ready in the buffer."""
        return self._live_training + len(self.buffer.ready_groups())

    def start(self, task: Optional[dict] = None, is_eval: bool = False, prefix: str = "g") -> str:
        """Draw a task (unless given), open its group in the buffer and queue its members."""
        task = task or self._draw()
        gid = f"{prefix}{self.started}v{self.version}"
        self.started += 1
        members = [TaskAssignment(task, gid, i, is_eval) for i in range(self.group_size)]
        self._live[gid] = members
        self._live_training += not is_eval
        self.buffer.open_group(gid, task["task_id"], time.monotonic(), is_eval=is_eval)
        if not is_eval:
            self._unadmitted.add(gid)
        self.placement.submit(members, front=is_eval)
        self.counters["groups_started"] += 1
        return gid

    def _draw(self) -> dict[str, Any]:
        if self.task_order == "sequential":
            task = self.tasks[self.drawn % len(self.tasks)]
        else:
            task = self.rng.choice(self.tasks)
        self.drawn += 1
        return task

    def submit_eval(self, version: int, tasks: list[dict[str, Any]], groups: int) -> None:
        """Eval groups for the model `version`, ahead of every queued training task."""
        assignments = []
        for _ in range(groups):
            gid = self.start(self.rng.choice(tasks), is_eval=True, prefix="eval")
            self._eval_groups[gid] = version
            assignments += self._live[gid]
        self.evals.expect(version, assignments, time.monotonic())

    def _on_group_started(self, gid: str) -> None:
        """The placement sent the group's first task to a rank: it is admitted under this version."""
        self._unadmitted.discard(gid)
        if self.buffer.is_pending(gid) and not self._live[gid][0].is_eval:
            self.buffer.note_admitted(gid, self.version)

    def outstanding(self) -> bool:
        """Some group is running or some task is queued (so rollout must make progress)."""
        return bool(self._live) or self.placement.queued() > 0

    # -- ending -------------------------------------------------------------------------------
    def _end(self, gid: str) -> None:
        self._unadmitted.discard(gid)
        members = self._live.pop(gid, None)
        self._live_training -= bool(members) and not members[0].is_eval
        self.placement.forget_group(gid)
        for tid, _ in self.placement.take_dropped_carries():  # handed over, never started again
            tokens, key = self.take_carry(tid)
            if key is not None:
                self.buffer.ledger.book_attempt(tokens, fate="cancelled", key=key)

    def give_up(self, gid: str, *, failed: bool, reason: str, now: float) -> None:
        """Cancel a group's other members and end it in the buffer (failed or cancelled)."""
        self.placement.cancel_group(gid, reason)
        for a in self._live.get(gid, []):
            self._attempts.pop(a.trajectory_id, None)
        if self.buffer.is_pending(gid):
            if failed:
                self.buffer.fail_group(gid, now)
            else:
                self.buffer.cancel_group(gid, now, consumer_version=self.version)
        members = self._live.get(gid)
        self._end(gid)
        self.counters["groups_failed" if failed else "groups_cancelled"] += 1
        if failed and members is not None and self.mode.continuous_rollout is False:
            self._requested += 1  # the sync batch still needs a whole group in its place
        if members and members[0].is_eval:  # the evaluation goes on without this group
            self.evals.abandon(self._eval_groups.pop(gid), [a.trajectory_id for a in members], now)

    def give_up_if_live(self, gids, reason: str, now: float) -> None:
        """Cancel the groups (still running) the placement found past their staleness deadline."""
        for gid in gids:
            if gid in self._live:
                self.give_up(gid, failed=False, reason=reason, now=now)

    def set_version(self, version: int) -> None:
        """New weights are out: later groups are admitted under `version`; groups that can no
        longer be consumed within the bound are cancelled at once (their tokens are wasted)."""
        self.version = version
        now = time.monotonic()
        for gid in self.buffer.doomed_groups(version):
            self.give_up(gid, failed=False, reason=f"stale for version {version}", now=now)
        self.placement.on_weight_sync()

    # -- task ends ----------------------------------------------------------------------------
    def on_task_end(self, msg, carried: int, now: float, key: Optional[str] = None) -> None:
        """A task ended on the rank that owns it (a trajectory, a failure or a cancellation):
        `carried` tokens of the ranks that handed it over before go with it. `key`: the end's
        name in the ledger (`ledger_keys.task_end`; drawn here when not given)."""
        key = key or ledger_keys.task_end(msg)
        if isinstance(msg, TrajectoryDone):
            self._on_trajectory(msg, now, key)
        elif isinstance(msg, TaskFailed):
            self._on_failed(msg, carried, now, key)
        elif isinstance(msg, TaskCancelled):
            self._on_cancelled(msg, carried, now, key)

    def _on_trajectory(self, msg: TrajectoryDone, now: float, key: str) -> None:
        traj = msg.trajectory
        tid = traj.trajectory_id
        fresh = self.placement.finished(tid, msg.src, len(traj.token_ids))
        self.health.booked(msg.src, traj.generated_tokens - msg.carried_tokens, now)
        if not fresh or traj.group_id not in self._live:  # cancelled, or its group ended meanwhile
            self.buffer.ledger.book_attempt(traj.generated_tokens, fate="cancelled", key=key)
            return
        self._attempts.pop(tid, None)
        done = self.buffer.add_trajectory(traj, now, consumer_version=self.version)
        self.evals.record(traj, now)
        if done is not None:
            self.meter.delivered(done)
        if not self.buffer.is_pending(traj.group_id):  # completed (ready, dropped or evaluated)
            self._end(traj.group_id)
            if done is not None and not done.is_eval:
                self._consecutive_failed = 0

    def _on_failed(self, msg: TaskFailed, carried: int, now: float, key: str) -> None:
        a = msg.assignment
        tid = a.trajectory_id
        fresh = self.placement.failed(tid, msg.src, msg.error)
        self.health.booked(msg.src, msg.generated_tokens, now)
        self.buffer.ledger.book_attempt(msg.generated_tokens + carried, fate="failed", key=key)
        self.counters["task_failures"] += 1
        if fresh and a.group_id in self._live:
            self.retry_or_give_up(a, msg.error, msg.src, now)

    def _on_cancelled(self, msg: TaskCancelled, carried: int, now: float, key: str) -> None:
        self.placement.released(msg.task_id, msg.src)
        self.health.booked(msg.src, msg.generated_tokens, now)
        self.buffer.ledger.book_attempt(msg.generated_tokens + carried, fate="cancelled", key=key)

    def retry_or_give_up(self, a: TaskAssignment, error: str, rank: int, now: float) -> bool:
        """A task attempt failed on `rank`: run it again (True), or give its group up."""
        tid = a.trajectory_id
        attempt = self._attempts.get(tid, 0)
        if attempt < self.max_task_retries:
            logger.warning("retrying %s (attempt %d) after: %s", tid, attempt + 1, error)
            self._attempts[tid] = attempt + 1
            self.counters["retries"] += 1
            self.placement.retry(TaskAssignment(a.task, a.group_id, a.index, a.is_eval, attempt + 1))
            return True
        logger.warning("giving up group %s: %s failed %d times, last on rank %d: %s",
                       a.group_id, tid, attempt + 1, rank, error)
        self.give_up(a.group_id, failed=True, reason=f"{tid} failed: {error}", now=now)
        self._consecutive_failed += 1
        if self._consecutive_failed > self.max_failed_groups:
            raise RunError(f"{self._consecutive_failed} groups in a row failed past their retries "
                           f"(scheduler.max_failed_groups={self.max_failed_groups}); last error on rank "
                           f"{rank} for {tid}: {error}")
        return False

    # -- a rank's tasks, when it leaves service (see handover.py) --------------------------------
    def member(self, tid: str) -> Optional[TaskAssignment]:
        """The assignment of task `tid`, or None once its group ended."""
        gid, index = tid.rsplit("/", 1)
        members = self._live.get(gid)
        return None if members is None else members[int(index)]

    def fail_with_rank(self, tid: str, rank: int, now: float) -> bool:
        """Task `tid` was on `rank`, quarantined: like a task of a dead engine, its attempt
        failed there. True when it runs again elsewhere (False: retries spent, or its group
        ended meanwhile, a cancel the rank never answered)."""
        a = self.member(tid)
        if a is None:
            return False
        self.counters["task_failures"] += 1
        return self.retry_or_give_up(a, f"rank {rank} quarantined", rank, now)

    def restart(self, tid: str) -> bool:
        """Task `tid` was on a rank ERS moved to the trainer without handing it over: it starts
        afresh elsewhere, no retry charged. False when its group ended meanwhile."""
        a = self.member(tid)
        if a is None:
            return False
        self.placement.retry(TaskAssignment(a.task, a.group_id, a.index, a.is_eval, self._attempts.get(tid, 0)))
        return True

    def carry(self, tid: str, tokens: int) -> None:
        """Task `tid` was handed over holding `tokens` generated on the ranks it left."""
        self._carried[tid] = (tokens, ledger_keys.carry(tid))

    def take_carried(self, tid: str) -> int:
        """The tokens task `tid` carries from ranks it left (0: none), to book with its end."""
        return self.take_carry(tid)[0]

    def take_carry(self, tid: str) -> tuple[int, Optional[str]]:
        """The tokens task `tid` carries and the carry's name in the ledger, to book them
        without a task end ((0, None): it carries none)."""
        return self._carried.pop(tid, (0, None))
