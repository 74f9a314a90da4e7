"""The one trajectory record, from the rollout rank to the trainer.

A rollout rank builds a `Trajectory` when a multi-turn task ends; the mailbox carries it as
JSON with its token lists packed (`to_wire`; files keep the plain lists of `to_json`, and
`from_json` reads both); the global buffer keeps it as it is (it only sets
`advantage` when the group completes); the trainer collates its token lists into tensors.
Nothing converts it to another type on the way, so what was generated is what is trained.

The simulator uses the same record with empty token lists: it only needs the counts.

Policy versions. A task keeps running across weight updates; each generated segment (one
turn's action) records the weight version that produced it, and its tokens keep the
behaviour log-probs of that version, which the importance ratio uses token by token. The
staleness of a trajectory is judged on its oldest segment (`policy_version`), which is the
version it was admitted under or later: that is the bound CTB and the dispatcher enforce at
admission.
"""

from __future__ import annotations

import base64
import math
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Hashable, Optional


def is_fresh(version: int, consumer_version: int, max_staleness: int) -> bool:
    """The staleness bound, the one rule every part applies (the buffer's drops, CTB's and the
    controller's cancels): work of policy `version` may train the step that makes weights
    `consumer_version` iff it is at most `max_staleness` versions older."""
    return consumer_version - version <= max_staleness


def _shallow_copy(value: Any) -> Any:
    if isinstance(value, list):
        return list(value)
    return dict(value) if isinstance(value, dict) else value


# The per-token lists on the wire: base64 of packed machine values (int32 token ids, one byte of
# mask, float64 log-probs, native byte order; every value comes back exactly). Python's JSON
# writes and parses a long list one element at a time (a float by its repr); packed, a
# 3,200-token trajectory's message encodes ~2.5x and decodes ~2x faster at ~1.2x the size
# (benchmarks/trajectory_wire.py), and rank 0 decodes and encodes every trajectory once each.
_PACKED = {"token_ids": "i", "loss_mask": "B", "logprobs": "d"}


def _pack(values: list, typecode: str) -> Any:
    try:
        packed = array(typecode, values)
    except (OverflowError, TypeError):  # a value the packed type cannot hold: the list as it is
        return values
    if typecode == "d" and not math.isfinite(sum(packed)):
        return values  # NaN or inf: the list, which the mailbox's JSON refuses, as before
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _unpack(value: Any, typecode: str) -> list:
    if not isinstance(value, str):
        return value
    out = array(typecode)
    out.frombytes(base64.b64decode(value))
    return out.tolist()


