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

Moving to another process. When ERS moves its rank to the trainer, a task is handed over
(`handle.carry`, then a cancel): it stops at its next await (after a turn in flight), detaches
its env session and returns a `CarriedTask` (`task_carry.py`) instead of a trajectory; the rank
that gets it (`run(..., carry=...)`) attaches the session and goes on with a fresh engine
session, so its next turn re-prefills the whole context there.

Weight updates. A task keeps running across them. The engine drains its turns before it loads
new weights (`RolloutEngine.turn`), and every session opened under the old weights is dropped,
so the task's next turn sends its whole context and is prefilled under the new weights; each
turn's generated tokens form a `Segment` tagged with the weight version that produced them.

With `use_sessions=False` (the vanilla, request-level baseline) it sends the whole context
every turn, untagged, and is never paused.

Observations with images (a vision-language policy, see `multimodal.py`): each turn carries its
images to SGLang with its new ids; a fresh session gets the whole context with every image.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sglang_patches.task_tag import ADMIT, RESUME, TURN, TaskTag
from tide_megatron.comm.messages import TaskAssignment
from tide_megatron.core.trajectory import Segment, Trajectory
from tide_megatron.envs.client import EnvClient
from tide_megatron.envs.errors import EnvError
from tide_megatron.models.qwen3_vl_inputs import encode_image_for_record
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.config import TaskRunnerConfig
from tide_megatron.rollout.engine import Generation, RolloutEngine
from tide_megatron.rollout.episode import Episode
from tide_megatron.rollout.multimodal import ImageInputError, observation_images
from tide_megatron.rollout.task_carry import CarriedTask, episode_from_json, episode_to_json, pending_step

