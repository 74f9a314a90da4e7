"""The transformer layer spec of every trainer model: Transformer Engine's, or the local one with
packed-sequence attention (`trainer.layer_spec: auto | te | local`).

- `te`: Megatron's Transformer Engine spec (fused kernels, THD attention for packed batches,
  sequence parallelism under TP). Needs `transformer_engine` and a GPU.
- `local`: Megatron's local spec, whose core attention is replaced by `PackedDotProductAttention`:
  Megatron's own `DotProductAttention` for padded batches (dense mask), and for packed (THD)
  batches one causal `scaled_dot_product_attention` per trajectory, so the cost is the sum of
  squared trajectory lengths, never the square of the packed length. On GPU torch picks its
  flash kernel for each trajectory; on CPU its math kernel.
- `auto`: `te` when `transformer_engine` imports and CUDA is there, else `local`.

The weight names of the two specs differ (TE fuses the input norms into the following linear
layers); `weight_conversion` reads both.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from tide_megatron.trainer.config import LAYER_SPECS


@functools.cache
def transformer_engine_available() -> bool:
    """Transformer Engine imports and there is a GPU for it."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken install (ABI mismatch) is as good as none
        return False
    return True


def resolve_layer_spec(name: str) -> str:
    """"te" or "local" for a configured `trainer.layer_spec`; ValueError naming the key when `te`
    is asked for where it cannot run."""
    if name not in LAYER_SPECS:
        raise ValueError(f"trainer.layer_spec={name!r}: expected one of {LAYER_SPECS}")
    if name == "auto":
        return "te" if transformer_engine_available() else "local"
    if name == "te" and not transformer_engine_available():
        raise ValueError("trainer.layer_spec=te needs transformer_engine and a CUDA GPU; this machine has "
                         f"{'no GPU' if not torch.cuda.is_available() else 'no transformer_engine'} "
                         "(set trainer.layer_spec=local or auto)")
    return name


def gpt_layer_spec(layer_spec: str = "local", qk_layernorm: bool = False):
    """The `ModuleSpec` of one decoder layer (RMSNorm, SwiGLU, optional per-head q/k norm)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if resolve_layer_spec(layer_spec) == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = packed_dot_product_attention_class()
    return spec


@functools.cache
def packed_dot_product_attention_class():
    """`PackedDotProductAttention`, built on first use (megatron-core imports lazily)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        """Megatron's local core attention, plus packed (THD) batches attended per trajectory."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed attention takes the thd format, got {packed_seq_params.qkv_format!r}")
            if attention_bias is not None:
                raise ValueError("packed attention takes no attention bias")
            return packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale)

    return PackedDotProductAttention


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention within each segment of a packed sequence.

    query # [T, Hq, D]; key, value # [T, Hkv, D] (grouped-query: Hq a multiple of Hkv);
    cu_seqlens # [S + 1] segment starts. Returns # [T, Hq * D].
    """
    total, heads, dim = query.shape
    groups = heads // key.shape[1]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} does not cover the {total} packed tokens")
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = query[start:end].transpose(0, 1)  # [Hq, L, D]
        k = key[start:end].transpose(0, 1)  # [Hkv, L, D]
        v = value[start:end].transpose(0, 1)
        if groups > 1:
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)  # [Hq, L, D]
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)  # [1, Hq, L, D]
        out.append(o[0].transpose(0, 1))  # [L, Hq, D]
    return torch.cat(out).reshape(total, heads * dim)
