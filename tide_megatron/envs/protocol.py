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
built-in envs to [0, 1] (`gui_desktop` may go slightly below 0 through its penalties). A
reward is always a finite number: the server and the client both refuse NaN and infinities.

Image observations (screenshots) never travel inline. An env puts encoded PNG/JPEG bytes in a
result's `image_data`; the server validates them (`images.py`), writes them to its node-local
image store and sends `ImageRef`s in `images` instead; the client reads each reference back,
validates it again and fills `image_data`, aligned with `images`. Text observations are
unchanged: a text env leaves both lists empty.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

IMAGE_FORMATS = ("png", "jpeg")
_IMAGE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


@dataclass(frozen=True)
class ImageRef:
    """Where one image observation lies in the server's image store, and what it must be."""

    id: str
    """Unguessable id within the server (`[A-Za-z0-9_-]`, at most 64 characters)."""

    path: str
    """Absolute path of the file on the server's node (readable by clients on that node)."""

    format: str
    """`png` or `jpeg`."""

    width: int
    """Decoded width in pixels."""

    height: int
    """Decoded height in pixels."""

    sha256: str
    """Hex digest of the encoded bytes; the reader checks it."""

    nbytes: int
    """Size of the encoded bytes."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageRef:
        if not isinstance(data, dict):
            raise ValueError(f"an image reference must be an object, got {data!r}")
        ref = cls(id=_str(data, "id"), path=_str(data, "path"), format=_str(data, "format"),
                  width=_int(data, "width"), height=_int(data, "height"), sha256=_str(data, "sha256"),
                  nbytes=_int(data, "nbytes"))
        if not _IMAGE_ID.fullmatch(ref.id):
            raise ValueError(f"image id {ref.id!r} is not [A-Za-z0-9_-]{{1,64}}")
        if ref.format not in IMAGE_FORMATS:
            raise ValueError(f"image format {ref.format!r} is not one of {IMAGE_FORMATS}")
        if not _SHA256.fullmatch(ref.sha256):
            raise ValueError(f"image sha256 {ref.sha256!r} is not 64 lowercase hex digits")
        if min(ref.width, ref.height, ref.nbytes) < 1:
            raise ValueError(f"image {ref.id}: width, height and nbytes must be positive")
        return ref


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

    images: list[ImageRef] = field(default_factory=list)
    """Image observations by reference (filled by the server from `image_data`)."""

    image_data: list[bytes] = field(default_factory=list, repr=False, compare=False)
    """Encoded image bytes in this process, never on the wire: what an env returns (the server
    stores them and fills `images`), and what the client read back (aligned with `images`)."""

    def to_json(self) -> dict[str, Any]:
        return {"observation": self.observation, "info": self.info, "task_type": self.task_type,
                "latency_s": self.latency_s, "session_id": self.session_id,
                "images": [r.to_json() for r in self.images]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResetResult:
        return cls(
            observation=_str(data, "observation"), info=_dict(data, "info"), task_type=_str(data, "task_type"),
            latency_s=_float(data, "latency_s"), session_id=_str(data, "session_id"), images=_images(data),
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

    images: list[ImageRef] = field(default_factory=list)
    """Image observations by reference (filled by the server from `image_data`)."""

    image_data: list[bytes] = field(default_factory=list, repr=False, compare=False)
    """Encoded image bytes in this process, never on the wire: what an env returns (the server
    stores them and fills `images`), and what the client read back (aligned with `images`)."""

    def to_json(self) -> dict[str, Any]:
        return {"observation": self.observation, "reward": self.reward, "done": self.done, "info": self.info,
                "latency_s": self.latency_s, "images": [r.to_json() for r in self.images]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepResult:
        done = data.get("done")
        if not isinstance(done, bool):
            raise ValueError(f"field 'done' must be a bool, got {done!r}")
        return cls(
            observation=_str(data, "observation"), reward=_float(data, "reward"), done=done,
            info=_dict(data, "info"), latency_s=_float(data, "latency_s"), images=_images(data),
        )


@dataclass
class AttachResult:
    """A session taken over from another connection (`EnvClient.attach`)."""

    session_id: str
    """The session's handle, unchanged by the handoff: use it for `step` and `close`."""

    env: str
    """Served env name of the session."""

    task_id: str
    """The task the session plays."""

    trajectory_id: str
    """The trajectory id it was reset with."""

    turns: int
    """Env steps the session has taken so far (a step that was in flight at the handoff counts)."""

    done: bool
    """The episode is over: further steps are an error."""

    last: ResetResult | StepResult
    """The result of step number `last_turn` (the reset when 0), as it was returned to the
    previous owner, with its images read back like a reset's or a step's."""

    last_turn: int = 0
    """The turn `last` answers: `turns`, unless the env applied a later step whose result the
    server refused (a NaN reward or a bad image); then that step's result is lost."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttachResult:
        turns, done, last = _int(data, "turns"), data.get("done"), _dict(data, "last")
        last_turn = _int(data, "last_turn") if "last_turn" in data else turns
        if not isinstance(done, bool):
            raise ValueError(f"field 'done' must be a bool, got {done!r}")
        if not 0 <= last_turn <= turns:
            raise ValueError(f"last_turn {last_turn} is not within 0..turns={turns}")
        return cls(
            session_id=_str(data, "session_id"), env=_str(data, "env"), task_id=_str(data, "task_id"),
            trajectory_id=_str(data, "trajectory_id"), turns=turns, done=done,
            last=ResetResult.from_json(last) if last_turn == 0 else StepResult.from_json(last), last_turn=last_turn,
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
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"field {key!r} must be a finite number, got {value!r}")
    return value


def _int(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {key!r} must be an integer, got {value!r}")
    return value


def _images(data: dict[str, Any]) -> list[ImageRef]:
    # Absent in replies of servers that predate image observations: no images.
    value = data.get("images", [])
    if not isinstance(value, list):
        raise ValueError(f"field 'images' must be a list, got {value!r}")
    return [ImageRef.from_json(v) for v in value]


def _dict(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"field {key!r} must be an object, got {value!r}")
    return value
