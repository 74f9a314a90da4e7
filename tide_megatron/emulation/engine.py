"""An SGLang engine stand-in for emulated device time (`cluster.device=emulated`).

It serves a rollout rank exactly what `rollout.engine.RolloutEngine` serves (token-in/token-out
generation, streaming sessions, the weight-update boundary, the `tide_ctb` plugin's contract)
with no model: each prefill and decode iteration of its current batch takes the time the
simulator's cost model gives (`sim.hardware.HardwareModel`), times `EmulationConfig.dilation`.

The scheduler it emulates is SGLang's, with the `tide_ctb` plugin in it, and it takes the
plugin's decisions from the plugin's own module (`sglang_patches.scheduler_hooks`):
- a loop on the engine's event loop alternates prefill batches of waiting requests (taken in
  the plugin's `queue_key` order while request rows, `max_prefill_tokens` and KV room last) and
  decode iterations of the running batch;
- the KV pool (`kv_pool.KVPool`) reuses prefixes: a session's context stays held between turns,
  a closed session's context stays cached (the plugin's release caching), LRU eviction;
- when decode runs out of KV it retracts the plugin's `keep_key` order's last request first;
- each finished tagged request carries the plugin's report (`SchedulerCTBState.report`) with
  this pool's numbers and the decode counters (in wall seconds, i.e. dilated).
Decode advances in leaps to the next request's end (one sleep, not one per token), cut short
when a request arrives: SGLang takes a new request in after at most one decode iteration, and
so does this loop.

Output tokens are `filler_token_id`, each with log-prob -1.0: emulated envs do not read actions.
How many a request generates: `answer_length(context)` when it says (the `workload` env writes
it into each observation), else a draw from `EmulationConfig.gen_tokens` seeded by the context,
capped by `max_new_tokens` (`ignore_eos`: exactly `max_new_tokens`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sglang_patches.scheduler_hooks import SchedulerCTBState, keep_key, queue_key
from sglang_patches.task_tag import ADMIT, TaskTag, parse_rid
from tide_megatron.emulation.config import EmulationConfig
from tide_megatron.emulation.kv_pool import Holding, KVPool
from tide_megatron.rollout.config import RolloutEngineConfig
from tide_megatron.rollout.engine import Generation
from tide_megatron.rollout.turn_gate import TurnGate
from tide_megatron.sim.hardware import HardwareModel

logger = logging.getLogger(__name__)

OUTPUT_LOGPROB = -1.0


@dataclass(eq=False)
class _Session:
    sid: str
    context: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    holding: Optional[Holding] = None
    """What the session holds between turns (None while a turn has it, or before the first)."""
    busy: bool = False
    closing: bool = False
    first_pages: int = -1
    """Full pages of its first request's context: all that an untagged session leaves cached
    when it closes (SGLang's own release; the plugin caches a tagged session's whole context).
    -1 until that request is admitted; from then on the session holds a request row."""


@dataclass(eq=False)
class _Request:
    rid: str
    tag: Optional[TaskTag]
    context: list[int]
    """Tokens before this request's output. [T_in]"""
    answer: int
    """Tokens it generates in all."""
    finish_reason: str
    session: Optional[_Session]
    future: asyncio.Future
    out: int = 0
    cached: int = -1
    """Context tokens found in the pool at its first admission (-1: not admitted yet)."""
    prefix: int = 0
    """Tokens it did not have to prefill at its latest admission (after a retraction, fewer)."""
    hashes: list[int] = field(default_factory=list)
    """Page hashes of its tokens so far (a prefix of them)."""
    holding: Optional[Holding] = None
    retractions: int = 0

    def tokens(self) -> int:
        return len(self.context) + self.out


