"""The GRPO objective per token: PPO-clip against the rollout policy, plus a KL penalty.

For a generated token with actor log-prob x, rollout (old) log-prob o, reference log-prob y and
its trajectory's group-normalised advantage A:

    ratio = exp(x - o)
    pg    = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    kl    = k1: x - y  |  k2: (x - y)^2 / 2  |  k3: exp(y - x) - (y - x) - 1
    loss  = sum over tokens with loss_mask = 1 of (pg + kl_coef * kl)

Aggregation is the token mean over the whole step: each micro-batch returns its sum and its token
count, Megatron's schedule adds the counts across micro-batches and DP ranks
(`calculate_per_token_loss=True`) and scales the gradients by 1 / total.

`grpo_loss_grad_wrt_logprobs` is the analytic d(loss)/dx that the loss-in-backward path uses; it
mirrors autograd's conventions at ties (half to each branch of the max, inclusive clamp) so the
two agree within fp32 rounding (same branches taken, a few ulps apart).
"""

from __future__ import annotations

import torch

from tide_megatron.trainer.config import TrainerConfig


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(actor || ref) from actor-sampled tokens. # [B, T]"""
    log_ratio = logprobs - ref_logprobs  # log pi / pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def kl_penalty_grad(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """d kl_penalty / d logprobs. # [B, T]"""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return torch.ones_like(log_ratio)
    if estimator == "k2":
        return log_ratio
    if estimator == "k3":
        return 1.0 - torch.exp(-log_ratio)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_gradient_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                         clip_eps_low: float, clip_eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip surrogate per token and whether it was clipped. # ([B, T], [B, T] bool)

    advantages: # [B] per trajectory, broadcast over its tokens
    """
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def grpo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    ref_logprobs: torch.Tensor | None, cfg: TrainerConfig) -> dict[str, torch.Tensor]:
    """Unmasked per-token terms: {"loss", "pg", "kl", "clipped"}, each # [B, T]."""
    pg, clipped = policy_gradient_loss(logprobs, old_logprobs, advantages, cfg.clip_eps_low, cfg.clip_eps_high)
    if cfg.kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs reference log-probs")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss = pg + cfg.kl_coef * kl
    else:
        kl = torch.zeros_like(pg)
        loss = pg
    return {"loss": loss, "pg": pg, "kl": kl, "clipped": clipped}


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              ref_logprobs: torch.Tensor | None, loss_mask: torch.Tensor, cfg: TrainerConfig
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron loss-function contract: (loss sum, number of loss tokens, metrics to report).

    Metrics are [sum, count] pairs so Megatron-style reductions over micro-batches and DP ranks
    give exact token means.
    """
    mask = loss_mask.to(logprobs.dtype)  # [B, T]
    terms = grpo_token_loss(logprobs, old_logprobs, advantages, ref_logprobs, cfg)
    num_tokens = mask.sum().to(torch.int)
    count = mask.sum().detach()
    loss_sum = (terms["loss"] * mask).sum()
    metrics = {
        "loss": torch.stack([loss_sum.detach(), count]),
        "pg_loss": torch.stack([(terms["pg"] * mask).sum().detach(), count]),
        "kl": torch.stack([(terms["kl"] * mask).sum().detach(), count]),
        "clip_frac": torch.stack([(terms["clipped"].to(mask.dtype) * mask).sum(), count]),
    }
    return loss_sum, num_tokens, metrics


def grpo_loss_grad_wrt_logprobs(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                                advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
                                loss_mask: torch.Tensor, cfg: TrainerConfig) -> torch.Tensor:
    """d grpo_loss(...)[0] / d logprobs, in closed form. # [B, T]

    PPO-clip: with u = -A r, c = -A clip(r), loss = max(u, c); torch gives a tie half to each
    side and clamp passes the gradient on [lo, hi] inclusive; d r / d x = r.
    """
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logprobs - old_logprobs)
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, lo, hi)
    tie = (unclipped == clipped).to(ratio.dtype)
    weight_unclipped = (unclipped > clipped).to(ratio.dtype) + 0.5 * tie
    weight_clipped = (clipped > unclipped).to(ratio.dtype) + 0.5 * tie
    in_range = ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)
    d_ratio = -adv * (weight_unclipped + weight_clipped * in_range)
    grad = d_ratio * ratio
    if cfg.kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs reference log-probs")
        grad = grad + cfg.kl_coef * kl_penalty_grad(logprobs, ref_logprobs, cfg.kl_estimator)
    return grad * loss_mask.to(grad.dtype)
