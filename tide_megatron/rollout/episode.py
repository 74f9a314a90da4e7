"""The state of one running task: its episode so far, in tokens.

`CTBTaskRunner` builds it turn by turn and turns it into the finished `Trajectory`;
`task_carry.py` writes it to JSON when the task is handed to another rank and reads it back
there. It lives apart from both so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tide_megatron.core.trajectory import Segment


@dataclass
class Episode:
    """A trajectory while it runs."""

    tokens: list[int]
    """The context so far: prompt, generated actions and observations, in order."""
    env_wait_s: float
    """Seconds waited before the first turn (admission and the env's reset) and on env steps."""
    version: int
    """The weight version when the task started (the trajectory's version if it generated nothing)."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on generated tokens, 0 on prompt and observation tokens; one per token."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated token, 0.0 elsewhere; one per token."""
    reward: float = 0.0
    """The env steps' rewards, summed."""
    turns: int = 0
    """Turns generated."""
    truncated: bool = False
    """Ended by `max_turns` or the context limit rather than by the env."""
    generated: int = 0
    """Tokens generated (the ones with loss mask 1)."""
    prompt_tokens: int = 0
    """Context tokens the engine had to have for the turns, summed (`Generation.prompt_tokens`)."""
    cached_tokens: int = 0
    """Of those, the ones the prefix cache held."""
    generate_s: float = 0.0
    """Seconds spent in the engine's generate calls."""
    info: dict[str, Any] = field(default_factory=dict)
    """The last env step's `info`."""
    segments: list[Segment] = field(default_factory=list)
    """Each turn's generated tokens with the weight version that produced them."""
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