logger = logging.getLogger(__name__)


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
    carry: bool = False
    """Rank 0 moves the task to another rank: a cancel then hands it over (`CarriedTask`)."""

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
        self.images = getattr(chat, "images", None)
        """The policy's image handling (`multimodal.ImagePrompts`); None for a text-only policy."""

    def _sampling(self, remaining: int) -> dict[str, Any]:
        params = {"max_new_tokens": max(1, min(self.cfg.max_new_tokens, remaining)),
                  "temperature": self.cfg.temperature, "top_p": self.cfg.top_p}
        if self.images is not None:
            params["logit_bias"] = self.images.logit_bias
        return params

    def _observation(self, result: Any, what: str, render) -> tuple[list[int], list[int], list]:
        """(ids SGLang is sent, ids of the context, images) of one observation; `render()` gives
        the ids of its turn, `render(n)` with n images (one pad each)."""
        data = observation_images(result)
        if not data:
            ids = render()
            return ids, ids, []
        if self.images is None:
            raise ImageInputError(f"{what}: the env returned {len(data)} image(s), but the policy is text-only")
        images = self.images.prepare(data, what)
        send = render(len(images))
        return send, self.images.expand(send, images, what), images

    async def run(self, assignment: TaskAssignment, handle: TaskHandle, listener: TurnListener,
                  carry: Optional[CarriedTask] = None) -> Trajectory | CarriedTask:
        """Run the task to its end, or go on with a `carry` another rank handed over. Returns its
        trajectory, or, when it is cancelled with `handle.carry` set, the `CarriedTask` to hand
        over (the env session is detached, not closed)."""
        t0 = time.monotonic()
        await handle.runnable.wait()  # admitted before it takes an environment
        tid = assignment.trajectory_id
        step_result = None
        if carry is None:
            started = time.time()
            first = await self.env.reset(assignment.task["env"], assignment.task["task_id"], tid)
            env_session = first.session_id
            try:
                what = f"task {tid} turn 0"
                send, ids, images = self._observation(first, what,
                                                      lambda *n: self.chat.prompt_ids(first.observation, *n))
                if images and len(ids) > self.cfg.max_context_tokens:
                    raise ImageInputError(f"{what}: the first observation takes {len(ids)} tokens, over "
                                          f"max_context_tokens={self.cfg.max_context_tokens}")
            except BaseException:
                await self.env.close_quietly(env_session)
                raise
            ep = Episode(tokens=[], env_wait_s=time.monotonic() - t0,
                         version=self.engines[handle.rank].weight_version if handle.rank in self.engines
                         else min(e.weight_version for e in self.engines.values()),
                         send_tokens=[] if self.images is not None else None)
            ep.append(ids, 0, send_ids=send, images=images)
        else:
            started = carry.started_at
            handle.started, handle.pauses, handle.moves = True, carry.pauses, carry.moves + 1
            ep = episode_from_json(carry.episode, lambda data: self._images_of_carry(data, tid))
            attached = await self.env.attach(carry.claim)
            env_session = attached.session_id
        carried: Optional[CarriedTask] = None
        ended = False
        try:
            if carry is not None and pending_step(ep, attached.turns, attached.last_turn) == "result":
                step_result = attached.last  # the step was in flight when the task was handed over
            await self._turns(env_session, ep, handle, listener, tid, step_result)
            ended = True
        except asyncio.CancelledError:
            if not handle.carry:
                raise
            # Handed over: the env session goes with the task (a detach does not wait for a
            # step in flight; the next rank gets its result with the attach).
            try:
                claim = await self.env.detach(env_session)
            except EnvError as exc:  # e.g. an env server without `detach`: the task starts afresh
                logger.warning("task %s cannot be handed over (%s); it starts afresh elsewhere", tid, exc)
                raise asyncio.CancelledError(f"not handed over: {exc}") from None
            carried = CarriedTask(claim, episode_to_json(ep), started, handle.pauses, handle.moves)
        finally:
            closing = self._close_sessions(handle, None if carried is not None else env_session)
            if ended:
                await self._after_the_end(closing, tid)
            else:
                await closing
        if carried is not None:
            return carried
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
            images=[encode_image_for_record(im.data) for im in ep.images],
            image_grid_thw=[list(im.grid) for im in ep.images], image_tokens=sum(im.num_tokens for im in ep.images),
        )

    async def _close_sessions(self, handle: TaskHandle, env_session: Optional[str]) -> None:
        """The task's engine session, and its env session unless it was handed over (None)."""
        async with handle.lock:
            if handle.session_id is not None:
                session, handle.session_id = handle.session_id, None
                await self.engines[handle.session_rank].close_session(session)
        if env_session is not None:
            await self.env.close_quietly(env_session)

    @staticmethod
    async def _after_the_end(closing, task_id: str) -> None:
        """Close a finished episode's sessions; a cancel that lands meanwhile does not undo it.
        A cancel (a hand-over, a quarantine, a CTB cancel) can reach a task after its last env
        step returned and before it returns: the env answered, so its trajectory is whole, and
        raising the cancel would throw it away (a hand-over then started it afresh elsewhere,
        its tokens wasted). Its sessions still close, shielded from the cancel."""
        closing = asyncio.ensure_future(closing)
        while not closing.done():
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()
                logger.info("task %s: cancelled after its episode ended; its trajectory stands", task_id)
        closing.result()

    def _images_of_carry(self, data: list[bytes], task_id: str) -> list:
        if self.images is None:
            raise ImageInputError(f"task {task_id}: the carried episode holds {len(data)} image(s), but the policy "
                                  "is text-only")
        return self.images.prepare(data, f"task {task_id} (carried)")

    async def _turns(self, env_session: str, ep: Episode, handle: TaskHandle, listener: TurnListener,
                     task_id: str, result=None) -> None:
        """Generate and step the env until the episode ends. `result`: the env's answer to the
        episode's pending action, already known (a carried task's attach brought it)."""
        pending: tuple[list[int], list] = ([], [])  # what a live engine session has not seen yet
        previous_rid: Optional[str] = None  # none yet: the first turn sends the whole context
        while True:
            if ep.pending_action is None:
                remaining = self.cfg.max_context_tokens - len(ep.tokens)
                if ep.turns >= self.cfg.max_turns or remaining <= 0:
                    ep.truncated = True
                    return
                gen, version = await self._generate_turn(ep, pending, previous_rid, remaining, handle, listener)
                previous_rid = gen.rid
                ep.segments.append(Segment(len(ep.tokens), len(ep.tokens) + len(gen.output_ids), version))
                ep.append(gen.output_ids, 1, gen.logprobs)
                ep.pending_action = self.chat.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
                if handle.carry:  # stop before the env step: the next rank sends the action
                    raise asyncio.CancelledError("carried to another rank")
            if result is None:
                t0 = time.monotonic()
                result = await self.env.step(env_session, ep.pending_action)
                ep.env_wait_s += time.monotonic() - t0
            ep.env_steps, ep.pending_action = ep.env_steps + 1, None
            ep.reward += result.reward
            ep.info = result.info
            if result.done:
                return
            last = ep.segments[-1]
            output_ids = ep.tokens[last.start:last.end]
            send, ids, images = self._observation(
                result, f"task {task_id} turn {ep.turns}",
                lambda *n: self.chat.user_turn_ids(result.observation, output_ids, *n))
            if images and len(ep.tokens) + len(ids) > self.cfg.max_context_tokens:
                ep.truncated = True  # the context ends before the turn: an image is never cut
                return
            ep.append(ids, 0, send_ids=send, images=images)
            pending, result = (send, images), None

    async def _generate_turn(self, ep: Episode, pending: tuple[list[int], list], previous_rid: Optional[str],
                             remaining: int, handle: TaskHandle, listener: TurnListener) -> tuple[Generation, int]:
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
                    if session_params is not None and previous_rid is not None:
                        send, images = pending
                    else:
                        send, images = (ep.tokens if ep.send_tokens is None else ep.send_tokens), ep.images
                    tag = listener.turn_started(handle.task_id, len(ep.tokens), kind)
                    handle.started, handle.last_rank = True, rank
                    version = engine.weight_version
                    t0 = time.monotonic()
                    gen, report = await generate_tagged(engine, send, self._sampling(remaining), tag, session_params,
                                                        [im.data for im in images])
                    ep.generate_s += time.monotonic() - t0
            if ep.send_tokens is not None and gen.prompt_tokens != len(ep.tokens):
                raise RuntimeError(f"task {handle.task_id}: SGLang's context has {gen.prompt_tokens} tokens, the "
                                   f"trajectory {len(ep.tokens)}: image pads expanded differently")
            # SGLang's own per-request weight version, if it names one, cross-checks ours: a turn
            # that (against the turn gate) straddled an update is booked under the older one.
            if gen.weight_version is not None and str(gen.weight_version).isdigit():
                version = min(version, int(gen.weight_version))
            ep.turns += 1
            ep.prompt_tokens += gen.prompt_tokens
            ep.cached_tokens += gen.cached_tokens
            ep.generated += len(gen.output_ids)
            listener.turn_finished(handle.task_id, len(ep.tokens) + len(gen.output_ids), report)
            return gen, version


async def generate_tagged(engine: RolloutEngine, input_ids: list[int], sampling_params: dict[str, Any],
                          tag: Optional[TaskTag], session_params: Optional[dict[str, Any]],
                          image_data: Optional[list[bytes]] = None) -> tuple[Generation, Optional[dict[str, Any]]]:
    """`RolloutEngine.generate` with a CTB-tagged rid; also returns the plugin's report."""
    session_params = session_params or {}
    images = {"image_data": image_data} if image_data else {}  # text turns call the engine as before
    gen = await engine.generate(input_ids, sampling_params, session_params.get("id"), session_params.get("rid"),
                                rid=tag.to_rid() if tag is not None else None, **images)
    return gen, gen.ctb_report
