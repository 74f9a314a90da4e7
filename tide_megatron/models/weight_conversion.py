"""Weight layouts: Hugging Face Qwen2 / Qwen3 <-> Megatron-core GPTModel (local spec), TP-sharded.

Megatron fuses and shards differently from HF:

- Attention: one `linear_qkv` (column-parallel). Its output rows are grouped by KV group: for
  each of the `ng` query groups, the group's `nq/ng` query heads, then its key head, then its
  value head, `head_dim` rows each. TP rank r holds groups [r*ng/tp, (r+1)*ng/tp). HF keeps
  separate q_proj/k_proj/v_proj (heads in order). The bias follows the same layout.
- MLP: one `linear_fc1` (column-parallel) = [gate; up] *per rank*: rank r holds
  [gate rows of r; up rows of r], not a slice of the full [gate; up].
- `linear_proj` (o_proj) and `linear_fc2` (down_proj) are row-parallel: split along inputs.
- Embedding and output layer are vocab-parallel: split along rows.
- Norms are replicated, Qwen3's per-head q/k norms (`self_attn.q_norm` / `k_norm`, Megatron's
  `self_attention.q_layernorm` / `k_layernorm`, `head_dim` wide) too.

Transformer Engine's layer spec fuses each pre-norm into the linear layer after it: its
`self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight` are the local
spec's `input_layernorm.weight` and `pre_mlp_layernorm.weight` (`local_name`); everything else is
named alike, so one mapping serves both specs.

`hf_to_megatron` builds one rank's shard; `megatron_to_hf` gathers all ranks' shards and yields
full HF tensors one at a time (a streaming weight sync never holds the whole model twice).
"""

from __future__ import annotations

import os
import re
from typing import Iterator

import torch

from tide_megatron.models.config import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TE_FUSED_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def local_name(name: str) -> str:
    """The local spec's name of a Megatron parameter of either spec (module docstring)."""
    for te, local in _TE_FUSED_NORMS.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _qkv_groups(cfg: ModelConfig, tp_size: int) -> tuple[int, int, int]:
    """(query groups per rank, query heads per group, head dim)."""
    return cfg.num_key_value_heads // tp_size, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig, tp_rank: int,
              tp_size: int) -> torch.Tensor:
    """HF q [nq*hd, ...], k/v [ng*hd, ...] -> this rank's Megatron qkv [ng_r*(q_per+2)*hd, ...]."""
    ng_r, q_per, hd = _qkv_groups(cfg, tp_size)
    tail = q.shape[1:]
    q = q.reshape(cfg.num_key_value_heads, q_per * hd, *tail)
    k = k.reshape(cfg.num_key_value_heads, hd, *tail)
    v = v.reshape(cfg.num_key_value_heads, hd, *tail)
    groups = slice(tp_rank * ng_r, (tp_rank + 1) * ng_r)
    fused = torch.cat([q[groups], k[groups], v[groups]], dim=1)  # [ng_r, (q_per+2)*hd, ...]
    return fused.reshape(ng_r * (q_per + 2) * hd, *tail)


def _split_qkv(fused: torch.Tensor, cfg: ModelConfig, tp_size: int):
    """One rank's Megatron qkv shard -> that rank's (q, k, v) rows in HF order."""
    ng_r, q_per, hd = _qkv_groups(cfg, tp_size)
    tail = fused.shape[1:]
    grouped = fused.reshape(ng_r, (q_per + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [q_per * hd, hd, hd], dim=1)
    return (q.reshape(ng_r * q_per * hd, *tail), k.reshape(ng_r * hd, *tail),
            v.reshape(ng_r * hd, *tail))


def _shard(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.chunk(t, tp_size, dim=dim)[tp_rank].contiguous()


def hf_to_megatron(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, tp_rank: int = 0,
                   tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron GPTModel state dict (TP rank `tp_rank` of `tp_size`) of an HF Qwen2/Qwen3 one.

    `cfg.qk_layernorm` (Qwen3, Qwen3-VL's language model) says whether the q/k norms are read: a
    checkpoint of the other family fails here (KeyError) or in `copy_shard_into` (unexpected)."""
    cfg.check_tensor_parallel(tp_size)
    sd = state_dict
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _shard(sd["model.embed_tokens.weight"], 0, tp_rank, tp_size),
        "decoder.final_layernorm.weight": sd["model.norm.weight"].clone(),
    }
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _shard(sd["lm_head.weight"], 0, tp_rank, tp_size)
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = sd[hf + "input_layernorm.weight"].clone()
        out[mg + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"],
            cfg, tp_rank, tp_size)
        if cfg.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                sd[attn + "q_proj.bias"], sd[attn + "k_proj.bias"], sd[attn + "v_proj.bias"],
                cfg, tp_rank, tp_size)
        out[mg + "self_attention.linear_proj.weight"] = _shard(sd[attn + "o_proj.weight"], 1, tp_rank, tp_size)
        if cfg.qk_layernorm:  # Qwen3: per-head RMSNorm of q and k (replicated)
            out[mg + "self_attention.q_layernorm.weight"] = sd[attn + "q_norm.weight"].clone()
            out[mg + "self_attention.k_layernorm.weight"] = sd[attn + "k_norm.weight"].clone()
        out[mg + "pre_mlp_layernorm.weight"] = sd[hf + "post_attention_layernorm.weight"].clone()
        gate = _shard(sd[hf + "mlp.gate_proj.weight"], 0, tp_rank, tp_size)
        up = _shard(sd[hf + "mlp.up_proj.weight"], 0, tp_rank, tp_size)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mg + "mlp.linear_fc2.weight"] = _shard(sd[hf + "mlp.down_proj.weight"], 1, tp_rank, tp_size)
    return out


def _megatron_shards_to_hf(name: str, shards: list[torch.Tensor], cfg: ModelConfig
                           ) -> list[tuple[str, torch.Tensor]]:
    """All TP ranks' shards of one Megatron parameter -> its full HF tensor(s)."""
    tp = len(shards)
    name = local_name(name)
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(shards, 0))]
    if name == "output_layer.weight":
        return [("lm_head.weight", torch.cat(shards, 0))]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no HF name for Megatron parameter {name}")
    i, rest = match.groups()
    hf = f"model.layers.{i}."
    if rest == "input_layernorm.weight":
        return [(hf + "input_layernorm.weight", shards[0])]
    if rest == "pre_mlp_layernorm.weight":
        return [(hf + "post_attention_layernorm.weight", shards[0])]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        parts = [_split_qkv(s, cfg, tp) for s in shards]
        return [(f"{hf}self_attn.{p}_proj.{kind}", torch.cat([qkv[j] for qkv in parts], 0))
                for j, p in enumerate("qkv")]
    if rest == "self_attention.linear_proj.weight":
        return [(hf + "self_attn.o_proj.weight", torch.cat(shards, 1))]
    if rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return [(f"{hf}self_attn.{rest.split('.')[1][0]}_norm.weight", shards[0])]
    if rest == "mlp.linear_fc1.weight":
        halves = [torch.chunk(s, 2, 0) for s in shards]  # per rank: [gate_r; up_r]
        return [(hf + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves], 0)),
                (hf + "mlp.up_proj.weight", torch.cat([h[1] for h in halves], 0))]
    if rest == "mlp.linear_fc2.weight":
        return [(hf + "mlp.down_proj.weight", torch.cat(shards, 1))]
    raise KeyError(f"no HF name for Megatron parameter {name}")


