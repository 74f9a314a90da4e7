"""One rollout task: its limits, and a runner for one engine.

The assignment (`comm.messages.TaskAssignment`) and the finished record
(`core.trajectory.Trajectory`) are imported here for the callers that run tasks.

A task is one trajectory of a GRPO group. The trajectory is kept in tokens: the prompt,
each generated action (loss mask 1, with the engine's log-probs), and each observation
(loss mask 0). With sessions enabled, only each turn's new tokens are sent to the
engine, and the session keeps the task's prefix resident while it waits for its
environment. The multi-turn loop itself lives in `ctb_task_runner.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tide_megatron.comm.messages import TaskAssignment
from tide_megatron.core.trajectory import Segment, Trajectory
from tide_megatron.envs.client import EnvClient
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.engine import RolloutEngine

__all__ = ["TaskAssignment", "TaskRunner", "TaskRunnerConfig", "Trajectory"]


@dataclass
class TaskRunnerConfig:
    """Limits and sampling of a multi-turn rollout task."""

    max_turns: int = 8
    """Hard cap on assistant turns per trajectory."""
    max_context_tokens: int = 1024
    """A trajectory stops (truncated) once its context would exceed this."""
    max_new_tokens: int = 32
    """Tokens generated per turn at most."""
    temperature: float = 1.0
    """Sampling temperature (1.0 keeps engine log-probs equal to the policy's)."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 for unbiased GRPO log-probs."""
    system_prompt: str | None = None
    """System message before the first observation (None: the template's default)."""


class TaskRunner:
    """Runs trajectories on one engine against one env client.

    It is the pausable runner (`ctb_task_runner.CTBTaskRunner`) with a task that is placed once
    and never paused, and untagged requests: one multi-turn loop serves both request-level and
    task-level scheduling.
    """

    def __init__(self, cfg: TaskRunnerConfig, engine: RolloutEngine, chat: ChatFormat, env: EnvClient):
        from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner  # it builds on this module's types

        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.env = env
        self._runner = CTBTaskRunner(cfg, {0: engine}, chat, env, use_sessions=engine.cfg.use_sessions)

    async def run(self, assignment: TaskAssignment) -> Trajectory:
        from tide_megatron.rollout.ctb_task_runner import TaskHandle

        handle = TaskHandle(assignment.trajectory_id)
        handle.place(0)
        return await self._runner.run(assignment, handle, _Untagged())


class _Untagged:
    """Turn events of a task nobody schedules: nothing to report, no CTB tag on its requests."""

    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> None:
        return None

    def turn_finished(self, task_id: str, context_tokens: int, report: dict[str, Any] | None) -> None:
        pass


@dataclass
class _Episode:
    """A trajectory while it runs."""

    tokens: list[int]
    env_wait_s: float
    version: int
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    generated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generate_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    send_tokens: list[int] | None = None
    """With images: `tokens` as SGLang is sent them (one pad per image); None: `tokens` itself."""
    images: list[Any] = field(default_factory=list)
    """`multimodal.TurnImage`s of the observations so far, in order."""
    env_steps: int = 0
    """Env step results in the episode (a carried task checks it against the env session's)."""
    pending_action: str | None = None
    """The last turn's action while its env step's result is not in the episode yet."""

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None,
               send_ids: list[int] | None = None, images: list[Any] = ()) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if self.send_tokens is not None:
            self.send_tokens += send_ids if send_ids is not None else ids
        self.images += images
