"""The Qwen3-VL vision tower, built from Megatron-core modules (local spec, TP-sharded).

Megatron's own `CLIPViTModel` does not fit (class token, one fixed image size, learned absolute
positions), so the tower is assembled from its parts:

- `patch_embed`: a plain `Conv3d` whose kernel equals its stride (a linear map of each patch's
  pixels), replicated on every TP rank like the position table `pos_embed`;
- `decoder`: a Megatron `TransformerBlock` of ViT layers (the local ViT spec: LayerNorm with bias,
  biased column/row-parallel linears, GELU-tanh MLP) with `AttnMaskType.no_mask`, fed a 2-D rotary
  embedding through `rotary_pos_emb` and no final norm;
- `merger` and `deepstack_mergers`: Megatron `MultimodalProjector`s (`mlp`: fc1, exact GELU, fc2)
  after a replicated LayerNorm, over the concatenation of each merge block of patches.

Attention never crosses images. Images of one grid shape run as one batch `[patches, images,
hidden]` with full attention, so no `[N, N]` mask is ever built, whatever the number of images.
The processor emits each image's patches in merge-block order (block row, block column, row and
column within the block); positions and the position table follow that order.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F

from tide_megatron.models.megatron_gpt import unfused_config_kwargs
from tide_megatron.models.qwen3_vl_config import VisionTowerConfig


def vision_transformer_config(v: VisionTowerConfig, tp: int, bf16: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, num_attention_heads=v.num_heads,
        num_query_groups=v.num_heads, kv_channels=v.head_dim, ffn_hidden_size=v.intermediate_size,
        normalization="LayerNorm", layernorm_epsilon=v.layer_norm_eps, add_bias_linear=True, add_qkv_bias=True,
        gated_linear_unit=False, activation_func=partial(F.gelu, approximate="tanh"),
        **unfused_config_kwargs(tp, bf16))


def merger_config(v: VisionTowerConfig, tp: int, bf16: bool):
    """Config of a merger MLP: merged patches (4 x vision width) -> 4 x width -> LM width."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=v.out_hidden_size, num_attention_heads=v.num_heads,
        ffn_hidden_size=v.merged_size, add_bias_linear=True, gated_linear_unit=False, activation_func=F.gelu,
        **unfused_config_kwargs(tp, bf16))


def _vit_layer_spec():
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}  # bidirectional
    return spec


