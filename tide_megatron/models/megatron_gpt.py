"""Megatron-core GPTModel for a Qwen2 `ModelConfig`, and the process-group setup it needs.

Everything uses Megatron-core's local (non-Transformer-Engine) spec so that one code path runs on
CPU (gloo) and GPU (NCCL). On CPU, `install_megatron_cpu_shims()` must run first; `init_parallel`
does that.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn.functional as F

from tide_megatron.compat.megatron_cpu import install_megatron_cpu_shims
from tide_megatron.models.config import ModelConfig


def init_parallel(tp_size: int = 1, seed: int = 0, timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed (from torchrun/spawn env vars) and Megatron's parallel state.

    Idempotent. Backend: NCCL with CUDA, gloo without. Pipeline parallelism is 1: the RL trainer
    shards the tiny-to-mid models it trains with TP and DP only. `seed` seeds Megatron's RNG
    tracker, which initialises TP-sharded weights (overwritten later by the HF checkpoint).
    """
    from megatron.core import parallel_state, tensor_parallel

    install_megatron_cpu_shims()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        world = torch.distributed.get_world_size()
        if world % tp_size:
            raise ValueError(f"world size {world} does not divide by tensor-parallel size {tp_size}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    elif parallel_state.get_tensor_model_parallel_world_size() != tp_size:
        raise RuntimeError(
            f"parallel state already initialised with TP="
            f"{parallel_state.get_tensor_model_parallel_world_size()}, asked for TP={tp_size}"
        )
    # The default tracker reads the CUDA RNG state; the inference tracker does not.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (end of a test or a run)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def megatron_transformer_config(cfg: ModelConfig, tp: int = 1, bf16: bool = False):
    """The Megatron `TransformerConfig` equivalent of a Qwen2 `ModelConfig`.

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
        **unfused_config_kwargs(tp, bf16),
    )


def unfused_config_kwargs(tp: int, bf16: bool) -> dict:
    """The `TransformerConfig` fields every model of the trainer shares: no dropout, no fusion,
    CPU initialisation, TP without sequence parallelism, fp32 (or bf16) params."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,  # torch LayerNorm asserts under SP on CPU; TP only
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


def build_gpt_model(cfg: ModelConfig, tp: int | None = None, bf16: bool = False):
    """A Megatron-core `GPTModel` (local spec, RoPE, Qwen2 layout) on the current device.

    Weights are Megatron's random init; load real ones with
    `tide_megatron.models.weight_conversion.load_hf_into_megatron`. `parallel_output=True`: the
    logits stay vocab-sharded under TP and log-probs use the vocab-parallel cross entropy.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if tp is None:
        tp = parallel_state.get_tensor_model_parallel_world_size()
    config = megatron_transformer_config(cfg, tp=tp, bf16=bf16)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask, True = masked (future positions). # [1, 1, S, S]

    Passed explicitly because Megatron builds its default one with `device="cuda"`.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]
