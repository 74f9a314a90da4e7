"""Packed and padded micro-batches (`trainer/batch.py`) and the per-trajectory attention of packed
ones (`models/layer_spec.packed_causal_attention`)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.models.layer_spec import packed_causal_attention, resolve_layer_spec
from tide_megatron.trainer.batch import BatchLayout, TrajectoryTensors, collate, micro_batches_by_budget, pack
from tide_megatron.trainer.config import TrainerConfig


def _traj(n: int, adv: float = 1.0, offset: int = 0) -> TrajectoryTensors:
    mask = torch.ones(n)
    mask[0] = 0
    return TrajectoryTensors(torch.arange(offset, offset + n), mask, torch.full((n,), -0.5), adv)


def test_pack_lays_trajectories_end_to_end():
    mb = pack([_traj(3, 1.0), _traj(5, -2.0, offset=10)])
    assert mb.packed and mb.token_ids.shape == (1, 8)  # [1, T], no padding
    assert mb.cu_seqlens.tolist() == [0, 3, 8] and mb.cu_seqlens.dtype == torch.int32
    assert mb.token_ids[0].tolist() == [0, 1, 2, 10, 11, 12, 13, 14]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # each trajectory from 0
    assert mb.advantages[0].tolist() == [1.0] * 3 + [-2.0] * 5  # one per token
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 0, 1, 1, 1, 1]
    assert mb.num_loss_tokens == 6 and mb.lengths == [3, 5]
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 5
    assert "packed_seq_params" in mb.model_inputs()


def test_pack_rounds_up_with_a_masked_filler_segment():
    plain, padded = pack([_traj(3), _traj(6)]), pack([_traj(3), _traj(6)], pad_to_multiple_of=8)
    assert padded.token_ids.shape == (1, 16) and padded.cu_seqlens.tolist() == [0, 3, 9, 16]
    assert padded.lengths == [3, 6] and padded.num_loss_tokens == plain.num_loss_tokens
    assert padded.loss_mask[0, 9:].sum() == 0 and padded.advantages[0, 9:].abs().sum() == 0
    assert padded.position_ids[0, 9:].tolist() == list(range(7))  # the filler attends only to itself
    assert pack([_traj(8)], pad_to_multiple_of=8).token_ids.shape == (1, 8)  # already a multiple
    assert BatchLayout(pad_to_multiple_of=8).cost_tokens([3, 6]) == 16


def test_padded_batch_has_no_packing():
    mb = collate([_traj(3), _traj(5)])
    assert not mb.packed and mb.packed_seq_params() is None and mb.model_inputs() == {}


def test_pack_keeps_images_in_trajectory_order():
    def with_images(n: int, images: int, fill: float) -> TrajectoryTensors:
        t = _traj(n)
        t.pixel_values = torch.full((4 * images, 6), fill)  # [patches, patch_dim]
        t.image_grid_thw = torch.tensor([[1, 2, 2]] * images)
        t.image_mask = torch.zeros(n, dtype=torch.bool)
        t.image_mask[1:1 + images] = True
        t.position_ids = torch.arange(n)[None].expand(3, n) + 7  # [3, T]: its own MRoPE positions
        return t

    mb = pack([with_images(4, 1, 1.0), _traj(3), with_images(5, 2, 2.0)])
    assert mb.position_ids.shape == (3, 1, 12)  # [3, 1, T]
    assert mb.position_ids[0, 0].tolist() == [7, 8, 9, 10, 0, 1, 2, 7, 8, 9, 10, 11]
    assert mb.image_mask.shape == (1, 12) and int(mb.image_mask.sum()) == 3
    assert mb.pixel_values[:, 0].tolist() == [1.0] * 4 + [2.0] * 8 and mb.image_grid_thw.shape == (3, 3)


def test_pack_rejects_empty_input():
    with pytest.raises(ValueError, match="empty"):
        pack([])


def test_split_by_budget_counts_computed_tokens():
    trajs = [_traj(n) for n in (4, 4, 4, 10, 3)]
    packed = micro_batches_by_budget(trajs, 12)  # sums: 4+4+4 | 10 | 3 ... 10+3 > 12
    assert [mb.lengths for mb in packed] == [[4, 4, 4], [10], [3]]
    padded = micro_batches_by_budget(trajs, 12, BatchLayout(packed=False, pad_to_multiple_of=8))
    assert [mb.token_ids.shape for mb in padded] == [(1, 8), (1, 8), (1, 8), (1, 16), (1, 8)]
    assert BatchLayout(packed=False).cost_tokens([2, 9]) == 18 and BatchLayout().cost_tokens([2, 9]) == 11


def test_layout_follows_the_trainer_config():
    assert BatchLayout.of(TrainerConfig()) == BatchLayout(packed=True)
    assert BatchLayout.of(TrainerConfig(packing=False, pad_to_multiple_of=64)) == BatchLayout(False, 64)
    with pytest.raises(ValueError, match="trainer.layer_spec"):
        TrainerConfig(layer_spec="fast")


def _dense_reference(q, k, v, lengths, scale):
    """Each segment alone, through an explicit masked softmax. q # [T, Hq, D]"""
    groups = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(1, 2) * scale  # [Hq, L, L]
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), -math.inf)
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))  # [L, Hq, D]
        start += n
    return torch.cat(out).reshape(q.shape[0], -1)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5), kv_heads=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2 ** 16))
def test_packed_attention_attends_within_each_trajectory(lengths, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    total, heads, dim = sum(lengths), 4, 8
    q = torch.randn(total, heads, dim, generator=g)
    k, v = torch.randn(total, kv_heads, dim, generator=g), torch.randn(total, kv_heads, dim, generator=g)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    got = packed_causal_attention(q, k, v, cu, scale=dim ** -0.5)
    torch.testing.assert_close(got, _dense_reference(q, k, v, lengths, dim ** -0.5), rtol=1e-5, atol=1e-6)
    # A later trajectory's tokens never reach an earlier one.
    if len(lengths) > 1:
        k2, v2 = k.clone(), v.clone()
        k2[lengths[0]:] += 5.0
        v2[lengths[0]:] -= 3.0
        again = packed_causal_attention(q, k2, v2, cu, scale=dim ** -0.5)
        torch.testing.assert_close(again[:lengths[0]], got[:lengths[0]])


def test_packed_attention_rejects_bounds_that_miss_tokens():
    q = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_causal_attention(q, q, q, torch.tensor([0, 3], dtype=torch.int32), scale=0.5)


def test_layer_spec_names():
    assert resolve_layer_spec("local") == "local"
    if not torch.cuda.is_available():
        assert resolve_layer_spec("auto") == "local"
        with pytest.raises(ValueError, match="transformer_engine"):
            resolve_layer_spec("te")
    with pytest.raises(ValueError, match="layer_spec"):
        resolve_layer_spec("tee")
