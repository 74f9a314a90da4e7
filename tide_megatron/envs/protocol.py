"""The environment protocol: what an environment is, independent of where it runs.

An `Env` is one episode at a time (the server keeps one instance per session):

    reset(task, trajectory_id) -> ResetResult(observation, info)
    step(action)               -> StepResult(observation, reward, done, info)

A task is identified by a `TaskSpec`. Resetting the same task spec G times with G different
trajectory ids gives the G members of a GRPO group: the initial state depends only on the
task, so the group shares its first prompt (and its prefix in the rollout engine's cache);
only the trajectory id (and the actions) tell members apart.

Rewards are computed by the env (next to the environment state, server-side). Each step
returns the reward earned by that step; an episode's return is the sum, normalised by the
built-in envs to [0, 1].
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TaskSpec:
    """One task of an environment, as the dispatcher sees it."""

    env: str
    """Served env name (`EnvConfig.key`)."""

    task_id: str
    """Stable identity of the task within its env; resetting it twice gives the same start."""

    task_type: str
    """Coarse kind of task, for CTB's diversity constraint (e.g. `door_game/rooms3`)."""

    split: str = "train"
    """`train` or `eval`."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskSpec:
        return cls(
            env=_str(data, "env"), task_id=_str(data, "task_id"), task_type=_str(data, "task_type"),
            split=_str(data, "split"),
        )


@dataclass
class ResetResult:
    """The first observation of an episode."""

    observation: str
    """Text of the first user turn (instructions and initial state)."""

    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras (admissible commands, room count, ...)."""

    task_type: str = ""
    """The task's type, echoed so a client that only knows the task id can report it."""

    latency_s: float = 0.0
    """Emulated latency the server waited before replying (set by the latency wrapper)."""

    session_id: str = ""
    """Filled in by the server: the handle for `step` and `close`."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResetResult:
        return cls(
            observation=_str(data, "observation"), info=_dict(data, "info"), task_type=_str(data, "task_type"),
            latency_s=_float(data, "latency_s"), session_id=_str(data, "session_id"),
        )


@dataclass
class StepResult:
    """What one action led to."""

    observation: str
    """Text of the next user turn (empty when done and there is nothing to say)."""

    reward: float
    """Reward earned by this step."""

    done: bool
    """The episode is over (won, lost, or cut off); further steps are an error."""

    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras. Built-in envs set `episode_return` (sum of rewards so far), `won`,
    and `truncated` (cut off by a step limit) when done."""

    latency_s: float = 0.0
    """Emulated latency the server waited before replying (set by the latency wrapper)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepResult:
        done = data.get("done")
        if not isinstance(done, bool):
            raise ValueError(f"field 'done' must be a bool, got {done!r}")
        return cls(
            observation=_str(data, "observation"), reward=_float(data, "reward"), done=done,
            info=_dict(data, "info"), latency_s=_float(data, "latency_s"),
        )


class Env(abc.ABC):
    """One episode of an environment at a time. Not thread-safe; the server serialises calls
    of a session. Subclasses are built by a factory registered with `register_env`."""

    blocking: bool = False
    """True when calls block for long (a subprocess, a compiled game): the server then runs
    them on a worker thread instead of its event loop."""

    @abc.abstractmethod
    def list_tasks(self, split: str) -> list[TaskSpec]:
        """All tasks of a split (cheap: no game is generated)."""

    @abc.abstractmethod
    def task(self, task_id: str) -> TaskSpec:
        """The spec of one task id; raises `KeyError` for an unknown id."""

    @abc.abstractmethod
    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        """Start an episode of `task_id`. The start depends on the task only."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action (the model's text for this turn)."""

    def close(self) -> None:
        """Release what the episode holds (processes, files)."""


def _str(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} must be a string, got {value!r}")
    return value


def _float(data: dict[str, Any], key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {key!r} must be a number, got {value!r}")
    return float(value)


def _dict(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"field {key!r} must be an object, got {value!r}")
    return value
