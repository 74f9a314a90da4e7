"""CTB rollout in one process: the in-process carrier and the loop that drives it.

`LocalCarrier` is the `ctb_carrier.Carrier` whose ranks are engines in this process: each task
is an asyncio task running `CTBTaskRunner.run` on one event loop, and decisions act directly on
its `TaskHandle`. `LocalCTBRollout` runs a set of trajectories to completion under a
`CTBDispatcher` with that carrier (benchmarks, tests, a one-node setup). In the multi-rank
system the same dispatcher sits in the controller with the mailbox carrier instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from typing import Any, Callable, Optional

from sglang_patches.task_tag import TaskTag
from tide_megatron.comm.messages import TaskAssignment
from tide_megatron.core.trajectory import Trajectory
from tide_megatron.rollout.ctb_carrier import TagFields
from tide_megatron.rollout.ctb_config import CTBDispatchConfig
from tide_megatron.rollout.ctb_dispatcher import CTBDispatcher, RankResources
from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner, TaskHandle


class LocalCarrier:
    """Carries CTB decisions to tasks on this event loop (see `ctb_carrier` for the contract)."""

    can_move_tasks = True
    """Every engine is in this process, so a paused task may resume on any of them."""

    def __init__(self, runner: CTBTaskRunner):
        self.runner = runner
        self.engines = runner.engines
        self.dispatcher: Optional[CTBDispatcher] = None
        self.handles: dict[str, TaskHandle] = {}
        self.outcomes: deque[tuple[str, Any]] = deque()
        """(task id, its Trajectory, the exception it raised, or None if cancelled), in order."""
        self.wakeup = asyncio.Event()
        """Set on every event that may change a decision (turn end, finish, release)."""
        self._tasks: dict[str, asyncio.Task] = {}
        self._tags: dict[str, Optional[TagFields]] = {}
        self._rank: dict[str, int] = {}
        self._target: dict[str, Optional[int]] = {}
        """Where the task may run once its pending release is done (None: nowhere, paused)."""
        self._releases: dict[str, asyncio.Task] = {}
        self._cancelled: dict[str, int] = {}

    def bind(self, dispatcher: CTBDispatcher) -> None:
        self.dispatcher = dispatcher

    # -- decisions ------------------------------------------------------------------------
    def admit(self, rank: int, assignment: TaskAssignment, tag: Optional[TagFields]) -> None:
        tid = assignment.trajectory_id
        handle = self.handles[tid] = TaskHandle(tid)
        self._tags[tid], self._rank[tid] = tag, rank
        for stale in (self._cancelled, self._releases, self._target):  # of an earlier, failed attempt
            stale.pop(tid, None)
        handle.place(rank)
        task = asyncio.get_running_loop().create_task(self.runner.run(assignment, handle, _LocalTurns(self, assignment)))
        self._tasks[tid] = task
        task.add_done_callback(lambda t: self._task_done(tid, t))

    def pause(self, rank: int, task_id: str) -> None:
        # Stops the task before its next turn; the session closes once no turn is in flight.
        self._target[task_id] = None
        release = self.handles[task_id].pause(self.engines)
        self._releases[task_id] = release
        release.add_done_callback(lambda _: self._released(rank, task_id, release))

    def resume(self, rank: int, task_id: str, tag: TagFields) -> None:
        self._tags[task_id], self._rank[task_id], self._target[task_id] = tag, rank, rank
        if task_id not in self._releases:  # otherwise it is placed when its release is done
            self.handles[task_id].place(rank)

    def cancel(self, rank: int, task_id: str) -> None:
        handle, task = self.handles[task_id], self._tasks[task_id]
        self._target[task_id] = None
        self._cancelled[task_id] = rank
        handle.rank = None
        handle.runnable.clear()
        # Close the session after any in-flight turn (SGLang does not abort a request whose
        # caller is cancelled), then stop the runner; its done callback reports the release.
        release = asyncio.get_running_loop().create_task(handle.release_session(self.engines))
        release.add_done_callback(lambda _: task.cancel())

    def release(self, rank: int, carry: dict) -> None:
        raise RuntimeError("a local carrier moves tasks, it never hands one over")

    def cancel_all(self) -> None:
        """Stop every task now (the rollout failed)."""
        for task in self._tasks.values():
            task.cancel()

    # -- events ---------------------------------------------------------------------------
    def _released(self, rank: int, task_id: str, release: asyncio.Task) -> None:
        self.dispatcher.task_released(rank, task_id)
        if self._releases.get(task_id) is release:
            del self._releases[task_id]
            target = self._target.get(task_id)
            if target is not None:
                self.handles[task_id].place(target)
        self.wakeup.set()

    def _task_done(self, task_id: str, task: asyncio.Task) -> None:
        d, rank = self.dispatcher, self._rank[task_id]
        if task_id in self._cancelled:
            d.task_released(self._cancelled.pop(task_id), task_id)
            self.outcomes.append((task_id, None))
        elif task.cancelled():
            return  # cancel_all: the rollout is being torn down
        elif task.exception() is not None:
            error = task.exception()
            if d.task_failed(rank, task_id, f"{type(error).__name__}: {error}"):
                self.outcomes.append((task_id, error))
        else:
            trajectory = task.result()
            if d.task_finished(rank, task_id, len(trajectory.token_ids)):
                self.outcomes.append((task_id, trajectory))
        self.wakeup.set()


class _LocalTurns:
    """A task's turn events, to the dispatcher; its requests' tags, from the latest tag fields."""

    def __init__(self, carrier: LocalCarrier, assignment: TaskAssignment):
        self.carrier = carrier
        self.assignment = assignment

    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> Optional[TaskTag]:
        c = self.carrier
        c.dispatcher.turn_started(c.handles[task_id].rank, task_id, context_tokens)
        fields = c._tags[task_id]
        return fields.task_tag(kind, self.assignment, context_tokens) if fields is not None else None

    def turn_finished(self, task_id: str, context_tokens: int, report: Optional[dict[str, Any]]) -> None:
        c = self.carrier
        c.dispatcher.turn_finished(c.handles[task_id].last_rank, task_id, context_tokens, report)
        c.wakeup.set()


class LocalCTBRollout:
    """Runs trajectories to completion under CTB over the runner's engines, in this process."""

    def __init__(self, cfg: CTBDispatchConfig, runner: CTBTaskRunner):
        if cfg.policy.task_max_turns is None:  # tasks on their last turn are protected from pauses
            cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, task_max_turns=runner.cfg.max_turns))
        self.carrier = LocalCarrier(runner)
        ranks = {r: RankResources(e.cfg.max_total_tokens, e.cfg.max_running_requests) for r, e in runner.engines.items()}
        self.dispatcher = CTBDispatcher(cfg, self.carrier, ranks)
        self.carrier.bind(self.dispatcher)

    async def run(self, assignments: list[TaskAssignment], *,
                  unconsumed_trajectories: Callable[[], int] = lambda: 0,
                  on_trajectory: Optional[Callable[[Trajectory], None]] = None,
                  prompt_tokens: Optional[int] = None, max_task_retries: int = 0,
                  stall_timeout_s: float = 600.0) -> list[Trajectory]:
        """Run every assignment to completion (or cancellation of its group); trajectories come
        back in finishing order.

        A failed task is run again from scratch up to `max_task_retries` times; past that its
        error stops the rollout. `stall_timeout_s`: the rollout stops with an error when no
        task event (turn end, finish, release) happens for this long."""
        d, c = self.dispatcher, self.carrier
        d.submit(assignments, prompt_tokens=prompt_tokens)
        remaining = {a.trajectory_id for a in assignments}
        failures: dict[str, int] = {}
        done: list[Trajectory] = []
        last_event = time.monotonic()
        try:
            while remaining:
                c.wakeup.clear()
                while c.outcomes:
                    task_id, outcome = c.outcomes.popleft()
                    last_event = time.monotonic()
                    if isinstance(outcome, BaseException):
                        failures[task_id] = failures.get(task_id, 0) + 1
                        if failures[task_id] > max_task_retries:
                            raise outcome
                        d.requeue_failed(task_id)
                        continue
                    remaining.discard(task_id)
                    if outcome is None:
                        continue  # its group was cancelled
                    done.append(outcome)
                    if on_trajectory is not None:
                        on_trajectory(outcome)
                if not remaining:
                    break
                d.schedule(time.monotonic(), unconsumed_trajectories())
                try:
                    await asyncio.wait_for(c.wakeup.wait(), timeout=d.cfg.schedule_interval_s * 50)
                    last_event = time.monotonic()
                except TimeoutError:
                    if time.monotonic() - last_event > stall_timeout_s:
                        raise RuntimeError(f"CTB rollout stalled: no task event for {stall_timeout_s:.0f} s with "
                                           f"{len(remaining)} trajectories unfinished ({d.policy.counts()})")
        except BaseException:
            c.cancel_all()
            raise
        return done
