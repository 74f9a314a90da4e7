"""Weight layouts: Hugging Face Qwen3-VL <-> the Megatron `Qwen3VLModel`, TP-sharded, exact.

- Language model (`model.language_model.*`, `lm_head.weight` <-> `language_model.*`): the Qwen2
  converter of `weight_conversion.py` (fused QKV grouped by KV head, per-rank [gate; up],
  row/column/vocab-parallel splits), plus Qwen3's per-head q/k RMSNorms.
- Vision tower (`model.visual.*` <-> `vision.*`): one table (`vision_name_table`) names every
  tensor on both sides with its layout, read in both directions:
  `rep` replicated (norms, the patch embedding, the position table, biases of row-parallel
  layers); `col` split along rows (column-parallel weights and their biases); `row` split along
  columns (row-parallel weights); `qkv` HF's fused `attn.qkv` ([q heads; k heads; v heads]) ->
  Megatron's per-head [q; k; v] blocks (one query group per head), split by heads.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

from tide_megatron.models.qwen3_vl_config import VisionTowerConfig, VLModelConfig
from tide_megatron.models.weight_conversion import (
    _megatron_shards_to_hf,
    _shard,
    copy_shard_into,
    gather_tp_shards,
    hf_to_megatron,
)

HF_TEXT = "model.language_model."
HF_VISION = "model.visual."
MG_TEXT = "language_model."
MG_VISION = "vision."
REP, COL, ROW, QKV = "rep", "col", "row", "qkv"

_BLOCK = (  # HF under blocks.{i}. / Megatron under decoder.layers.{i}. / layout
    ("norm1.weight", "input_layernorm.weight", REP), ("norm1.bias", "input_layernorm.bias", REP),
    ("norm2.weight", "pre_mlp_layernorm.weight", REP), ("norm2.bias", "pre_mlp_layernorm.bias", REP),
    ("attn.qkv.weight", "self_attention.linear_qkv.weight", QKV),
    ("attn.qkv.bias", "self_attention.linear_qkv.bias", QKV),
    ("attn.proj.weight", "self_attention.linear_proj.weight", ROW),
    ("attn.proj.bias", "self_attention.linear_proj.bias", REP),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", COL), ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias", COL),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", ROW), ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias", REP),
)
_MERGER = (  # HF under merger. or deepstack_merger_list.{j}. / Megatron under merger. or deepstack_mergers.{j}.
    ("norm.weight", "norm.weight", REP), ("norm.bias", "norm.bias", REP),
    ("linear_fc1.weight", "projector.encoder.linear_fc1.weight", COL),
    ("linear_fc1.bias", "projector.encoder.linear_fc1.bias", COL),
    ("linear_fc2.weight", "projector.encoder.linear_fc2.weight", ROW),
    ("linear_fc2.bias", "projector.encoder.linear_fc2.bias", REP),
)


def vision_name_table(v: VisionTowerConfig) -> list[tuple[str, str, str]]:
    """(HF name, Megatron name, layout) of every vision tensor."""
    table = [(HF_VISION + "patch_embed.proj.weight", MG_VISION + "patch_embed.weight", REP),
             (HF_VISION + "patch_embed.proj.bias", MG_VISION + "patch_embed.bias", REP),
             (HF_VISION + "pos_embed.weight", MG_VISION + "pos_embed.weight", REP)]
    for i in range(v.depth):
        table += [(f"{HF_VISION}blocks.{i}.{h}", f"{MG_VISION}decoder.layers.{i}.{m}", k) for h, m, k in _BLOCK]
    table += [(f"{HF_VISION}merger.{h}", f"{MG_VISION}merger.{m}", k) for h, m, k in _MERGER]
    for j in range(len(v.deepstack_visual_indexes)):
        table += [(f"{HF_VISION}deepstack_merger_list.{j}.{h}", f"{MG_VISION}deepstack_mergers.{j}.{m}", k)
                  for h, m, k in _MERGER]
    return table


def _qkv_to_megatron(t: torch.Tensor, v: VisionTowerConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
    """HF [3 * heads * hd, ...] -> this rank's heads as per-head [q; k; v]. # [heads/tp * 3 * hd, ...]"""
    tail = t.shape[1:]
    per_head = t.reshape(3, v.num_heads, v.head_dim, *tail).transpose(0, 1)  # [heads, 3, hd, ...]
    mine = torch.chunk(per_head, tp_size, dim=0)[tp_rank]
    return mine.reshape(-1, *tail).contiguous()