def _merge_block_order(h: int, w: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid in merge-block order. # ([h*w], [h*w])"""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    reorder = lambda x: x.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1)  # noqa: E731
    return reorder(rows), reorder(cols)


def megatron_module_base():
    """`MegatronModule`, imported when a model class is defined: its `sharded_state_dict` recurses
    into children, so TP-sharded parameters inside are checkpointed as shards."""
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class Merger(megatron_module_base()):
    """LayerNorm + Megatron MLP projector over merge blocks (`postshuffle`: norm after grouping)."""

    def __init__(self, v: VisionTowerConfig, config, postshuffle: bool, tp_group):
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        super().__init__(config=config)
        self.postshuffle = postshuffle
        self.merged = v.merged_size
        self.norm = torch.nn.LayerNorm(v.merged_size if postshuffle else v.hidden_size, eps=v.layer_norm_eps,
                                       dtype=config.params_dtype)
        self.projector = MultimodalProjector(
            config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp", input_size=v.merged_size, tp_group=tp_group)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """# [patches, vision width] in merge-block order -> [patches / merge^2, LM width]"""
        x = self.norm(patches.reshape(-1, self.merged)) if self.postshuffle else self.norm(patches)
        return self.projector(x.reshape(-1, 1, self.merged))[:, 0]


class MergerList(megatron_module_base()):
    """The DeepStack mergers, children `0`, `1`, ... A plain `ModuleList` is no `MegatronModule`:
    its TP-sharded parameters would be checkpointed as replicated (rank 0's shard for all)."""

    def __init__(self, config, mergers: list[Merger]):
        super().__init__(config=config)
        for j, merger in enumerate(mergers):
            self.add_module(str(j), merger)

    def __getitem__(self, j: int) -> Merger:
        return self._modules[str(j)]


class Qwen3VLVisionTower(megatron_module_base()):
    """Pixel values of several images -> their image-token embeddings and DeepStack features."""

    def __init__(self, v: VisionTowerConfig, groups, bf16: bool = False):
        """`groups`: the Megatron `ProcessGroupCollection` of the model (its TP group shards the
        attention heads and MLPs as in the language model)."""
        from megatron.core.transformer.transformer_block import TransformerBlock

        tp = groups.tp.size()
        config = vision_transformer_config(v, tp, bf16)
        super().__init__(config=config)
        self.cfg = v
        dtype = torch.bfloat16 if bf16 else torch.float32
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = torch.nn.Conv3d(v.in_channels, v.hidden_size, kernel, stride=kernel, bias=True, dtype=dtype)
        self.pos_embed = torch.nn.Embedding(v.num_position_embeddings, v.hidden_size, dtype=dtype)
        self.side = int(v.num_position_embeddings ** 0.5)
        self.decoder = TransformerBlock(config, _vit_layer_spec(), post_layer_norm=False, pg_collection=groups)
        proj_cfg = merger_config(v, tp, bf16)
        self.merger = Merger(v, proj_cfg, postshuffle=False, tp_group=groups.tp)
        self.deepstack_mergers = MergerList(proj_cfg, [Merger(v, proj_cfg, postshuffle=True, tp_group=groups.tp)
                                                       for _ in v.deepstack_visual_indexes])
        self._deepstack_layers = sorted(v.deepstack_visual_indexes)
        # Megatron's torch-norm wrapper builds its LayerNorms in fp32 whatever params_dtype says;
        # torch's layer_norm (unlike rms_norm) refuses a bf16 input with fp32 weights.
        for module in self.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.to(dtype)
        quarter = v.head_dim // 4
        inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    # ---- per-grid constants -------------------------------------------------------------

    def _position_embedding(self, h: int, w: int) -> torch.Tensor:
        """The learned table resampled (bilinear, corners aligned) to an h x w grid. # [h*w, width]"""
        rows, cols = _merge_block_order(h, w, self.cfg.spatial_merge_size, self.pos_embed.weight.device)
        side = self.side

        def taps(index: torch.Tensor, size: int):
            src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
            floor = torch.floor(src)
            offsets = torch.arange(0, 2, device=index.device)
            return (floor.long()[:, None] + offsets).clamp(0, side - 1), (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)

        h_taps, h_weights = taps(rows, h)
        w_taps, w_weights = taps(cols, w)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)

    def _rotary(self, h: int, w: int) -> torch.Tensor:
        """2-D rotary angles in Megatron's layout: [rows | cols | rows | cols]. # [h*w, 1, 1, head_dim]"""
        rows, cols = _merge_block_order(h, w, self.cfg.spatial_merge_size, self.inv_freq.device)
        freqs = torch.cat([rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq], -1)
        return torch.cat([freqs, freqs], -1)[:, None, None, :]

    # ---- forward ------------------------------------------------------------------------

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values: # [patches, patch_dim], images in order; grid_thw: # [images, 3].

        Returns the image-token embeddings # [patches / merge^2, LM width] and one tensor of the
        same shape per DeepStack merger, both in image order.
        """
        v = self.cfg
        grids = [tuple(int(x) for x in g) for g in grid_thw.tolist()]
        if any(t != 1 for t, _, _ in grids):
            raise ValueError("videos (grid t > 1) are not supported by the trainer's vision tower")
        sizes = [t * h * w for t, h, w in grids]
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patches for grids {grids} that need {sum(sizes)}")
        dtype = self.patch_embed.weight.dtype
        patches = self.patch_embed(pixel_values.to(dtype).view(-1, v.in_channels, v.temporal_patch_size,
                                                               v.patch_size, v.patch_size)).view(-1, v.hidden_size)
        per_image = list(torch.split(patches, sizes))
        outputs: list[list[torch.Tensor] | None] = [None] * len(grids)
        for shape in dict.fromkeys(grids):  # each distinct grid, in first-seen order
            idx = [i for i, g in enumerate(grids) if g == shape]
            _, h, w = shape
            x = torch.stack([per_image[i] for i in idx], 1) + self._position_embedding(h, w)[:, None]  # [hw, n, width]
            rotary = self._rotary(h, w)
            taken = {}
            for layer_no, layer in enumerate(self.decoder.layers):
                x, _ = layer(x, attention_mask=None, rotary_pos_emb=rotary)
                if layer_no in v.deepstack_visual_indexes:
                    taken[layer_no] = x
            for k, i in enumerate(idx):
                outputs[i] = [x[:, k]] + [taken[layer_no][:, k] for layer_no in self._deepstack_layers]
        merged = self.merger(torch.cat([o[0] for o in outputs]))
        # DeepStack feature j comes from the j-th tapped block in depth order (HF's order), through
        # the merger listed for that block.
        deepstack = [self.deepstack_mergers[v.deepstack_visual_indexes.index(layer_no)](
            torch.cat([o[1 + j] for o in outputs])) for j, layer_no in enumerate(self._deepstack_layers)]
        return merged, deepstack
