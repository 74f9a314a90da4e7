"""The Qwen3-VL policy as a Megatron-core model: vision tower + GPTModel with interleaved MRoPE.

`Qwen3VLModel` holds
- `vision`: `Qwen3VLVisionTower` (megatron_qwen3_vl_vision.py);
- `language_model`: a Megatron `GPTModel` (local spec, RMSNorm, per-head q/k RMSNorm, SwiGLU,
  `position_embedding_type="mrope"`, vocab-parallel output).

Two pieces of Qwen3-VL that megatron-core 0.16.1 lacks are added here, on top of its modules:
- interleaved MRoPE: `InterleavedMRoPE` replaces the GPTModel's `MultimodalRotaryEmbedding`, whose
  sections are contiguous (Qwen2-VL's layout); Qwen3-VL spreads t, h, w over the frequencies
  round-robin (h at i % 3 == 1 below 3 * section_h, w at i % 3 == 2 below 3 * section_w, t elsewhere);
- DeepStack: forward hooks on the first decoder layers add the DeepStack features to the hidden
  states at the image positions (HF adds them after layer j for j < number of DeepStack mergers).

The forward pass takes what `forward_logprobs` passes a GPTModel (ids, positions, mask) plus the
images of the batch: `image_mask` # [B, S] marks the image pads (`qwen3_vl_inputs.image_positions`),
row by row, matching the images' order in `pixel_values` / `image_grid_thw`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tide_megatron.models.layer_spec import gpt_layer_spec, resolve_layer_spec
from tide_megatron.models.megatron_gpt import unfused_config_kwargs
from tide_megatron.models.megatron_qwen3_vl_vision import Qwen3VLVisionTower, megatron_module_base
from tide_megatron.models.qwen3_vl_config import VLModelConfig


def _interleaved_mrope_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    class InterleavedMRoPE(MultimodalRotaryEmbedding):
        """Qwen3-VL's interleaved multimodal rotary angles in Megatron's `[S, B, 1, D]` layout."""

        def __init__(self, head_dim: int, rope_theta: float):
            super().__init__(kv_channels=head_dim, rotary_percent=1.0, rotary_base=int(rope_theta))
            device = self.inv_freq.device
            # As HF computes it (float base), so angles agree bit for bit.
            self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.inv_freq = self.inv_freq.to(device)

        def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
            """position_ids: # [3, B, S] (t, h, w) -> angles # [S, B, 1, head_dim]"""
            if cp_group is not None and cp_group.size() > 1:
                raise NotImplementedError("context parallelism is not supported with interleaved MRoPE")
            freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [3, B, S, D/2]
            angles = freqs[0].clone()
            for axis in (1, 2):
                pick = slice(axis, 3 * mrope_section[axis], 3)
                angles[..., pick] = freqs[axis][..., pick]
            emb = torch.cat([angles, angles], -1)  # [B, S, D]
            return emb.transpose(0, 1)[:, :, None, :].contiguous()

    return InterleavedMRoPE


def language_transformer_config(cfg: VLModelConfig, tp: int, bf16: bool, recompute: str = "none"):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, mrope_section=list(cfg.mrope_section),
        # No sequence parallelism even with TE: the image features are scattered into whole rows.
        **unfused_config_kwargs(tp, bf16, recompute))


def _scatter_rows(hidden: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, add: bool) -> torch.Tensor:
    """Write (or add) `values` # [N, H] at the positions of `mask` # [B, S], row-major (HF's order),
    into `hidden` # [S, B, H]; out of place, differentiable."""
    rows, cols = mask.nonzero(as_tuple=True)
    by_row = hidden.transpose(0, 1)  # [B, S, H]
    values = values.to(by_row.dtype)
    by_row = by_row.index_put((rows, cols), by_row[rows, cols] + values if add else values)
    return by_row.transpose(0, 1).contiguous()


