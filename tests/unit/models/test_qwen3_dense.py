"""Qwen3 dense text models: the config read from / written to config.json, the weight layout, the
random test checkpoint (no process groups; the Megatron side is in
tests/integration/models/test_hf_export.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import load_hf_model, load_hf_state_dict, write_random_hf_checkpoint
from tide_megatron.models.policy import model_config_from_checkpoint
from tide_megatron.models.weight_conversion import hf_to_megatron, megatron_shards_to_hf_state_dict

QWEN3 = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=24, ffn_hidden_size=96, qkv_bias=False, qk_layernorm=True, tie_word_embeddings=True)

# config.json of Qwen3-0.6B (released), the fields ModelConfig reads.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_released_qwen3_config_is_read():
    cfg = ModelConfig.from_hf_config_dict(QWEN3_0_6B)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads) == (1024, 16, 128, 8)
    assert cfg.qk_layernorm and not cfg.qkv_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.ffn_hidden_size == 3072 and cfg.hf_model_type == "qwen3"


def test_qwen2_stays_qwen2():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4)
    assert cfg.head_dim == 16 and cfg.qkv_bias and not cfg.qk_layernorm
    hf = cfg.to_hf_config_dict()
    assert hf["model_type"] == "qwen2" and hf["architectures"] == ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf_config_dict(hf) == cfg


def test_qwen3_config_round_trip():
    hf = QWEN3.to_hf_config_dict()
    assert hf["model_type"] == "qwen3" and hf["architectures"] == ["Qwen3ForCausalLM"]
    assert hf["head_dim"] == 24 and hf["attention_bias"] is False
    assert ModelConfig.from_hf_config_dict(hf) == QWEN3


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"model_type": "llama"}, "expected a qwen2 or qwen3 config"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config_dict({**QWEN3_0_6B, **change})


def test_qk_layernorm_with_a_qkv_bias_is_refused():
    with pytest.raises(ValueError, match="qkv_bias=False"):
        ModelConfig(qk_layernorm=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_weights_round_trip_with_their_qk_norms(tmp_path, tp):
    path = write_random_hf_checkpoint(tmp_path, QWEN3, seed=1)
    hf = load_hf_state_dict(path)
    assert "model.layers.0.self_attn.q_norm.weight" in hf and "model.layers.0.self_attn.q_proj.bias" not in hf
    shards = [hf_to_megatron(hf, QWEN3, rank, tp) for rank in range(tp)]
    q_norm = shards[0]["decoder.layers.1.self_attention.q_layernorm.weight"]
    assert torch.equal(q_norm, hf["model.layers.1.self_attn.q_norm.weight"]) and q_norm.shape == (24,)
    assert not any(name.endswith("linear_qkv.bias") for name in shards[0])
    back = megatron_shards_to_hf_state_dict(shards, QWEN3)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_a_qwen2_converter_does_not_drop_qwen3_norms(tmp_path):
    """A Qwen3 checkpoint read as Qwen2 (no q/k norms asked for) must not load silently: it
    has no Q/K/V bias, so the conversion fails naming the missing tensor."""
    hf = load_hf_state_dict(write_random_hf_checkpoint(tmp_path, QWEN3, seed=1))
    as_qwen2 = ModelConfig(**{**QWEN3.to_dict(), "qkv_bias": True, "qk_layernorm": False})
    with pytest.raises(KeyError, match="q_proj.bias"):
        hf_to_megatron(hf, as_qwen2)


def test_random_qwen3_checkpoint_loads_in_transformers(tmp_path):
    path = write_random_hf_checkpoint(tmp_path, QWEN3, seed=2)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3"
    assert model_config_from_checkpoint(path) == QWEN3
    model = load_hf_model(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (24,)
    # randomised: norms are not HF's constant 1
    assert model.model.layers[0].self_attn.k_norm.weight.std() > 0
