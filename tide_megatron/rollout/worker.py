"""A rollout rank: one SGLang engine, many concurrent multi-turn tasks.

The worker runs on the engine's event loop. It takes typed control messages from its mailbox
(`comm.messages`), runs each task as an asyncio task, and posts every finished trajectory to
the controller as soon as it is done. Every task has a `TaskHandle` from the moment its
`RunTask` arrives, so a `PauseTask`, `ResumeTask` or `CancelTask` that follows it in the same
poll always finds it. A task sent with CTB tag fields runs tagged: its requests carry the task
tag to the `tide_ctb` SGLang plugin and each turn is reported (`TurnEvent`); `PauseTask`
stops it before its next turn and releases its SGLang session.

Heartbeats carry the rank's own count of generated tokens, the tokens of tasks still running,
and what the longest-waiting tasks wait for: the controller reconciles its ledger against the
first (a vanished task shows up as lost tokens) and names the second when a run stalls.

On `LoadWeights` the rank loads the weights into its engine from shared-memory buckets on its
node (the sender's, or a relay's), or, as its node's relay, receives them from the sender first
(point to point, in a thread, so running tasks keep going) and passes the buckets on (see
`weight_sync.py`); the engine drains turns, drops stale sessions and flushes the cache first
(see `engine.py`).
Heartbeats go on meanwhile: a long transfer or load is not silence.

On `CancelAll` (rank 0 quarantined this rank after it fell silent, and took its tasks back)
every task stops as on `CancelTask`; once none is left the rank answers `AllCancelled`, and
rank 0 sends it weights again at its next sync. On `Stop` it answers `Stopped` after its last
heartbeat, so rank 0 knows it ended (see `controller/loop.py`).

ERS may move the rank to the trainer: rank 0 takes its tasks back with `CancelAll(carry=True)`
and, once it answered `AllCancelled`, posts it the trainer's `SetRoles`. Each task that has
begun its episode is handed over rather than dropped: it stops at its next await (a turn in
flight ends first), detaches its env session and answers `TaskCarried` with its episode so far
(`rollout/task_carry.py`); rank 0 resumes it on another rank (`RunTask.carry`), which attaches
the session and re-prefills the context under the new weights (or, if its group ended
meanwhile, any rollout rank closes the session: `ReleaseCarry`). `run` then returns that
message and whatever the same read brought after it (the trainer's first commands), for
`TrainerWorker.serve`; the engine releases its memory where SGLang can
(`RolloutEngine.release_memory`). Moved back, the same worker `run`s again: the
engine resumes its memory and reports ready, and loads the weights rank 0 sent for its return.

If the engine dies (its scheduler subprocess crashed or was killed), the rank survives: its
running tasks are reported failed (rank 0 retries them), a new engine starts, the last weights
it received are loaded into it, and the rank reports ready again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sglang_patches.task_tag import TaskTag
from tide_megatron.rollout.ctb_carrier import TagFields
from tide_megatron.comm import bucket_broadcast, weight_sync
from tide_megatron.comm.mailbox import CONTROLLER, Mailbox
from tide_megatron.comm.messages import (
    STOP_GRACE_S,
    AllCancelled,
    CancelAll,
    CancelTask,
    EngineFacts,
    Heartbeat,
    JoinUpdateGroup,
    LoadWeights,
    PauseTask,
    RankReady,
    ReleaseCarry,
    ResumeTask,
    RunTask,
    SetRoles,
    Stop,
    Stopped,
    TaskAssignment,
    TaskCancelled,
    TaskCarried,
    TaskFailed,
    TaskReleased,
    TrajectoryDone,
    TurnEvent,
    WeightsLoaded,
)
from tide_megatron.envs.errors import EnvError
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner, TaskHandle
from tide_megatron.rollout.engine import RolloutEngine
from tide_megatron.rollout.task_carry import CarriedTask, release_claim
from tide_megatron.rollout.task_runner import TaskRunnerConfig
from tide_megatron.utils import fault_injection

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.02
WEIGHT_RECV_TIMEOUT_S = 1800.0  # the job group's own timeout: only a dead sender lets it pass
FAULT_KILL_ENGINE_ENV = fault_injection.KILL_ENGINE_ENV
"""Test-only fault injector: `<moment>:<n>[:<which>]`, the rank kills its own SGLang scheduler at
that moment (as a crash would), so tests can show the rank and the run survive it (see
`utils/fault_injection.py`)."""


@dataclass
class _Task:
    """A task on this rank while it runs."""

    assignment: TaskAssignment
    handle: TaskHandle
    tag: Optional[dict[str, Any]]
    """Latest CTB tag fields from rank 0 (None: untagged, request-level scheduling)."""
    generated: int = 0
    """Tokens this task has generated so far (on every rank it ran on)."""
    carried_in: int = 0
    """Of `generated`: tokens generated on the ranks that handed the task over."""
    carry: Optional[CarriedTask] = None
    """The state it goes on from (`RunTask.carry`), if another rank handed it over."""
    turn_context: int = 0
    """Context tokens when the current turn started."""
    state: str = "queued"
    """What it does now: queued, generating, env, paused."""
    since: float = field(default_factory=time.monotonic)
    cancel_reason: Optional[str] = None
    job: Optional[asyncio.Task] = None
    releasing: Optional[asyncio.Task] = None
    """A pause's session release under way (a resume waits for it)."""

    @property
    def own(self) -> int:
        """Tokens it generated on this rank."""
        return self.generated - self.carried_in

    @property
    def tokens(self) -> tuple[int, int]:
        """(own, carried) tokens, as the task-ending messages report them."""
        return self.own, self.carried_in


