"""A running task handed from one rollout rank to another: its episode so far, as JSON.

When ERS moves a rollout rank to the trainer, its tasks go on elsewhere instead of starting
afresh (paper, "Seamless Scaling Operations"): no KV moves, the next turn re-prefills the whole
context under the new weights on the new rank, and the environment session moves with the task
(the env server's `detach` / `attach`, so the env does not restart its episode either).

What moves is `CarriedTask`: the episode as the trajectory record will hold it (tokens, loss
mask, behaviour log-probs, generated segments with their weight versions, images), its counters,
and the env session's claim. `CTBTaskRunner.run` makes one when its task is stopped for a carry
and goes on from one when it is given one (`RunTask.carry`).

Where a carry can stop a task, and how the new rank picks it up:
- between turns, paused or waiting for its rank: the episode ends with an observation;
- right after a turn generated: the action is in the episode but was not sent to the env
  (`pending_action`);
- during the env step of that action: the step may or may not have reached the env. The env
  server counts the session's steps and keeps the latest result, so the new rank compares the
  count with `env_steps` (the results in the episode): one more means the step ran and its
  result comes with the attach; equal means it never arrived and the new rank sends it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Optional

from tide_megatron.core.trajectory import Segment
from tide_megatron.rollout.episode import Episode


@dataclass
class CarriedTask:
    """A task's state as it leaves its rank (`TaskCarried.carry` is its JSON)."""

    claim: str
    """The env session's single-use claim (`EnvClient.detach`)."""
    episode: dict[str, Any]
    """The `Episode` so far (`episode_to_json`)."""
    started_at: float
    """Wall-clock time the task first started (the trajectory's `started_at`)."""
    pauses: int = 0
    moves: int = 0
    """CTB pauses and moves so far (a carry is a move)."""
    carried_from: list[int] = field(default_factory=list)
    """The ranks the task ran on before, in order."""

    @property
    def generated(self) -> int:
        return int(self.episode["generated"])

    def to_json(self) -> dict[str, Any]:
        return {"claim": self.claim, "episode": self.episode, "started_at": self.started_at, "pauses": self.pauses,
                "moves": self.moves, "carried_from": list(self.carried_from)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CarriedTask":
        missing = {"claim", "episode", "started_at"} - set(data)
        if missing:
            raise ValueError(f"carried task record lacks {sorted(missing)}")
        return cls(str(data["claim"]), dict(data["episode"]), float(data["started_at"]), int(data.get("pauses", 0)),
                   int(data.get("moves", 0)), [int(r) for r in data.get("carried_from", [])])


_REQUIRED = ("tokens", "env_wait_s", "version")  # `Episode`'s fields without a default
_PLAIN = (*_REQUIRED, "loss_mask", "logprobs", "reward", "turns", "truncated", "generated", "prompt_tokens",
          "cached_tokens", "generate_s", "info", "send_tokens", "env_steps", "pending_action")


async def release_claim(env, claim: str) -> None:
    """Close the env session behind a hand-over that will not go on (`ReleaseCarry`): take it
    over with its claim (its images are not read: nobody looks at them), then close it.
    Raises `EnvError` when that fails (the claim was used or expired, the server is down); the
    session is then the idle reaper's."""
    attached = await env.attach(claim, images=False)
    await env.close_quietly(attached.session_id)


def episode_to_json(ep: Episode) -> dict[str, Any]:
    out = {k: getattr(ep, k) for k in _PLAIN}
    out["segments"] = [[s.start, s.end, s.version] for s in ep.segments]
    out["images"] = [base64.b64encode(im.data).decode("ascii") for im in ep.images]
    return out


def episode_from_json(data: dict[str, Any], prepare_images) -> Episode:
    """The episode of a carried task; `prepare_images(list[bytes])` measures its images again
    (`ImagePrompts.prepare`; only called when there are images)."""
    ep = Episode(tokens=list(data["tokens"]), env_wait_s=float(data["env_wait_s"]), version=int(data["version"]))
    for k in _PLAIN[len(_REQUIRED):]:
        setattr(ep, k, data[k])
    ep.loss_mask, ep.logprobs = list(ep.loss_mask), list(ep.logprobs)
    if not len(ep.tokens) == len(ep.loss_mask) == len(ep.logprobs) or sum(ep.loss_mask) != ep.generated:
        raise ValueError("carried episode: tokens, loss mask and log-probs disagree")
    ep.segments = [Segment(int(a), int(b), int(v)) for a, b, v in data["segments"]]
    images = [base64.b64decode(s) for s in data["images"]]
    ep.images = prepare_images(images) if images else []
    return ep


def pending_step(ep: Episode, server_steps: int, last_turn: Optional[int] = None) -> Optional[str]:
    """What the new rank does about the episode's last action (module docstring): "send" it,
    take the attach's "result", or nothing (None: the episode ends with an observation).
    `last_turn`: the step the attach's result answers (`AttachResult.last_turn`); when the env
    took the step but the server refused its result, the task fails as it would have there."""
    if ep.pending_action is None:
        if server_steps != ep.env_steps:
            raise RuntimeError(f"carried task: the env session took {server_steps} steps, the episode holds "
                               f"{ep.env_steps} results and no action awaits one")
        return None
    if server_steps == ep.env_steps:
        return "send"
    if server_steps == ep.env_steps + 1:
        if last_turn is not None and last_turn != server_steps:
            raise RuntimeError(f"carried task: the env server refused the result of step {server_steps} "
                               "(a NaN reward or a bad image)")
        return "result"
    raise RuntimeError(f"carried task: the env session took {server_steps} steps, the episode holds "
                       f"{ep.env_steps} results and one action awaits its step")
