"""The architecture of a Qwen3-VL policy, in one dataclass shared by Megatron and Hugging Face.

A Qwen3-VL model is a vision tower and a language model:

- vision: a Conv3d patch embedding (`temporal_patch_size` x `patch_size`^2 pixels per patch), a
  learned position table resampled bilinearly to each image's patch grid, `depth` pre-LayerNorm
  transformer blocks (biased linears, GELU-tanh MLP, 2-D rotary positions, attention within one
  image), then a merger that concatenates each `spatial_merge_size`^2 block of patches and projects
  it to the language model's width (one image token per block). DeepStack mergers take the hidden
  states after the blocks in `deepstack_visual_indexes`; their outputs are added to the language
  model's hidden states at the image positions after its first layers.
- language model: Qwen3 (pre-RMSNorm decoder, grouped-query attention with per-head q/k RMSNorm,
  no biases, SwiGLU) with multimodal rotary positions (MRoPE): every token has a (t, h, w) position;
  text tokens have t = h = w, image tokens their grid coordinates. Qwen3-VL interleaves the three
  axes over the rotary frequencies (`mrope_section` counts the frequencies of t, h, w).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from tide_megatron.models.config import read_hf_config


@dataclass(frozen=True)
class VisionTowerConfig:
    """The Qwen3-VL vision encoder (`vision_config` in HF)."""

    depth: int = 2
    """Transformer blocks."""
    hidden_size: int = 32
    """Width of the vision transformer."""
    intermediate_size: int = 64
    """Inner width of its MLP."""
    num_heads: int = 2
    """Attention heads (head dim = hidden_size / num_heads)."""
    patch_size: int = 16
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The merger turns each `spatial_merge_size` x `spatial_merge_size` block into one token."""
    out_hidden_size: int = 64
    """Width of the merger's output: the language model's hidden size."""
    num_position_embeddings: int = 64
    """Rows of the learned position table (a square grid, resampled to each image)."""
    deepstack_visual_indexes: tuple[int, ...] = (0,)
    """Blocks whose output feeds a DeepStack merger, in order."""
    in_channels: int = 3
    """Image channels."""
    rope_theta: float = 10000.0
    """Base of the 2-D rotary frequencies."""
    layer_norm_eps: float = 1e-6
    """Epsilon of every vision LayerNorm."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_size(self) -> int:
        """Width of a merged block of patches."""
        return self.hidden_size * self.spatial_merge_size ** 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError("vision hidden_size / num_heads must be a multiple of 4 (2-D rotary)")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside 0..{self.depth - 1}")


@dataclass(frozen=True)
class VLModelConfig:
    """A Qwen3-VL-architecture vision-language model."""

    vocab_size: int = 3136
    """Rows of the embedding and output layer; divides by the TP size."""
    hidden_size: int = 64
    """Width of the language model's residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 16
    """Per-head width (Qwen3 sets it independently of hidden_size / heads)."""
    ffn_hidden_size: int = 128
    """SwiGLU inner width."""
    rope_theta: float = 5_000_000.0
    """Base of the text rotary frequencies."""
    mrope_section: tuple[int, int, int] = (4, 2, 2)
    """Rotary frequencies given to the t, h, w axes; sums to head_dim / 2."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (layers, final, q/k norms)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer (Qwen3-VL-2B/4B do)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for."""
    image_token_id: int = 3075
    """`<|image_pad|>`: one per merged image block in the token sequence."""
    video_token_id: int = 3076
    """`<|video_pad|>`."""
    vision_start_token_id: int = 3072
    """`<|vision_start|>`, just before an image's pads."""
    vision_end_token_id: int = 3073
    """`<|vision_end|>`, just after them."""
    vision: VisionTowerConfig = field(default_factory=VisionTowerConfig)
    """The vision encoder."""

    @property
    def qkv_bias(self) -> bool:
        return False

    @property
    def qk_layernorm(self) -> bool:
        """The language model is Qwen3's: per-head q/k RMSNorm (read by the text converter)."""
        return True

    @property
    def vision_special_token_ids(self) -> tuple[int, int, int, int]:
        return (self.vision_start_token_id, self.vision_end_token_id, self.image_token_id, self.video_token_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", VisionTowerConfig(**self.vision))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must divide by num_key_value_heads")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must be 3 numbers summing to head_dim/2 = "
                             f"{self.head_dim // 2}")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision.out_hidden_size={self.vision.out_hidden_size} must equal hidden_size="
                             f"{self.hidden_size}")
        if len(self.vision.deepstack_visual_indexes) > self.num_layers:
            raise ValueError("more DeepStack mergers than decoder layers")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise if this model cannot be sharded `tp_size` ways without padding."""
        for name, value in (("vocab_size", self.vocab_size), ("num_key_value_heads", self.num_key_value_heads),
                            ("num_attention_heads", self.num_attention_heads),
                            ("ffn_hidden_size", self.ffn_hidden_size), ("vision.num_heads", self.vision.num_heads),
                            ("vision.intermediate_size", self.vision.intermediate_size),
                            ("vision.merged_size", self.vision.merged_size)):
            if value % tp_size:
                raise ValueError(f"{name}={value} does not divide by tensor-parallel size {tp_size}")

    # ---- Hugging Face config.json ----------------------------------------------------------

    def to_hf_config_dict(self) -> dict:
        """The `config.json` of the equivalent `Qwen3VLForConditionalGeneration`."""
        v = self.vision
        return {
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": {
                "model_type": "qwen3_vl_text",
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.ffn_hidden_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": self.rms_norm_eps,
                "attention_bias": False,
                "tie_word_embeddings": self.tie_word_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                    "mrope_section": list(self.mrope_section), "mrope_interleaved": True},
            },
            "vision_config": {
                "model_type": "qwen3_vl_vision",
                "depth": v.depth,
                "hidden_size": v.hidden_size,
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_channels": v.in_channels,
                "patch_size": v.patch_size,
                "temporal_patch_size": v.temporal_patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "out_hidden_size": v.out_hidden_size,
                "num_position_embeddings": v.num_position_embeddings,
                "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
                "hidden_act": "gelu_pytorch_tanh",
            },
        }

    @classmethod
    def from_hf_config_dict(cls, hf: dict) -> "VLModelConfig":
        if hf.get("model_type") != "qwen3_vl":
            raise ValueError(f"expected a qwen3_vl config, got model_type={hf.get('model_type')!r}")
        text, vis = hf["text_config"], hf["vision_config"]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("mrope_interleaved") is False:
            raise ValueError("only interleaved MRoPE (Qwen3-VL) is supported; this config says "
                             "mrope_interleaved=false")
        act = vis.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act={act!r}: only gelu_pytorch_tanh is supported")
        tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_layers=text["num_hidden_layers"],
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            ffn_hidden_size=text["intermediate_size"], rope_theta=float(rope.get("rope_theta", text.get("rope_theta"))),
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))), rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(tied), max_position_embeddings=text.get("max_position_embeddings", 4096),
            image_token_id=hf["image_token_id"], video_token_id=hf["video_token_id"],
            vision_start_token_id=hf["vision_start_token_id"], vision_end_token_id=hf["vision_end_token_id"],
            vision=VisionTowerConfig(
                depth=vis["depth"], hidden_size=vis["hidden_size"], intermediate_size=vis["intermediate_size"],
                num_heads=vis["num_heads"], patch_size=vis["patch_size"],
                temporal_patch_size=vis["temporal_patch_size"], spatial_merge_size=vis["spatial_merge_size"],
                out_hidden_size=vis["out_hidden_size"], num_position_embeddings=vis["num_position_embeddings"],
                deepstack_visual_indexes=tuple(vis.get("deepstack_visual_indexes", ())),
                in_channels=vis.get("in_channels", 3),
                rope_theta=float((vis.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        )

    @classmethod
    def from_hf_checkpoint(cls, checkpoint_dir: str | os.PathLike) -> "VLModelConfig":
        return cls.from_hf_config_dict(read_hf_config(checkpoint_dir))

    def to_dict(self) -> dict:
        return asdict(self)
