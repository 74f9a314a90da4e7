"""The architecture of the policy model, in one dataclass shared by Megatron and Hugging Face.

The trainer builds a Megatron-core `GPTModel` from it, the tests write a random Hugging Face
`Qwen2ForCausalLM` from it, and the weight converters read head counts and sizes from it. Only the
Qwen2 family (Qwen2 / Qwen2.5 text models) is described: pre-norm RMSNorm decoder, rotary
position embeddings, grouped-query attention with a bias on Q/K/V only, SwiGLU MLP.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen2-architecture decoder-only language model."""

    vocab_size: int = 4096
    """Rows of the embedding and of the output layer. Must divide by the tensor-parallel size (no
    vocab padding: padded logits would change the softmax and break exactness with HF)."""

    hidden_size: int = 64
    """Width of the residual stream."""

    num_layers: int = 2
    """Number of transformer decoder layers."""

    num_attention_heads: int = 4
    """Query heads. `hidden_size / num_attention_heads` is the head dimension."""

    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); divides `num_attention_heads`. With tensor
    parallelism it must also divide by the TP size, since Megatron shards whole KV groups."""

    ffn_hidden_size: int = 128
    """Inner width of the SwiGLU MLP (`intermediate_size` in HF)."""

    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding frequencies (Qwen2.5 uses 1e6)."""

    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    qkv_bias: bool = True
    """A bias on the Q, K and V projections (true for Qwen2; no bias anywhere else)."""

    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer (Qwen2.5 0.5B/1.5B/3B do)."""

    max_position_embeddings: int = 2048
    """Longest sequence the model is built for (sizes the rotary cache)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must divide by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must divide by num_key_value_heads")

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
        """The `config.json` fields of the equivalent `Qwen2ForCausalLM`."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
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

    @classmethod
    def from_hf_config_dict(cls, hf: dict) -> "ModelConfig":
        if hf.get("model_type") not in ("qwen2", None):
            raise ValueError(f"expected a qwen2 config, got model_type={hf.get('model_type')!r}")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers 5 may nest it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            ffn_hidden_size=hf["intermediate_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=True,
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
