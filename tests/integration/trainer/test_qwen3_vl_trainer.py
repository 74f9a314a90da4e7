"""The Megatron Qwen3-VL actor on CPU against Hugging Face: TP=1 (1 rank) and TP=2 (2 ranks, gloo).

Trajectory records are built here the way the rollout writes them (text, images as expanded pads
between the vision markers, generated spans with loss mask 1, base64 images with their grids);
`qwen3_vl_worker.py` trains on them and reports. Megatron never runs in the pytest process.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from tide_megatron.models.qwen3_vl_checkpoint import load_hf_vl_model, write_random_vl_checkpoint
from tide_megatron.models.qwen3_vl_config import VisionTowerConfig, VLModelConfig
from tide_megatron.models.qwen3_vl_inputs import ImageProcessor, TrajectoryImages, encode_image_for_record
from tide_megatron.tokenizer import TINY_BPE_DIR

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
    generated action; in all but the last record the first action holds an image pad the policy
    sampled itself."""
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
            action = text(4) + ([cfg.image_token_id] if k == 0 and i < len(IMAGE_SIZES) - 1 else [])
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
    proc = subprocess.run([sys.executable, WORKER, "--world", str(world), "--tp", str(tp), "--hf", path,
                           "--records", records_path, "--out", out_dir], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
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
def _hf_logprobs(model, record: dict, path: str, cfg: VLModelConfig, composed: bool | None = None) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) from transformers, with the record's images. # [T], 0 at t = 0

    HF's own forward takes every image pad for an image position; an image pad the policy
    generated is an ordinary token (as in SGLang and the trainer). For such records the forward
    is composed from HF's own parts (vision tower, embedding, MRoPE index, language model with
    DeepStack, head) with the trainer's image mask; `composed=True` forces that path.
    """
    ids = torch.tensor(record["token_ids"])
    fields = TrajectoryImages.for_model(cfg, path).fields(record, ids, torch.tensor(record["loss_mask"]))
    if "pixel_values" not in fields:
        logits = model(input_ids=ids[None]).logits[0]
    else:
        mask = fields["image_mask"]
        if composed is None:
            composed = bool(((ids == cfg.image_token_id) & ~mask).any())
        if not composed:
            logits = model(input_ids=ids[None], pixel_values=fields["pixel_values"],
                           image_grid_thw=fields["image_grid_thw"], mm_token_type_ids=mask[None].int()).logits[0]
        else:
            vision = model.model.get_image_features(fields["pixel_values"], fields["image_grid_thw"])
            embeds = model.model.get_input_embeddings()(ids[None]).clone()
            embeds[0, mask] = torch.cat(vision.pooler_output)
            positions, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=mask[None].int(),
                                                      image_grid_thw=fields["image_grid_thw"])
            hidden = model.model.language_model(
                inputs_embeds=embeds, position_ids=positions, visual_pos_masks=mask[None],
                deepstack_visual_embeds=[torch.cat(f) for f in vision.deepstack_features]).last_hidden_state
            logits = model.lm_head(hidden)[0]
    picked = torch.log_softmax(logits.float()[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


def test_composed_hf_reference_is_hf_forward(setup):
    path, cfg, records, _ = setup
    hf = load_hf_vl_model(path)
    clean = records[-1]
    assert clean["token_ids"].count(cfg.image_token_id) == sum(
        n for n in (ImageProcessor(path).num_tokens(g) for g in clean["image_grid_thw"]))
    torch.testing.assert_close(_hf_logprobs(hf, clean, path, cfg, composed=True),
                               _hf_logprobs(hf, clean, path, cfg, composed=False), rtol=0, atol=1e-6)


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