class Qwen3VLModel(megatron_module_base()):
    """Qwen3-VL: images -> vision tower -> image pads of the token embeddings -> GPTModel."""

    def __init__(self, cfg: VLModelConfig, groups, bf16: bool = False, recompute: str = "none",
                 layer_spec: str = "auto"):
        """`groups`: the Megatron `ProcessGroupCollection` it runs on (its TP group sets the TP
        size); the vision tower and the language model share it."""
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import MegatronModule

        tp = groups.tp.size()
        cfg.check_tensor_parallel(tp)
        spec = resolve_layer_spec(layer_spec)
        config = language_transformer_config(cfg, tp, bf16, recompute)
        super().__init__(config=config)
        self.cfg = cfg
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        # Read by the log-prob and weight-conversion code (as on a GPTModel) and by
        # MegatronModule.sharded_state_dict (else it falls back to the uninitialised parallel_state).
        self.pg_collection, self.tp_group = groups, groups.tp
        self.language_model = GPTModel(
            config=config,
            transformer_layer_spec=gpt_layer_spec(spec, qk_layernorm=True),
            vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings, pre_process=True,
            post_process=True, parallel_output=True, share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="mrope", rotary_base=int(cfg.rope_theta), pg_collection=groups)
        self.language_model.rotary_pos_emb = _interleaved_mrope_class()(cfg.head_dim, cfg.rope_theta)
        self.vision = Qwen3VLVisionTower(cfg.vision, groups, bf16)
        # Megatron modules that take no group (the projector, the ViT block's children) read the
        # global parallel_state in sharded_state_dict, which is never initialised here.
        for module in self.modules():
            if isinstance(module, MegatronModule) and not hasattr(module, "tp_group"):
                module.tp_group = groups.tp
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        for j in range(len(cfg.vision.deepstack_visual_indexes)):
            self.language_model.decoder.layers[j].register_forward_hook(self._deepstack_hook(j))

    def _deepstack_hook(self, j: int):
        def hook(module, args, output):
            if self._deepstack is None:
                return output
            mask, features = self._deepstack
            hidden, context = output
            return _scatter_rows(hidden, mask, features[j], add=True), context

        return hook

    def set_input_tensor(self, input_tensor) -> None:  # pipeline parallelism is 1; Megatron calls it
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """input_ids # [B, S]; position_ids # [3, B, S] (or [B, S] for text: t = h = w);
        pixel_values # [patches, patch_dim], image_grid_thw # [images, 3], image_mask # [B, S];
        `packed_seq_params`: a packed micro-batch's THD description (B = 1; the positions are
        each trajectory's own, so the rotary angles need no offsets).
        Returns logits # [B, S, V / tp]."""
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        embeds = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        if pixel_values is not None:
            if image_grid_thw is None or image_mask is None:
                raise ValueError("pixel_values need image_grid_thw and image_mask")
            image_embeds, deepstack = self.vision(pixel_values, image_grid_thw)
            if int(image_mask.sum()) != image_embeds.shape[0]:
                raise ValueError(f"{int(image_mask.sum())} image pads in the batch, but the images give "
                                 f"{image_embeds.shape[0]} image embeddings")
            embeds = _scatter_rows(embeds, image_mask, image_embeds, add=False)
            self._deepstack = (image_mask, deepstack)
        try:
            return self.language_model(input_ids, position_ids, attention_mask, decoder_input=embeds,
                                       packed_seq_params=packed_seq_params)
        finally:
            self._deepstack = None


def build_qwen3_vl_model(cfg: VLModelConfig, groups=None, bf16: bool = False, recompute: str = "none",
                         layer_spec: str = "auto") -> Qwen3VLModel:
    """A Megatron `Qwen3VLModel` on the current device (random init; load HF weights with
    `qwen3_vl_conversion.load_hf_into_qwen3_vl`). `groups`: its `ProcessGroupCollection`
    (default: this rank's forward-only collection from the start-up registry)."""
    if groups is None:
        from tide_megatron.comm.groups import registry

        groups = registry().model_groups()
    model = Qwen3VLModel(cfg, groups, bf16, recompute, layer_spec)
    if torch.cuda.is_available():
        model = model.cuda()
    return model
