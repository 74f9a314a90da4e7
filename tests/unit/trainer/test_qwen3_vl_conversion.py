"""HF Qwen3-VL <-> Megatron layout conversion (exact, TP 1/2/4), configs, and MRoPE positions.

Uses a real (tiny, random) transformers `Qwen3VLForConditionalGeneration` for the names, shapes and
the reference `get_rope_index`; no process group, no Megatron import.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.models.qwen3_vl_config import VisionTowerConfig, VLModelConfig
from tide_megatron.models.qwen3_vl_conversion import (
    hf_to_megatron_vl,
    megatron_shards_to_hf_vl,
    vision_name_table,
)
from tide_megatron.models.qwen3_vl_inputs import ImageInputError, mrope_position_ids

CFG = VLModelConfig(vocab_size=256, hidden_size=64, num_layers=3, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=16, ffn_hidden_size=128, image_token_id=250, video_token_id=251,
                    vision_start_token_id=252, vision_end_token_id=253,
                    vision=VisionTowerConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=4,
                                             deepstack_visual_indexes=(2, 0)))


def _hf_model(cfg: VLModelConfig, seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tide_megatron.models.hf_checkpoint import randomise_

    hf = cfg.to_hf_config_dict()
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**{k: v for k, v in hf.items()
                                                             if k not in ("architectures", "model_type")}))
    randomise_(model, seed, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def hf_model():
    return _hf_model(CFG)


def _state(model, tied: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bit_exact(hf_model, tp, tied):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    hf = _state(hf_model, tied)
    shards = [hf_to_megatron_vl(hf, cfg, rank, tp) for rank in range(tp)]
    back = megatron_shards_to_hf_vl(shards, cfg)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_shards_split_what_megatron_splits(hf_model):
    hf = _state(hf_model, tied=False)
    one, two = hf_to_megatron_vl(hf, CFG, 0, 1), hf_to_megatron_vl(hf, CFG, 1, 2)
    qkv = "vision.decoder.layers.0.self_attention.linear_qkv.weight"
    assert two[qkv].shape[0] * 2 == one[qkv].shape[0]
    # rank 1 of 2 holds heads 2 and 3, each as [q; k; v] of head_dim rows
    hd, heads = CFG.vision.head_dim, CFG.vision.num_heads
    full = hf["model.visual.blocks.0.attn.qkv.weight"].reshape(3, heads, hd, -1)
    expected = torch.cat([full[:, h].reshape(3 * hd, -1) for h in (2, 3)])
    assert torch.equal(two[qkv], expected)
    for replicated in ("vision.pos_embed.weight", "vision.decoder.layers.0.self_attention.linear_proj.bias",
                       "vision.merger.norm.weight", "language_model.decoder.layers.0.self_attention.q_layernorm.weight"):
        assert torch.equal(one[replicated], two[replicated]), replicated


def test_every_hf_tensor_has_one_megatron_name(hf_model):
    names = set(_state(hf_model, tied=False))
    vision = {hf for hf, _, _ in vision_name_table(CFG.vision)}
    assert vision == {n for n in names if n.startswith("model.visual.")}
    megatron = hf_to_megatron_vl(_state(hf_model, tied=False), CFG)
    assert len(megatron) == len(names) - 3 * CFG.num_layers  # q/k/v fuse into one, gate/up into one


def test_missing_vision_tensor_is_named(hf_model):
    hf = _state(hf_model, tied=False)
    del hf["model.visual.merger.norm.bias"]
    with pytest.raises(KeyError, match="model.visual.merger.norm.bias"):
        hf_to_megatron_vl(hf, CFG)


def test_hf_config_round_trip_and_real_checkpoint_spelling():
    assert VLModelConfig.from_hf_config_dict(CFG.to_hf_config_dict()) == CFG
    # Released Qwen3-VL config.json files spell the rotary settings the transformers-4 way.
    raw = CFG.to_hf_config_dict()
    text = raw["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    assert VLModelConfig.from_hf_config_dict(raw) == CFG


@pytest.mark.parametrize("bad,match", [
    (dict(mrope_section=(4, 2, 1)), "mrope_section"),
    (dict(vision=VisionTowerConfig(out_hidden_size=32)), "out_hidden_size"),
])
def test_inconsistent_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **bad)


def test_tensor_parallel_check_names_the_field():
    with pytest.raises(ValueError, match="vision.num_heads=4 does not divide by tensor-parallel size 8"):
        dataclasses.replace(CFG, num_attention_heads=8, num_key_value_heads=8).check_tensor_parallel(8)


@settings(max_examples=25, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(0, 6), st.sampled_from([(1, 2, 2), (1, 4, 6), (1, 6, 4), (1, 2, 8)])),
                       min_size=0, max_size=4), tail=st.integers(1, 5))
def test_mrope_positions_equal_hf(hf_model, layout, tail):
    merge = CFG.vision.spatial_merge_size
    ids, grids = [], []
    for text, grid in layout:
        ids += [7] * text + [CFG.vision_start_token_id] + [CFG.image_token_id] * (grid[1] * grid[2] // merge ** 2)
        ids += [CFG.vision_end_token_id]
        grids.append(grid)
    ids += [9] * tail
    token_ids = torch.tensor(ids)
    mask = token_ids == CFG.image_token_id
    grid_t = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    ours = mrope_position_ids(mask, grid_t, merge)
    hf, _ = hf_model.model.get_rope_index(token_ids[None], mm_token_type_ids=mask[None].int(),
                                          image_grid_thw=grid_t if grids else None)
    assert torch.equal(ours, hf[:, 0])


def test_mrope_positions_refuse_a_pad_count_that_does_not_fit():
    mask = torch.tensor([False, True, True, True, False])
    with pytest.raises(ImageInputError, match="3 image pads in the sequence, but the 1 image"):
        mrope_position_ids(mask, torch.tensor([[1, 4, 4]]), 2)
