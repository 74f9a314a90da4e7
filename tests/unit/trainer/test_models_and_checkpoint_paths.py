"""ModelConfig <-> HF config, the random checkpoint writer, and checkpoint-path errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tide_megatron import compat
from tide_megatron.compat.megatron_cpu import PINNED_MEGATRON_CORE_VERSION
from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import load_hf_state_dict, write_random_hf_checkpoint
from tide_megatron.trainer.checkpoint import LATEST_MARKER, latest_checkpoint, step_dir_name

TINY = ModelConfig(vocab_size=128, hidden_size=32, num_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, ffn_hidden_size=64)


def test_pin_agrees_with_the_compat_package():
    pinned = getattr(compat, "PINNED_VERSIONS", {}).get("megatron-core", PINNED_MEGATRON_CORE_VERSION)
    assert pinned == PINNED_MEGATRON_CORE_VERSION


def test_hf_config_round_trip():
    cfg = ModelConfig(tie_word_embeddings=True, rope_theta=10000.0)
    assert ModelConfig.from_hf_config_dict(cfg.to_hf_config_dict()) == cfg


def test_random_checkpoint_is_deterministic_fp32_and_reloads(tmp_path):
    a = write_random_hf_checkpoint(tmp_path / "a", TINY, seed=3)
    b = write_random_hf_checkpoint(tmp_path / "b", TINY, seed=3)
    c = write_random_hf_checkpoint(tmp_path / "c", TINY, seed=4)
    sa, sb, sc = load_hf_state_dict(a), load_hf_state_dict(b), load_hf_state_dict(c)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.norm.weight"], sc["model.norm.weight"])
    assert all(t.dtype == torch.float32 for t in sa.values())
    assert ModelConfig.from_hf_checkpoint(a) == TINY
    with open(os.path.join(a, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]


def test_tokenizer_files_are_copied(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "config.json").write_text("{}")  # must not overwrite the model's config
    out = write_random_hf_checkpoint(tmp_path / "m", TINY, seed=0, tokenizer_dir=tok)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert ModelConfig.from_hf_checkpoint(out) == TINY


def test_missing_paths_raise_with_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / LATEST_MARKER)):
        latest_checkpoint(tmp_path)
    (tmp_path / LATEST_MARKER).write_text(step_dir_name(7) + "\n")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "step_000007")):
        latest_checkpoint(tmp_path)
    (tmp_path / "step_000007").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_000007")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_state_dict(tmp_path / "nowhere")
