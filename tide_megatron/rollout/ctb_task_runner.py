"""A multi-turn rollout task that CTB can pause, move and resume between turns.

Same loop and the same `Trajectory` as `task_runner.TaskRunner`, plus what task-level
scheduling needs:
- every request carries a CTB task tag in its rid (`sglang_patches.task_tag`), so SGLang's
  scheduler (with the `tide_ctb` plugin) knows the task, its group and its priority;
- before each turn the task waits until the dispatcher has it RUNNING on some rank, and it
  reports each turn's start and end (context tokens, and the plugin's KV report) back;
- pausing closes the task's SGLang session (its KV becomes evictable but stays in the radix
  tree until something evicts it); resuming opens a fresh session on the rank chosen by the
  dispatcher and sends the whole context again, which re-uses any prefix still cached there.
The environment session stays open while a task is paused: a paused task still holds its env.

Weight updates. A task keeps running across them. The engine drains its turns before it loads
new weights (`RolloutEngine.turn`), and every session opened under the old weights is dropped,
so the task's next turn sends its whole context and is prefilled under the new weights; each
turn's generated tokens form a `Segment` tagged with the weight version that produced them.

With `use_sessions=False` (the vanilla, request-level baseline) it sends the whole context
every turn, untagged, and is never paused.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sglang_patches.task_tag import ADMIT, RESUME, TURN, TaskTag
from tide_megatron.envs.client import EnvClient
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.engine import Generation, RolloutEngine
from tide_megatron.core.trajectory import Segment
from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunnerConfig, Trajectory, _Episode


class TurnListener(Protocol):
    """The dispatcher side of a running task (`CTBDispatcher` implements it)."""

    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> Optional[TaskTag]: ...

    def turn_finished(self, task_id: str, context_tokens: int, report: Optional[dict[str, Any]]) -> None: ...


@dataclass
class TaskHandle:
    """Where a task may run now; shared by the dispatcher (writer) and the runner (reader)."""

    task_id: str
    rank: Optional[int] = None
    """Rank the task is placed on; None while queued or paused."""
    session_id: Optional[str] = None
    """Open SGLang session on `rank` (pins the task's prefix), if any."""
    session_rank: Optional[int] = None
    session_epoch: int = -1
    """The engine's weight epoch the session was opened in (older sessions hold stale KV)."""
    started: bool = False
    """Has sent its first turn."""
    pauses: int = 0
    moves: int = 0
    """Resumes that landed on another rank than the one the task last ran on."""
    last_rank: Optional[int] = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while a turn generates and while the session is being released, so a pause
    requested mid-generation releases the session right after that generation."""
    runnable: asyncio.Event = field(default_factory=asyncio.Event)

    def place(self, rank: int) -> None:
        if self.last_rank is not None and rank != self.last_rank:
            self.moves += 1
        self.rank = rank
        self.runnable.set()

    def pause(self, engines: dict[int, RolloutEngine]) -> asyncio.Task:
        """Stop the task before its next turn and release its session (KV becomes evictable)."""
        self.rank = None
        self.pauses += 1
        self.runnable.clear()
        return asyncio.get_running_loop().create_task(self.release_session(engines))

    async def release_session(self, engines: dict[int, RolloutEngine], *, even_if_placed: bool = False) -> None:
        """Close the task's session (a paused task; or any task, before a weight update)."""
        async with self.lock:
            if self.session_id is not None and (self.rank is None or even_if_placed):
                engine = engines.get(self.session_rank)
                session, self.session_id = self.session_id, None
                if engine is not None:
                    await engine.close_session(session)


class CTBTaskRunner:
    """Runs pausable trajectories over several engines against one env client."""

    def __init__(self, cfg: TaskRunnerConfig, engines: dict[int, RolloutEngine], chat: ChatFormat, env: EnvClient,
                 use_sessions: bool = True):
        self.cfg = cfg
        self.engines = engines
        self.chat = chat
        self.env = env
        self.use_sessions = use_sessions

    def _sampling(self, remaining: int) -> dict[str, Any]:
        return {"max_new_tokens": max(1, min(self.cfg.max_new_tokens, remaining)),
                "temperature": self.cfg.temperature, "top_p": self.cfg.top_p}

    async def run(self, assignment: TaskAssignment, handle: TaskHandle, listener: TurnListener) -> Trajectory:
        started = time.time()
        t0 = time.monotonic()
        await handle.runnable.wait()  # admitted before it takes an environment
        async with self.env.session(assignment.task["env"], assignment.task["task_id"],
                                    assignment.trajectory_id) as first:
            ep = _Episode(tokens=self.chat.prompt_ids(first.observation), env_wait_s=time.monotonic() - t0,
                          version=self.engines[handle.rank].weight_version if handle.rank in self.engines
                          else min(e.weight_version for e in self.engines.values()))
            ep.loss_mask = [0] * len(ep.tokens)
            ep.logprobs = [0.0] * len(ep.tokens)
            try:
                await self._turns(first.session_id, ep, handle, listener)
            finally:
                async with handle.lock:
                    if handle.session_id is not None:
                        session, handle.session_id = handle.session_id, None
                        await self.engines[handle.session_rank].close_session(session)
        # Generation never runs past the context limit; only a last observation can, and it is cut.
        cut = self.cfg.max_context_tokens
        mask = ep.loss_mask[:cut]
        assert sum(mask) == ep.generated, "the context cut must not drop generated tokens"
        return Trajectory(
            group_id=assignment.group_id, index=assignment.index, task_id=assignment.task.get("task_id", ""),
            policy_version=min((s.version for s in ep.segments), default=ep.version),
            prompt_tokens=len(mask) - ep.generated, generated_tokens=ep.generated,
            reward=float(ep.info.get("episode_return", ep.reward)), started_at=started, finished_at=time.time(),
            is_eval=assignment.is_eval, token_ids=ep.tokens[:cut], loss_mask=mask, logprobs=ep.logprobs[:cut],
            segments=list(ep.segments), task=assignment.task, turns=ep.turns,
            truncated=ep.truncated or bool(ep.info.get("truncated", False)),
            engine_prompt_tokens=ep.prompt_tokens, cached_tokens=ep.cached_tokens,
            env_wait_s=ep.env_wait_s, generate_s=ep.generate_s,
            info={**{k: v for k, v in ep.info.items() if isinstance(v, (int, float, str, bool))},
                  "ctb_pauses": handle.pauses, "ctb_moves": handle.moves},
        )

    async def _turns(self, env_session: str, ep: _Episode, handle: TaskHandle, listener: TurnListener) -> None:
        pending = list(ep.tokens)  # tokens the engine's session has not seen yet
        previous_rid: Optional[str] = None
        done = False
        while not done:
            remaining = self.cfg.max_context_tokens - len(ep.tokens)
            if ep.turns >= self.cfg.max_turns or remaining <= 0:
                ep.truncated = True
                return
            gen, version = await self._generate_turn(ep, pending, previous_rid, remaining, handle, listener)
            previous_rid = gen.rid
            ep.segments.append(Segment(len(ep.tokens), len(ep.tokens) + len(gen.output_ids), version))
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

    async def _generate_turn(self, ep: _Episode, pending: list[int], previous_rid: Optional[str], remaining: int,
                             handle: TaskHandle, listener: TurnListener) -> tuple[Generation, int]:
        """One turn on the rank the task is placed on; returns the generation and the weight
        version that produced it."""
        while True:
            await handle.runnable.wait()
            async with handle.lock:
                if handle.rank is None:
                    continue  # paused again while waiting for the lock
                rank = handle.rank
                engine = self.engines[rank]
                async with engine.turn():  # no weight update starts while this turn generates
                    if handle.rank != rank:
                        continue  # paused while waiting for the engine
                    kind = TURN if handle.started else ADMIT
                    session_params = None
                    if self.use_sessions:
                        stale = handle.session_epoch != engine.weight_epoch
                        if handle.session_id is None or handle.session_rank != rank or stale:
                            if handle.session_id is not None:  # opened under old weights
                                await self.engines[handle.session_rank].close_session(handle.session_id)
                                handle.session_id = None
                            if handle.started:
                                kind = RESUME
                            handle.session_id = await engine.open_session(self.cfg.max_context_tokens * 8)
                            handle.session_rank, handle.session_epoch, previous_rid = rank, engine.weight_epoch, None
                        session_params = {"id": handle.session_id}
                        if previous_rid is not None:
                            session_params["rid"] = previous_rid
                    # A fresh session (first turn, resume, new weights) needs the whole context;
                    # a live one only the delta.
                    send = pending if session_params is not None and previous_rid is not None else ep.tokens
                    tag = listener.turn_started(handle.task_id, len(ep.tokens), kind)
                    handle.started, handle.last_rank = True, rank
                    version = engine.weight_version
                    t0 = time.monotonic()
                    gen, report = await generate_tagged(engine, send, self._sampling(remaining), tag, session_params)
                    ep.generate_s += time.monotonic() - t0
            ep.turns += 1
            ep.prompt_tokens += gen.prompt_tokens
            ep.cached_tokens += gen.cached_tokens
            ep.generated += len(gen.output_ids)
            listener.turn_finished(handle.task_id, len(ep.tokens) + len(gen.output_ids), report)
            return gen, version


async def generate_tagged(engine: RolloutEngine, input_ids: list[int], sampling_params: dict[str, Any],
                          tag: Optional[TaskTag], session_params: Optional[dict[str, Any]]
                          ) -> tuple[Generation, Optional[dict[str, Any]]]:
    """`RolloutEngine.generate` with a CTB-tagged rid; also returns the plugin's report."""
    session_params = session_params or {}
    gen = await engine.generate(input_ids, sampling_params, session_params.get("id"), session_params.get("rid"),
                                rid=tag.to_rid() if tag is not None else None)
    return gen, gen.ctb_report
