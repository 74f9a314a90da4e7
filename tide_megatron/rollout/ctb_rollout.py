"""Runs a set of trajectories under a `CTBDispatcher` over engines in this process.

The single-process form of CTB rollout (benchmarks, tests, a one-node setup): the dispatcher
loop and every task runner share one asyncio loop, so dispatcher calls need no locking. In the
multi-rank system the same dispatcher sits in the controller and the runners on rollout ranks,
with `schedule()` decisions and turn events carried by the mailbox instead of direct calls.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from tide_megatron.rollout.ctb_dispatcher import CTBDispatcher
from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner
from tide_megatron.rollout.task_runner import TaskAssignment, Trajectory


class LocalCTBRollout:
    def __init__(self, dispatcher: CTBDispatcher, runner: CTBTaskRunner):
        self.dispatcher = dispatcher
        self.runner = runner

    async def run(self, assignments: list[TaskAssignment], *,
                  unconsumed_trajectories: Callable[[], int] = lambda: 0,
                  on_trajectory: Optional[Callable[[Trajectory], None]] = None,
                  prompt_tokens: Optional[int] = None) -> list[Trajectory]:
        """Run every assignment to completion; trajectories come back in finishing order."""
        d = self.dispatcher
        if d.cfg.enabled and d.policy.task_max_turns is None:  # protect tasks on their last turn
            d.policy.task_max_turns = self.runner.cfg.max_turns
        d.submit(assignments, prompt_tokens=prompt_tokens)
        running: dict[asyncio.Task, str] = {}
        done: list[Trajectory] = []
        remaining = len(assignments)
        while remaining:
            d.wakeup.clear()
            for admit in d.schedule(time.monotonic(), unconsumed_trajectories()):
                tid = str(admit.task.task_id)
                coro = self.runner.run(d.assignments[tid], d.handles[tid], d)
                running[asyncio.get_running_loop().create_task(coro)] = tid
            waiter = asyncio.get_running_loop().create_task(d.wakeup.wait())
            finished, _ = await asyncio.wait([waiter, *running], timeout=d.cfg.schedule_interval_s * 50,
                                             return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for task in finished:
                if task is waiter:
                    continue
                tid = running.pop(task)
                trajectory = task.result()  # a failed task fails the run, loudly
                d.task_finished(tid, len(trajectory.token_ids))
                done.append(trajectory)
                remaining -= 1
                if on_trajectory is not None:
                    on_trajectory(trajectory)
        return done