def _qkv_to_hf(shards: list[torch.Tensor], v: VisionTowerConfig) -> torch.Tensor:
    tail = shards[0].shape[1:]
    per_head = torch.cat([s.reshape(-1, 3, v.head_dim, *tail) for s in shards], 0)  # [heads, 3, hd, ...]
    return per_head.transpose(0, 1).reshape(3 * v.num_heads * v.head_dim, *tail).contiguous()


def _text_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under the Qwen2-style names `hf_to_megatron` reads."""
    text = {"model." + k[len(HF_TEXT):]: t for k, t in state.items() if k.startswith(HF_TEXT)}
    if "lm_head.weight" in state:
        text["lm_head.weight"] = state["lm_head.weight"]
    return text


def hf_to_megatron_vl(state: dict[str, torch.Tensor], cfg: VLModelConfig, tp_rank: int = 0,
                      tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The `Qwen3VLModel` state dict (TP rank `tp_rank` of `tp_size`) of an HF Qwen3-VL one."""
    cfg.check_tensor_parallel(tp_size)
    out = {MG_TEXT + k: t for k, t in hf_to_megatron(_text_state_dict(state), cfg, tp_rank, tp_size).items()}
    for hf, mg, layout in vision_name_table(cfg.vision):
        if hf not in state:
            raise KeyError(f"checkpoint has no {hf}")
        t = state[hf]
        if layout == REP:
            out[mg] = t.clone()
        elif layout == QKV:
            out[mg] = _qkv_to_megatron(t, cfg.vision, tp_rank, tp_size)
        else:
            out[mg] = _shard(t, 0 if layout == COL else 1, tp_rank, tp_size)
    return out


def _vl_shards_to_hf(name: str, shards: list[torch.Tensor], cfg: VLModelConfig,
                     vision: dict[str, tuple[str, str]]) -> list[tuple[str, torch.Tensor]]:
    """Every TP rank's shard of one `Qwen3VLModel` parameter -> its full HF tensor(s)."""
    if name.startswith(MG_TEXT):
        pairs = _megatron_shards_to_hf(name[len(MG_TEXT):], shards, cfg)
        return [(n if n == "lm_head.weight" else HF_TEXT + n[len("model."):], t) for n, t in pairs]
    if name not in vision:
        raise KeyError(f"no HF name for Megatron parameter {name}")
    hf, layout = vision[name]
    if layout == REP:
        return [(hf, shards[0])]
    if layout == QKV:
        return [(hf, _qkv_to_hf(shards, cfg.vision))]
    return [(hf, torch.cat(shards, 0 if layout == COL else 1))]


def _vision_by_megatron_name(cfg: VLModelConfig) -> dict[str, tuple[str, str]]:
    return {mg: (hf, layout) for hf, mg, layout in vision_name_table(cfg.vision)}


def megatron_shards_to_hf_vl(shard_dicts: list[dict[str, torch.Tensor]], cfg: VLModelConfig
                             ) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron_vl` given every TP rank's state dict (rank order), no comms."""
    vision = _vision_by_megatron_name(cfg)
    out: dict[str, torch.Tensor] = {}
    for name in shard_dicts[0]:
        out.update(_vl_shards_to_hf(name, [d[name] for d in shard_dicts], cfg, vision))
    return out


def megatron_to_hf_vl(model: torch.nn.Module, cfg: VLModelConfig,
                      tp_group: "torch.distributed.ProcessGroup | None" = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight of a (TP-sharded) `Qwen3VLModel`; collective
    over the TP group like `weight_conversion.megatron_to_hf`."""
    vision = _vision_by_megatron_name(cfg)
    for name, shards in gather_tp_shards(model, tp_group):
        yield from _vl_shards_to_hf(name, shards, cfg, vision)


def load_hf_into_qwen3_vl(model: torch.nn.Module, source: str | os.PathLike | dict, cfg: VLModelConfig) -> None:
    """Copy an HF Qwen3-VL checkpoint (directory or state dict) into this rank's shard of `model`."""
    from tide_megatron.models.hf_checkpoint import load_hf_state_dict

    state = source if isinstance(source, dict) else load_hf_state_dict(source)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in state:
        raise KeyError("untied config but checkpoint has no lm_head.weight")
    copy_shard_into(model, lambda tp_rank, tp_size: hf_to_megatron_vl(state, cfg, tp_rank, tp_size))
