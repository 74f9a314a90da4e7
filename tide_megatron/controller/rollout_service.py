"""Rank 0's rollout side: one thread owns the global buffer, task placement and rank health.

The trainer (rank 0's main thread, where Megatron's state lives) must keep computing while
rollout messages keep arriving, so the rollout side runs on its own thread. That thread is the
only one that touches its state: the global buffer and its ledger, the task placement
(request level or CTB), retries, evaluation bookkeeping and rank health. The main thread asks
for what it needs through `call` (run a function on this thread, get its result) and `when`
(run it once a condition holds): nothing is shared, so nothing needs a lock.

Each loop turn: read the mailbox and book what arrived (trajectories into the buffer, failures
into retries, heartbeats into health and the ledger check), start new groups while the mode and
the staleness bound allow, place queued tasks, stream newly completed groups into an open
training step, check rank health and progress, and run the main thread's requests. A failure
here is stored, logged once, and raised to the main thread at its next request or wait; an
open step's micro-batch source is failed at once, so a trainer blocked on it stops too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (
    Heartbeat,
    RankReady,
    TaskAssignment,
    TaskCancelled,
    TaskFailed,
    TrajectoryDone,
    TurnEvent,
)
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import ModePolicy
from tide_megatron.core.buffer import CompletedGroup, GlobalBuffer
from tide_megatron.rollout.eval_aggregator import EvalAggregator

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005


class RunError(RuntimeError):
    """The run cannot go on; the message says why."""


class RolloutService(threading.Thread):
    def __init__(self, *, mailbox: Mailbox, buffer: GlobalBuffer, placement, mode: ModePolicy,
                 rollout_ranks: list[int], tasks: list[dict[str, Any]], group_size: int, groups_per_step: int,
                 max_staleness: int, max_task_retries: int, max_failed_groups: int, seed: int,
                 start_version: int, health: RolloutHealth, eval_pass_threshold: float = 1.0):
        super().__init__(name="rollout-service", daemon=True)
        self.mailbox, self.buffer, self.placement, self.mode, self.health = mailbox, buffer, placement, mode, health
        self.rollout_ranks = list(rollout_ranks)
        self.tasks = tasks
        self.group_size, self.groups_per_step, self.max_staleness = group_size, groups_per_step, max_staleness
        self.max_task_retries, self.max_failed_groups = max_task_retries, max_failed_groups
        self.version = start_version
        self.evals = EvalAggregator(pass_threshold=eval_pass_threshold)
        self.error: Optional[BaseException] = None
        self.engines: dict[int, dict[str, Any]] = {}  # rank -> its RankReady engine facts
        self.trainer_inbox: "queue.Queue[Any]" = queue.Queue()  # trainer/ref messages, for the main thread
        self.counters = defaultdict(int)  # groups started / failed / cancelled, retries, ...
        self._rng = random.Random(seed)
        self._stopping = threading.Event()
        self._calls: "queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future, Optional[Callable[[], bool]]]]" = \
            queue.Queue()
        self._waiting: list[tuple[Callable[[], bool], Callable[[], Any], concurrent.futures.Future]] = []
        self._groups_started = 0
        self._requested_groups = 0  # sync mode: groups the current rollout phase still has to start
        self._live: dict[str, list[TaskAssignment]] = {}  # training/eval groups started, not yet ended
        self._attempts: dict[str, int] = {}
        self._consecutive_failed_groups = 0
        self._stream: Optional[tuple[Any, int, Callable[[CompletedGroup], None]]] = None
        self._step_consumed_groups = 0
        self._eval_groups: dict[str, int] = {}  # eval group -> the model version it evaluates
        placement.on_group_started = self._on_group_started

    # ------------------------------------------------------------------ main-thread API
    def call(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `fn` on the service thread and return its result (or raise its error)."""
        return self._wait(self.submit(fn), timeout_s, getattr(fn, "__name__", "a request"))

    def submit(self, fn: Callable[[], Any], when: Optional[Callable[[], bool]] = None) -> concurrent.futures.Future:
        """Queue `fn` to run on the service thread (once `when()` holds, if given); a Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.check()
        self._calls.put((fn, fut, when))
        return fut

    def wait(self, fut: concurrent.futures.Future, timeout_s: float, what: str) -> Any:
        return self._wait(fut, timeout_s, what)

    def _wait(self, fut: concurrent.futures.Future, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                self.check()
                if time.monotonic() > deadline:
                    raise RunError(f"timed out after {timeout_s:.0f} s waiting for {what}") from None

    def check(self) -> None:
        """Raise the service's failure in the calling thread, if it failed or died."""
        if self.error is not None:
            raise RunError(f"rollout side failed: {self.error}") from self.error
        if self.ident is not None and not self.is_alive() and not self._stopping.is_set():
            raise RunError("the rollout service thread exited")

    def stop(self) -> None:
        self._stopping.set()

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._pump()
                self._start_groups()
                self.placement.dispatch(time.monotonic(), self.buffer.unconsumed_trajectories())
                self._feed_stream()
                self._serve_calls()
                problem = self.health.check(time.monotonic(), outstanding=self._outstanding())
                if problem:
                    raise RunError(problem)
                time.sleep(POLL_INTERVAL_S)
        except BaseException as exc:
            logger.error("rollout service failed: %s", exc)
            self.error = exc
            self._fail_waiters(exc)

    def _serve_calls(self) -> None:
        while True:
            try:
                fn, fut, when = self._calls.get_nowait()
            except queue.Empty:
                break
            if when is None:
                self._run_call(fn, fut)
            else:
                self._waiting.append((when, fn, fut))
        still = []
        for when, fn, fut in self._waiting:
            if when():
                self._run_call(fn, fut)
            else:
                still.append((when, fn, fut))
        self._waiting = still

    @staticmethod
    def _run_call(fn, fut) -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    def _fail_waiters(self, exc: BaseException) -> None:
        for _, _, fut in self._waiting:
            fut.set_exception(RunError(f"rollout side failed: {exc}"))
        while not self._calls.empty():
            _, fut, _ = self._calls.get_nowait()
            fut.set_exception(RunError(f"rollout side failed: {exc}"))
        if self._stream is not None:
            self._stream[0].fail(RunError(f"rollout side failed: {exc}"))

    def _outstanding(self) -> bool:
        return bool(self._live) or self.placement.queued() > 0

    # ------------------------------------------------------------------ messages
    def _pump(self) -> None:
        now = time.monotonic()
        for msg in self.mailbox.poll():
            if isinstance(msg, TrajectoryDone):
                self._on_trajectory(msg, now)
            elif isinstance(msg, TaskFailed):
                self._on_failed(msg, now)
            elif isinstance(msg, TaskCancelled):
                self._on_cancelled(msg, now)
            elif isinstance(msg, TurnEvent):
                self.health.progressed(now)
                self.placement.on_turn(msg)
            elif isinstance(msg, Heartbeat):
                self.health.on_heartbeat(msg.src, msg, now)
                self._reconcile()
            elif isinstance(msg, RankReady):
                self.engines[msg.src] = msg.engine
                self.health.add_rank(msg.src, now)
                self.health.progressed(now)
            else:  # the trainer's and reference rank's replies, weight loads: the main thread's
                self.trainer_inbox.put(msg)

    def _on_trajectory(self, msg: TrajectoryDone, now: float) -> None:
        traj = msg.trajectory
        tid = traj.trajectory_id
        self.placement.release(tid, len(traj.token_ids))
        self.health.booked(msg.src, traj.generated_tokens, now)
        self._attempts.pop(tid, None)
        if traj.group_id not in self._live:  # its group was cancelled or failed meanwhile
            self.buffer.ledger.book_attempt(traj.generated_tokens, fate="cancelled")
            return
        done = self.buffer.add_trajectory(traj, now, consumer_version=self.version)
        self.evals.record(traj)
        if not self.buffer.is_pending(traj.group_id):  # completed (ready, dropped or evaluated)
            self._end_group(traj.group_id)
            if done is not None and not done.is_eval:
                self._consecutive_failed_groups = 0

    def _on_failed(self, msg: TaskFailed, now: float) -> None:
        a = msg.assignment
        tid = a.trajectory_id
        self.placement.release(tid, None)
        self.health.booked(msg.src, msg.generated_tokens, now)
        self.buffer.ledger.book_attempt(msg.generated_tokens, fate="failed")
        self.counters["task_failures"] += 1
        if a.group_id not in self._live:
            return
        if a.attempt < self.max_task_retries:
            logger.warning("retrying %s (attempt %d) after: %s", tid, a.attempt + 1, msg.error)
            self.counters["retries"] += 1
            self.placement.submit([TaskAssignment(a.task, a.group_id, a.index, a.is_eval, a.attempt + 1)], front=True)
            return
        logger.warning("giving up group %s: %s failed %d times, last on rank %d: %s",
                       a.group_id, tid, a.attempt + 1, msg.src, msg.error)
        self._give_up_group(a.group_id, failed=True, reason=f"{tid} failed: {msg.error}", now=now)
        self._consecutive_failed_groups += 1
        if self._consecutive_failed_groups > self.max_failed_groups:
            raise RunError(f"{self._consecutive_failed_groups} groups in a row failed past their retries "
                           f"(scheduler.max_failed_groups={self.max_failed_groups}); last error on rank "
                           f"{msg.src} for {tid}: {msg.error}")

    def _on_cancelled(self, msg: TaskCancelled, now: float) -> None:
        self.placement.release(msg.task_id, None)
        self.health.booked(msg.src, msg.generated_tokens, now)
        self.buffer.ledger.book_attempt(msg.generated_tokens, fate="cancelled")

    def _reconcile(self) -> None:
        """Book tokens the ranks generated that never reached the buffer as lost."""
        unbooked = self.health.lost_tokens()
        if unbooked > self.buffer.ledger.lost:
            logger.error("%d generated tokens were never booked (a task or message vanished)",
                         unbooked - self.buffer.ledger.lost)
            self.buffer.ledger.lose(unbooked - self.buffer.ledger.lost)

    # ------------------------------------------------------------------ groups
    def request_groups(self, n: int) -> None:
        """Sync mode: start `n` training groups now (replacements follow failures)."""
        self._requested_groups += n

    def _start_groups(self) -> None:
        if len(self.engines) < len(self.rollout_ranks):
            return  # every rank's engine first: the staleness clock starts with rollout
        if self.mode.continuous_rollout:
            # Admission bounds staleness: a group started now must be consumable before the
            # step that trains version+max_staleness+1 ends; groups ahead of it take the slots.
            cap = (self.max_staleness + 1) * self.groups_per_step - self._step_consumed_groups
            while self._live_training_groups() < cap:
                self._start_group()
        else:
            while self._requested_groups > 0:
                self._requested_groups -= 1
                self._start_group()

    def _live_training_groups(self) -> int:
        """Training groups started and not yet consumed or ended: running, or ready in the buffer."""
        running = sum(1 for members in self._live.values() if not members[0].is_eval)
        return running + len(self.buffer.ready_groups())

    def _start_group(self, task: Optional[dict] = None, is_eval: bool = False, prefix: str = "g") -> str:
        task = task or self._rng.choice(self.tasks)
        gid = f"{prefix}{self._groups_started}v{self.version}"
        self._groups_started += 1
        members = [TaskAssignment(task, gid, i, is_eval) for i in range(self.group_size)]
        self._live[gid] = members
        self.buffer.open_group(gid, task["task_id"], time.monotonic(), is_eval=is_eval)
        self.placement.submit(members, front=is_eval)
        self.counters["groups_started"] += 1
        return gid

    def _on_group_started(self, gid: str) -> None:
        """The placement sent the group's first task to a rank: it is admitted under this version."""
        if self.buffer.is_pending(gid) and not self._live[gid][0].is_eval:
            self.buffer.note_admitted(gid, self.version)

    def _end_group(self, gid: str) -> None:
        self._live.pop(gid, None)
        self.placement.forget_group(gid)

    def _give_up_group(self, gid: str, *, failed: bool, reason: str, now: float) -> None:
        """Cancel a group's other members and end it in the buffer (failed or cancelled)."""
        for a in self._live.get(gid, []):
            self.placement.cancel(a.trajectory_id, reason)
        if self.buffer.is_pending(gid):
            if failed:
                self.buffer.fail_group(gid, now)
            else:
                self.buffer.cancel_group(gid, now, consumer_version=self.version)
        members = self._live.get(gid)
        self._end_group(gid)
        self.counters["groups_failed" if failed else "groups_cancelled"] += 1
        if failed and members is not None and self.mode.continuous_rollout is False:
            self._requested_groups += 1  # the sync batch still needs a whole group in its place
        if members and members[0].is_eval:  # the evaluation goes on without this group
            self.evals.abandon(self._eval_groups.pop(gid), [a.trajectory_id for a in members])

    def set_version(self, version: int) -> None:
        """New weights are out: later groups are admitted under `version`; groups that can no
        longer be consumed within the bound are cancelled at once (their tokens are wasted)."""
        self.version = version
        self._step_consumed_groups = 0
        now = time.monotonic()
        for gid in self.buffer.doomed_groups(version):
            self._give_up_group(gid, failed=False, reason=f"stale for version {version}", now=now)
        self.placement.on_weight_sync()

    def submit_eval(self, version: int, tasks: list[dict[str, Any]], groups: int) -> None:
        """Eval groups for the model `version`, ahead of every queued training task."""
        assignments = []
        for _ in range(groups):
            gid = self._start_group(self._rng.choice(tasks), is_eval=True, prefix="eval")
            self._eval_groups[gid] = version
            assignments += self._live[gid]
        self.evals.expect(version, assignments)

    # ------------------------------------------------------------------ the trainer's step
    def open_step(self, max_groups: int) -> tuple[float, float, list[CompletedGroup]]:
        """A streaming step starts: RAS and the head-of-line age, and the groups ready now."""
        now = time.monotonic()
        hol = self.buffer.head_of_line_latency(now)
        ras = self.buffer.begin_step(now)
        taken = self.buffer.fetch(self.version, now, max_groups * self.group_size)
        self._step_consumed_groups = len(taken)
        return ras, hol, taken

    def stream_into(self, sink, groups_left: int, on_group: Callable[[CompletedGroup], None]) -> None:
        """Completed groups of the open step go to `on_group` as they complete (this thread)."""
        self._stream = (sink, groups_left, on_group)
        self._feed_stream()

    def _feed_stream(self) -> None:
        while self._stream is not None and self._stream[1] > 0:
            sink, left, on_group = self._stream
            taken = self.buffer.fetch(self.version, time.monotonic(), left * self.group_size, max_groups=1)
            if not taken:
                return
            self._step_consumed_groups += 1
            self._stream = (sink, left - 1, on_group)
            on_group(taken[0])

    def batch_ready(self) -> bool:
        return self.buffer.fetchable_trajectories(self.version) >= self.buffer.config.b_min

    def step_can_open(self) -> bool:
        """A streaming step starts once it has a group to train, or one it must wait for."""
        return self.buffer.fetchable_trajectories(self.version) > 0 or \
            self.buffer.last_chance_reserve(self.version) > 0

    def fetch_batch(self):
        """A whole-batch step starts: (the global batch, RAS, head-of-line age), or None when
        stale groups were dropped and what is left falls short (the caller waits again)."""
        now = time.monotonic()
        self.buffer.drop_stale(self.version, now)
        if not self.batch_ready():
            return None
        hol = self.buffer.head_of_line_latency(now)
        ras = self.buffer.begin_step(now)
        batch = self.buffer.fetch_batch(self.version, now)
        self._step_consumed_groups = len(batch.groups)
        return batch, ras, hol

    def close_step(self):
        """The step's update is done. Admission stays as the step left it until `set_version`:
        a group started now would be stamped with the old version though the new weights
        reach the ranks before its tasks do."""
        self._stream = None
        return self.buffer.end_step(time.monotonic())

    # ------------------------------------------------------------------ views
    def ledger_snapshot(self) -> dict[str, int]:
        """The ledger's buckets, and the tokens of tasks still running on the ranks (not booked
        until their task ends), as of the ranks' last heartbeats."""
        led = self.buffer.ledger
        return {**{b: getattr(led, b) for b in led.BUCKETS}, "generated": led.generated, "wasted": led.wasted,
                "running_on_ranks": self.health.running_tokens()}