class ServiceClock:
    """A rank's rollout time: busy (a task running) and idle (in rollout service, no task
    running), cumulative, as its heartbeats report them (rank 0 takes the RWT of each step from
    their differences). Time the rank spends out of rollout (training, or parked on standby
    before it first rolls out) is neither: counted as idle, a rank that came back from the
    trainer reported its whole time there as the RWT of one step."""

    def __init__(self, now: float):
        self._started = now
        self._busy_s = self._away_s = 0.0
        self._busy_since: Optional[float] = None
        self._away_since: Optional[float] = None

    def task_started(self, now: float) -> None:
        if self._busy_since is None:
            self._busy_since = now

    def no_task(self, now: float) -> None:
        if self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None

    def left(self, now: float) -> None:
        """The rank leaves rollout (it holds no task then)."""
        self.no_task(now)
        self._away_since = now

    def back(self, now: float) -> None:
        if self._away_since is not None:
            self._away_s += now - self._away_since
            self._away_since = None

    def busy_idle(self, now: float) -> tuple[float, float]:
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        away = self._away_s + (now - self._away_since if self._away_since is not None else 0.0)
        return busy, now - self._started - away - busy


class RolloutWorker:
    def __init__(self, rank: int, engine: RolloutEngine, runner_cfg: TaskRunnerConfig, chat: ChatFormat, env,
                 mailbox: Mailbox, job_group, heartbeat_interval_s: float = 2.0,
                 engine_factory: Optional[Callable[[], RolloutEngine]] = None):
        self.rank = rank
        self._engine_factory = engine_factory
        self._last_weights: Optional[tuple[int, list]] = None
        """(version, its buckets of tensors in shared memory, mapped here)."""
        self.engine_restarts = 0
        self._weights_owed = False
        """The engine died while loading the last weights: report them once a new engine has them."""
        self._group_timeout_s = 60.0  # set by each `JoinUpdateGroup`
        self.job_group = job_group
        self.engine = engine
        self.mailbox = mailbox
        self.heartbeat_interval_s = heartbeat_interval_s
        self._engines = {rank: engine}
        self._runner = CTBTaskRunner(runner_cfg, self._engines, chat, env, use_sessions=engine.cfg.use_sessions)
        self._tasks: dict[str, _Task] = {}
        self._stopping = False
        self._clock = ServiceClock(time.monotonic())
        self._generated = 0  # tokens generated here, every task (the ledger's independent count)
        self._env_steps = 0
        self._cancel_all_epoch: Optional[int] = None
        """A `CancelAll` whose tasks are still ending (answered once none is left)."""
        self._handoff: Optional[list] = None
        """The trainer's `SetRoles` message and what followed it: this rank leaves rollout."""
        self._away = False  # the engine's memory is released while the rank trains
        self._releases: set[asyncio.Task] = set()
        """Env sessions of dropped hand-overs being closed (`ReleaseCarry`)."""
        self._fault = fault_injection.EngineFault(rank)  # test-only; inert unless its variable is set
        self._moves_out = 0
        self._unread: list = []
        """Messages read with the one during which the engine died, not handled yet: the
        replacement engine's loop handles them first (a `RunTask` dropped here would stay
        resident in rank 0's CTB placement forever, and the run would stall)."""

    def run(self) -> Optional[list]:
        """Roll out until `Stop` (returns None) or until rank 0 moves this rank to the trainer
        (returns the `SetRoles` message and the messages read after it, in order)."""
        if self._away:
            self.engine.resume_memory()
            self._away = False
        self._clock.back(time.monotonic())
        self._handoff = None
        if not self.engine.check_alive():  # died while this rank was away (`check_alive`)
            self._restart_engine()
        while self.engine.loop.run_until_complete(self._main()) == "engine died":
            self._restart_engine()
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            self._clock.left(time.monotonic())
            self._away = self.engine.release_memory()
        return handoff

    def park(self) -> None:
        """A standby engine on a trainer rank (`ers.standby_engines`): its memory is released
        until the rank first rolls out."""
        self._clock.left(time.monotonic())
        self._away = self.engine.release_memory()

    def shutdown(self) -> None:
        self.engine.shutdown()

    async def _main(self) -> str:
        cfg = self.engine.cfg
        forked = getattr(self.engine, "children_forked", None)  # None: an emulated engine, no SGLang children
        logger.info("rollout rank %d: pid %d, engine ready (restarts: %d)%s", self.rank, os.getpid(), self.engine_restarts,
                    "" if forked is None else f", SGLang's children {'forked' if forked else 'spawned'}")
        facts = EngineFacts(kv_tokens=self.engine.kv_tokens, request_rows=self.engine.request_rows,
                            max_total_tokens=cfg.max_total_tokens, max_running_requests=cfg.max_running_requests,
                            use_sessions=cfg.use_sessions, restarts=self.engine_restarts,
                            weight_version=self.engine.weight_version)
        self.mailbox.post(CONTROLLER, RankReady(facts, pid=os.getpid()))
        next_beat = 0.0
        while not self._stopping and not self.engine.died and self._handoff is None:
            msgs, self._unread = self._unread + self.mailbox.poll(), []
            for i, msg in enumerate(msgs):
                if isinstance(msg, SetRoles):
                    if self._tasks:  # rank 0 posts it only after this rank's AllCancelled
                        raise RuntimeError(f"rollout rank {self.rank}: moved to the trainer with "
                                           f"{len(self._tasks)} task(s) still running")
                    self._handoff = msgs[i:]
                    break
                await self._handle(msg)
                if self.engine.died:
                    self._unread = msgs[i + 1:]
                    break
            if self._cancel_all_epoch is not None and not self._tasks:
                # after each task's TaskCancelled (posted before it leaves `_tasks`)
                self.mailbox.post(CONTROLLER, AllCancelled(self._cancel_all_epoch))
                self._cancel_all_epoch = None
            self._fault.poll(time.monotonic())
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + self.heartbeat_interval_s
            await asyncio.sleep(POLL_INTERVAL_S)
        # Whatever still runs ends now: on a dead engine rank 0 retries it; at Stop the run is
        # over, and a paused task would otherwise wait forever for a resume that never comes.
        reason = "the rollout engine died" if self.engine.died else "the run ended"
        for task in self._tasks.values():
            task.cancel_reason = task.cancel_reason or reason
            if task.job is not None:
                task.job.cancel()
        jobs = [t.job for t in self._tasks.values() if t.job is not None] + list(self._releases)
        if jobs:
            _, pending = await asyncio.wait(jobs, timeout=STOP_GRACE_S)
            if pending:
                logger.warning("rollout rank %d: %d task(s) or session release(s) still closing %.0f s after the "
                               "stop; left behind", self.rank, len(pending), STOP_GRACE_S)
        self._heartbeat()
        if self._stopping:
            self.mailbox.post(CONTROLLER, Stopped())
        if self._handoff is not None:
            logger.info("rollout rank %d: leaves rollout for the trainer", self.rank)
            return "to the trainer"
        return "engine died" if self.engine.died and not self._stopping else "stopped"

    def _restart_engine(self) -> None:
        """Replace a dead engine; it gets the last weights this rank received."""
        if self._engine_factory is None:
            raise RuntimeError(f"rollout rank {self.rank}: the engine died and no factory can replace it")
        logger.warning("rollout rank %d: restarting its engine", self.rank)
        # A new engine takes as long to start as the first (over a minute on a loaded CPU); the
        # event loop is not running meanwhile, so a thread keeps rank 0's heartbeat clock fed.
        restarted = threading.Event()
        beats = threading.Thread(target=self._beat_until, args=(restarted,), daemon=True, name="restart-heartbeat")
        beats.start()
        try:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting down the dead engine")
            self.engine = self._engine_factory()
            self._engines[self.rank] = self.engine
            self.engine_restarts += 1
            if self._last_weights is not None:
                version, mapped = self._last_weights
                t0 = time.perf_counter()
                self.engine.loop.run_until_complete(
                    self.engine.load_serialized(weight_sync.serialize_buckets(mapped), version))
                if self._weights_owed:  # rank 0 may be waiting for this version (sync mode)
                    self._weights_owed = False
                    self._report_loaded(version, 0.0, time.perf_counter() - t0)
        finally:
            restarted.set()
            beats.join()

    def _beat_until(self, done: threading.Event) -> None:
        while not done.wait(self.heartbeat_interval_s):
            self._heartbeat()

    async def _handle(self, msg) -> None:
        if isinstance(msg, RunTask):
            self._start(msg.assignment, msg.tag, msg.carry)
        elif isinstance(msg, PauseTask):
            self._pause(msg.task_id)
        elif isinstance(msg, ResumeTask):
            task = self._tasks.get(msg.task_id)
            if task is not None:
                task.tag = msg.tag
                if task.releasing is not None and not task.releasing.done():
                    task.releasing.add_done_callback(lambda _, h=task.handle: h.place(self.rank))
                else:
                    task.handle.place(self.rank)
        elif isinstance(msg, CancelTask):
            task = self._tasks.get(msg.task_id)
            if task is None:  # already finished or never here: nothing to stop
                self.mailbox.post(CONTROLLER, TaskCancelled(msg.task_id, 0))
            else:
                self._cancel(task, msg.reason or "cancelled")
        elif isinstance(msg, CancelAll):
            if msg.carry:
                logger.info("rollout rank %d: leaves rollout (%s); handing over its %d task(s)",
                            self.rank, msg.reason, len(self._tasks))
            else:
                logger.warning("rollout rank %d: quarantined by rank 0 (%s); dropping its %d task(s)",
                               self.rank, msg.reason, len(self._tasks))
            for task in list(self._tasks.values()):
                task.handle.carry = msg.carry
                self._cancel(task, "carried to another rank" if msg.carry else "quarantined")
            self._cancel_all_epoch = msg.epoch
            if msg.carry:
                self._moves_out += 1
                self._fault.at("during_handover", self._moves_out)
        elif isinstance(msg, ReleaseCarry):
            release = asyncio.get_running_loop().create_task(self._release(msg.claim))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)
        elif isinstance(msg, LoadWeights):
            await (self._load_broadcast(msg) if msg.group else self._load_weights(msg))
        elif isinstance(msg, JoinUpdateGroup):
            await self._join_update_group(msg)
        elif isinstance(msg, Stop):
            self._stopping = True
        else:
            raise ValueError(f"rollout rank {self.rank}: unexpected message {msg!r}")

    async def _release(self, claim: str) -> None:
        try:
            await release_claim(self._runner.env, claim)
        except EnvError as exc:  # the claim was used or expired, or the server is down
            logger.info("rollout rank %d: could not close a dropped hand-over's env session: %s", self.rank, exc)

    @staticmethod
    def _cancel(task: _Task, reason: str) -> None:
        task.cancel_reason = task.cancel_reason or reason
        if task.state != "generating":  # a turn in flight ends first (see _Listener)
            task.job.cancel()

    def _pause(self, task_id: str) -> None:
        """No further turn; the session closes once no turn is in flight; then `TaskReleased`."""
        task = self._tasks.get(task_id)
        if task is None:  # finished meanwhile: it holds nothing
            self.mailbox.post(CONTROLLER, TaskReleased(task_id))
            return
        task.releasing = task.handle.pause(self._engines)
        task.state, task.since = "paused", time.monotonic()
        task.releasing.add_done_callback(lambda _: self.mailbox.post(CONTROLLER, TaskReleased(task_id)))

    def _start(self, assignment: TaskAssignment, tag: Optional[dict[str, Any]],
               carry: Optional[dict[str, Any]] = None) -> None:
        tid = assignment.trajectory_id
        if tid in self._tasks:
            raise ValueError(f"rollout rank {self.rank}: task {tid} started twice")
        handle = TaskHandle(tid)
        handle.place(self.rank)
        state = CarriedTask.from_json(carry) if carry is not None else None
        carried_in = state.generated if state is not None else 0
        task = self._tasks[tid] = _Task(assignment, handle, tag, generated=carried_in, carried_in=carried_in,
                                        carry=state)
        task.job = asyncio.get_running_loop().create_task(self._run_task(task))
        task.job.add_done_callback(lambda _, t=task: self._if_never_ran(t))
        self._clock.task_started(time.monotonic())

    async def _run_task(self, task: _Task) -> None:
        tid = task.assignment.trajectory_id
        listener = _Listener(self, task)
        try:
            result = await self._runner.run(task.assignment, task.handle, listener, task.carry)
            self._env_steps += task.state == "env step"
            if isinstance(result, CarriedTask):
                self.mailbox.post(CONTROLLER, TaskCarried(tid, result.to_json(), *task.tokens))
            else:
                self.mailbox.post(CONTROLLER, TrajectoryDone(result, task.carried_in))
        except asyncio.CancelledError:
            if self.engine.died:
                self.mailbox.post(CONTROLLER, TaskFailed(task.assignment, task.cancel_reason or "engine died", "",
                                                         *task.tokens))
            else:
                await task.handle.release_session(self._engines, even_if_placed=True)
                self.mailbox.post(CONTROLLER, TaskCancelled(tid, *task.tokens))
        except Exception as exc:  # report, never lose the task silently
            logger.warning("task %s failed on rank %d: %s", tid, self.rank, exc)
            self.mailbox.post(CONTROLLER, TaskFailed(
                task.assignment, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=5), *task.tokens))
        finally:
            self._forget(tid)

    def _if_never_ran(self, task: _Task) -> None:
        """A job cancelled before its first step (its `RunTask` and a cancel in one poll, e.g.
        stale tasks ahead of `CancelAll`) never runs `_run_task`, nor its `finally`: answer for
        it here, as `_run_task` would have (it holds no session yet; a carried task's claim is
        still unused)."""
        tid = task.assignment.trajectory_id
        if self._tasks.get(tid) is not task:
            return  # it ran, and reported itself
        if self.engine.died:
            self.mailbox.post(CONTROLLER, TaskFailed(task.assignment, task.cancel_reason or "engine died", "",
                                                     *task.tokens))
        elif task.carry is not None and task.handle.carry:  # handed on untouched: its claim is unused
            self.mailbox.post(CONTROLLER, TaskCarried(tid, task.carry.to_json(), *task.tokens))
        else:
            self.mailbox.post(CONTROLLER, TaskCancelled(tid, *task.tokens))
        self._forget(tid)

    def _forget(self, tid: str) -> None:
        del self._tasks[tid]
        if not self._tasks:
            self._clock.no_task(time.monotonic())

    def _busy_idle(self) -> tuple[float, float]:
        return self._clock.busy_idle(time.monotonic())

    def _heartbeat(self) -> None:
        now = time.monotonic()
        longest = sorted(self._tasks.values(), key=lambda t: t.since)[:3]
        waiting = [f"{t.assignment.trajectory_id}: {t.state} for {now - t.since:.0f} s" for t in longest]
        busy, idle = self._busy_idle()
        self.mailbox.post(CONTROLLER, Heartbeat(
            generated_tokens=self._generated,
            running_tokens=sum(t.own for t in self._tasks.values()),
            running_tasks=len(self._tasks), env_steps=self._env_steps, waiting=waiting, busy_s=busy, idle_s=idle))

    async def _load_weights(self, msg: LoadWeights) -> None:
        """Load the weights `msg` names: from the sender's shared buckets on this node, or, as
        its node's relay, received point to point into shared memory, loaded, and passed on to
        the node's other receivers (`weight_sync.py`)."""
        manifest = weight_sync.WeightManifest.from_json(msg.manifest)
        self._fault.at("at_step_boundary", manifest.version)
        loop = asyncio.get_running_loop()
        beats = loop.create_task(self._beat_forever())  # the mailbox loop waits for this load
        comm_s = 0.0
        try:
            if msg.shared:
                mapped = weight_sync.map_buckets(msg.shared)
            else:
                flat, comm_s = await loop.run_in_executor(None, functools.partial(
                    weight_sync.receive_flat, self.job_group, manifest, msg.sender, WEIGHT_RECV_TIMEOUT_S, shared=True))
                mapped = weight_sync.buckets(weight_sync.unpack(manifest, flat), manifest.bucket_bytes)
                for peer in msg.relay_to:  # before loading here: the node's engines load in parallel
                    self.mailbox.post(peer, LoadWeights(manifest.to_json(), sender=self.rank,
                                                        shared=weight_sync.bucket_handles(manifest, flat)))
            t0 = time.perf_counter()
            # Held until the next version: a replacement engine loads them again, and holding
            # them keeps their shared memory alive after the sender lets go.
            self._last_weights = (manifest.version, mapped)
            self._fault.at("during_weight_sync", manifest.version)
            try:
                await self.engine.load_serialized(weight_sync.serialize_buckets(mapped), manifest.version)
            except RuntimeError:
                if not self.engine.died:
                    raise
                self._weights_owed = True  # the replacement loads them and reports then
                return
        finally:
            beats.cancel()
        self._fault.at("after_version", manifest.version)
        self._report_loaded(manifest.version, comm_s, time.perf_counter() - t0)

    async def _join_update_group(self, msg: JoinUpdateGroup) -> None:
        """Join rank 0's weight update group (`comm/update_group.py`). Failing here is not the
        rank's end: the broadcast that follows cannot reach it, it does not confirm those
        weights, and rank 0 quarantines it; it rejoins by the host path."""
        self._group_timeout_s = msg.timeout_s
        joined = await self._bounded(self.engine.join_update_group(
            msg.address, msg.port, msg.rank_offset, msg.world_size, msg.group_name, msg.backend, msg.leave),
            msg.timeout_s, f"joining weight update group {msg.group_name}")
        if joined:
            logger.info("rollout rank %d joined weight update group %s", self.rank, msg.group_name)

    async def _load_broadcast(self, msg: LoadWeights) -> None:
        """Take weights `msg.manifest` from rank 0's broadcast over update group `msg.group`,
        bucket by bucket, straight into the engine (no host copy is kept: a replacement engine
        cannot reload them, and rank 0 quarantines a rank whose engine restarts without them)."""
        manifest = weight_sync.WeightManifest.from_json(msg.manifest)
        self._fault.at("at_step_boundary", manifest.version)
        self._last_weights = None  # the engine's weights change now: an older copy is stale
        beats = asyncio.get_running_loop().create_task(self._beat_forever())
        t0 = time.perf_counter()
        try:
            self._fault.at("during_weight_sync", manifest.version)
            loaded = await self._bounded(self.engine.load_broadcast(
                bucket_broadcast.bucket_specs(manifest), manifest.dtype, msg.group, manifest.version),
                self._group_timeout_s, f"the broadcast of weights {manifest.version}")
        finally:
            beats.cancel()
        if loaded:
            self._fault.at("after_version", manifest.version)
            self._report_loaded(manifest.version, 0.0, time.perf_counter() - t0)

    async def _bounded(self, work, timeout_s: float, what: str) -> bool:
        """Await an engine call inside the weight update group: True once done; False when it
        failed (logged) or did not end within `timeout_s`: its scheduler is stuck in the
        collective then (a peer hung), and the engine is given up for a new one."""
        job = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({job}, timeout=timeout_s)
        if not done:
            self.engine.abandon(f"{what} did not end within {timeout_s:.0f} s "
                                f"(scheduler.weight_broadcast_timeout_s)")
        try:
            await job
            return True
        except Exception as exc:  # refused, or the engine died (then the rank replaces it)
            logger.warning("rollout rank %d: %s failed: %s", self.rank, what, exc)
            return False

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self._heartbeat()

    def _report_loaded(self, version: int, transfer_s: float, load_s: float) -> None:
        busy, idle = self._busy_idle()
        self.mailbox.post(CONTROLLER, WeightsLoaded(version, transfer_s=transfer_s, load_s=load_s,
                                                    busy_s=busy, idle_s=idle))


