"""Images into the trainer: decoding with clear errors, grids that agree with the processor,
the random tiny checkpoint, and micro-batches that carry images."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tide_megatron.models.policy import model_config_from_checkpoint
from tide_megatron.models.qwen3_vl_checkpoint import VISION_SPECIAL_TOKENS, write_random_vl_checkpoint
from tide_megatron.models.qwen3_vl_config import VLModelConfig
from tide_megatron.models.qwen3_vl_inputs import (
    ImageInputError,
    DecodeLimits,
    ImageProcessor,
    TrajectoryImages,
    encode_image_for_record,
)
from tide_megatron.tokenizer import TINY_BPE_DIR
from tide_megatron.core.trajectory import Trajectory
from tide_megatron.trainer.batch import TrajectoryTensors, collate


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, cfg = write_random_vl_checkpoint(tmp_path_factory.mktemp("vl"), VLModelConfig(), TINY_BPE_DIR)
    return path, cfg


@pytest.fixture(scope="module")
def processor(ckpt):
    return ImageProcessor(ckpt[0])


def test_checkpoint_has_the_vision_tokens_the_config_names(ckpt):
    from transformers import AutoTokenizer

    path, cfg = ckpt
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.convert_tokens_to_ids(list(VISION_SPECIAL_TOKENS))
    assert ids == [cfg.vision_start_token_id, cfg.vision_end_token_id, ids[2], cfg.image_token_id, cfg.video_token_id]
    assert len(tok) <= cfg.vocab_size
    assert model_config_from_checkpoint(path) == cfg
    # The chat template renders an image part as one pad between the vision markers.
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        assert json.load(f)["merge_size"] == cfg.vision.spatial_merge_size


@settings(max_examples=30, deadline=None)
@given(width=st.integers(8, 400), height=st.integers(8, 400))
def test_predicted_grid_is_the_processors(processor, width, height):
    if max(width, height) / min(width, height) > 200:
        return
    image = Image.new("RGB", (width, height))
    _, grids = processor.pixel_values([image])
    assert list(processor.grid(width, height)) == grids[0].tolist()


@pytest.mark.parametrize("data,match", [
    (b"", "non-empty"),
    (b"not an image at all", "cannot decode"),
    (png(64, 48)[:200], "cannot decode"),  # truncated transfer
])
def test_bad_images_fail_with_one_line(processor, data, match):
    with pytest.raises(ImageInputError, match=match) as err:
        processor.decode(data, "turn 3 image 0")
    assert "\n" not in str(err.value) and str(err.value).startswith("turn 3 image 0")


def test_too_large_images_are_refused_before_decoding(ckpt):
    small = ImageProcessor(ckpt[0], DecodeLimits(max_bytes=10_000_000, max_pixels=1000))
    with pytest.raises(ImageInputError, match="64x48 pixels is over the limit of 1000"):
        small.decode(png(64, 48))
    tiny = ImageProcessor(ckpt[0], DecodeLimits(max_bytes=100))
    with pytest.raises(ImageInputError, match="over the limit of 100"):
        tiny.decode(png(64, 48))


def _record(cfg, processor, images: list[bytes], generated_pad: bool = False) -> dict:
    ids, mask, grids = [5, 6], [0, 0], []
    for data in images:
        image = processor.decode(data)
        grid = processor.grid(image.width, image.height)
        grids.append(list(grid))
        span = [cfg.vision_start_token_id] + [cfg.image_token_id] * processor.num_tokens(grid) + [cfg.vision_end_token_id]
        ids += span + [7, 8]
        mask += [0] * len(span) + [1, 1]
    if generated_pad:  # the policy may sample an image pad itself: an ordinary token
        ids.append(cfg.image_token_id)
        mask.append(1)
    return {"group_id": "g", "index": 0, "token_ids": ids, "loss_mask": mask, "logprobs": [0.0] * len(ids),
            "images": [encode_image_for_record(d) for d in images], "image_grid_thw": grids}


def _fields(images: TrajectoryImages, record: dict) -> dict:
    return images.fields(Trajectory.from_tokens(**record), torch.tensor(record["token_ids"]), torch.tensor(record["loss_mask"], dtype=torch.float))


def test_trajectory_images_become_vision_inputs(ckpt, processor):
    path, cfg = ckpt
    images = TrajectoryImages.for_model(cfg, path)
    record = _record(cfg, processor, [png(96, 64, 1), png(40, 90, 2)], generated_pad=True)
    fields = _fields(images, record)
    assert fields["image_grid_thw"].tolist() == record["image_grid_thw"]
    assert int(fields["image_mask"].sum()) == sum(processor.num_tokens(g) for g in record["image_grid_thw"])
    assert not fields["image_mask"][-1]  # the generated pad takes no image feature
    assert fields["position_ids"].shape == (3, len(record["token_ids"]))
    assert fields["pixel_values"].shape[1] == cfg.vision.patch_dim


def test_rollout_and_trainer_disagreeing_on_a_grid_is_an_error(ckpt, processor):
    path, cfg = ckpt
    record = _record(cfg, processor, [png(96, 64)])
    record["image_grid_thw"] = [[1, 8, 8]]
    with pytest.raises(ImageInputError, match=r"trajectory g/0: the trainer's image grids \[\[1, 4, 6\]\] differ"):
        _fields(TrajectoryImages.for_model(cfg, path), record)


def test_pads_without_images_and_corrupt_records_are_errors(ckpt, processor):
    path, cfg = ckpt
    images = TrajectoryImages.for_model(cfg, path)
    record = _record(cfg, processor, [png(96, 64)])
    no_images = dict(record, images=[], image_grid_thw=[])
    with pytest.raises(ImageInputError, match="6 image pads but no images"):
        _fields(images, no_images)
    with pytest.raises(ImageInputError, match="trajectory g/0 image 0: not base64"):
        _fields(images, dict(record, images=["%%%"]))


def test_collate_carries_images_and_mrope_positions(ckpt, processor):
    path, cfg = ckpt
    images = TrajectoryImages.for_model(cfg, path)
    rows = []
    for n_images in (2, 0, 1):
        record = _record(cfg, processor, [png(64, 64, s) for s in range(n_images)])
        ids, mask = torch.tensor(record["token_ids"]), torch.tensor(record["loss_mask"], dtype=torch.float)
        rows.append(TrajectoryTensors(ids, mask, torch.zeros(len(ids)), 1.0, **_fields(images, record)))
    mb = collate(rows, pad_to_multiple_of=8)
    batch, seq = mb.token_ids.shape
    assert mb.position_ids.shape == (3, batch, seq) and mb.image_mask.shape == (batch, seq)
    assert mb.image_grid_thw.shape == (3, 3)  # 2 + 0 + 1 images, row order
    assert mb.pixel_values.shape[0] == int(mb.image_grid_thw.prod(-1).sum())
    assert int(mb.image_mask.sum()) == sum(int(r.image_mask.sum()) for r in rows if r.image_mask is not None)
    for row, traj in enumerate(rows):
        n = len(traj)
        expected = traj.position_ids if traj.position_ids is not None else torch.arange(n).expand(3, n)
        assert torch.equal(mb.position_ids[:, row, :n], expected)
        assert (mb.position_ids[:, row, n:].diff(dim=-1) == 1).all()  # padding continues
    assert set(mb.model_inputs()) == {"pixel_values", "image_grid_thw", "image_mask"}
    moved = mb.to("cpu")
    assert torch.equal(moved.pixel_values, mb.pixel_values) and torch.equal(moved.image_mask, mb.image_mask)
