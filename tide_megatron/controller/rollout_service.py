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

A silent rank, or one that does not confirm its weights in time, is quarantined rather than
ending the run, and rejoins at a later weight sync once it is heard from again: the steps are
in `quarantine.py`, the bookkeeping here and there; the weights go out from this thread too
(`send_weights`), to the ranks in service and those rejoining only. ERS's moves of ranks
between rollout and the trainer take the same path (`move_to_trainer`, `return_to_rollout`).

It also measures what ERS reads of the rollout side over each step (`ers_window`): the tokens
of training groups that became ready, of evaluation trajectories, the time the staleness
window's admission slots were full, the CTB ranks' KV use, and their decode iteration times
(from the cumulative counters in each finished turn's plugin report, `_on_decode_counters`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Optional

from sglang_patches.scheduler_hooks import DECODE_COUNTERS
from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (
    Heartbeat,
    RankReady,
    TaskAssignment,
    TaskCancelled,
    TaskCarried,
    TaskFailed,
    TaskReleased,
    TrajectoryDone,
    TurnEvent,
)
from tide_megatron.core.ctb_deadline import ConsumptionMeter, TrainerClock
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import ModePolicy
from tide_megatron.controller.quarantine import Quarantine
from tide_megatron.core.buffer import CompletedGroup, GlobalBuffer
from tide_megatron.rollout.eval_aggregator import EvalAggregator

logger = logging.getLogger(__name__)

SAMPLE_S = 0.1
"""How often the KV use and the tasks in flight that ERS reads are sampled."""
POLL_INTERVAL_S = 0.005


def _empty_window() -> dict[str, float]:
    return {"fresh_tokens": 0, "eval_tokens": 0, "slots_full_s": 0.0, "kv_share_s": 0.0, "kv_s": 0.0,
            "tasks_s": 0.0, "decode_iterations": 0, "decode_s": 0.0, "decode_seq_s": 0.0}


_TASK_ENDS = (TrajectoryDone, TaskFailed, TaskCancelled, TaskCarried)


def _task_id(msg) -> str:
    if isinstance(msg, TrajectoryDone):
        return msg.trajectory.trajectory_id
    return msg.assignment.trajectory_id if isinstance(msg, TaskFailed) else msg.task_id


class RunError(RuntimeError):
    """The run cannot go on; the message says why."""


class RolloutService(threading.Thread):
    def __init__(self, *, mailbox: Mailbox, buffer: GlobalBuffer, placement, mode: ModePolicy,
                 rollout_ranks: list[int], tasks: list[dict[str, Any]], group_size: int, groups_per_step: int,
                 max_staleness: int, max_task_retries: int, max_failed_groups: int, seed: int,
                 start_version: int, health: RolloutHealth, eval_pass_threshold: float = 1.0,
                 weight_sender=None, weight_sync_timeout_s: float = 300.0, min_rollout_ranks: int = 1,
                 hand_over_tasks: bool = True):
        super().__init__(name="rollout-service", daemon=True)
        self.mailbox, self.buffer, self.placement, self.mode, self.health = mailbox, buffer, placement, mode, health
        self._startup_ranks = list(rollout_ranks)
        self._all_started = False  # every start-up rank has reported its engine
        self.tasks = tasks
        self.group_size, self.groups_per_step, self.max_staleness = group_size, groups_per_step, max_staleness
        self.max_task_retries, self.max_failed_groups = max_task_retries, max_failed_groups
        self.version = start_version
        self.evals = EvalAggregator(pass_threshold=eval_pass_threshold)
        self.error: Optional[BaseException] = None
        self.engines: dict[int, dict[str, Any]] = {}  # rank -> its RankReady engine facts
        self.trainer_inbox: "queue.Queue[Any]" = queue.Queue()  # trainer/ref messages, for the main thread
        self.counters = defaultdict(int)  # groups started / failed / cancelled, retries, ...
        self.quarantine = Quarantine(rollout_ranks, placement=placement, health=health, ledger=buffer.ledger,
                                     mailbox=mailbox, weight_sender=weight_sender,
                                     weight_sync_timeout_s=weight_sync_timeout_s)
        self.min_rollout_ranks = min_rollout_ranks
        self.hand_over_tasks = hand_over_tasks and placement.hands_over
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
        self._consumption = ConsumptionMeter(window_steps=4)
        self.lost_before = 0  # lost tokens booked before a restart (run_state.restore sets it)
        self._step_started: Optional[float] = None
        self._window = _empty_window()
        self._decode_last: dict[int, tuple[int, tuple[float, ...]]] = {}  # rank -> (scheduler pid, counters)
        self._floor = [0, 0.0]  # batch-of-one decode iterations and seconds, the whole run
        self._full_since: Optional[float] = None
        self._kv_share: Optional[float] = None  # CTB ranks' mean KV use at the last sample (None: unknown)
        self._tasks = 0  # tasks placed on rollout ranks at the last sample
        self._sampled_at = 0.0
        self._unadmitted: set[str] = set()  # training groups started, none of their tasks on a rank yet
        self._handing_over: dict[str, int] = {}  # task -> the rank leaving rollout that hands it over
        self._carried: dict[str, int] = {}
        """Tokens of a handed-over task generated on the ranks it left: booked with its end."""
        placement.on_group_started = self._on_group_started

    @property
    def rollout_ranks(self) -> list[int]:
        """The ranks that are rollout ranks now (in service, quarantined, or joining)."""
        return self.quarantine.rollout_side

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
                read_at = self._pump()
                self._sample_occupancy(read_at)
                self._start_groups()
                self._place()
                self._feed_stream()
                self._serve_calls()
                now = time.monotonic()
                # silent as of the last read of the mailbox: a slow request above must not make
                # the heartbeats it kept us from reading look missing
                for rank, why in self.health.silent(read_at):
                    self._quarantine_rank(rank, why, now)
                for rank, why in self.quarantine.overdue(now):  # weights not confirmed in time
                    self._quarantine_rank(rank, why, now)
                problem = self.health.check(now, outstanding=self._outstanding())
                if problem:
                    raise RunError(f"{problem}; {self.placement.describe()}")
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
    def _pump(self) -> float:
        """Book every message that arrived; returns when the mailbox was read."""
        now = time.monotonic()
        for msg in self.mailbox.poll():
            if isinstance(msg, TurnEvent) and msg.report:  # out of service too: its last counters
                self._on_decode_counters(msg.src, msg.report)
            if isinstance(msg, _TASK_ENDS):
                self._on_task_end(msg, now)
            elif self.quarantine.handles(msg, now):  # a quarantined rank's, or a weight confirmation
                continue
            elif isinstance(msg, TaskReleased):
                self.placement.released(msg.task_id, msg.src)
            elif isinstance(msg, TurnEvent):
                self.health.progressed(now)
                self.placement.on_turn(msg)
            elif isinstance(msg, Heartbeat):
                self.health.on_heartbeat(msg.src, msg, now)
                self._reconcile()
            elif isinstance(msg, RankReady):
                self.engines[msg.src] = msg.engine
                self.placement.engine_ready(msg.src, msg.engine.get("kv_tokens"), msg.engine.get("request_rows"))
                self.health.add_rank(msg.src, now)
                self.health.progressed(now)
            else:  # the trainer's and reference rank's replies: the main thread's
                self.trainer_inbox.put(msg)
        return now

    def _on_task_end(self, msg, now: float) -> None:
        """A task ended on a rank: it finished, failed, was cancelled, or was handed over. The
        tokens of ranks that handed it over before are booked with this end (a trajectory
        holds them already); only the rank that was handed the task reports any, which keeps a
        late report of an older attempt elsewhere from booking them."""
        tid = _task_id(msg)
        carried = self._carried.pop(tid, 0) if msg.carried_tokens else 0
        if self._handing_over.get(tid) == msg.src:  # the rank leaving rollout answers for it
            del self._handing_over[tid]
            if isinstance(msg, TaskCarried):
                self._on_carried(msg, carried, now)
                return
            if isinstance(msg, TaskCancelled):  # it had not begun: it starts afresh elsewhere
                self.health.booked(msg.src, msg.generated_tokens, now)
                self.buffer.ledger.book_attempt(msg.generated_tokens + carried, fate="cancelled")
                self.placement.not_carried(tid)
                return
        elif self.quarantine.handles(msg, now):  # a task the rank no longer owns
            self.buffer.ledger.book_attempt(carried, fate="cancelled")
            return
        if isinstance(msg, TrajectoryDone):
            self._on_trajectory(msg, now)
        elif isinstance(msg, TaskFailed):
            self._on_failed(msg, carried, now)
        elif isinstance(msg, TaskCancelled):
            self._on_cancelled(msg, carried, now)
        else:
            raise RunError(f"rank {msg.src} handed over task {tid}, which it was not asked to")

    def _on_carried(self, msg: TaskCarried, carried: int, now: float) -> None:
        """A rank leaving rollout handed a task over: it goes on where CTB resumes it."""
        self.health.booked(msg.src, msg.generated_tokens, now)
        total = msg.generated_tokens + carried
        if self.placement.carried(msg.task_id, msg.carry):
            self._carried[msg.task_id] = total
            self.counters["tasks_carried"] += 1
            self.counters["carried_tokens"] += total
        else:  # its group ended meanwhile
            self.buffer.ledger.book_attempt(total, fate="cancelled")

    def _on_trajectory(self, msg: TrajectoryDone, now: float) -> None:
        traj = msg.trajectory
        tid = traj.trajectory_id
        fresh = self.placement.finished(tid, msg.src, len(traj.token_ids))
        self.health.booked(msg.src, traj.generated_tokens - msg.carried_tokens, now)
        if not fresh or traj.group_id not in self._live:  # cancelled, or its group ended meanwhile
            self.buffer.ledger.book_attempt(traj.generated_tokens, fate="cancelled")
            return
        self._attempts.pop(tid, None)
        done = self.buffer.add_trajectory(traj, now, consumer_version=self.version)
        self.evals.record(traj, now)
        if done is not None and self._full_since is None:  # ERS counts delivery only while admission is open
            self._window["eval_tokens" if done.is_eval else "fresh_tokens"] += done.total_tokens
        if not self.buffer.is_pending(traj.group_id):  # completed (ready, dropped or evaluated)
            self._end_group(traj.group_id)
            if done is not None and not done.is_eval:
                self._consecutive_failed_groups = 0

    def _on_failed(self, msg: TaskFailed, carried: int, now: float) -> None:
        a = msg.assignment
        tid = a.trajectory_id
        fresh = self.placement.failed(tid, msg.src, msg.error)
        self.health.booked(msg.src, msg.generated_tokens, now)
        self.buffer.ledger.book_attempt(msg.generated_tokens + carried, fate="failed")
        self.counters["task_failures"] += 1
        if fresh and a.group_id in self._live:
            self._retry_or_give_up(a, msg.error, msg.src, now)

    def _retry_or_give_up(self, a: TaskAssignment, error: str, rank: int, now: float) -> bool:
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
        self._give_up_group(a.group_id, failed=True, reason=f"{tid} failed: {error}", now=now)
        self._consecutive_failed_groups += 1
        if self._consecutive_failed_groups > self.max_failed_groups:
            raise RunError(f"{self._consecutive_failed_groups} groups in a row failed past their retries "
                           f"(scheduler.max_failed_groups={self.max_failed_groups}); last error on rank "
                           f"{rank} for {tid}: {error}")
        return False

    def _on_cancelled(self, msg: TaskCancelled, carried: int, now: float) -> None:
        self.placement.released(msg.task_id, msg.src)
        self.health.booked(msg.src, msg.generated_tokens, now)
        self.buffer.ledger.book_attempt(msg.generated_tokens + carried, fate="cancelled")

    # ------------------------------------------------------------------ quarantine
    def _quarantine_rank(self, rank: int, reason: str, now: float) -> None:
        """Take a silent or unconfirming rank out of service (see `quarantine.py`)."""
        task_ids, written_off = self.quarantine.take_out(rank, reason, now)
        retried = 0
        for tid in task_ids:  # like the tasks of a dead engine: each attempt failed there
            self.buffer.ledger.book_attempt(self._carried.pop(tid, 0), fate="failed")  # (on earlier ranks)
            gid, index = tid.rsplit("/", 1)
            members = self._live.get(gid)
            if members is None:  # its group ended meanwhile (a cancel the rank never answered)
                continue
            self.counters["task_failures"] += 1
            retried += self._retry_or_give_up(members[int(index)], f"rank {rank} quarantined", rank, now)
        logger.warning("quarantined rollout rank %d: %s; %d task(s) taken back (%d retried on other ranks, "
                       "%d tokens booked as failed)", rank, reason, len(task_ids), retried, written_off)
        left = self.quarantine.serving
        if len(left) < self.min_rollout_ranks:
            raise RunError(f"{reason}; {len(left)} rollout rank(s) left in service, fewer than "
                           f"scheduler.min_rollout_ranks={self.min_rollout_ranks}")

    # ------------------------------------------------------------------ ERS moves
    def move_to_trainer(self, rank: int, reason: str, retain: bool = True) -> int:
        """ERS moves rollout rank `rank` to the trainer: it takes no new task, and its tasks go
        on on the other ranks: with CTB it hands each over (`TaskCarried`: its episode and env
        session go on where CTB resumes it, re-prefilled under the new weights; a task that had
        not begun starts afresh), otherwise they start afresh (no retry is charged; their tokens
        are wasted) and it drops them. `in_trainer(rank)` once it answered for every task.
        `retain`: the move starts adaptive data retention (a rollout scale-down). Returns the
        tasks moved."""
        now = time.monotonic()
        if rank not in self.quarantine.serving:
            raise ValueError(f"rank {rank} is not a rollout rank in service")
        hand_over = self.hand_over_tasks
        task_ids, written_off = self.quarantine.take_out(rank, reason, now, kind="trainer", hand_over=hand_over)
        if retain:
            self.buffer.notify_rollout_scaled(-1)  # adaptive data retention
        if hand_over:
            self._handing_over.update((tid, rank) for tid in task_ids)
            self.counters["tasks_moved"] += len(task_ids)
            logger.info("rank %d leaves rollout for the trainer (%s): it hands %d task(s) over", rank, reason,
                        len(task_ids))
            return len(task_ids)
        moved = 0
        for tid in task_ids:
            gid, index = tid.rsplit("/", 1)
            members = self._live.get(gid)
            if members is None:  # its group ended meanwhile
                continue
            a = members[int(index)]
            self.placement.retry(TaskAssignment(a.task, a.group_id, a.index, a.is_eval, self._attempts.get(tid, 0)))
            moved += 1
        self.counters["tasks_moved"] += moved
        logger.info("rank %d leaves rollout for the trainer (%s): %d task(s) re-dispatched, %d tokens wasted",
                    rank, reason, moved, written_off)
        return moved

    def in_trainer(self, rank: int) -> bool:
        return self.quarantine.in_trainer(rank)

    def returning(self, rank: int) -> bool:
        """ERS moved trainer rank `rank` to rollout, and it has not loaded the weights yet."""
        return self.quarantine.returning(rank)

    def return_to_rollout(self, rank: int) -> None:
        """ERS moves trainer rank `rank` to rollout: it receives the next weights (its engine
        may still be starting) and takes tasks once it has loaded them."""
        self.quarantine.return_to_rollout(rank, time.monotonic())
        self.buffer.notify_rollout_scaled(+1)
        logger.info("rank %d joins rollout; tasks go to it once it has loaded the next weights", rank)

    def ers_window(self, now: Optional[float] = None) -> dict[str, float]:
        """What ERS reads of rollout since the last call (then reset): tokens of training groups
        that became ready and of evaluation trajectories while admission was open (a group was
        waiting for a rank: Rollout ran at capacity), seconds the admission slots were full,
        the mean KV use of the CTB ranks in service (0 without CTB), the task-seconds of the
        tasks placed on rollout ranks (`tasks_in_flight_s`), and their decode:
        `decode_iteration_s`, the mean decode iteration of the window (pooled over the ranks:
        seconds / iterations); `mean_decode_batch`, the time-averaged sequences per iteration
        (sum of batch size x seconds / seconds, as the simulator's); `decode_seq_s`, that sum;
        `decode_floor_s`, the mean batch-of-one iteration of the whole run so far (rare under
        load, so not per window).
        Each is 0 when nothing was measured (no CTB report yet, or no batch of one): ERS then
        reads decode as unslowed. The window lags by up to a turn (the counters travel in the
        plugin's report at each turn's end)."""
        now = time.monotonic() if now is None else now
        self._note_slots(now, self._full_since is not None)
        self._sample_occupancy(now, force=True)
        w, self._window = self._window, _empty_window()
        floor_n, floor_s = self._floor
        return {"fresh_tokens": w["fresh_tokens"], "eval_tokens": w["eval_tokens"], "slots_full_s": w["slots_full_s"],
                "kv_used_fraction": w["kv_share_s"] / w["kv_s"] if w["kv_s"] else 0.0,
                "decode_iteration_s": w["decode_s"] / w["decode_iterations"] if w["decode_iterations"] else 0.0,
                "mean_decode_batch": w["decode_seq_s"] / w["decode_s"] if w["decode_s"] > 0 else 0.0,
                "decode_seq_s": w["decode_seq_s"], "tasks_in_flight_s": w["tasks_s"],
                "decode_floor_s": floor_s / floor_n if floor_n else 0.0}

    def _on_decode_counters(self, rank: int, report: dict[str, Any]) -> None:
        """Book the decode a rank in service ran since its previous turn report. The counters
        are cumulative per scheduler process (`pid`): a new process (the engine restarted)
        starts afresh, so its values are the difference; a report of the same process with
        fewer iterations is an older one that arrived late and is skipped. A rank out of
        service (moved to the trainer, quarantined) only updates its last values."""
        if "decode_iterations" not in report:
            return
        pid, now = report.get("pid", 0), tuple(report[f] for f in DECODE_COUNTERS)
        prev = self._decode_last.get(rank)
        same = prev is not None and prev[0] == pid
        if same and now[0] < prev[1][0]:
            return
        self._decode_last[rank] = (pid, now)
        if rank not in self.quarantine.serving:
            return
        diff = dict(zip(DECODE_COUNTERS, (a - b for a, b in zip(now, prev[1])) if same else now))
        for f in ("decode_iterations", "decode_s", "decode_seq_s"):
            self._window[f] += diff[f]
        self._floor[0] += diff["decode_floor_iterations"]
        self._floor[1] += diff["decode_floor_s"]

    def _note_slots(self, now: float, full: bool) -> None:
        if self._full_since is not None:
            self._window["slots_full_s"] += now - self._full_since
        self._full_since = now if full else None

    def _sample_occupancy(self, now: float, force: bool = False) -> None:
        """Time-weighted KV use and tasks in flight: each sample, taken at most every
        `SAMPLE_S`, holds until the next (the loop runs every few ms; a sample per pass would
        weigh busy spells, when the loop is slow, less than idle ones)."""
        if not force and now - self._sampled_at < SAMPLE_S:
            return
        if self._kv_share is not None:
            self._window["kv_share_s"] += self._kv_share * (now - self._sampled_at)
            self._window["kv_s"] += now - self._sampled_at
        self._window["tasks_s"] += self._tasks * (now - self._sampled_at)
        usage = getattr(self.placement, "kv_usage", None)
        self._kv_share = usage(self.quarantine.serving) if usage is not None else None
        self._tasks = self.placement.running()
        self._sampled_at = now

    def send_weights(self, weights) -> list[int]:
        """Send weights (a `weight_sync.WeightSet`) to the ranks in service and those ready to
        rejoin; returns them. Nothing waits here: each must confirm within
        `weight_sync_timeout_s` or is quarantined."""
        return self.quarantine.send_weights(weights, time.monotonic())

    def weights_settled(self, version: int) -> bool:
        """Every receiver of `version` loaded it or was quarantined (sync mode waits for this)."""
        return self.quarantine.settled(version)

    def _reconcile(self) -> None:
        """Book tokens the ranks generated that never reached the buffer as lost."""
        unbooked = self.health.lost_tokens()  # this attempt's ranks only
        booked_here = self.buffer.ledger.lost - self.lost_before
        if unbooked > booked_here:
            logger.error("%d generated tokens were never booked (a task or message vanished)", unbooked - booked_here)
            self.buffer.ledger.lose(unbooked - booked_here)

    def _place(self) -> None:
        """One placement pass; with CTB, groups past their staleness deadline come back cancelled."""
        now = time.monotonic()
        for gid in self.placement.dispatch(now, self.buffer.unconsumed_trajectories(), clock=self._clock(now)):
            if gid in self._live:
                self._give_up_group(gid, failed=False, reason="past its staleness deadline", now=now)

    def _clock(self, now: float) -> Optional[TrainerClock]:
        """The trainer's clock for deadline-aware admission (None until a step was measured)."""
        est = self.buffer.estimate()
        if not self.mode.continuous_rollout or not est.steps_observed:
            return None
        started = self._step_started if self._step_started is not None else now
        return TrainerClock(version=self.version, step_time_s=est.step_time_s,
                            next_sync_at=started + est.step_time_s, consumed_per_s=self._consumption.rate())

    # ------------------------------------------------------------------ groups
    def request_groups(self, n: int) -> None:
        """Sync mode: start `n` training groups now (replacements follow failures)."""
        self._requested_groups += n

    def _start_groups(self) -> None:
        if not self._all_started:
            if any(r not in self.engines for r in self._startup_ranks):
                return  # every rank's engine first: the staleness clock starts with rollout
            self._all_started = True
        if self.mode.continuous_rollout:
            # Admission bounds staleness: a group started now must be consumable before the
            # step that trains version+max_staleness+1 ends; groups ahead of it take the slots
            # (steps are shorter while the buffer retains a reservoir: the window follows them).
            cap = self.buffer.window_groups(self.groups_per_step, self.version) - self._step_consumed_groups
            while self._live_training_groups() < cap:
                self._start_group()
            # full: no room for one more group, and every group started is admitted on a rank
            # (so nothing but the throttle holds the next one back)
            self._note_slots(time.monotonic(), full=not self._unadmitted)
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
        if not is_eval:
            self._unadmitted.add(gid)
        self.placement.submit(members, front=is_eval)
        self.counters["groups_started"] += 1
        return gid

    def _on_group_started(self, gid: str) -> None:
        """The placement sent the group's first task to a rank: it is admitted under this version."""
        self._unadmitted.discard(gid)
        if self.buffer.is_pending(gid) and not self._live[gid][0].is_eval:
            self.buffer.note_admitted(gid, self.version)

    def _end_group(self, gid: str) -> None:
        self._unadmitted.discard(gid)
        self._live.pop(gid, None)
        self.placement.forget_group(gid)
        for tid, _ in self.placement.take_dropped_carries():  # handed over, never started again
            self.buffer.ledger.book_attempt(self._carried.pop(tid, 0), fate="cancelled")

    def _give_up_group(self, gid: str, *, failed: bool, reason: str, now: float) -> None:
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
        self._end_group(gid)
        self.counters["groups_failed" if failed else "groups_cancelled"] += 1
        if failed and members is not None and self.mode.continuous_rollout is False:
            self._requested_groups += 1  # the sync batch still needs a whole group in its place
        if members and members[0].is_eval:  # the evaluation goes on without this group
            self.evals.abandon(self._eval_groups.pop(gid), [a.trajectory_id for a in members], now)

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
        self.evals.expect(version, assignments, time.monotonic())

    # ------------------------------------------------------------------ the trainer's step
    def open_step(self, max_groups: int) -> tuple[float, float, list[CompletedGroup], int]:
        """A streaming step starts: RAS and the head-of-line age, the groups ready now, and the
        groups it trains in all (fewer than `max_groups` while the buffer retains a reservoir
        after a rollout scale-down, see `GlobalBuffer.open_stream`)."""
        now = time.monotonic()
        hol = self.buffer.head_of_line_latency(now)
        ras = self.buffer.begin_step(now)
        self._step_started = now
        taken, groups = self.buffer.open_stream(self.version, now, max_groups)
        self._step_consumed_groups = len(taken)
        if groups < max_groups:
            logger.info("step of %d group(s), not %d: the buffer keeps a reservoir after a rollout scale-down",
                        groups, max_groups)
        return ras, hol, taken, groups

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
        return self.buffer.batch_available(self.version)

    def step_can_open(self) -> bool:
        """A streaming step starts once it has a group to train, or one it must wait for."""
        return self.buffer.fetchable_trajectories(self.version, self.groups_per_step * self.group_size) > 0 or \
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
        self._step_started = now
        batch = self.buffer.fetch_batch(self.version, now)
        assert batch is not None, "batch_available and fetch_batch disagree"
        self._step_consumed_groups = len(batch.groups)
        return batch, ras, hol

    def close_step(self):
        """The step's update is done. Admission stays as the step left it until `set_version`:
        a group started now would be stamped with the old version though the new weights
        reach the ranks before its tasks do."""
        self._stream = None
        now = time.monotonic()
        readiness = self.buffer.end_step(now)
        if self._step_started is not None:
            self._consumption.record_step(self._step_started, now, self._step_consumed_groups * self.group_size)
        self._step_started = None
        return readiness

    # ------------------------------------------------------------------ views
    def quarantine_counts(self) -> dict[str, int]:
        return {**self.quarantine.counts, "out_of_service": len(self.quarantine.out)}

    def ledger_snapshot(self) -> dict[str, int]:
        """The ledger's buckets, and the tokens of tasks still running on the ranks (not booked
        until their task ends), as of the ranks' last heartbeats."""
        led = self.buffer.ledger
        return {**{b: getattr(led, b) for b in led.BUCKETS}, "generated": led.generated, "wasted": led.wasted,
                "running_on_ranks": self.health.running_tokens()}