@dataclass(frozen=True)
class Segment:
    """Generated tokens [start, end) of the trajectory, produced by weight `version`."""

    start: int
    end: int
    version: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class Trajectory:
    """One finished multi-turn trajectory (a member of a GRPO group)."""

    group_id: Hashable
    """GRPO group this trajectory belongs to."""
    index: int
    """Position in the group, 0..G-1."""
    task_id: Hashable
    """The task (prompt + environment instance) the group samples."""
    policy_version: int
    """Oldest policy version that generated any of its tokens (staleness is judged on it)."""
    prompt_tokens: int
    """Tokens the policy did not generate: the prompt and every observation."""
    generated_tokens: int
    """Tokens the policy generated (actions): what goodput counts."""
    reward: float
    """Scalar reward computed next to the environment."""
    started_at: float = 0.0
    """Clock value at first admission."""
    finished_at: float = 0.0
    """Clock value at the final turn."""
    is_eval: bool = False
    """Evaluation trajectories are scored, never trained on."""
    advantage: Optional[float] = None
    """Group-relative advantage, set by the buffer when the group completes."""
    payload: Any = None
    """Opaque extras of a caller that has no token lists (the simulator's workload record)."""

    # -- what the real system carries (empty in the simulator) ------------------------------
    token_ids: list[int] = field(default_factory=list)
    """Prompt, actions and observations, as the trainer sees them. [T]"""
    loss_mask: list[int] = field(default_factory=list)
    """1 on tokens the policy generated, 0 elsewhere. [T]"""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-probs of generated tokens (the engine's, per segment version), 0.0 elsewhere. [T]"""
    segments: list[Segment] = field(default_factory=list)
    """Generated spans with the weight version that produced each."""
    task: dict[str, Any] = field(default_factory=dict)
    """The env's task spec the trajectory ran."""
    turns: int = 0
    truncated: bool = False
    """Stopped by the turn or context limit rather than by the environment."""
    engine_prompt_tokens: int = 0
    """Context tokens the engine needed over all turns (prefilled or cached)."""
    cached_tokens: int = 0
    """Of `engine_prompt_tokens`, those reused from the prefix cache."""
    image_tokens: int = 0
    """Of the context, tokens that stand for images (multi-modal tasks)."""
    images: list[str] = field(default_factory=list)
    """Encoded images of the observations (base64 PNG/JPEG), in the order of their tokens."""
    image_grid_thw: list[list[int]] = field(default_factory=list)
    """(t, h, w) patch grid of each image, as the rollout counted its tokens."""
    env_wait_s: float = 0.0
    generate_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def trajectory_id(self) -> str:
        return f"{self.group_id}/{self.index}"

    @property
    def versions(self) -> list[int]:
        """Distinct weight versions that produced this trajectory, oldest first."""
        return sorted({s.version for s in self.segments}) or [self.policy_version]

    def check(self) -> None:
        """Raise ValueError when the token lists and counts disagree (a corrupt record)."""
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == n):
            raise ValueError(f"trajectory {self.trajectory_id}: token_ids, loss_mask and logprobs differ in length")
        if n and self.prompt_tokens + self.generated_tokens < n:
            raise ValueError(f"trajectory {self.trajectory_id}: counts below the token list length")
        for s in self.segments:
            if not 0 <= s.start <= s.end <= max(n, s.end) or s.version < 0:
                raise ValueError(f"trajectory {self.trajectory_id}: bad segment {s}")
        if self.segments and min(s.version for s in self.segments) != self.policy_version:
            raise ValueError(f"trajectory {self.trajectory_id}: policy_version is not its oldest segment's")

    @classmethod
    def from_tokens(cls, token_ids: list[int], loss_mask: list[float], logprobs: list[float],
                    advantage: Optional[float] = None, group_id: Hashable = "g", index: int = 0,
                    **fields: Any) -> "Trajectory":
        """A trajectory known by its token lists alone (benchmarks, tests, data from elsewhere):
        the counts follow from the mask, the version is 0, the task its group."""
        mask = [int(m) for m in loss_mask]
        generated = sum(mask)
        return cls(group_id=group_id, index=index, task_id=group_id, policy_version=0,
                   prompt_tokens=len(mask) - generated, generated_tokens=generated, reward=0.0,
                   advantage=advantage, token_ids=[int(t) for t in token_ids], loss_mask=mask,
                   logprobs=[float(x) for x in logprobs], **fields)

    def to_json(self) -> dict[str, Any]:
        return self._json(packed=False)

    def to_wire(self) -> dict[str, Any]:
        """`to_json` with the per-token lists packed (what the mailbox carries; `from_json`
        reads both forms)."""
        return self._json(packed=True)

    def _json(self, packed: bool) -> dict[str, Any]:
        # Shallow copies: `asdict` copied every element of the token lists one by one, and rank 0
        # serialises each trajectory on its way to the trainer; packed lists are read, not copied.
        data = {f.name: _pack(getattr(self, f.name), _PACKED[f.name]) if packed and f.name in _PACKED
                else _shallow_copy(getattr(self, f.name)) for f in fields(self) if f.name != "payload"}
        data["segments"] = [[s.start, s.end, s.version] for s in self.segments]
        data["image_grid_thw"] = [list(g) for g in self.image_grid_thw]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Trajectory":
        data = dict(data)
        data["segments"] = [Segment(int(a), int(b), int(v)) for a, b, v in data.get("segments", [])]
        for name, typecode in _PACKED.items():
            if name in data:
                data[name] = _unpack(data[name], typecode)
        return cls(**data)