class EmulatedEngine:
    """A rollout rank's engine with modelled device time (see the module docstring)."""

    def __init__(self, cfg: RolloutEngineConfig, emulation: EmulationConfig, cost: HardwareModel,
                 answer_length: Optional[Callable[[list[int]], Optional[int]]] = None, cluster_gpus: int = 1):
        """`answer_length(context)`: tokens the policy answers a context with, when it says;
        `cluster_gpus`: GPUs of the job (a weight update costs the simulator's broadcast time
        for that many, `HardwareModel.weight_sync_s`)."""
        self.cfg = cfg
        self.cluster_gpus = cluster_gpus
        self.emulation = emulation
        self.cost = cost
        self._answer_length = answer_length
        self.loop = asyncio.new_event_loop()
        self.died = False
        self.kv_tokens: int = cfg.max_total_tokens or cost.kv_capacity_tokens
        self.request_rows: int = cfg.max_running_requests or emulation.request_rows
        self.weight_version = 0
        self.weight_epoch = 0
        self.device_s = 0.0
        """Modelled device seconds spent so far (undilated): prefill, decode, weight loads."""
        self._pool = KVPool(self.kv_tokens, emulation.page_tokens)
        self._state = SchedulerCTBState()
        self._gate = TurnGate()
        self._sessions: dict[str, _Session] = {}
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._arrived = asyncio.Event()
        self._scheduler: Optional[asyncio.Task] = None
        self._ids = itertools.count()

    # -- the TurnGate and liveness, as RolloutEngine -----------------------------------
    def turn(self):
        return self._gate.turn()

    @property
    def active_turns(self) -> int:
        return self._gate.active

    def check_alive(self) -> bool:
        return not self.died

    def abandon(self, why: str) -> None:
        self.died = True
        for req in self._waiting + self._running:
            if not req.future.done():
                req.future.set_exception(RuntimeError(f"the rollout engine died: {why}"))

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # -- generation -----------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], session_id: Optional[str] = None,
                       previous_rid: Optional[str] = None, rid: Optional[str] = None,
                       image_data: Optional[list[bytes]] = None) -> Generation:
        """`RolloutEngine.generate`, with modelled time."""
        if self.died:
            raise RuntimeError("the rollout engine died")
        if image_data:
            raise ValueError("the emulated engine models text-only policies: a request brought images")
        self._start_scheduler()
        rid = rid or f"emulated-{uuid.uuid4().hex[:12]}"
        tag = parse_rid(rid)
        session = None
        if session_id is not None:
            session = self._sessions.get(session_id)
            if session is None or session.closing:
                raise RuntimeError(f"SGLang aborted request {rid}: session {session_id} is not open")
            if session.busy:
                raise RuntimeError(f"SGLang aborted request {rid}: session {session_id} already runs a request")
        context = (session.context if session is not None and previous_rid is not None else []) + list(input_ids)
        if tag is not None:
            self._state.count("intake")
            self._state.tags[rid] = tag
            self._state.pinned.pop(tag.task_id, None)
            if session is not None:
                self._state.session_task[session.sid] = tag.task_id
        max_new = max(1, int(sampling_params.get("max_new_tokens") or 128))
        wanted = max_new if sampling_params.get("ignore_eos") else self._wanted(context)
        answer = min(max_new, wanted)
        req = _Request(rid, tag, context, answer, "stop" if wanted < max_new else "length", session,
                       self.loop.create_future())
        if session is not None:
            session.busy = True
            req.hashes = session.hashes if previous_rid is not None else []
        self._waiting.append(req)
        self._arrived.set()
        try:
            return await req.future
        finally:
            self._state.tags.pop(rid, None)

    def _wanted(self, context: list[int]) -> int:
        said = self._answer_length(context) if self._answer_length is not None else None
        if said is not None:
            return max(1, int(said))
        median, sigma = self.emulation.gen_tokens
        rng = random.Random(hash((self.cfg.seed, len(context), tuple(context[-16:]))))
        return max(1, round(median * math.exp(rng.gauss(0.0, sigma)))) if sigma > 0 else max(1, round(median))

    async def open_session(self, capacity_tokens: int) -> Optional[str]:
        if not self.cfg.use_sessions:
            return None
        sid = f"session-{next(self._ids)}"
        self._sessions[sid] = _Session(sid)
        return sid

    async def close_session(self, session_id: Optional[str]) -> None:
        """Close a session (closed already: no-op). With a turn in flight the close waits for
        it (SGLang defers it); the context then stays in the pool as evictable cache."""
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is None:
            return
        session.closing = True
        if not session.busy:
            self._release_session(session)

    def _release_session(self, session: _Session) -> None:
        del self._sessions[session.sid]
        task_id = self._state.session_task.pop(session.sid, None)
        if task_id is not None:
            self._state.count("close_session")
            self._state.pinned.pop(task_id, None)
        if session.holding is not None:
            pages = session.holding.pages
            if task_id is not None and pages:
                self._state.count("release_cached")
                self._state.released_sessions += 1
                self._state.released_cached_tokens += len(pages) * self._pool.page
            self._pool.release(session.holding)
            if task_id is None:
                self._pool.forget(pages[max(0, session.first_pages):])
            session.holding = None
        self._arrived.set()  # a row came free

    # -- weights ----------------------------------------------------------------------------
    async def load_serialized(self, buckets: list, version: int) -> None:
        """New weights at a weight-update boundary: the engine closes every session, takes the
        simulator's time for a weight broadcast to it, and drops its cache. (The bytes that
        arrive are the small checkpoint's; the time is the modelled model's.)"""
        await self._swap_weights(version)

    async def update_weights(self, named_tensors, version: int) -> None:
        await self._swap_weights(version)

    async def load_broadcast(self, *args, **kwargs) -> None:
        raise RuntimeError("the emulated engine receives weights on the host path only "
                           "(scheduler.weight_sync_path=host)")

    async def join_update_group(self, *args, **kwargs) -> None:
        raise RuntimeError("the emulated engine receives weights on the host path only "
                           "(scheduler.weight_sync_path=host)")

    async def _swap_weights(self, version: int) -> None:
        async def swap() -> None:
            for sid in list(self._sessions):
                await self.close_session(sid)
            await self._device(self.cost.weight_sync_s(self.cluster_gpus))
            self._pool.flush()
            self.weight_version = version
            self.weight_epoch += 1

        await self._gate.closed(swap)

    async def flush_cache(self) -> bool:
        if self._running or self._waiting or self._sessions:
            return False
        self._pool.flush()
        return True

    # -- a spell in the trainer (ERS): as SGLang's memory saver on GPU ----------------------
    @property
    def can_release_memory(self) -> bool:
        return True

    def release_memory(self) -> bool:
        for session in list(self._sessions.values()):
            if not session.busy:
                self._release_session(session)
        if not self._running and not self._waiting and not self._sessions:
            self._pool.flush()
        return True

    def resume_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._scheduler is not None and not self.loop.is_closed():
            self._scheduler.cancel()
            self.loop.run_until_complete(asyncio.gather(self._scheduler, return_exceptions=True))
        if not self.loop.is_closed():
            self.loop.close()

    # -- the scheduler ------------------------------------------------------------------------
    def _start_scheduler(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = self.loop.create_task(self._schedule())

    def _rows_used(self) -> int:
        """Request rows held: one by each session since its first request was admitted (SGLang
        keeps it between turns), one by each running request outside a session."""
        return sum(1 for s in self._sessions.values() if s.first_pages >= 0) + sum(
            1 for r in self._running if r.session is None)

    async def _device(self, seconds: float, interruptible: bool = False) -> float:
        """Let `seconds` of modelled device time pass (dilated); with `interruptible`, a request's
        arrival ends the wait early. Returns the modelled seconds that passed."""
        self.device_s += seconds
        wall = seconds * self.emulation.dilation
        if not interruptible:
            await asyncio.sleep(wall)
            return seconds
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._arrived.wait(), wall)
        except asyncio.TimeoutError:
            return seconds
        passed = (time.monotonic() - t0) / self.emulation.dilation
        self.device_s -= seconds - passed
        return passed

    async def _schedule(self) -> None:
        try:
            await self._schedule_forever()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a request must never wait on a scheduler that is gone
            logger.exception("the emulated engine's scheduler failed")
            self.abandon(f"its scheduler failed: {type(exc).__name__}: {exc}")
            raise

    async def _schedule_forever(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            self._arrived.clear()
            batch = self._admit()
            if batch:
                await self._prefill(batch)
            elif self._running:
                await self._decode()
            else:  # waiting requests that do not fit yet: a release or an arrival may change that
                await self._arrived.wait()

    def _admit(self) -> list[_Request]:
        """Waiting requests SGLang's scheduler would take into the next prefill batch."""
        batch: list[_Request] = []
        budget = self.emulation.max_prefill_tokens
        rows = self.request_rows - self._rows_used()
        for req in sorted(self._waiting, key=lambda r: queue_key(r.tag)):
            if rows < 1:  # SGLang admits a request only while a row is free (a session's turn then
                break     # runs on the session's own row)
            if req.tokens() + 1 > self.kv_tokens:
                req.future.set_exception(RuntimeError(
                    f"SGLang aborted request {req.rid}: its {req.tokens()} tokens do not fit the KV pool of "
                    f"{self.kv_tokens}"))
                self._waiting.remove(req)
                continue
            tokens = req.context + [self.emulation.filler_token_id] * req.out  # out > 0: retracted
            req.hashes = self._pool.hashes(tokens, req.hashes)
            held = req.session.holding if req.session is not None else None
            cached = len(req.session.context) if held is not None else self._pool.match(req.hashes)
            new = req.tokens() - cached
            if batch and new > budget:
                break
            need = self._pool.room_for(req.hashes, req.tokens() + 1, held)
            if need and self._pool.evict(need, keep=req.hashes) < need:
                break  # SGLang's own KV check: it waits for room
            req.holding = self._pool.hold(req.hashes, req.tokens(), held)
            if req.session is not None:
                req.session.holding = None  # the request holds the session's context now
            if req.session is None or req.session.first_pages < 0:
                rows -= 1
            if req.session is not None and req.session.first_pages < 0:
                req.session.first_pages = len(req.context) // self._pool.page
            req.prefix = min(cached, req.tokens() - 1)
            if req.cached < 0:
                req.cached = min(cached, len(req.context))
            budget -= new
            batch.append(req)
            self._waiting.remove(req)
            if req.tag is not None and req.tag.kind == ADMIT:
                self._state.count("add_one_req")
                self._state.admitted += 1
        if len(batch) > 0:
            self._state.count("calc_priority")
        return batch

    async def _prefill(self, batch: list[_Request]) -> None:
        seconds = await self._device(sum(self.cost.prefill_s(r.tokens() - r.prefix, r.prefix) for r in batch))
        self._state.record_batch(seconds * self.emulation.dilation)
        for req in batch:  # a prefill samples each request's first token
            self._advance(req, 1)
            if req.out >= req.answer:
                self._finish(req)
            else:
                self._running.append(req)

    def _advance(self, req: _Request, tokens: int) -> None:
        short = tokens - self._pool.available
        if short > 0:
            self._pool.evict(short)
        self._pool.reserve(req.holding, tokens)
        req.out += tokens

    async def _decode(self) -> None:
        """Decode iterations until the next request ends, or a request arrives."""
        n = len(self._running)
        room = self._pool.available + self._pool.evictable
        while room < n and n > 1:  # not one more token each: retract (SGLang's retract_decode)
            self._retract()
            n = len(self._running)
            room = self._pool.available + self._pool.evictable
        if room < 1:
            raise RuntimeError("the emulated KV pool is full with a single running request")
        k = max(1, min(min(r.answer - r.out for r in self._running), room // n))
        context = sum(r.tokens() for r in self._running)
        times = [self.cost.decode_iteration_s(n, context + i * n) for i in range(k)]
        passed = await self._device(sum(times), interruptible=True)
        done, elapsed = 0, 0.0
        while done < k and elapsed < passed - 1e-12:
            elapsed += times[done]
            done += 1
        if elapsed > passed:  # finish the iteration in flight, as SGLang does
            await self._device(elapsed - passed)
        self._state.record_batch(max(elapsed, passed) * self.emulation.dilation)
        if done:
            self._state.record_decode(n, elapsed * self.emulation.dilation, done)
        for req in list(self._running):
            self._advance(req, done)
            if req.out >= req.answer:
                self._running.remove(req)
                self._finish(req)

    def _retract(self) -> None:
        victim = max(self._running, key=lambda r: keep_key(r.tag))
        self._running.remove(victim)
        self._pool.release(victim.holding)
        victim.holding = None
        victim.retractions += 1
        if victim.tag is not None:
            self._state.count("retraction_order")
            self._state.ctb_retractions += 1
        self._waiting.insert(0, victim)  # its output so far is kept and prefilled again with its input

    def _finish(self, req: _Request) -> None:
        out_ids = [self.emulation.filler_token_id] * req.out
        full = req.context + out_ids
        hashes = self._pool.hashes(full, req.hashes)
        holding = self._pool.hold(hashes, len(full), req.holding)
        session = req.session
        if session is not None:
            session.context, session.hashes, session.holding, session.busy = full, hashes, holding, False
        else:
            self._pool.release(holding)  # the finished request's prefix stays cached
        report = None
        if req.tag is not None:
            if session is not None and not session.closing:
                self._state.pinned[req.tag.task_id] = (len(full), req.tag.turn_reserve_tokens)
            self._state.count("report")
            report = self._state.report(req.tag, len(full), req.retractions, self._kv_state())
        if session is not None and session.closing:
            self._release_session(session)
        if not req.future.done():
            req.future.set_result(Generation(
                output_ids=out_ids, logprobs=[OUTPUT_LOGPROB] * req.out, finish_reason=req.finish_reason,
                prompt_tokens=len(req.context), cached_tokens=max(0, req.cached), rid=req.rid,
                weight_version=str(self.weight_version), ctb_report=report))

    def _kv_state(self) -> dict[str, int]:
        return {"kv_available": self._pool.available, "kv_total": self._pool.capacity,
                "kv_evictable": self._pool.evictable, "kv_protected": self._pool.protected,
                "rows_free": self.request_rows - self._rows_used(), "rows_total": self.request_rows}
