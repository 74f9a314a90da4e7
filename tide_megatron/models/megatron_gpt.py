"""Megatron-core GPTModel for a Qwen2 / Qwen3 dense `ModelConfig`, and the process-group setup it
needs.

The layer spec is `trainer.layer_spec`'s (`models/layer_spec.py`): Transformer Engine's where it
can run, else Megatron's local spec with packed attention, the same code path on CPU (gloo) and
GPU (NCCL). On CPU, `install_megatron_cpu_shims()` must run first; `init_parallel` does that. Models take their process groups as a `ProcessGroupCollection` (`comm/groups.py`).
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from datetime import timedelta
from typing import Iterator

import torch
import torch.nn.functional as F

from tide_megatron.compat.megatron_cpu import install_megatron_cpu_shims
from tide_megatron.models.config import ModelConfig
from tide_megatron.models.layer_spec import gpt_layer_spec, resolve_layer_spec


def init_parallel(tp_size: int = 1, seed: int = 0, timeout_s: float = 600.0):
    """Join torch.distributed (from torchrun/spawn env vars) and create this rank's process groups.

    Idempotent; returns the process's `comm.groups.GroupRegistry` (layout: the whole world in TP
    blocks of `tp_size`, see `comm/groups.py`). Backend: NCCL with CUDA, gloo without. Megatron's
    global `parallel_state` stays uninitialised: models, DDP, optimizer and schedule take the
    registry's groups explicitly. `seed` seeds Megatron's RNG tracker, which initialises
    TP-sharded weights (overwritten later by the HF checkpoint).
    """
    from tide_megatron.comm import groups

    install_megatron_cpu_shims()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    layout = groups.GroupLayout(torch.distributed.get_world_size(), tp_size)
    current = groups.registry(required=False)
    if current is None:
        current = groups.GroupRegistry.build(layout, torch.distributed.get_rank(),
                                             groups.new_group_factory(timeout_s=timeout_s))
        groups.set_registry(current)
    elif current.layout != layout:
        raise RuntimeError(f"process groups already set up for {current.layout}, asked for {layout}")
    seed_megatron(seed, current.layout.tp_position(current.rank))
    return current


def seed_megatron(seed: int, tp_rank: int) -> None:
    """Megatron's per-process state that is not a process group: the RNG tracker (seeded for this
    TP rank; the default tracker reads the CUDA RNG state, the inference tracker does not) and
    the scratch buffer its attention uses."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True,
        tp_rank=tp_rank, ep_rank=0, etp_rank=tp_rank)


def destroy_parallel() -> None:
    """Forget the process groups and tear down the default process group (end of a test or a run)."""
    from tide_megatron.comm import groups

    groups.set_registry(None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def spawned_rank(rank: int, world: int, port: int, threads: int = 1) -> Iterator[None]:
    """Run the block as rank `rank` of a job of `world` processes on this machine (the children
    of `torch.multiprocessing.spawn` in tests and benchmarks): env:// rendezvous on `port`,
    `threads` torch threads, the traceback printed on failure (spawn reports only the exit), and
    the process groups torn down at the end."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        yield
    except Exception:
        traceback.print_exc()
        raise
    finally:
        destroy_parallel()


def spawn_ranks(scenario, world: int, *args) -> None:
    """Run `scenario(rank, *args)` in `world` processes of one job on this machine, each inside
    `spawned_rank` on a fresh port; returns when all have ended, raises when one failed.
    `scenario` must be a module-level function (spawn pickles it by name)."""
    from tide_megatron.utils.net import free_port

    torch.multiprocessing.spawn(_run_spawned, args=(scenario, world, free_port(), args), nprocs=world, join=True)


def _run_spawned(rank: int, scenario, world: int, port: int, args: tuple) -> None:
    warnings.filterwarnings("ignore")  # Megatron's CPU-path deprecation noise in every child
    with spawned_rank(rank, world, port):
        scenario(rank, *args)


def megatron_transformer_config(cfg: ModelConfig, tp: int = 1, bf16: bool = False, recompute: str = "none",
                                layer_spec: str = "local"):
    """The Megatron `TransformerConfig` equivalent of a Qwen2 `ModelConfig` (`layer_spec`:
    "te" or "local", resolved).

    fp32 by default (exact agreement with HF on CPU); dropout 0 (the RL default, and it keeps
    old/new/ref log-probs comparable); every fusion off (none exist on CPU, and the unfused paths
    are the reference numerics).
    """
    from megatron.core.transformer import TransformerConfig

    cfg.check_tensor_parallel(tp)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: fc1 = [gate; up], act = silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_layernorm,  # Qwen3: per-head RMSNorm of q and k
        **unfused_config_kwargs(tp, bf16, recompute, sequence_parallel=layer_spec == "te" and tp > 1),
    )


def unfused_config_kwargs(tp: int, bf16: bool, recompute: str = "none", sequence_parallel: bool = False) -> dict:
    """The `TransformerConfig` fields every model of the trainer shares: no dropout, no fusion,
    CPU initialisation, fp32 (or bf16) params, the activation recompute of `trainer.recompute`
    ("selective": core attention, whose O(L^2) scores dominate long rows; "full": every layer
    from its input, one layer per unit), and sequence parallelism when asked (the Transformer
    Engine spec under TP; the local spec's torch norms assert under it)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    if recompute == "selective":
        recompute_kwargs = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute == "full":
        recompute_kwargs = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "none":
        recompute_kwargs = {}
    else:
        raise ValueError(f"trainer.recompute={recompute!r}: expected none, selective or full")
    return dict(
        **recompute_kwargs,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        bf16=bf16,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt_model(cfg: ModelConfig, groups=None, bf16: bool = False, recompute: str = "none",
                    layer_spec: str = "auto"):
    """A Megatron-core `GPTModel` (local spec, RoPE, Qwen2 layout) on the current device.

    `groups`: the Megatron `ProcessGroupCollection` it runs on (its TP group sets the TP size);
    default: this rank's forward-only collection from the start-up registry. Weights are
    Megatron's random init; load real ones with
    `tide_megatron.models.weight_conversion.load_hf_into_megatron`. `parallel_output=True`: the
    logits stay vocab-sharded under TP and log-probs use the vocab-parallel cross entropy.
    """
    from megatron.core.models.gpt import GPTModel

    if groups is None:
        from tide_megatron.comm.groups import registry

        groups = registry().model_groups()
    spec = resolve_layer_spec(layer_spec)
    config = megatron_transformer_config(cfg, tp=groups.tp.size(), bf16=bf16, recompute=recompute, layer_spec=spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(spec, qk_layernorm=cfg.qk_layernorm),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        pg_collection=groups,
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask, True = masked (future positions). # [1, 1, S, S]

    Passed explicitly because Megatron builds its default one with `device="cuda"`.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]
