"""One rollout task: its limits, and a runner for one engine.

The assignment (`comm.messages.TaskAssignment`), the finished record
(`core.trajectory.Trajectory`) and the limits (`rollout.config.TaskRunnerConfig`) are imported
here for the callers that run tasks.

A task is one trajectory of a GRPO group. The trajectory is kept in tokens: the prompt,
each generated action (loss mask 1, with the engine's log-probs), and each observation
(loss mask 0). With sessions enabled, only each turn's new tokens are sent to the
engine, and the session keeps the task's prefix resident while it waits for its
environment. The multi-turn loop itself lives in `ctb_task_runner.py`.
"""

from __future__ import annotations

from typing import Any

from tide_megatron.comm.messages import TaskAssignment
from tide_megatron.core.trajectory import Trajectory
from tide_megatron.envs.client import EnvClient
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.config import TaskRunnerConfig
from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner, TaskHandle
from tide_megatron.rollout.engine import RolloutEngine

__all__ = ["TaskAssignment", "TaskRunner", "TaskRunnerConfig", "Trajectory"]


class TaskRunner:
    """Runs trajectories on one engine against one env client.

    It is the pausable runner (`ctb_task_runner.CTBTaskRunner`) with a task that is placed once
    and never paused, and untagged requests: one multi-turn loop serves both request-level and
    task-level scheduling.
    """

    def __init__(self, cfg: TaskRunnerConfig, engine: RolloutEngine, chat: ChatFormat, env: EnvClient):
        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.env = env
        self._runner = CTBTaskRunner(cfg, {0: engine}, chat, env, use_sessions=engine.cfg.use_sessions)

    async def run(self, assignment: TaskAssignment) -> Trajectory:
        handle = TaskHandle(assignment.trajectory_id)
        handle.place(0)
        return await self._runner.run(assignment, handle, _Untagged())


class _Untagged:
    """Turn events of a task nobody schedules: nothing to report, no CTB tag on its requests."""

    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> None:
        return None

    def turn_finished(self, task_id: str, context_tokens: int, report: dict[str, Any] | None) -> None:
        pass
