"""The policy model of a checkpoint, whichever family it is: the one place that dispatches on it.

Two families: Qwen2 / Qwen3 dense text models (`ModelConfig`, Megatron `GPTModel`) and Qwen3-VL
vision-language models (`VLModelConfig`, `Qwen3VLModel`). The trainer, the reference model and
the weight push call these functions and never look at the family themselves.
"""

from __future__ import annotations

import os
from typing import Iterator, Union

import torch

from tide_megatron.models.config import ModelConfig, read_hf_config
from tide_megatron.models.qwen3_vl_config import VLModelConfig

VL_MODEL_TYPE = "qwen3_vl"

PolicyConfig = Union[ModelConfig, VLModelConfig]


def model_config_from_checkpoint(checkpoint_dir: str | os.PathLike) -> PolicyConfig:
    """The architecture of an HF checkpoint directory, from its `config.json` `model_type`."""
    hf = read_hf_config(checkpoint_dir)
    return (VLModelConfig if hf.get("model_type") == VL_MODEL_TYPE else ModelConfig).from_hf_config_dict(hf)


def is_vision_language_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    return read_hf_config(checkpoint_dir).get("model_type") == VL_MODEL_TYPE


def is_vision_language(cfg: PolicyConfig) -> bool:
    return isinstance(cfg, VLModelConfig)


def banned_token_ids(cfg: PolicyConfig) -> tuple[int, ...]:
    """Tokens outside the policy's action space: a vision-language policy never generates its
    vision special tokens (sent back to SGLang, a generated image pad would read as an image
    placeholder). SGLang samples with their logits at -inf (`logit_bias`); the trainer computes
    log-probs the same way (`trainer.logprobs.logprobs_from_logits`)."""
    return cfg.vision_special_token_ids if is_vision_language(cfg) else ()


def build_model(cfg: PolicyConfig, groups=None, bf16: bool = False, recompute: str = "none",
                layer_spec: str = "auto") -> torch.nn.Module:
    """The Megatron model of `cfg` on the current device (random init), on the Megatron
    `ProcessGroupCollection` `groups` (default: this rank's home TP group of the start-up
    registry, `comm.groups`), with `trainer.recompute`'s activation recompute and
    `trainer.layer_spec`'s layer spec (`models/layer_spec.py`)."""
    if is_vision_language(cfg):
        from tide_megatron.models.megatron_qwen3_vl import build_qwen3_vl_model

        return build_qwen3_vl_model(cfg, groups, bf16=bf16, recompute=recompute, layer_spec=layer_spec)
    from tide_megatron.models.megatron_gpt import build_gpt_model

    return build_gpt_model(cfg, groups, bf16=bf16, recompute=recompute, layer_spec=layer_spec)


def load_hf_weights(model: torch.nn.Module, source: str | os.PathLike | dict, cfg: PolicyConfig) -> None:
    """Copy an HF checkpoint (directory or state dict) into this rank's shard of `model`."""
    if is_vision_language(cfg):
        from tide_megatron.models.qwen3_vl_conversion import load_hf_into_qwen3_vl

        return load_hf_into_qwen3_vl(model, source, cfg)
    from tide_megatron.models.weight_conversion import load_hf_into_megatron

    return load_hf_into_megatron(model, source, cfg)


def hf_weights(model: torch.nn.Module, cfg: PolicyConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every weight; collective over the TP group."""
    if is_vision_language(cfg):
        from tide_megatron.models.qwen3_vl_conversion import megatron_to_hf_vl

        return megatron_to_hf_vl(model, cfg)
    from tide_megatron.models.weight_conversion import megatron_to_hf

    return megatron_to_hf(model, cfg)
