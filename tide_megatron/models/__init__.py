"""Model architecture config, HF checkpoints, Megatron GPTModel builder, weight conversion."""

import importlib

# Each name below is imported from its module on first use (PEP 562), not here: importing one
# submodule runs this file first, and the architecture configs (`models.config`,
# `models.qwen3_vl_config`) must import without torch and Megatron.
_EXPORTS = {name: module for module, names in {
    "config": ("ModelConfig",),
    "hf_checkpoint": ("load_hf_model", "load_hf_state_dict", "write_random_hf_checkpoint"),
    "megatron_gpt": ("build_gpt_model", "causal_attention_mask", "destroy_parallel", "init_parallel",
                     "megatron_transformer_config"),
    "weight_conversion": ("hf_to_megatron", "load_hf_into_megatron", "megatron_shards_to_hf_state_dict",
                          "megatron_to_hf", "unwrap_model"),
}.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
