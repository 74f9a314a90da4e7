"""The SGLang engine adapter: one in-process `sglang.Engine` per rollout rank.

Everything the rollout side needs from SGLang goes through `RolloutEngine`, as
coroutines on the engine's own event loop (SGLang's synchronous `Engine` methods call
`loop.run_until_complete`, which cannot nest inside the task runner's loop):
token-in/token-out generation with log-probs, one streaming session per task (the
session pins the task's prefix while it waits for its environment), in-place weight
updates from tensors, and cache flushes at the weight-sync boundary.

A weight update is a boundary for the tasks running on the engine: turns that are
generating finish first (`turn()`), no new turn starts, every open session is closed (its KV
was computed by the old weights), the weights load and the cache is flushed, then turns go
on; a task's next turn opens a fresh session and is prefilled under the new weights.

Images (vision-language checkpoints): `generate` passes the turn's encoded images to SGLang
(`image_data`, see `multimodal.py`), and the engine starts with two SGLang settings:
`SGLANG_VLM_CACHE_SIZE_MB=0`, because SGLang 0.5.23 keeps vision-encoder outputs in a cache keyed
by the image alone that neither `flush_cache` nor a weight update clears (a screenshot seen before
an update would keep the old vision weights' embedding; measured log-prob errors of 0.3-0.6), and
`SGLANG_MM_AVOID_RETOKENIZE=1`, so that prompts are never decoded and re-tokenized. A value
already in the environment is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Iterable

from tide_megatron.compat.sglang_fork import forked_engine_children
from tide_megatron.rollout.config import RolloutEngineConfig
from tide_megatron.rollout.turn_gate import TurnGate

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 60.0


@dataclass
class Generation:
    """One generate call's result, in tokens."""

    output_ids: list[int]
    logprobs: list[float]
    """Log-probability of each output token under the engine's weights. [T_out]"""
    finish_reason: str
    """`stop` (EOS or a stop token), `length` (max_new_tokens) or `abort`."""
    prompt_tokens: int
    """Tokens of context the engine had to have for this call (cached or not)."""
    cached_tokens: int
    """Of those, how many came from the prefix cache (no prefill)."""
    rid: str
    weight_version: str | None = None
    ctb_report: dict[str, Any] | None = None
    """The `tide_ctb` SGLang plugin's report on a task-tagged request (KV state, context)."""


DIST_INIT_OVERRIDE_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"


@contextlib.contextmanager
def _scheduler_environment(rendezvous_dir: str | None):
    """The environment SGLang's scheduler processes inherit while the engine starts.

    - Under torchrun they inherit TORCHELASTIC_USE_AGENT_STORE and would wait for a c10d
      store that nobody hosts: hidden.
    - Their torch.distributed world (the engine's TP ranks, all on this node) would meet at
      `tcp://127.0.0.1:<nccl_port>`, a TCPStore whose server listens on every interface
      whatever the host says. With `rendezvous_dir` they meet in a FileStore there instead,
      so the engine opens no TCP port (its other channels are ZMQ ipc sockets); the process
      groups' own sockets follow GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.
    """
    saved = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", DIST_INIT_OVERRIDE_ENV)}
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if rendezvous_dir is not None:
        os.environ[DIST_INIT_OVERRIDE_ENV] = "file://" + os.path.join(rendezvous_dir, "dist_init")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wants_file_rendezvous(engine_kwargs: dict[str, Any]) -> bool:
    """SGLang's own choice stays where the user made one (a multi-node engine, an explicit
    address or init method)."""
    return not (engine_kwargs.get("dist_init_addr") or int(engine_kwargs.get("nnodes") or 1) > 1
                or os.environ.get(DIST_INIT_OVERRIDE_ENV))


VISION_LANGUAGE_SGLANG_ENV = {"SGLANG_VLM_CACHE_SIZE_MB": "0", "SGLANG_MM_AVOID_RETOKENIZE": "1"}


