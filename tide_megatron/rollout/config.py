"""Configuration of the rollout side: each rank's SGLang engine and its tasks' limits.

A config-only module (stdlib only): `tide_megatron.config` composes these into the job
config without importing the engine adapter or the task runner, which import SGLang and the
models. CTB's own settings are in `ctb_config.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    base_gpu_id: int | None = None
    """The first local GPU of the engine (`device=cuda`); set per rank from the rank plan, not in
    a recipe. None: SGLang's default, GPU 0."""
    use_sessions: bool = True
    """One streaming session per task, so a waiting task keeps its prefix pinned."""
    sleep_on_idle: bool | None = None
    """An idle SGLang scheduler waits on its sockets instead of polling them. None: on with
    `device=cpu`, where a polling scheduler takes a core from the processes that work (2 rollout
    ranks on a 2-core machine: `benchmarks/sleep_on_idle.py`)."""
    fork_children: bool | None = None
    """Start SGLang's scheduler and detokenizer by fork instead of spawn, so that they do not
    import SGLang again (`tide_megatron/compat/sglang_fork.py`; `benchmarks/engine_start.py`).
    None: on with `device=cpu`. Never where CUDA exists: a CUDA context does not survive a fork."""
    log_level: str = "error"
    """SGLang's log level."""
    seed: int = 0
    """Sampling seed of the engine."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Further `sglang.Engine` keyword arguments, passed through unchanged."""

    def forks_children(self) -> bool:
        """`fork_children` resolved (the compat layer still refuses where CUDA exists)."""
        return self.fork_children if self.fork_children is not None else self.device == "cpu"

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
        elif self.base_gpu_id is not None:
            kwargs["base_gpu_id"] = self.base_gpu_id
        if self.sleep_on_idle if self.sleep_on_idle is not None else self.device == "cpu":
            kwargs["sleep_on_idle"] = True
        kwargs.update(self.extra_args)
        return kwargs


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
