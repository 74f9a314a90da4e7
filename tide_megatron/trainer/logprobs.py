"""Per-token log-probs of given token ids under a Megatron GPTModel (TP-aware)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tide_megatron.models.megatron_gpt import causal_attention_mask
from tide_megatron.models.weight_conversion import unwrap_model


BANNED_LOGIT = -1e9
"""Logit of a token outside the policy's action space: its probability is exactly 0 in fp32, on
the trainer's side as on SGLang's (`logit_bias` of the same value on the same tokens)."""


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(logits)[target] with the vocabulary split over a TP group.

    Megatron's `vocab_parallel_cross_entropy` computes the same (max, partition function and
    target logit all-reduced over TP, never the [N, V] logits gathered) but reads its TP group
    from the global `parallel_state`; this one takes the group, so models of different parallel
    configurations can live in one process (`comm/groups.py`).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        # logits: # [N, V/tp] fp32, this rank's vocab shard; target: # [N] global vocab ids
        part = logits.shape[-1]
        start = group.rank() * part if group is not None else 0
        logits_max = logits.max(dim=-1).values  # [N]
        if group is not None and group.size() > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max[:, None]  # [N, V/tp]
        local = target - start
        in_range = (local >= 0) & (local < part)  # [N]: the target id lives on this shard
        index = local.clamp(0, part - 1)
        exp = shifted.exp()
        sums = torch.stack([shifted.gather(-1, index[:, None])[:, 0] * in_range, exp.sum(-1)])  # [2, N]
        if group is not None and group.size() > 1:
            dist.all_reduce(sums, group=group)
        picked, partition = sums
        ctx.save_for_backward(exp.div_(partition[:, None]), index, in_range)  # softmax shard
        return picked - partition.log()  # [N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, in_range = ctx.saved_tensors
        # d logprob / d logits = onehot(target) - softmax, on this rank's shard.
        grad_logits = softmax * -grad[:, None]
        grad_logits.scatter_add_(-1, index[:, None], (grad * in_range)[:, None])
        return grad_logits, None, None


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor, tp_group=None,
                         banned_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """log p(token_ids[:, t] | token_ids[:, :t]), aligned with token_ids; 0 at t = 0.

    logits: # [B, T, V / tp], this rank's vocab shard (Megatron `parallel_output=True`)
    token_ids: # [B, T]
    tp_group: the group the vocabulary is split over (None: not split)
    returns: # [B, T] float32, identical on every TP rank; differentiable

    `banned_token_ids` are outside the policy's action space (a vision-language policy's
    vision special tokens): their logits are set to `BANNED_LOGIT` first.
    """
    batch, seq_len = token_ids.shape
    next_ids = token_ids[:, 1:].reshape(-1)  # [B*(T-1)]: the token each position predicts
    # Read in fp32 whatever the model's dtype.
    flat = logits[:, :-1].float().reshape(batch * (seq_len - 1), -1)  # [B*(T-1), V/tp]
    if banned_token_ids:
        flat = _ban(flat, banned_token_ids, tp_group.rank() if tp_group is not None else 0)
    next_logprobs = _VocabParallelLogprob.apply(flat, next_ids, tp_group).view(batch, seq_len - 1)
    first = torch.zeros_like(next_logprobs[:, :1])  # [B, 1]
    return torch.cat([first, next_logprobs], dim=1)  # [B, T]


def _ban(logits: torch.Tensor, banned_token_ids: Sequence[int], rank: int) -> torch.Tensor:
    """`logits` # [..., V/tp] (TP rank `rank`'s vocab shard) with the banned ids' entries at
    BANNED_LOGIT; out of place (their gradient is 0)."""
    shard = logits.shape[-1]
    local = [i - rank * shard for i in banned_token_ids if rank * shard <= i < (rank + 1) * shard]
    if not local:
        return logits
    return logits.index_fill(-1, torch.tensor(local, device=logits.device), BANNED_LOGIT)


def forward_logprobs(model: torch.nn.Module, token_ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None, banned_token_ids: Sequence[int] = (),
                     **model_inputs: torch.Tensor) -> torch.Tensor:
    """Run the model on token_ids # [B, T] and return their per-token log-probs # [B, T].

    `model_inputs` (`MicroBatch.model_inputs()`: a vision-language model's images, a packed
    micro-batch's `packed_seq_params`) go to the model's forward as they are. A padded batch gets
    an explicit causal mask (Megatron's default is built on "cuda"); a packed one none (each
    trajectory attends to itself, `models/layer_spec.py`), and the first position of every
    trajectory gets log-prob 0, as position 0 of a padded row does. The TP group is the model's
    own (`pg_collection.tp`). Differentiable; wrap in `torch.no_grad()` for the reference or
    old-policy recomputation.
    """
    batch, seq_len = token_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=token_ids.device)[None].expand(batch, seq_len)
    packed = model_inputs.get("packed_seq_params")
    mask = None if packed is not None else causal_attention_mask(seq_len, device=token_ids.device)  # [1, 1, T, T]
    logits = model(token_ids, position_ids, mask, **model_inputs)  # [B, T, V/tp]
    logprobs = logprobs_from_logits(logits, token_ids, unwrap_model(model).pg_collection.tp, banned_token_ids)
    if packed is not None:
        # Position s of a trajectory starting at s "predicts" it from the previous trajectory.
        starts = packed.cu_seqlens_q[:-1].to(device=logprobs.device, dtype=torch.long)
        logprobs = logprobs.index_fill(1, starts, 0.0)
    return logprobs  # [B, T]
