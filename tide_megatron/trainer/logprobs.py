"""Per-token log-probs of given token ids under a Megatron GPTModel (TP-aware)."""

from __future__ import annotations

from typing import Sequence

import torch

from tide_megatron.models.megatron_gpt import causal_attention_mask


BANNED_LOGIT = -1e9
"""Logit of a token outside the policy's action space: its probability is exactly 0 in fp32, on
the trainer's side as on SGLang's (`logit_bias` of the same value on the same tokens)."""


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor,
                         banned_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """log p(token_ids[:, t] | token_ids[:, :t]), aligned with token_ids; 0 at t = 0.

    logits: # [B, T, V / tp], this rank's vocab shard (Megatron `parallel_output=True`)
    token_ids: # [B, T]
    returns: # [B, T] float32, identical on every TP rank

    Uses Megatron's vocab-parallel cross entropy, which all-reduces the max and the partition
    function over the TP group instead of gathering [B, T, V] logits; it is exactly
    -log_softmax(logits)[target] and differentiable. It overwrites `logits` in place.
    `banned_token_ids` are outside the policy's action space (a vision-language policy's
    vision special tokens): their logits are set to `BANNED_LOGIT` first.
    """
    from megatron.core import tensor_parallel

    next_ids = token_ids[:, 1:]  # [B, T-1]: the token each position predicts
    # The CE kernel reads logits in fp32 precision only if they are fp32.
    logits = logits[:, :-1].float().contiguous()  # [B, T-1, V/tp]; the CE kernel views it 2-D
    if banned_token_ids:
        logits = _ban(logits, banned_token_ids)
    next_logprobs = -tensor_parallel.vocab_parallel_cross_entropy(logits, next_ids)  # [B, T-1]
    first = torch.zeros_like(next_logprobs[:, :1])  # [B, 1]
    return torch.cat([first, next_logprobs], dim=1)  # [B, T]


def _ban(logits: torch.Tensor, banned_token_ids: Sequence[int]) -> torch.Tensor:
    """`logits` # [..., V/tp] (this TP rank's vocab shard) with the banned ids' entries at
    BANNED_LOGIT; out of place (their gradient is 0)."""
    from megatron.core import parallel_state

    shard = logits.shape[-1]
    rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    local = [i - rank * shard for i in banned_token_ids if rank * shard <= i < (rank + 1) * shard]
    if not local:
        return logits
    return logits.index_fill(-1, torch.tensor(local, device=logits.device), BANNED_LOGIT)


def forward_logprobs(model: torch.nn.Module, token_ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None, banned_token_ids: Sequence[int] = (),
                     **model_inputs: torch.Tensor) -> torch.Tensor:
    """Run the model on token_ids # [B, T] and return their per-token log-probs # [B, T].

    Passes an explicit causal mask and position ids (Megatron's defaults are built on "cuda");
    `model_inputs` (a vision-language model's images, `MicroBatch.model_inputs()`) go to the
    model's forward as they are. Differentiable; wrap in `torch.no_grad()` for the reference or
    old-policy recomputation.
    """
    batch, seq_len = token_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=token_ids.device)[None].expand(batch, seq_len)
    mask = causal_attention_mask(seq_len, device=token_ids.device)  # [1, 1, T, T]
    logits = model(token_ids, position_ids, mask, **model_inputs)  # [B, T, V/tp]
    return logprobs_from_logits(logits, token_ids, banned_token_ids)
