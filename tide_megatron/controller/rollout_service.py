"""Rank 0's rollout side: one thread owns the global buffer, task placement and rank health.

The trainer (rank 0's main thread, where Megatron's state lives) must keep computing while
rollout messages keep arriving, so the rollout side runs on its own thread. That thread is the
only one that touches its state: the global buffer and its ledger, the task placement
(request level or CTB), the groups and their retries, evaluation bookkeeping and rank health.
The main thread asks for what it needs through `call` (run a function on this thread, get its
result) and `submit(..., when=...)` (run it once a condition holds, `call_queue.py`): nothing
is shared, so nothing needs a lock.

Each loop turn: read the mailbox and route what arrived (task ends to the hand-over, the
quarantine or the groups; heartbeats into health and the ledger check), start new groups while
the mode and the staleness bound allow, place queued tasks, stream newly completed groups into
an open training step, run the main thread's requests, and check rank health and progress. A
failure here is stored, logged once, and raised to the main thread at its next request or
wait; an open step's micro-batch source is failed at once, so a trainer blocked on it stops too.

This class wires the parts and routes messages; each part is owned by this thread:

- `groups.py` (`GroupBook`): starting groups within the staleness bound, booking each task's
  end, retries, giving groups up;
- `handover.py` (`Handover`): a rank leaving service (quarantined, or moved to the trainer by
  ERS) and what becomes of its tasks; a rank joining;
- `quarantine.py` (`Quarantine`): which ranks are out of service, and the weight sends still
  waiting for their confirmation (`send_weights`, `weights_settled`);
- `step_intake.py` (`StepIntake`): what the trainer's step takes from the buffer, and its clock;
- `rollout_meter.py` (`RolloutMeter`): what ERS reads of rollout over each step (`ers_window`);
- `health.py` (`RolloutHealth`): liveness, progress and the ledger's check against the ranks.
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

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (EngineFacts, Heartbeat, RankReady, TaskCancelled, TaskCarried, TaskFailed,
                                         TaskReleased, TrajectoryDone, TurnEvent)
from tide_megatron.controller import ledger_keys
from tide_megatron.controller.call_queue import CallQueue
from tide_megatron.controller.errors import RunError
from tide_megatron.controller.eval_aggregator import EvalAggregator
from tide_megatron.controller.groups import GroupBook
from tide_megatron.controller.handover import Handover
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import ModePolicy
from tide_megatron.controller.quarantine import Quarantine
from tide_megatron.controller.rollout_meter import RolloutMeter
from tide_megatron.controller.step_intake import StepIntake
from tide_megatron.core.buffer import CompletedGroup, GlobalBuffer, LedgerError

logger = logging.getLogger(__name__)

__all__ = ["RolloutService", "RunError"]

IDLE_POLL_MAX_S = 0.04
"""A pass that read no message and ran no request doubles the wait before the next, up to this:
an idle pass costs rank 0 CPU time per wall second whatever the job's size. A request from the
main thread ends the wait at once; a rank's message waits at most this long."""

_TASK_ENDS = (TrajectoryDone, TaskFailed, TaskCancelled, TaskCarried)


def _task_id(msg) -> str:
    if isinstance(msg, TrajectoryDone):
        return msg.trajectory.trajectory_id
    return msg.assignment.trajectory_id if isinstance(msg, TaskFailed) else msg.task_id


