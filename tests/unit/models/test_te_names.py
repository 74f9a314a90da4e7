"""Transformer Engine's layer spec names the fused pre-norms differently; the weight conversion
reads both names (`weight_conversion.local_name`)."""

from __future__ import annotations

import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.weight_conversion import hf_to_megatron, local_name, megatron_shards_to_hf_state_dict

TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _as_te(name: str) -> str:
    for local, te in TE_NAMES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


def test_local_name_maps_the_fused_norms_only():
    assert local_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert local_name("language_model.decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "language_model.decoder.layers.0.pre_mlp_layernorm.weight"
    for same in ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_layernorm.weight",
                 "decoder.layers.1.self_attention.q_layernorm.weight"):
        assert local_name(same) == same


def test_te_named_shards_convert_to_the_same_hf_weights():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      ffn_hidden_size=48)
    g = torch.Generator().manual_seed(0)
    local = hf_to_megatron({k: torch.randn(v.shape, generator=g) for k, v in _hf_shapes(cfg).items()}, cfg)
    te = {_as_te(k): v for k, v in local.items()}
    assert te.keys() != local.keys()
    a, b = megatron_shards_to_hf_state_dict([local], cfg), megatron_shards_to_hf_state_dict([te], cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _hf_shapes(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    out = {"model.embed_tokens.weight": torch.empty(cfg.vocab_size, h), "model.norm.weight": torch.empty(h),
           "lm_head.weight": torch.empty(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": torch.empty(h), p + "post_attention_layernorm.weight": torch.empty(h),
                    p + "self_attn.q_proj.weight": torch.empty(h, h), p + "self_attn.k_proj.weight": torch.empty(kv, h),
                    p + "self_attn.v_proj.weight": torch.empty(kv, h), p + "self_attn.q_proj.bias": torch.empty(h),
                    p + "self_attn.k_proj.bias": torch.empty(kv), p + "self_attn.v_proj.bias": torch.empty(kv),
                    p + "self_attn.o_proj.weight": torch.empty(h, h), p + "mlp.gate_proj.weight": torch.empty(f, h),
                    p + "mlp.up_proj.weight": torch.empty(f, h), p + "mlp.down_proj.weight": torch.empty(h, f)})
    return out
