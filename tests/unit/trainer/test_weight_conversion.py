"""HF Qwen2 <-> Megatron layout conversion, exact, for TP = 1, 2, 4 (no process groups needed)."""

from __future__ import annotations

import pytest
import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.weight_conversion import (
    _split_qkv,
    hf_to_megatron,
    megatron_shards_to_hf_state_dict,
)


def _hf_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with Qwen2 names and shapes (no transformers import)."""
    g = torch.Generator().manual_seed(seed)
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_exact(tp, tied):
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, ffn_hidden_size=96, tie_word_embeddings=tied)
    hf = _hf_state_dict(cfg)
    shards = [hf_to_megatron(hf, cfg, rank, tp) for rank in range(tp)]
    back = megatron_shards_to_hf_state_dict(shards, cfg)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_qkv_layout_groups_queries_with_their_kv_head():
    # 4 query heads, 2 KV groups, head_dim 1: rows tagged by origin.
    cfg = ModelConfig(vocab_size=8, hidden_size=4, num_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, ffn_hidden_size=4)
    hf = _hf_state_dict(cfg)
    hf["model.layers.0.self_attn.q_proj.bias"] = torch.tensor([10.0, 11.0, 12.0, 13.0])
    hf["model.layers.0.self_attn.k_proj.bias"] = torch.tensor([20.0, 21.0])
    hf["model.layers.0.self_attn.v_proj.bias"] = torch.tensor([30.0, 31.0])
    full = hf_to_megatron(hf, cfg, 0, 1)["decoder.layers.0.self_attention.linear_qkv.bias"]
    # Megatron: per group [q heads of the group, k, v].
    assert full.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    rank1 = hf_to_megatron(hf, cfg, 1, 2)["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert rank1.tolist() == [12, 13, 21, 31]  # TP rank 1 holds KV group 1 whole
    q, k, v = _split_qkv(rank1, cfg, 2)
    assert (q.tolist(), k.tolist(), v.tolist()) == ([12, 13], [21], [31])


def test_fc1_is_gate_then_up_per_rank():
    cfg = ModelConfig(vocab_size=8, hidden_size=4, num_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, ffn_hidden_size=4)
    hf = _hf_state_dict(cfg)
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.arange(4.0)[:, None].expand(4, 4).clone()
    hf["model.layers.0.mlp.up_proj.weight"] = 10 + torch.arange(4.0)[:, None].expand(4, 4).clone()
    fc1 = hf_to_megatron(hf, cfg, 1, 2)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1[:, 0].tolist() == [2, 3, 12, 13]


def test_tensor_parallel_divisibility_is_checked():
    cfg = ModelConfig(vocab_size=255, num_key_value_heads=2)
    with pytest.raises(ValueError, match="vocab_size=255"):
        hf_to_megatron(_hf_state_dict(cfg), cfg, 0, 2)
