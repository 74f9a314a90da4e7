"""Model architecture config, HF checkpoints, Megatron GPTModel builder, weight conversion."""

from tide_megatron.utils.lazy_exports import lazy_exports

# Each name below is imported from its module on first use (`utils/lazy_exports.py`), not here:
# importing one submodule runs this file first, and the architecture configs (`models.config`,
# `models.qwen3_vl_config`) must import without torch and Megatron.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("ModelConfig",),
    "hf_checkpoint": ("load_hf_model", "load_hf_state_dict", "write_random_hf_checkpoint"),
    "megatron_gpt": ("build_gpt_model", "causal_attention_mask", "destroy_parallel", "init_parallel",
                     "megatron_transformer_config"),
    "weight_conversion": ("hf_to_megatron", "load_hf_into_megatron", "megatron_shards_to_hf_state_dict",
                          "megatron_to_hf", "unwrap_model"),
})