class RolloutService(threading.Thread):
    def __init__(self, *, mailbox: Mailbox, buffer: GlobalBuffer, placement, mode: ModePolicy,
                 rollout_ranks: list[int], tasks: list[dict[str, Any]], group_size: int, groups_per_step: int,
                 max_staleness: int, max_task_retries: int, max_failed_groups: int, seed: int,
                 start_version: int, health: RolloutHealth, eval_pass_threshold: float = 1.0,
                 weight_sender=None, weight_sync_timeout_s: float = 300.0, min_rollout_ranks: int = 1,
                 hand_over_tasks: bool = True, task_order: str = "random", poll_s: float = 0.02):
        super().__init__(name="rollout-service", daemon=True)
        self.mailbox, self.buffer, self.placement, self.mode, self.health = mailbox, buffer, placement, mode, health
        self._startup_ranks = list(rollout_ranks)
        self._all_started = False  # every start-up rank has reported its engine
        self.tasks = tasks
        self.max_staleness = max_staleness
        self.evals = EvalAggregator(pass_threshold=eval_pass_threshold)
        self.error: Optional[BaseException] = None
        self.engines: dict[int, EngineFacts] = {}  # rank -> its engine, as it reported at start-up
        self.trainer_inbox: "queue.Queue[Any]" = queue.Queue()  # trainer/ref messages, for the main thread
        self.counters = defaultdict(int)  # groups started / failed / cancelled, retries, tasks moved, ...
        self.lost_before = 0  # lost tokens booked before a restart (run_state.restore sets it)
        self._rng = random.Random(seed)  # the task sampler's (run_state saves and restores it)
        self._stopping = threading.Event()
        self.poll_s = poll_s
        """The wait after a pass that read a message or ran a request (`scheduler.control_poll_s`)."""
        self.loops = 0
        """Passes of this thread's loop (each reads the mailbox once): `control/loops`."""
        self.cpu_s = 0.0
        """This thread's CPU time as of its latest pass: `control/cpu_rollout_thread_s`."""
        self._calls = CallQueue()
        self._notify: Callable[[str, str], None] = lambda kind, text: None  # set_event_sink
        self.quarantine = Quarantine(rollout_ranks, placement=placement, health=health, ledger=buffer.ledger,
                                     mailbox=mailbox, weight_sender=weight_sender,
                                     weight_sync_timeout_s=weight_sync_timeout_s)
        self.meter = RolloutMeter(placement=placement, quarantine=self.quarantine)
        self.step = StepIntake(buffer=buffer, continuous_rollout=mode.continuous_rollout, group_size=group_size,
                             groups_per_step=groups_per_step)
        self.groups = GroupBook(buffer=buffer, placement=placement, health=health, mode=mode, meter=self.meter,
                                evals=self.evals, counters=self.counters, tasks=tasks, rng=self._rng,
                                group_size=group_size, groups_per_step=groups_per_step,
                                max_task_retries=max_task_retries, max_failed_groups=max_failed_groups,
                                version=start_version, task_order=task_order)
        self.handover = Handover(quarantine=self.quarantine, groups=self.groups, buffer=buffer, placement=placement,
                                 health=health, counters=self.counters, min_rollout_ranks=min_rollout_ranks,
                                 hand_over_tasks=hand_over_tasks)

    @property
    def version(self) -> int:
        """The policy version groups are admitted under (the weights last sent, `set_version`)."""
        return self.groups.version

    @property
    def rollout_ranks(self) -> list[int]:
        """The ranks that are rollout ranks now (in service, quarantined, or joining)."""
        return self.quarantine.rollout_side

    # ------------------------------------------------------------------ main-thread API
    def call(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `fn` on the service thread and return its result (or raise its error)."""
        return self.wait(self.submit(fn), timeout_s, getattr(fn, "__name__", "a request"))

    def submit(self, fn: Callable[[], Any], when: Optional[Callable[[], bool]] = None) -> concurrent.futures.Future:
        """Queue `fn` to run on the service thread (once `when()` holds, if given); a Future."""
        self.check()
        return self._calls.submit(fn, when)

    def wait(self, fut: concurrent.futures.Future, timeout_s: float, what: str) -> Any:
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
        self._calls.arrived.set()  # out of its idle wait now

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        try:
            wait_s = self.poll_s
            while not self._stopping.is_set():
                self.loops += 1
                self._calls.arrived.clear()  # a request queued from here on ends the next wait
                received = self.mailbox.received
                read_at = self._pump()
                self.meter.sample(read_at)
                if self._rollout_started():
                    self.groups.start_due(self.step.consumed_groups)
                self._place()
                self.step.feed(self.version)
                busy = self._calls.serve() or self.mailbox.received > received
                now = time.monotonic()
                # silent as of the last read of the mailbox: a slow request above must not make
                # the heartbeats it kept us from reading look missing
                for rank, why in self.health.silent(read_at):
                    self.handover.quarantine_rank(rank, why, now)
                for rank, why in self.quarantine.overdue(now):  # weights not confirmed in time
                    self.handover.quarantine_rank(rank, why, now)
                problem = self.health.check(now, outstanding=self.groups.outstanding())
                if problem:
                    raise RunError(f"{problem}; {self.placement.describe()}")
                self.cpu_s = time.thread_time()
                wait_s = self.poll_s if busy else min(max(IDLE_POLL_MAX_S, self.poll_s), 2 * wait_s)
                self._calls.arrived.wait(wait_s)
        except BaseException as exc:
            logger.error("rollout service failed: %s", exc)
            self.error = exc
            why = f"rollout side failed: {exc}"
            self._calls.fail_all(lambda: RunError(why))  # each waiter its own error
            self.step.fail(RunError(why))

    def set_event_sink(self, notify: Callable[[str, str], None]) -> None:
        """`notify(kind, text)` hears of faults as they happen (`MetricsLogger.event`): engine
        restarts, quarantines, rejoins. Called from this service's thread."""
        self._notify = self.handover.notify = self.quarantine.notify = notify

    def _rollout_started(self) -> bool:
        """Every start-up rank's engine is up: the staleness clock starts with rollout."""
        if not self._all_started:
            self._all_started = all(r in self.engines for r in self._startup_ranks)
        return self._all_started

    def _place(self) -> None:
        """One placement pass; with CTB, groups past their staleness deadline come back cancelled."""
        now = time.monotonic()
        cancelled = self.placement.dispatch(now, self.buffer.unconsumed_trajectories(),
                                            clock=self.step.clock(now, self.version))
        self.groups.give_up_if_live(cancelled, "past its staleness deadline", now)

    # ------------------------------------------------------------------ messages
    def _pump(self) -> float:
        """Book every message that arrived; returns when the mailbox was read."""
        now = time.monotonic()
        for msg in self.mailbox.poll():
            if isinstance(msg, TurnEvent) and msg.report:  # out of service too: its last counters
                self.meter.decode_report(msg.src, msg.report)
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
                before = self.engines[msg.src].restarts if msg.src in self.engines else 0
                if msg.engine.restarts > before:  # its engine died and started again
                    self._notify("engine_restart", f"rollout rank {msg.src} restarted its engine "
                                 f"(restart {msg.engine.restarts})")
                self.engines[msg.src] = msg.engine
                self.placement.engine_ready(msg.src, msg.engine.kv_tokens, msg.engine.request_rows)
                self.health.add_rank(msg.src, now)
                self.health.progressed(now)
                if self.quarantine.lost_weights(msg.src, msg.engine.weight_version):
                    self.handover.quarantine_rank(
                        msg.src, f"its engine restarted with the weights of version {msg.engine.weight_version}, "
                        f"not those it had confirmed; it rejoins at the next weight sync", now)
            else:  # the trainer's and reference rank's replies: the main thread's
                self.trainer_inbox.put(msg)
        return now

    def _on_task_end(self, msg, now: float) -> None:
        """A task ended on a rank: it finished, failed, was cancelled, or was handed over. The
        tokens of ranks that handed it over before are booked with this end (a trajectory
        holds them already); only the rank that was handed the task reports any, which keeps a
        late report of an older attempt elsewhere from booking them."""
        tid = _task_id(msg)
        carried = self.groups.take_carried(tid) if msg.carried_tokens else 0
        key = ledger_keys.task_end(msg)  # this end's one name in the ledger, whichever part books it
        if self.handover.answers(tid, msg.src):  # the rank leaving rollout answers for it
            if self.handover.on_answer(msg, carried, now, key):
                return
        elif self.quarantine.handles(msg, now, key):  # a task the rank no longer owns
            if carried:  # (the end's own tokens are booked as late)
                self.buffer.ledger.book_attempt(carried, fate="cancelled", key=ledger_keys.carried_part(key))
            return
        if isinstance(msg, TaskCarried):
            raise RunError(f"rank {msg.src} handed over task {tid}, which it was not asked to")
        self.groups.on_task_end(msg, carried, now, key)

    def _reconcile(self) -> None:
        """Book tokens the ranks generated that never reached the buffer as lost."""
        unbooked = self.health.lost_tokens()  # this attempt's ranks only
        booked_here = self.buffer.ledger.lost - self.lost_before
        if unbooked > booked_here:
            logger.error("%d generated tokens were never booked (a task or message vanished)", unbooked - booked_here)
            self.buffer.ledger.lose(unbooked - booked_here, key=ledger_keys.lost())

    # ------------------------------------------------------------------ groups and weights
    def request_groups(self, n: int) -> None:
        """Sync mode: start `n` training groups now (replacements follow failures)."""
        self.groups.request(n)

    def submit_eval(self, version: int, tasks: list[dict[str, Any]], groups: int) -> None:
        """Eval groups for the model `version`, ahead of every queued training task."""
        self.groups.submit_eval(version, tasks, groups)

    def set_version(self, version: int) -> None:
        """New weights are out: later groups are admitted under `version`; groups that can no
        longer be consumed within the bound are cancelled at once (their tokens are wasted)."""
        self.step.consumed_groups = 0
        self.groups.set_version(version)

    def send_weights(self, weights, receivers: Optional[list[int]] = None) -> list[int]:
        """Send weights (a `weight_sync.WeightSet`) to the ranks in service and those ready to
        rejoin (or to `receivers`, some of them); returns them. Nothing waits here: each must
        confirm within `weight_sync_timeout_s` or is quarantined."""
        return self.quarantine.send_weights(weights, time.monotonic(), receivers)

    def weight_receivers(self) -> tuple[list[int], list[int]]:
        """(every receiver of the next sync, those of them that may take the broadcast path:
        `Quarantine.steady`)."""
        receivers = self.quarantine.weight_receivers(time.monotonic())
        return receivers, self.quarantine.steady(receivers)

    def sent_broadcast(self, loads: dict, version: int) -> None:
        """The broadcast path's `LoadWeights` (rank -> message) go out, each to be confirmed."""
        self.quarantine.broadcast_sent(loads, version, time.monotonic())

    def weights_settled(self, version: int) -> bool:
        """Every receiver of `version` loaded it or was quarantined (sync mode waits for this)."""
        return self.quarantine.settled(version)

    # ------------------------------------------------------------------ ERS
    def move_to_trainer(self, rank: int, reason: str, retain: bool = True) -> int:
        """ERS moves rollout rank `rank` to the trainer (`Handover.move_to_trainer`);
        `in_trainer(rank)` once it answered for every task. Returns the tasks moved."""
        return self.handover.move_to_trainer(rank, reason, retain)

    def in_trainer(self, rank: int) -> bool:
        return self.quarantine.in_trainer(rank)

    def returning(self, rank: int) -> bool:
        """ERS moved trainer rank `rank` to rollout, and it has not loaded the weights yet."""
        return self.quarantine.returning(rank)

    def return_to_rollout(self, rank: int) -> None:
        """ERS moves trainer rank `rank` to rollout: it receives the next weights (its engine
        may still be starting) and takes tasks once it has loaded them."""
        self.handover.return_to_rollout(rank)

    def ers_window(self, now: Optional[float] = None) -> dict[str, float]:
        """What ERS reads of rollout since the last call, then reset (`RolloutMeter.take_window`)."""
        return self.meter.take_window(now)

    # ------------------------------------------------------------------ the trainer's step
    def open_step(self, max_groups: int) -> tuple[float, float, list[CompletedGroup], int]:
        """A streaming step starts: RAS, the head-of-line age, the groups ready now, and the
        groups it trains in all (`StepIntake.open`)."""
        return self.step.open(max_groups, self.version)

    def stream_into(self, sink, groups_left: int, on_group: Callable[[CompletedGroup], None]) -> None:
        """Completed groups of the open step go to `on_group` as they complete (this thread)."""
        self.step.stream_into(sink, groups_left, on_group, self.version)

    def batch_ready(self) -> bool:
        return self.step.batch_ready(self.version)

    def step_can_open(self) -> bool:
        """A streaming step starts once it has a group to train, or one it must wait for."""
        return self.step.can_open(self.version)

    def fetch_batch(self):
        """A whole-batch step starts: (the global batch, RAS, head-of-line age), or None when
        stale groups were dropped and what is left falls short (the caller waits again)."""
        return self.step.fetch_batch(self.version)

    def close_step(self):
        """The step's update is done. Admission stays as the step left it until `set_version`:
        a group started now would be stamped with the old version though the new weights
        reach the ranks before its tasks do.

        The token ledger is checked here, per account (`GlobalBuffer.end_step`): a broken
        ledger means tokens were lost or counted twice, so the run stops with what is wrong."""
        try:
            return self.step.close()
        except LedgerError as exc:
            raise RunError(f"the token ledger is broken at the end of the step: {exc}") from exc

    # ------------------------------------------------------------------ views
    def quarantine_counts(self) -> dict[str, int]:
        return {**self.quarantine.counts, "out_of_service": len(self.quarantine.out)}

    def ledger_snapshot(self) -> dict[str, int]:
        """The ledger's buckets, and the tokens of tasks still running on the ranks (not booked
        until their task ends), as of the ranks' last heartbeats."""
        led = self.buffer.ledger
        return {**{b: getattr(led, b) for b in led.BUCKETS}, "generated": led.generated, "wasted": led.wasted,
                "running_on_ranks": self.health.running_tokens()}
