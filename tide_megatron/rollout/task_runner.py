"""The multi-turn loop of one rollout task: generate, act, observe, generate again.

A task is one trajectory of a GRPO group. The runner keeps the whole trajectory in
tokens: the prompt, each generated action (loss mask 1, with the engine's log-probs),
and each observation (loss mask 0). With sessions enabled, only each turn's new tokens
are sent to the engine, and the session keeps the task's prefix resident while it
waits for its environment.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tide_megatron.envs.client import EnvClient
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.engine import RolloutEngine


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


@dataclass
class TaskAssignment:
    """What the controller sends a rollout rank for one trajectory."""

    task: dict[str, Any]
    """The env's task spec (`TaskSpec.to_json()`)."""
    group_id: str
    """GRPO group of this trajectory."""
    index: int
    """Position within the group, 0..G-1."""
    is_eval: bool = False
    """Evaluation task (reward only; never trained on)."""

    @property
    def trajectory_id(self) -> str:
        return f"{self.group_id}/{self.index}"


@dataclass
class Trajectory:
    """A finished multi-turn trajectory, in tokens, as the trainer consumes it."""

    group_id: str
    index: int
    task: dict[str, Any]
    is_eval: bool
    token_ids: list[int]
    """Prompt, actions and observations. [T]"""
    loss_mask: list[int]
    """1 on tokens the policy generated, 0 elsewhere. [T]"""
    logprobs: list[float]
    """Engine log-probs on generated tokens, 0.0 elsewhere. [T]"""
    reward: float
    turns: int
    policy_version: int
    """Oldest weight version that generated any of its tokens (staleness is judged on it)."""
    truncated: bool = False
    generated_tokens: int = 0
    prompt_tokens: int = 0
    """Context tokens the engine needed over all turns (cached or prefilled)."""
    cached_tokens: int = 0
    """Of `prompt_tokens`, those reused from the prefix cache."""
    env_wait_s: float = 0.0
    generate_s: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        return cls(**data)


class TaskRunner:
    """Runs trajectories on one engine against one env client."""

    def __init__(self, cfg: TaskRunnerConfig, engine: RolloutEngine, chat: ChatFormat, env: EnvClient):
        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.env = env

    def _sampling(self, remaining: int) -> dict[str, Any]:
        return {
            "max_new_tokens": max(1, min(self.cfg.max_new_tokens, remaining)),
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
        }

    async def run(self, assignment: TaskAssignment) -> Trajectory:
        started = time.time()
        t0 = time.monotonic()
        async with self.env.session(assignment.task["env"], assignment.task["task_id"],
                                    assignment.trajectory_id) as first:
            ep = _Episode(tokens=self.chat.prompt_ids(first.observation), env_wait_s=time.monotonic() - t0,
                          version=self.engine.weight_version)
            ep.loss_mask = [0] * len(ep.tokens)
            ep.logprobs = [0.0] * len(ep.tokens)
            session = await self.engine.open_session(self.cfg.max_context_tokens * 8)
            try:
                await self._turns(first.session_id, session, ep)
            finally:
                await self.engine.close_session(session)
        # An observation can push the context past the limit; cut it so the trainer never
        # sees more than max_context_tokens (the cut tokens are env tokens, masked anyway).
        cut = self.cfg.max_context_tokens
        return Trajectory(
            group_id=assignment.group_id,
            index=assignment.index,
            task=assignment.task,
            is_eval=assignment.is_eval,
            token_ids=ep.tokens[:cut],
            loss_mask=ep.loss_mask[:cut],
            logprobs=ep.logprobs[:cut],
            reward=float(ep.info.get("episode_return", ep.reward)),
            turns=ep.turns,
            policy_version=ep.version,
            truncated=ep.truncated or bool(ep.info.get("truncated", False)),
            generated_tokens=ep.generated,
            prompt_tokens=ep.prompt_tokens,
            cached_tokens=ep.cached_tokens,
            env_wait_s=ep.env_wait_s,
            generate_s=ep.generate_s,
            started_at=started,
            finished_at=time.time(),
            info={k: v for k, v in ep.info.items() if isinstance(v, (int, float, str, bool))},
        )

    async def _turns(self, env_session: str, engine_session: str | None, ep: _Episode) -> None:
        pending = list(ep.tokens)  # tokens the engine has not seen yet
        previous_rid: str | None = None
        done = False
        while not done:
            remaining = self.cfg.max_context_tokens - len(ep.tokens)
            if ep.turns >= self.cfg.max_turns or remaining <= 0:
                ep.truncated = True
                return
            ep.version = min(ep.version, self.engine.weight_version)
            # Without a session the engine needs the whole context every turn.
            send = pending if engine_session is not None else ep.tokens
            t0 = time.monotonic()
            gen = await self.engine.generate(send, self._sampling(remaining), engine_session, previous_rid)
            ep.generate_s += time.monotonic() - t0
            previous_rid = gen.rid
            ep.turns += 1
            ep.prompt_tokens += gen.prompt_tokens
            ep.cached_tokens += gen.cached_tokens
            ep.generated += len(gen.output_ids)
            ep.append(gen.output_ids, 1, gen.logprobs)
            action = self.chat.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            t0 = time.monotonic()
            result = await self.env.step(env_session, action)
            ep.env_wait_s += time.monotonic() - t0
            ep.reward += result.reward
            ep.info = result.info
            done = result.done
            if not done:
                pending = self.chat.user_turn_ids(result.observation, gen.output_ids)
                ep.append(pending, 0)


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

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
