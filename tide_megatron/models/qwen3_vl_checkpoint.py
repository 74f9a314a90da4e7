"""Hugging Face Qwen3-VL checkpoints on local disk: write a tiny random one, read one back.

A random tiny checkpoint is servable by SGLang and loadable by transformers exactly like a released
Qwen3-VL: `config.json` + fp32 `model.safetensors`, a tokenizer that has the vision special tokens
(`<|vision_start|>`, `<|vision_end|>`, `<|vision_pad|>`, `<|image_pad|>`, `<|video_pad|>`, appended to
a base tokenizer such as the committed tiny BPE), a Qwen3-VL chat template (user content may be a
list of `{"type": "image"}` and `{"type": "text", "text": ...}` parts; no default system message) and
a `preprocessor_config.json` for the Qwen2-VL image processor that Qwen3-VL uses. Nothing here
touches the network.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from tide_megatron.models.qwen3_vl_config import VisionTowerConfig, VLModelConfig

VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

# Qwen3-VL-Instruct's template, reduced to what the rollout renders (no tools, videos, reasoning).
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """`preprocessor_config.json` of the Qwen2-VL image processor (used by Qwen3-VL)."""

    min_pixels: int = 32 * 32
    """Images are resized (keeping the aspect ratio) to at least this many pixels..."""
    max_pixels: int = 128 * 128
    """... and at most this many; each side a multiple of patch_size * spatial_merge_size."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def to_json(self, vision) -> dict:
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_resize": True,
            "do_convert_rgb": True,
        }


def write_vl_tokenizer(dest_dir: str | os.PathLike, base_tokenizer_dir: str | os.PathLike) -> dict[str, int]:
    """Copy a fast tokenizer into `dest_dir` with the vision special tokens appended and the
    Qwen3-VL chat template; returns the ids of the special tokens."""
    from tokenizers import AddedToken, Tokenizer

    dest_dir, base = os.fspath(dest_dir), os.fspath(base_tokenizer_dir)
    os.makedirs(dest_dir, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIAL_TOKENS])
    tok.save(os.path.join(dest_dir, "tokenizer.json"))
    with open(os.path.join(base, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = QWEN3_VL_CHAT_TEMPLATE
    tok_cfg.pop("added_tokens_decoder", None)  # tokenizer.json is the source of truth for ids
    with open(os.path.join(dest_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
    return {t: tok.token_to_id(t) for t in VISION_SPECIAL_TOKENS}


def write_random_vl_checkpoint(
    path: str | os.PathLike,
    cfg: VLModelConfig,
    base_tokenizer_dir: str | os.PathLike,
    seed: int = 0,
    image_processor: ImageProcessorConfig = ImageProcessorConfig(),
    init_std: float = 0.1,
) -> tuple[str, VLModelConfig]:
    """Write a random `Qwen3VLForConditionalGeneration` with its tokenizer and image processor.

    The special-token ids in `cfg` are replaced by the ones the tokenizer gives them, and the
    vocabulary must hold every token. Deterministic in (cfg, seed, tokenizer). Returns the
    directory and the config actually written.
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tide_megatron.models.hf_checkpoint import randomise_

    path = os.fspath(path)
    ids = write_vl_tokenizer(path, base_tokenizer_dir)
    cfg = dataclasses.replace(cfg, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    if max(ids.values()) >= cfg.vocab_size:
        raise ValueError(f"vocab_size={cfg.vocab_size} does not hold the tokenizer's {max(ids.values()) + 1} tokens")
    hf_dict = cfg.to_hf_config_dict()
    hf_config = Qwen3VLConfig(**{k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")})
    hf_config.architectures = hf_dict["architectures"]
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(hf_config).to(torch.float32)
    randomise_(model, seed, init_std)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(image_processor.to_json(cfg.vision), f, indent=2)
    return path, cfg


def write_random_vl_checkpoint_from(path: str | os.PathLike, lm, vision, base_tokenizer_dir: str | os.PathLike,
                                    base_vocab: int, tp_size: int = 1, seed: int = 0) -> str:
    """`write_random_vl_checkpoint` from the job's `model.random_init` (`lm`, the language model)
    and `model.random_vision` (`vision`, the vision tower and image processor) configs; the
    vocabulary is the base tokenizer's plus the vision tokens, rounded up to shard over TP."""
    unit = tp_size * 64
    vocab = -(-(base_vocab + len(VISION_SPECIAL_TOKENS)) // unit) * unit
    cfg = VLModelConfig(
        vocab_size=vocab, hidden_size=lm.hidden_size, num_layers=lm.num_layers,
        num_attention_heads=lm.num_attention_heads, num_key_value_heads=lm.num_key_value_heads,
        head_dim=lm.hidden_size // lm.num_attention_heads, ffn_hidden_size=lm.ffn_hidden_size,
        mrope_section=tuple(vision.mrope_section), tie_word_embeddings=lm.tie_word_embeddings,
        max_position_embeddings=lm.max_position_embeddings,
        vision=VisionTowerConfig(
            depth=vision.depth, hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
            num_heads=vision.num_heads, patch_size=vision.patch_size, spatial_merge_size=vision.spatial_merge_size,
            out_hidden_size=lm.hidden_size, num_position_embeddings=vision.num_position_embeddings,
            deepstack_visual_indexes=tuple(vision.deepstack_visual_indexes)))
    written, _ = write_random_vl_checkpoint(path, cfg, base_tokenizer_dir, seed=seed,
                                            image_processor=ImageProcessorConfig(vision.min_pixels, vision.max_pixels))
    return written


def load_hf_vl_model(checkpoint_dir: str | os.PathLike) -> torch.nn.Module:
    """The checkpoint as a transformers `Qwen3VLForConditionalGeneration` in fp32, eval mode."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(os.fspath(checkpoint_dir), dtype=torch.float32).eval()
