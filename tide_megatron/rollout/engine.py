"""The SGLang engine adapter: one in-process `sglang.Engine` per rollout rank.

Everything the rollout side needs from SGLang goes through `RolloutEngine`, as
coroutines on the engine's own event loop (SGLang's synchronous `Engine` methods call
`loop.run_until_complete`, which cannot nest inside the task runner's loop):
token-in/token-out generation with log-probs, one streaming session per task (the
session pins the task's prefix while it waits for its environment), in-place weight
updates from tensors, and cache flushes at the weight-sync boundary.

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
from dataclasses import dataclass, field
from typing import Any, Iterable

logger = logging.getLogger(__name__)


@dataclass
class RolloutEngineConfig:
    """How each rollout rank starts its SGLang engine."""

    device: str = "cpu"
    """`cpu` runs SGLang's generic path; `cuda` its normal GPU path."""
    attention_backend: str | None = "torch_native"
    """SGLang attention backend; torch_native is the one that works without GPU kernels."""
    dtype: str = "float32"
    """Engine dtype. fp32 on CPU keeps SGLang's log-probs equal to the trainer's."""
    max_total_tokens: int | None = 8192
    """KV pool size in tokens (None lets SGLang size it from memory)."""
    max_running_requests: int | None = 64
    """Request slots; each open streaming session holds one between turns."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights and KV (GPU only)."""
    tp_size: int = 1
    """Tensor parallelism inside one engine."""
    use_sessions: bool = True
    """One streaming session per task, so a waiting task keeps its prefix pinned."""
    log_level: str = "error"
    """SGLang's log level."""
    seed: int = 0
    """Sampling seed of the engine."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Further `sglang.Engine` keyword arguments, passed through unchanged."""

    def engine_kwargs(self, model_path: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model_path=model_path,
            device=self.device,
            dtype=self.dtype,
            tp_size=self.tp_size,
            log_level=self.log_level,
            random_seed=self.seed,
            skip_server_warmup=True,
            enable_streaming_session=self.use_sessions,
        )
        if self.attention_backend:
            kwargs["attention_backend"] = self.attention_backend
        if self.max_total_tokens:
            kwargs["max_total_tokens"] = self.max_total_tokens
        if self.max_running_requests:
            kwargs["max_running_requests"] = self.max_running_requests
        if self.mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = self.mem_fraction_static
        if self.device == "cpu":
            kwargs["disable_cuda_graph"] = True
        kwargs.update(self.extra_args)
        return kwargs


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


@contextlib.contextmanager
def _without_torchelastic_store():
    """Under torchrun, SGLang's scheduler inherits TORCHELASTIC_USE_AGENT_STORE and
    waits for a c10d store that nobody hosts; hide it while the engine starts."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


VISION_LANGUAGE_SGLANG_ENV = {"SGLANG_VLM_CACHE_SIZE_MB": "0", "SGLANG_MM_AVOID_RETOKENIZE": "1"}


def _is_vision_language(model_path: str) -> bool:
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f).get("model_type") == "qwen3_vl"
    except (OSError, ValueError):
        return False


class RolloutEngine:
    """An SGLang engine serving one rollout rank."""

    def __init__(self, cfg: RolloutEngineConfig, model_path: str):
        from sglang.srt.entrypoints.engine import Engine

        self.cfg = cfg
        self.model_path = model_path
        if _is_vision_language(model_path):
            for key, value in VISION_LANGUAGE_SGLANG_ENV.items():
                os.environ.setdefault(key, value)
        with _without_torchelastic_store():
            self._engine = Engine(**cfg.engine_kwargs(model_path))
        self.loop: asyncio.AbstractEventLoop = self._engine.loop
        self._tm = self._engine.tokenizer_manager
        self.weight_version = 0

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
        out = await self._engine.async_generate(
            input_ids=list(input_ids),
            sampling_params=sampling_params,
            return_logprob=True,
            session_params=session_params,
            rid=rid,
            image_data=image_data,
        )
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

        return await self._tm.open_session(
            OpenSessionReqInput(capacity_of_str_len=capacity_tokens, streaming=True), None
        )

    async def close_session(self, session_id: str | None) -> None:
        if session_id is None:
            return
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        await self._tm.close_session(CloseSessionReqInput(session_id=session_id), None)

    # -- weights ------------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load new weights in place (HF names) and drop every cached prefix, which the
        new policy makes stale."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        payload = [MultiprocessingSerializer.serialize(list(named_tensors))] * self.cfg.tp_size
        await self._tm.begin_weight_update(BeginWeightUpdateReqInput(selector="all"), None)
        try:
            ok, message = await self._tm.update_weights_from_tensor(
                UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=payload,
                    load_format=None,
                    flush_cache=True,
                    weight_version=str(version),
                ),
                None,
            )
        finally:
            await self._tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok:
            raise RuntimeError(f"SGLang rejected the weight update to version {version}: {message}")
        self.weight_version = version

    async def flush_cache(self) -> None:
        await self._tm.flush_cache()

    def shutdown(self) -> None:
        import multiprocessing

        self._engine.shutdown()
        for child in multiprocessing.active_children():  # reap the scheduler zombies
            child.join(timeout=1)