class _Listener:
    """A task's turn events: counted here for heartbeats; for a tagged task also sent to rank 0,
    and its requests carry the tag built from rank 0's latest fields."""

    def __init__(self, worker: RolloutWorker, task: _Task):
        self.worker = worker
        self.task = task

    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> Optional[TaskTag]:
        task = self.task
        if task.state == "env step":
            self.worker._env_steps += 1  # the env answered the previous turn's action
        task.turn_context, task.state, task.since = context_tokens, "generating", time.monotonic()
        if task.tag is None:
            return None
        self.worker.mailbox.post(CONTROLLER, TurnEvent(task_id, "started", context_tokens))
        return TagFields.from_json(task.tag).task_tag(kind, task.assignment, context_tokens)

    def turn_finished(self, task_id: str, context_tokens: int, report: Optional[dict[str, Any]]) -> None:
        task = self.task
        new = max(context_tokens - task.turn_context, 0)
        task.generated += new
        self.worker._generated += new
        task.state, task.since = "env step", time.monotonic()
        if task.tag is not None:
            self.worker.mailbox.post(CONTROLLER, TurnEvent(task_id, "finished", context_tokens, report))
        if task.cancel_reason is not None and not task.handle.carry:  # cancelled while this turn generated
            raise asyncio.CancelledError(task.cancel_reason)  # (a carried task stops after it, with it)


def build_chat(model_path: str, system_prompt: str | None) -> ChatFormat:
    from transformers import AutoTokenizer

    from tide_megatron.rollout.multimodal import ImagePrompts

    return ChatFormat(AutoTokenizer.from_pretrained(model_path), system_prompt,
                      images=ImagePrompts.for_checkpoint(model_path))