def _process_running(pid: int) -> bool:
    """The process exists and is not a zombie (Linux: /proc; elsewhere: it exists)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _signal_handler_class(engine: "RolloutEngine"):
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    class RankSignalHandler(SignalHandler):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            engine._child_died(signum, frame)

    return RankSignalHandler


async def _default_sigterm() -> None:
    """SIGTERM back to its default (the process ends). On the running loop: uvloop, SGLang's
    loop, removes a handler only while it runs."""
    asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)


class RolloutEngine:
    """An SGLang engine serving one rollout rank."""

    def __init__(self, cfg: RolloutEngineConfig, model_path: str):
        from sglang.srt.entrypoints.engine import Engine

        self.cfg = cfg
        self.model_path = model_path
        from tide_megatron.models.policy import is_vision_language_checkpoint

        if is_vision_language_checkpoint(model_path):
            for key, value in VISION_LANGUAGE_SGLANG_ENV.items():
                os.environ.setdefault(key, value)
        self.died = False
        """A subprocess of the engine (its scheduler) died; the engine must be replaced."""
        self._death = asyncio.Event()  # set with `died`: wakes every call waiting on the scheduler
        kwargs = cfg.engine_kwargs(model_path)
        # SGLang's default answer to a dead scheduler is to kill this whole process tree, which
        # would take the rollout rank (and, under torchrun, the job) with it. Instead the rank
        # is told, fails the engine's tasks (they are retried) and starts a new engine.
        kwargs.setdefault("custom_sigquit_handler", self._child_died)
        # SGLang reconfigures the root logger (basicConfig(force=True) at its log level): keep
        # this rank's logging as it was and apply SGLang's level to SGLang's loggers only.
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        # Private to this user (0700): the FileStore is the engine's rendezvous, no TCP port.
        self._rendezvous_dir = tempfile.mkdtemp(prefix="tide-sglang-") if _wants_file_rendezvous(kwargs) else None
        try:
            with _scheduler_environment(self._rendezvous_dir), forked_engine_children(cfg.forks_children()) as forked:
                self._engine = Engine(**kwargs)
        except BaseException:
            if self._rendezvous_dir is not None:
                shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            raise
        self.children_forked: bool = forked
        """SGLang's scheduler and detokenizer were forked from this process, not spawned."""
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.getLogger("sglang").setLevel(cfg.log_level.upper())
        self.loop: asyncio.AbstractEventLoop = self._engine.loop
        self._tm = self._engine.tokenizer_manager
        # When it first runs, the tokenizer manager installs its own SIGQUIT handler (kill the
        # process tree); give it one that reports to this engine instead.
        self._tm.signal_handler_class = _signal_handler_class(self)
        # What SGLang allocated (with `max_total_tokens: null` it sizes the pool from memory):
        # CTB's budget follows these, not the config (`RankReady`). This is the tokenizer
        # manager's first run, so it comes after the handler above. (`Engine.get_server_info()`
        # would deep-copy the server args, which cannot copy that handler: its two parts are
        # read here directly.)
        init_info = self._engine._scheduler_init_result.scheduler_infos[0]
        state = self.loop.run_until_complete(self._tm.get_internal_state())[0]
        # That first run also gave SIGTERM a handler that only flags a drain SGLang's HTTP
        # server acts on: the rank would outlive torchrun's closing SIGTERM (its scheduler, in
        # the rank's process group, dies of it and the rank starts a new engine) until
        # torchrun's SIGKILL 30 s later, which delays every restart of the job. A rank stops
        # on SIGTERM, as rank 0 does. (SGLang installs it from the main thread only.)
        if threading.current_thread() is threading.main_thread():
            self.loop.run_until_complete(_default_sigterm())
        self.kv_tokens: int = int(init_info["max_total_num_tokens"])
        """Tokens the engine's KV pool holds."""
        self.request_rows: int = int(state["effective_max_running_requests_per_dp"])
        """Requests the scheduler runs at once (`max_running_requests` as resolved)."""
        self.weight_version = 0
        self.weight_epoch = 0
        """Counts weight loads: a session opened in an older epoch holds stale KV."""
        self._sessions: set[str] = set()
        self._gate = TurnGate()

    def _child_died(self, signum, frame) -> None:
        logger.error("an SGLang subprocess of this rollout rank died; the engine will be replaced")
        self.died = True
        loop = getattr(self, "loop", None)  # None while the engine itself is starting
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._death.set)

    def check_alive(self) -> bool:
        """Whether every SGLang subprocess still runs; marks the engine dead when one does not.

        SGLang's watchdog reports a dead scheduler with SIGQUIT, handled on the engine's asyncio
        loop, which runs only while the rank rolls out: a death while the rank trained (or just
        before it left rollout) would go unnoticed until its next call hung. So a rank asks
        directly when it comes back to rollout."""
        pids = getattr(getattr(self._engine, "_scheduler_init_result", None), "all_child_pids", None) or []
        if not self.died and any(not _process_running(pid) for pid in pids):
            self._child_died(None, None)
        return not self.died

    async def _unless_dead(self, awaitable):
        """Await a call on the scheduler, or raise as soon as the engine dies: a dead scheduler
        never answers, and a call left waiting would stall the rank (its heartbeats too)."""
        work = asyncio.ensure_future(awaitable)
        if self.died:
            work.cancel()
            raise RuntimeError("the rollout engine died")
        death = asyncio.ensure_future(self._death.wait())
        try:
            await asyncio.wait({work, death}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            death.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled() or not work.done():
            raise RuntimeError("the rollout engine died")
        return work.result()

    def turn(self):
        """Hold while one turn generates: a weight update waits for it and blocks new ones."""
        return self._gate.turn()

    @property
    def active_turns(self) -> int:
        return self._gate.active

    # -- generation -------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str | None = None,
        previous_rid: str | None = None,
        rid: str | None = None,
        image_data: list[bytes] | None = None,
    ) -> Generation:
        """Generate after `input_ids`. With a session, `input_ids` are only the tokens
        appended since the session's previous turn (`previous_rid`). `rid` names the
        request (CTB's task tag rides in it, see `sglang_patches.task_tag`). `image_data`:
        the encoded images of the image placeholders in `input_ids`, in order."""
        session_params = None
        if session_id is not None:
            session_params = {"id": session_id}
            if previous_rid is not None:
                session_params["rid"] = previous_rid
        out = await self._unless_dead(self._engine.async_generate(
            input_ids=list(input_ids),
            sampling_params=sampling_params,
            return_logprob=True,
            session_params=session_params,
            rid=rid,
            image_data=image_data,
        ))
        meta = out["meta_info"]
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
        if reason == "abort":
            raise RuntimeError(f"SGLang aborted request {meta.get('id')}: {finish}")
        return Generation(
            output_ids=list(out["output_ids"]),
            logprobs=[float(lp) for lp, _tok, _ in meta["output_token_logprobs"]],
            finish_reason=reason,
            prompt_tokens=int(meta["prompt_tokens"]),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            rid=str(meta["id"]),
            weight_version=meta.get("weight_version"),
            ctb_report=(meta.get("tide_ctb") or [None])[-1],
        )

    async def open_session(self, capacity_tokens: int) -> str | None:
        if not self.cfg.use_sessions:
            return None
        from sglang.srt.managers.io_struct import OpenSessionReqInput

        session_id = await self._unless_dead(self._tm.open_session(
            OpenSessionReqInput(capacity_of_str_len=capacity_tokens, streaming=True), None
        ))
        if session_id is not None:
            self._sessions.add(session_id)
        return session_id

    async def close_session(self, session_id: str | None) -> None:
        """Close a session of this engine (closed already, e.g. by a weight update: no-op)."""
        if session_id is None or session_id not in self._sessions:
            return
        if self.died:  # its scheduler is gone: nothing would answer
            self._sessions.discard(session_id)
            return
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        self._sessions.discard(session_id)
        try:
            await self._unless_dead(self._tm.close_session(CloseSessionReqInput(session_id=session_id), None))
        except RuntimeError:
            pass  # died meanwhile: the session went with its scheduler

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # -- weights ------------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load new weights in place (HF names) and drop every cached prefix and open session,
        which the new policy makes stale (see the module docstring)."""
        from sglang.srt.utils import MultiprocessingSerializer

        await self.load_serialized([MultiprocessingSerializer.serialize(list(named_tensors))], version)

    async def load_serialized(self, buckets: list, version: int) -> None:
        """`update_weights` from serialized buckets of named tensors (`weight_sync.bucket_handles`:
        shared-memory handles, which the scheduler maps without a copy here), one SGLang update
        per bucket inside one weight-update boundary."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        await self._swap_weights(lambda: self._load(self._tm.update_weights_from_tensor, [
            UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[bucket] * self.cfg.tp_size,
                load_format=None,
                flush_cache=False,  # flushed in `_load`, once the sessions' requests have drained
                weight_version=str(version),
            ) for bucket in buckets], version), version)

    async def load_broadcast(self, buckets: list[tuple[list[str], list[list[int]]]], dtype: str, group: str,
                             version: int) -> None:
        """`load_serialized` for the broadcast path (`comm/update_group.py`): each bucket's
        tensors (names, shapes, all of `dtype`) arrive from rank 0's broadcast over `group`."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        await self._swap_weights(lambda: self._load(self._tm.update_weights_from_distributed, [
            UpdateWeightsFromDistributedReqInput(
                names=names, dtypes=[dtype] * len(names), shapes=shapes, group_name=group, flush_cache=False,
                load_format="flattened_bucket", weight_version=str(version),
            ) for names, shapes in buckets], version), version)

    async def join_update_group(self, address: str, port: int, rank_offset: int, world_size: int, group: str,
                                backend: str, leave: str = "") -> None:
        """Join the weight update group `group` (SGLang's `init_weights_update_group`; returns
        once every member and rank 0 joined), leaving `leave` first."""
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput, InitWeightsUpdateGroupReqInput

        if leave:  # refused when it went with an earlier engine: nothing to leave then
            await self._unless_dead(self._tm.destroy_weights_update_group(
                DestroyWeightsUpdateGroupReqInput(group_name=leave), None))
        ok, message = await self._unless_dead(self._tm.init_weights_update_group(InitWeightsUpdateGroupReqInput(
            master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size,
            group_name=group, backend=backend), None))
        if not ok:
            raise RuntimeError(f"the engine could not join weight update group {group}: {message}")

    def abandon(self, why: str) -> None:
        """Give this engine up (`died`): its scheduler is stuck (in a collective whose peer
        hung) and would never answer again. Its subprocesses are killed; the rank replaces it."""
        logger.error("abandoning the rollout engine: %s", why)
        pids = getattr(getattr(self._engine, "_scheduler_init_result", None), "all_child_pids", None) or []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._child_died(None, None)

    async def _swap_weights(self, load, version: int) -> None:
        """Await `load()` with no turn in flight and no session open (see the module docstring)."""
        async def swap() -> None:
            for session_id in list(self._sessions):
                await self.close_session(session_id)
            await self._unless_dead(load())
            self.weight_version = version
            self.weight_epoch += 1

        await self._gate.closed(swap)

    async def _load(self, update, requests: list, version: int) -> None:
        """`update(request)` for each bucket inside one weight-update boundary, then a flush."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        await self._unless_dead(self._tm.begin_weight_update(BeginWeightUpdateReqInput(selector="all"), None))
        try:
            for request in requests:
                ok, message = await self._unless_dead(update(request, None))
                if not ok:
                    raise RuntimeError(f"SGLang rejected the weight update to version {version}: {message}")
        finally:
            await self._unless_dead(self._tm.end_weight_update(EndWeightUpdateReqInput(), None))
        # Closing a session frees its request on the scheduler's next pass; the deferred flush
        # waits for that idle moment (no new turn can start meanwhile: the turn gate is closed).
        flushed = await self._tm.flush_cache(timeout_s=FLUSH_TIMEOUT_S)
        if not flushed.success:
            raise RuntimeError(f"weights {version} loaded but SGLang could not flush the old cache within "
                               f"{FLUSH_TIMEOUT_S:.0f} s: {flushed.message}")

    async def flush_cache(self) -> bool:
        return (await self._unless_dead(self._tm.flush_cache(timeout_s=FLUSH_TIMEOUT_S))).success

    # -- a spell in the trainer (ERS) -------------------------------------------------
    @property
    def can_release_memory(self) -> bool:
        """SGLang frees and restores weights and KV only with its memory saver (GPU only:
        `rollout.engine.extra_args.enable_memory_saver=true`, with `torch_memory_saver`)."""
        return bool(getattr(self._engine.server_args, "enable_memory_saver", False))

    def release_memory(self) -> bool:
        """Free the engine's GPU memory while the rank trains; False when it cannot (see
        `can_release_memory`: the engine then stays resident and idle)."""
        if not self.can_release_memory:
            logger.info("rollout engine stays resident while this rank trains (no SGLang memory saver%s)",
                        " on CPU" if self.cfg.device == "cpu" else "")
            return False
        self._engine.release_memory_occupation()
        return True

    def resume_memory(self) -> None:
        """Restore what `release_memory` freed (the weights are reloaded by the next sync)."""
        self._engine.resume_memory_occupation()

    def shutdown(self) -> None:
        import multiprocessing

        try:
            self._engine.shutdown()
        finally:
            for child in multiprocessing.active_children():  # reap the scheduler zombies
                if self.died:
                    child.kill()  # a dead engine's other subprocesses go too
                child.join(timeout=1)
            if self._rendezvous_dir is not None:
                shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.load_snapshot_file)

    @property
    def load_snapshot_file(self) -> str:
        """The /dev/shm file in which SGLang's scheduler publishes its load. Nothing upstream
        unlinks it (SGLang's own CI sweeps such files at job start), so without `shutdown`'s
        unlink every engine start would leave one behind."""
        from sglang.srt.managers.load_snapshot import shm_path_for

        return shm_path_for(self._engine.port_args.instance_id)