def megatron_shards_to_hf_state_dict(shard_dicts: list[dict[str, torch.Tensor]], cfg: ModelConfig
                                     ) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron` given every TP rank's state dict (rank order), no comms."""
    out: dict[str, torch.Tensor] = {}
    for name in shard_dicts[0]:
        if name.endswith("_extra_state"):
            continue
        out.update(_megatron_shards_to_hf(name, [d[name] for d in shard_dicts], cfg))
    return out


def megatron_to_hf(model: torch.nn.Module, cfg: ModelConfig,
                   tp_group: "torch.distributed.ProcessGroup | None" = None,
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every weight of a (TP-sharded) Megatron GPTModel.

    Collective over `tp_group` (default: the model's own, `GPTModel.pg_collection.tp`): every TP
    rank must iterate it to the end, in the same order. Tensors are detached, contiguous, on
    the model's device, in the model's dtype: the shape SGLang's `update_weights_from_tensor` /
    `update_weights_from_distributed` take. With tied embeddings `lm_head.weight` is not yielded
    (HF and SGLang tie it to `model.embed_tokens.weight`).
    """
    for name, shards in gather_tp_shards(model, tp_group):
        yield from _megatron_shards_to_hf(name, shards, cfg)


def gather_tp_shards(model: torch.nn.Module, tp_group: "torch.distributed.ProcessGroup | None" = None
                     ) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """(Megatron name, every TP rank's shard in rank order) of each parameter, in module order.

    Collective over `tp_group` (default: the model's own, `pg_collection.tp`). A parameter that is not
    TP-sharded is the same on every rank: its local tensor stands for every shard.
    """
    model = unwrap_model(model)
    if tp_group is None:
        tp_group = model.pg_collection.tp
    tp_size = tp_group.size()
    for name, param in model.named_parameters():
        local = param.detach().contiguous()
        if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
            shards = [local] * tp_size
        else:
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, local, group=tp_group)
        yield name, shards


def load_hf_into_megatron(model: torch.nn.Module, source: str | os.PathLike | dict, cfg: ModelConfig
                          ) -> None:
    """Copy an HF checkpoint (directory or state dict) into this rank's shard of `model`."""
    from tide_megatron.models.hf_checkpoint import load_hf_state_dict

    state = source if isinstance(source, dict) else load_hf_state_dict(source)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" not in state:
        raise KeyError("checkpoint has no model.embed_tokens.weight")
    if not cfg.tie_word_embeddings and "lm_head.weight" not in state:
        raise KeyError("untied config but checkpoint has no lm_head.weight")
    copy_shard_into(model, lambda tp_rank, tp_size: hf_to_megatron(state, cfg, tp_rank, tp_size))


def copy_shard_into(model: torch.nn.Module, make_shard) -> None:
    """Copy `make_shard(tp_rank, tp_size)` (Megatron name -> this rank's tensor) into `model`,
    after checking that it names every parameter, and nothing else, with the right shapes. The
    TP rank and size are those of the model's own TP group (`pg_collection.tp`)."""
    module = unwrap_model(model)
    tp_group = module.pg_collection.tp
    shard = make_shard(tp_group.rank(), tp_group.size())
    params = {local_name(n): p for n, p in module.named_parameters()}
    missing = set(params) - set(shard)
    unexpected = set(shard) - set(params)
    if missing or unexpected:
        raise KeyError(f"HF->Megatron mismatch: missing={sorted(missing)} unexpected={sorted(unexpected)}")
    with torch.no_grad():
        for name, tensor in shard.items():
            target = params[name]
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: Megatron shape {tuple(target.shape)} vs HF-derived "
                                 f"{tuple(tensor.shape)}")
            target.copy_(tensor.to(dtype=target.dtype, device=target.device))
