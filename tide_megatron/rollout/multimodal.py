"""Images in multi-turn rollouts of a vision-language policy (Qwen3-VL) on SGLang.

Token-in/token-out with images works like this (SGLang 0.5.23, `qwen3_vl`):
- the rollout sends SGLang token ids with ONE `<|image_pad|>` between `<|vision_start|>` and
  `<|vision_end|>` per image, plus the images' encoded bytes (`image_data`), in the order of their
  pads. SGLang keeps the ids verbatim and expands each pad to the image's token count
  (`grid_t * grid_h * grid_w / merge^2`, from its grid after the processor's resize);
- the trajectory records the expanded ids (what the trainer and the KV cache see), so the
  rollout expands the same pads itself, with the same image-processor config, and checks every
  turn that SGLang's context length equals its own;
- with a streaming session, a turn sends only its new ids and its new images; a fresh session
  (first turn, a task resumed by CTB, or no sessions at all) sends the whole context in the
  one-pad form with every image so far, so the episode keeps both forms (`episode.Episode.send_tokens`).

An image the env returns is decoded and checked here first (`ImageInputError`, naming the task,
turn and image): a corrupt or oversized image fails the task with that message, which the rollout
worker reports to the controller like any failed task (re-run or stop with the error; never
dropped). The policy never generates a vision special token (sent back, a generated pad would
read as an image placeholder): SGLang samples with their logits at `BANNED_LOGIT` (`logit_bias`),
and the trainer computes its log-probs the same way (`models.policy.banned_token_ids`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from tide_megatron.models.qwen3_vl_inputs import ImageInputError, DecodeLimits, ImageProcessor


@dataclass(frozen=True)
class TurnImage:
    """One image of an observation, checked and measured."""

    data: bytes
    """Encoded PNG/JPEG bytes, as the env returned them (what SGLang and the trainer decode)."""
    grid: tuple[int, int, int]
    """(t, h, w) patch grid after the processor's resize."""
    num_tokens: int
    """Image pads it takes in the context."""


class ImagePrompts:
    """What a vision-language policy's rollout needs to know about images."""

    def __init__(self, processor: ImageProcessor, image_token_id: int, banned_token_ids: Sequence[int]):
        from tide_megatron.trainer.logprobs import BANNED_LOGIT

        self.processor = processor
        self.image_token_id = image_token_id
        self.logit_bias = {str(t): BANNED_LOGIT for t in banned_token_ids}
        """SGLang's `logit_bias` that keeps the vision special tokens out of every sample."""

    @classmethod
    def for_checkpoint(cls, checkpoint_dir: str | os.PathLike, limits: DecodeLimits = DecodeLimits()
                       ) -> "ImagePrompts | None":
        """None for a text-only checkpoint."""
        from tide_megatron.models.policy import banned_token_ids, is_vision_language, model_config_from_checkpoint

        cfg = model_config_from_checkpoint(checkpoint_dir)
        if not is_vision_language(cfg):
            return None
        return cls(ImageProcessor(checkpoint_dir, limits), cfg.image_token_id, banned_token_ids(cfg))

    def prepare(self, images: Sequence[bytes], what: str) -> list[TurnImage]:
        """Decode and measure an observation's images; `ImageInputError` names `what` and the image."""
        out = []
        for i, data in enumerate(images):
            image = self.processor.decode(data, f"{what} image {i}")
            grid = self.processor.grid(image.width, image.height)
            out.append(TurnImage(bytes(data), grid, self.processor.num_tokens(grid)))
        return out

    def expand(self, send_ids: list[int], images: Sequence[TurnImage], what: str) -> list[int]:
        """The one-pad ids SGLang is sent -> the ids it processes (each pad -> the image's pads)."""
        pads = [i for i, t in enumerate(send_ids) if t == self.image_token_id]
        if len(pads) != len(images):
            raise ImageInputError(f"{what}: {len(pads)} image placeholders for {len(images)} images "
                                  "(does the chat template render image parts?)")
        out: list[int] = []
        start = 0
        for at, image in zip(pads, images):
            out += send_ids[start:at] + [self.image_token_id] * image.num_tokens
            start = at + 1
        return out + send_ids[start:]


def observation_images(result: Any) -> list[bytes]:
    """Encoded images of an env reset/step result (`image_data`, filled by the env client)."""
    return list(getattr(result, "image_data", None) or [])
