"""The Megatron Qwen3-VL actor on CPU against Hugging Face: TP=1 (1 rank) and TP=2 (2 ranks, gloo).

Trajectory records are built here the way the rollout writes them (text, images as expanded pads
between the vision markers, generated spans with loss mask 1, base64 images with their grids);
`qwen3_vl_worker.py` trains on them and reports. Megatron never runs in the pytest process.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from tide_megatron.core.trajectory import Trajectory
from tide_megatron.models.policy import banned_token_ids
from tide_megatron.models.qwen3_vl_checkpoint import load_hf_vl_model, write_random_vl_checkpoint
from tide_megatron.models.qwen3_vl_config import VisionTowerConfig, VLModelConfig
from tide_megatron.models.qwen3_vl_inputs import ImageProcessor, TrajectoryImages, encode_image_for_record
from tide_megatron.testing import run_script
from tide_megatron.tokenizer import TINY_BPE_DIR
from tide_megatron.trainer.logprobs import BANNED_LOGIT

pytestmark = pytest.mark.integration

WORKER = os.path.join(os.path.dirname(__file__), "qwen3_vl_worker.py")
LOGPROB_ATOL = 1e-5  # fp32; Megatron local spec vs HF eager
# Three LM layers: a DeepStack feature added after the last layer would reach only the logits of
# image positions, which predict no trained token, and get no gradient.
MODEL = VLModelConfig(num_layers=3, tie_word_embeddings=True,  # as Qwen3-VL-2B/4B
                      vision=VisionTowerConfig(depth=2, deepstack_visual_indexes=(1, 0)))
IMAGE_SIZES = [[], [(96, 64)], [(64, 64), (96, 64)], [(40, 90), (96, 64), (96, 64)]]


def _png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _records(cfg: VLModelConfig, processor: ImageProcessor) -> list[dict]:
    """One record per entry of IMAGE_SIZES: each image starts an observation turn, followed by a
    generated action."""
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(10, 3000, (n,), generator=g).tolist()  # noqa: E731
    records = []
    for i, sizes in enumerate(IMAGE_SIZES):
        ids, mask, images, grids = text(6), [0] * 6, [], []
        for k, (w, h) in enumerate(sizes):
            data = _png(w, h, 10 * i + k)
            grid = processor.grid(w, h)
            pads = [cfg.image_token_id] * processor.num_tokens(grid)
            ids += text(3) + [cfg.vision_start_token_id] + pads + [cfg.vision_end_token_id] + text(2)
            mask += [0] * (len(pads) + 7)
            images.append(encode_image_for_record(data))
            grids.append(list(grid))
            action = text(4)
            ids += action
            mask += [1] * len(action)
        ids += text(5)
        mask += [1] * 5
        records.append({"group_id": "g", "index": i, "token_ids": ids, "loss_mask": mask,
                        "logprobs": [0.0] * len(ids), "advantage": 1.0 if i % 2 else -1.0,
                        "images": images, "image_grid_thw": grids})
    return records


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, cfg = write_random_vl_checkpoint(tmp_path_factory.mktemp("hf"), MODEL, TINY_BPE_DIR)
    records = _records(cfg, ImageProcessor(path))
    records_path = os.path.join(path, "records.json")
    with open(records_path, "w") as f:
        json.dump(records, f)
    return path, cfg, records, records_path


def _run(setup, out_dir: str, world: int, tp: int) -> dict:
    path, _, _, records_path = setup
    run_script(WORKER, "--world", world, "--tp", tp, "--hf", path, "--records", records_path, "--out", out_dir,
               timeout=900)
    results = torch.load(os.path.join(out_dir, "results.pt"), weights_only=False)
    results["hf_after"] = torch.load(os.path.join(out_dir, "hf_after.pt"))
    return results


@pytest.fixture(scope="module")
def tp1(setup, tmp_path_factory):
    return _run(setup, str(tmp_path_factory.mktemp("tp1")), 1, 1)


@pytest.fixture(scope="module")
def tp2(setup, tmp_path_factory):
    return _run(setup, str(tmp_path_factory.mktemp("tp2")), 2, 2)


@pytest.fixture(params=["tp1", "tp2"])
def run(request) -> dict:
    return request.getfixturevalue(request.param)


def _rows(per_micro_batch: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """Unpadded per-trajectory rows, in record order (micro-batches keep it)."""
    rows = [r for mb in per_micro_batch for r in mb]
    return [row[:n] for row, n in zip(rows, lengths)]


@torch.no_grad()
def _hf_logprobs(model, record: dict, path: str, cfg: VLModelConfig) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) from transformers with the record's images, over the policy's
    action space (vision special tokens excluded, as SGLang samples). # [T], 0 at t = 0"""
    ids = torch.tensor(record["token_ids"])
    fields = TrajectoryImages.for_model(cfg, path).fields(Trajectory.from_tokens(**record), ids, torch.tensor(record["loss_mask"]))
    kwargs = {}
    if "pixel_values" in fields:
        kwargs = dict(pixel_values=fields["pixel_values"], image_grid_thw=fields["image_grid_thw"],
                      mm_token_type_ids=fields["image_mask"][None].int())
    logits = model(input_ids=ids[None], **kwargs).logits[0].float()
    logits[:, list(banned_token_ids(cfg))] = BANNED_LOGIT
    picked = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


