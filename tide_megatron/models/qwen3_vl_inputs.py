"""What a Qwen3-VL model reads besides token ids: images, their grids, and MRoPE positions.

One image in a token sequence is `<|vision_start|>`, then `grid_h * grid_w / merge^2` copies of
`<|image_pad|>` (one per merged block of patches), then `<|vision_end|>`. Everything here is
shared by the rollout side (how many pads an image takes) and the trainer (pixel values, the
image positions, MRoPE positions), so both count the same tokens:

- `ImageProcessor` wraps the checkpoint's own image processor (`preprocessor_config.json`): it
  decodes encoded images with one-line errors (`ImageInputError`), predicts an image's grid from
  its size without resizing it, and turns images into the vision tower's pixel values.
- `image_positions` marks the pads that stand for image features: pads the policy generated
  itself are ordinary tokens, exactly as SGLang treats them.
- `mrope_position_ids` gives every token its (t, h, w) position as Qwen3-VL does (HF's
  `Qwen3VLModel.get_rope_index`): text advances all three by one; an image's tokens take their
  merged-grid coordinates offset by the running position, which then advances by the larger side.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from PIL import Image


class ImageInputError(ValueError):
    """An image the model cannot take; the message says why in one line."""


@dataclass(frozen=True)
class DecodeLimits:
    """What an encoded image may be before it is decoded (a decompression bomb is refused)."""

    max_bytes: int = 16 * 1024 * 1024
    """Largest encoded image."""
    max_pixels: int = 4096 * 4096
    """Largest decoded width x height (read from the header, before decoding)."""


class ImageProcessor:
    """The checkpoint's Qwen2-VL image processor (Qwen3-VL uses it) and its geometry."""

    def __init__(self, checkpoint_dir: str | os.PathLike, limits: DecodeLimits = DecodeLimits()):
        from transformers import AutoImageProcessor

        path = os.fspath(checkpoint_dir)
        if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            raise FileNotFoundError(f"no preprocessor_config.json in {path}: not a vision-language checkpoint")
        self.hf = AutoImageProcessor.from_pretrained(path)
        self.limits = limits
        self.patch_size = int(self.hf.patch_size)
        self.merge_size = int(self.hf.merge_size)
        self.min_pixels = int(self.hf.size["shortest_edge"])
        self.max_pixels = int(self.hf.size["longest_edge"])

    def decode(self, data: bytes, what: str = "image") -> "Image.Image":
        """Encoded PNG/JPEG bytes -> an RGB PIL image, or `ImageInputError` naming `what`."""
        from PIL import Image, UnidentifiedImageError

        if not isinstance(data, (bytes, bytearray)) or not data:
            raise ImageInputError(f"{what}: expected non-empty encoded image bytes, got {type(data).__name__}")
        if len(data) > self.limits.max_bytes:
            raise ImageInputError(f"{what}: {len(data)} bytes is over the limit of {self.limits.max_bytes}")
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > self.limits.max_pixels:
                raise ImageInputError(f"{what}: {width}x{height} pixels is over the limit of {self.limits.max_pixels}")
            image.load()
        except ImageInputError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise ImageInputError(f"{what}: cannot decode ({type(exc).__name__}: {exc})") from None
        return image.convert("RGB")

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of an image of this size after the processor's resize."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        try:
            rh, rw = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as exc:
            raise ImageInputError(f"image of {width}x{height}: {exc}") from None
        return 1, rh // self.patch_size, rw // self.patch_size

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Image pads of an image with this grid."""
        t, h, w = grid
        return t * h * w // self.merge_size ** 2

    def pixel_values(self, images: Sequence["Image.Image"]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images -> (pixel values # [patches, patch_dim] float32, grids # [images, 3] int64)."""
        out = self.hf(images=list(images), return_tensors="pt")
        return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.long)


def image_positions(token_ids: torch.Tensor, loss_mask: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Where image features go: image pads that the policy did not generate. # [T] bool"""
    return (token_ids == image_token_id) & (loss_mask == 0)


def mrope_position_ids(image_mask: torch.Tensor, grids: torch.Tensor, merge_size: int) -> torch.Tensor:
    """(t, h, w) positions of a token sequence. # [3, T] int64

    image_mask: # [T] bool, the image pads (`image_positions`), images in order.
    grids: # [n, 3] (t, h, w) patch grid of each image, in order of appearance.
    """
    length = image_mask.numel()
    mask = image_mask.tolist()
    expected = [int(t) * int(h) * int(w) // merge_size ** 2 for t, h, w in grids.tolist()]
    if sum(expected) != sum(mask):
        raise ImageInputError(f"{sum(mask)} image pads in the sequence, but the {len(expected)} image(s) "
                              f"need {sum(expected)}")
    out = torch.empty(3, length, dtype=torch.long)
    pos, i, image = 0, 0, 0
    while i < length:
        if not mask[i]:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        t, h, w = (int(x) for x in grids[image].tolist())
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if not all(mask[i:i + n]):
            raise ImageInputError(f"image {image} needs {n} consecutive pads at position {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        out[:, i:i + n] = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos
        pos += max(gh, gw)
        i += n
        image += 1
    return out


def encode_image_for_record(data: bytes) -> str:
    """Encoded image bytes as they travel in a JSON trajectory record (base64 text)."""
    import base64

    return base64.b64encode(bytes(data)).decode("ascii")


def decode_image_record(text: str, what: str) -> bytes:
    import base64
    import binascii

    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise ImageInputError(f"{what}: not base64 ({exc})") from None


class TrajectoryImages:
    """Turns a trajectory record's images into the trainer's vision inputs, checking that the
    rollout and the trainer agree on every image's grid and on the number of image pads."""

    def __init__(self, processor: ImageProcessor, image_token_id: int):
        self.processor = processor
        self.image_token_id = image_token_id

    @classmethod
    def for_model(cls, cfg, checkpoint_dir: str | os.PathLike) -> "TrajectoryImages | None":
        """For the policy `cfg` loaded from `checkpoint_dir`; None for a text-only policy."""
        from tide_megatron.models.policy import is_vision_language

        return cls(ImageProcessor(checkpoint_dir), cfg.image_token_id) if is_vision_language(cfg) else None

    def fields(self, record, token_ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """`pixel_values`, `image_grid_thw`, `image_mask` # [T], `position_ids` # [3, T] of one
        trajectory (`core.trajectory.Trajectory`: `images`, base64 strings, and
        `image_grid_thw`, the rollout's grids)."""
        what = f"trajectory {record.trajectory_id}"
        mask = image_positions(token_ids, loss_mask, self.image_token_id)
        images = record.images
        if not images:
            if mask.any():
                raise ImageInputError(f"{what}: {int(mask.sum())} image pads but no images")
            return {}  # text positions: the collate fills them in
        decoded = [self.processor.decode(decode_image_record(text, f"{what} image {i}"), f"{what} image {i}")
                   for i, text in enumerate(images)]
        pixel_values, grids = self.processor.pixel_values(decoded)
        recorded = record.image_grid_thw or None  # absent: nothing to check against
        if recorded is not None and grids.tolist() != [list(g) for g in recorded]:
            raise ImageInputError(f"{what}: the trainer's image grids {grids.tolist()} differ from the rollout's "
                                  f"{recorded} (different preprocessor_config.json?)")
        try:
            positions = mrope_position_ids(mask, grids, self.processor.merge_size)
        except ImageInputError as exc:
            raise ImageInputError(f"{what}: {exc}") from None
        return {"pixel_values": pixel_values, "image_grid_thw": grids, "image_mask": mask, "position_ids": positions}
