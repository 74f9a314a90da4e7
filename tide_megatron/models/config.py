"""The architecture of the policy model, in one dataclass shared by Megatron and Hugging Face.

The trainer builds a Megatron-core `GPTModel` from it, the tests write a random Hugging Face
`Qwen2ForCausalLM` / `Qwen3ForCausalLM` from it, and the weight converters read head counts and
sizes from it. Two dense text families are described, both a pre-norm RMSNorm decoder with rotary
position embeddings, grouped-query attention and a SwiGLU MLP:

- Qwen2 / Qwen2.5 (`model_type: qwen2`): a bias on Q/K/V (and nowhere else);
- Qwen3 (`model_type: qwen3`): no bias, a per-head RMSNorm of the queries and keys before the
  rotary embedding (`q_norm` / `k_norm`, Megatron's `qk_layernorm`), and a head width set on its
  own (`head_dim`, not always `hidden_size / num_attention_heads`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

TEXT_MODEL_TYPES = ("qwen2", "qwen3")
"""Hugging Face `model_type`s that `ModelConfig` describes."""


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen2- or Qwen3-architecture dense decoder-only language model."""

    vocab_size: int = 4096
    """Rows of the embedding and of the output layer. Must divide by the tensor-parallel size (no
    vocab padding: padded logits would change the softmax and break exactness with HF)."""

    hidden_size: int = 64
    """Width of the residual stream."""

    num_layers: int = 2
    """Number of transformer decoder layers."""

    num_attention_heads: int = 4
    """Query heads."""

    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); divides `num_attention_heads`. With tensor
    parallelism it must also divide by the TP size, since Megatron shards whole KV groups."""

    ffn_hidden_size: int = 128
    """Inner width of the SwiGLU MLP (`intermediate_size` in HF)."""

    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding frequencies (Qwen2.5 uses 1e6)."""

    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    head_dim: int = 0
    """Width of one attention head. 0: `hidden_size / num_attention_heads` (always so in Qwen2;
    Qwen3 configs set it, e.g. 128 with hidden 1024 and 16 heads in Qwen3-0.6B)."""

    qkv_bias: bool = True
    """A bias on the Q, K and V projections (true for Qwen2; no bias anywhere else)."""

    qk_layernorm: bool = False
    """Per-head RMSNorm of the queries and keys (Qwen3's `q_norm` / `k_norm`). It also names the
    Hugging Face family: true is Qwen3 (`model_type: qwen3`, which has no Q/K/V bias), false
    Qwen2."""

    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer (Qwen2.5 0.5B/1.5B/3B do)."""

    max_position_embeddings: int = 2048
    """Longest sequence the model is built for (sizes the rotary cache)."""

    @property
    def hf_model_type(self) -> str:
        """The Hugging Face `model_type` of this architecture."""
        return "qwen3" if self.qk_layernorm else "qwen2"

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must divide by num_attention_heads (or set head_dim)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must divide by num_key_value_heads")
        if self.qk_layernorm and self.qkv_bias:
            # Qwen3's `attention_bias` puts a bias on o_proj too, which the Megatron model lacks.
            raise ValueError("qk_layernorm=True is Qwen3, which has no Q/K/V bias: set qkv_bias=False")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise if this model cannot be sharded `tp_size` ways without padding."""
        for name, value in (
            ("vocab_size", self.vocab_size),
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_attention_heads", self.num_attention_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
        ):
            if value % tp_size:
                raise ValueError(f"{name}={value} does not divide by tensor-parallel size {tp_size}")

    # ---- Hugging Face config.json ----------------------------------------------------------

    def to_hf_config_dict(self) -> dict:
        """The `config.json` fields of the equivalent `Qwen2ForCausalLM` or `Qwen3ForCausalLM`."""
        hf = {
            "architectures": ["Qwen3ForCausalLM" if self.qk_layernorm else "Qwen2ForCausalLM"],
            "model_type": self.hf_model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_hidden_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "torch_dtype": "float32",
        }
        if self.qk_layernorm:
            hf["attention_bias"] = False
        return hf

    @classmethod
    def from_hf_config_dict(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in TEXT_MODEL_TYPES + (None,):
            raise ValueError(f"expected a {' or '.join(TEXT_MODEL_TYPES)} config, got model_type={model_type!r}")
        qwen3 = model_type == "qwen3"
        if qwen3 and hf.get("attention_bias"):
            raise ValueError("a qwen3 config with attention_bias=true (a bias on q/k/v/o_proj) is not supported")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            # YaRN / dynamic scaling would change the rotary angles the Megatron model computes.
            raise ValueError(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported "
                             "(only the default rotary embedding)")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers 5 may nest it under rope_parameters
            rope_theta = rope.get("rope_theta", 10000.0)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            ffn_hidden_size=hf["intermediate_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=not qwen3,
            qk_layernorm=qwen3,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
        )

    @classmethod
    def from_hf_checkpoint(cls, checkpoint_dir: str | os.PathLike) -> "ModelConfig":
        return cls.from_hf_config_dict(read_hf_config(checkpoint_dir))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def read_hf_config(checkpoint_dir: str | os.PathLike) -> dict:
    """The `config.json` of a Hugging Face checkpoint directory."""
    path = os.path.join(os.fspath(checkpoint_dir), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no Hugging Face config.json at {path}")
    with open(path) as f:
        return json.load(f)
