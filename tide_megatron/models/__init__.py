"""Model architecture config, HF checkpoints, Megatron GPTModel builder, weight conversion."""

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import load_hf_model, load_hf_state_dict, write_random_hf_checkpoint
from tide_megatron.models.megatron_gpt import (
    build_gpt_model,
    causal_attention_mask,
    destroy_parallel,
    init_parallel,
    megatron_transformer_config,
)
from tide_megatron.models.weight_conversion import (
    hf_to_megatron,
    load_hf_into_megatron,
    megatron_shards_to_hf_state_dict,
    megatron_to_hf,
    unwrap_model,
)

__all__ = [
    "ModelConfig", "build_gpt_model", "causal_attention_mask", "destroy_parallel", "hf_to_megatron",
    "init_parallel", "load_hf_into_megatron", "load_hf_model", "load_hf_state_dict",
    "megatron_shards_to_hf_state_dict", "megatron_to_hf", "megatron_transformer_config",
    "unwrap_model", "write_random_hf_checkpoint",
]