def test_micro_batches_mix_rows_with_and_without_images(run):
    assert run["micro_batches"] >= 2
    assert sum(run["images_per_micro_batch"]) == sum(len(s) for s in IMAGE_SIZES)


def test_megatron_logprobs_equal_hf_on_multimodal_trajectories(setup, run):
    path, cfg, records, _ = setup
    hf = load_hf_vl_model(path)
    lengths = run["rows"][0]
    for record, actor, ref in zip(records, _rows(run["initial_logprobs"], lengths), _rows(run["ref_logprobs"], lengths)):
        expected = _hf_logprobs(hf, record, path, cfg)
        torch.testing.assert_close(actor, expected, rtol=0, atol=LOGPROB_ATOL)
        torch.testing.assert_close(ref, actor, rtol=0, atol=LOGPROB_ATOL)


def test_tp2_matches_tp1(tp1, tp2):
    for a, b in zip(tp1["initial_logprobs"], tp2["initial_logprobs"]):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL)
    # After three Adam steps: rounding differences of the TP reductions (relative ~1e-7) pass
    # through Adam's per-weight normalisation, which enlarges them where gradients are tiny;
    # measured up to 1.1e-5 on a log-prob near -7.
    for a, b in zip(tp1["after_logprobs"], tp2["after_logprobs"]):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
    for s1, s2 in zip(tp1["steps"], tp2["steps"]):
        assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)


def test_gradient_reaches_every_part_of_the_model(run):
    grads = run["grad_norms"]
    groups = {"vision patch embedding": "vision.patch_embed.weight", "vision position table": "vision.pos_embed.weight",
              "vision block 0 qkv": "vision.decoder.layers.0.self_attention.linear_qkv.weight",
              "merger": "vision.merger.projector.encoder.linear_fc2.weight",
              "DeepStack merger 0": "vision.deepstack_mergers.0.projector.encoder.linear_fc1.weight",
              "DeepStack merger 1": "vision.deepstack_mergers.1.projector.encoder.linear_fc1.weight",
              "LM q norm": "language_model.decoder.layers.1.self_attention.q_layernorm.weight",
              "embedding": "language_model.embedding.word_embeddings.weight"}
    for what, name in groups.items():
        assert grads[name] > 0.0, what


def test_grpo_steps_lower_the_loss_and_follow_the_advantage(setup, run):
    losses = [s["loss"] for s in run["steps"]]
    assert losses[0] > losses[-1], losses
    up = down = 0.0
    for before, after, adv, mask in zip(run["initial_logprobs"], run["after_logprobs"], run["advantages"],
                                        run["loss_masks"]):
        delta = ((after - before) * mask).sum(1) / mask.sum(1)
        up += delta[adv > 0].sum().item()
        down += delta[adv < 0].sum().item()
    assert up > 0 > down, (up, down)


def test_trained_weights_back_in_hf_reproduce_the_megatron_logprobs(setup, run):
    path, cfg, records, _ = setup
    hf = load_hf_vl_model(path)
    state = run["hf_after"]
    expected_names = set(hf.state_dict()) - {"lm_head.weight"}  # tied: HF ties it to the embedding
    assert set(state) == expected_names
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    for record, lp in zip(records, _rows(run["after_logprobs"], run["rows"][0])):
        torch.testing.assert_close(_hf_logprobs(hf, record, path, cfg), lp, rtol=0, atol=LOGPROB_ATOL)


def test_checkpoint_resume_restores_the_policy(run):
    assert run["resumed_step"] == 3
    assert run["resume_param_diffs"] == {}
    assert run["resume_logprob_diff"] == 0.0


def test_packed_micro_batches_give_the_padded_loss_and_gradients(run):
    """Packed multimodal micro-batches (each trajectory's own MRoPE positions and images, one
    row): the padded layout's loss sums, token counts and gradients, to fp32 rounding."""
    assert run["packed_images"] == run["images_per_micro_batch"] and sum(run["packed_images"]) > 0
    for padded_sum, packed_sum, padded_count, packed_count in run["packed_loss"]:
        assert packed_count == padded_count > 0
        assert abs(packed_sum - padded_sum) <= 1e-5 * max(1.0, abs(padded_sum))
    diff, scale = run["packed_grad_diff"]
    assert scale > 0 and diff <= 1e-5 * max(1.0, scale)

