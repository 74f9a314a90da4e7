"""The GRPO objective per token: PPO-clip against the rollout policy (with TIS: against the
trainer's old policy, importance-weighted to the rollout's), plus a KL penalty.

For a generated token with actor log-prob x, rollout (old) log-prob o, reference log-prob y and
its trajectory's group-normalised advantage A:

    ratio = exp(x - o)
    pg    = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    kl    = k1: x - y  |  k2: (x - y)^2 / 2  |  k3: exp(y - x) - (y - x) - 1
    loss  = sum over tokens with loss_mask = 1 of (pg + kl_coef * kl)

Aggregation is the token mean over the whole step: each micro-batch returns its sum and its token
count, Megatron's schedule adds the counts across micro-batches and DP ranks
(`calculate_per_token_loss=True`) and scales the gradients by 1 / total.

Train-inference mismatch (`TrainerConfig.tis_mode`). The rollout log-prob o is SGLang's number
(bf16 kernels, and for a stale trajectory an older policy version); the trainer's own log-prob of
the same token under the pre-update weights, q (`old_trainer`), differs from it. With TIS on
(decoupled PPO, as AReaL's proximal policy and slime's / verl's TIS):

    w     = exp(q - o)                               per token, no gradient
    ratio = exp(x - q)                               the PPO ratio against the trainer's old policy
    pg    = c(w) * max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    c(w)  = truncate: min(w, C)  |  mask: w if 1/C <= w <= C else 0        (C = tis_cap)

The KL term is not weighted. With tis_mode "none" the ratio is exp(x - o), exactly as before.

q defaults to x.detach(): the trainer takes one optimizer step per RL step, so its forward runs on
the pre-update weights and its own log-probs ARE the old trainer log-probs (then ratio = 1 in
value, the PPO clip never binds, and the gradient is c(w) * -A * dx: REINFORCE with truncated
importance weights). `TrainerConfig.recompute_old_logprobs` computes q in a separate no-grad
forward instead; the numbers are the same.

The mismatch metrics (mean |q - o| and the k3 estimate of KL(rollout || trainer) from the
rollout's samples, r = exp(q - o): r - 1 - log r) are reported whatever the mode. log(w) is
bounded to +-LOG_W_BOUND before exp (verl's SAFETY_BOUND), so a pathological token (or the
arbitrary values under loss_mask 0) cannot overflow; with a finite cap it moves no weight by more
than exp(-20) = 2e-9.

`grpo_loss_grad_wrt_logprobs` is the analytic d(loss)/dx that the loss-in-backward path uses; it
mirrors autograd's conventions at ties (half to each branch of the max, inclusive clamp) so the
two agree within fp32 rounding (same branches taken, a few ulps apart).
"""

from __future__ import annotations

import torch

from tide_megatron.trainer.config import TrainerConfig

METRIC_KEYS = ("loss", "pg_loss", "kl", "clip_frac", "mismatch_abs", "mismatch_kl", "tis_clip_frac")
"""The [sum, count] metrics of one micro-batch (count = its loss tokens), in report order."""

LOG_W_BOUND = 20.0
"""|log w| is clamped to this before exp (w <= 4.9e8): finite weights and metrics everywhere."""


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages that broadcast over a micro-batch's tokens: one per padded row # [B] -> [B, 1],
    or already one per token # [B, T] (a packed micro-batch's rows are whole trajectories)."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


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

    advantages: # [B] per row, broadcast over its tokens, or # [B, T] per token
    """
    adv = per_token(advantages)  # [B, 1] or [B, T]
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def tis_weights(trainer_old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mode: str, cap: float
                ) -> dict[str, torch.Tensor]:
    """Importance weights of the trainer's old policy against the rollout's, per token, no gradient.

    Returns {"weight": c(w), "capped": whether the cap changed w (truncated or masked),
    "abs_diff": |q - o|, "kl": k3 estimate of KL(rollout || trainer)}, each # [B, T].
    """
    diff = (trainer_old_logprobs - rollout_logprobs).detach()  # log w, [B, T]
    log_w = diff.clamp(-LOG_W_BOUND, LOG_W_BOUND)
    w = torch.exp(log_w)
    if mode == "none":
        weight, capped = torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)
    elif mode == "truncate":
        capped = w > cap
        weight = torch.clamp(w, max=cap)
    elif mode == "mask":
        # verl's token-level mask (IcePop): keep w inside [1/C, C], zero outside.
        capped = (w > cap) | (w < 1.0 / cap)
        weight = torch.where(capped, torch.zeros_like(w), w)
    else:
        raise ValueError(f"unknown tis_mode {mode!r}")
    return {"weight": weight, "capped": capped, "abs_diff": diff.abs(), "kl": w - log_w - 1.0}


def grpo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    ref_logprobs: torch.Tensor | None, cfg: TrainerConfig,
                    trainer_old_logprobs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Unmasked per-token terms: {"loss", "pg", "kl", "clipped"} and the mismatch terms
    {"tis_weight", "tis_capped", "mismatch_abs", "mismatch_kl"}, each # [B, T].

    old_logprobs: the rollout's (SGLang's) log-probs; trainer_old_logprobs: the trainer's under
    the pre-update weights, None: `logprobs.detach()` (the same numbers, see the module docstring).
    """
    trainer_old = logprobs.detach() if trainer_old_logprobs is None else trainer_old_logprobs.detach()
    tis = tis_weights(trainer_old, old_logprobs, cfg.tis_mode, cfg.tis_cap)
    if cfg.tis_mode == "none":
        pg, clipped = policy_gradient_loss(logprobs, old_logprobs, advantages, cfg.clip_eps_low, cfg.clip_eps_high)
    else:
        pg, clipped = policy_gradient_loss(logprobs, trainer_old, advantages, cfg.clip_eps_low, cfg.clip_eps_high)
        pg = tis["weight"] * pg  # the weight is detached: it reweights tokens, it is not optimised
    if cfg.kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs reference log-probs")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss = pg + cfg.kl_coef * kl
    else:
        kl = torch.zeros_like(pg)
        loss = pg
    return {"loss": loss, "pg": pg, "kl": kl, "clipped": clipped, "tis_weight": tis["weight"],
            "tis_capped": tis["capped"], "mismatch_abs": tis["abs_diff"], "mismatch_kl": tis["kl"]}


def loss_metrics(terms: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`METRIC_KEYS` as [sum, count] pairs over the loss tokens, no gradient. mask: # [B, T] float"""
    count = mask.sum().detach()
    total = lambda t: (t.detach().to(mask.dtype) * mask).sum()  # noqa: E731
    return {
        "loss": torch.stack([total(terms["loss"]), count]),
        "pg_loss": torch.stack([total(terms["pg"]), count]),
        "kl": torch.stack([total(terms["kl"]), count]),
        "clip_frac": torch.stack([total(terms["clipped"]), count]),
        "mismatch_abs": torch.stack([total(terms["mismatch_abs"]), count]),
        "mismatch_kl": torch.stack([total(terms["mismatch_kl"]), count]),
        "tis_clip_frac": torch.stack([total(terms["tis_capped"]), count]),
    }


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              ref_logprobs: torch.Tensor | None, loss_mask: torch.Tensor, cfg: TrainerConfig,
              trainer_old_logprobs: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron loss-function contract: (loss sum, number of loss tokens, metrics to report).

    Metrics are [sum, count] pairs (`METRIC_KEYS`) so Megatron-style reductions over
    micro-batches and DP ranks give exact token means. trainer_old_logprobs: see
    `grpo_token_loss`.
    """
    mask = loss_mask.to(logprobs.dtype)  # [B, T]
    terms = grpo_token_loss(logprobs, old_logprobs, advantages, ref_logprobs, cfg, trainer_old_logprobs)
    num_tokens = mask.sum().to(torch.int)
    loss_sum = (terms["loss"] * mask).sum()
    return loss_sum, num_tokens, loss_metrics(terms, mask)


def grpo_loss_grad_wrt_logprobs(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                                advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
                                loss_mask: torch.Tensor, cfg: TrainerConfig,
                                trainer_old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """d grpo_loss(...)[0] / d logprobs, in closed form. # [B, T]

    PPO-clip: with u = -A r, c = -A clip(r), loss = max(u, c); torch gives a tie half to each
    side and clamp passes the gradient on [lo, hi] inclusive; d r / d x = r. With TIS, r is taken
    against the trainer's old log-probs (None: `logprobs`, i.e. r = 1 with d r / d x = 1, as
    autograd sees x - x.detach()) and the PPO part is scaled by the detached weight c(w).
    """
    adv = per_token(advantages)  # [B, 1] or [B, T]
    trainer_old = logprobs if trainer_old_logprobs is None else trainer_old_logprobs
    base = old_logprobs if cfg.tis_mode == "none" else trainer_old  # [B, T]
    ratio = torch.exp(logprobs - base)
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, lo, hi)
    tie = (unclipped == clipped).to(ratio.dtype)
    weight_unclipped = (unclipped > clipped).to(ratio.dtype) + 0.5 * tie
    weight_clipped = (clipped > unclipped).to(ratio.dtype) + 0.5 * tie
    in_range = ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)
    d_ratio = -adv * (weight_unclipped + weight_clipped * in_range)
    grad = d_ratio * ratio
    if cfg.tis_mode != "none":
        grad = grad * tis_weights(trainer_old, old_logprobs, cfg.tis_mode, cfg.tis_cap)["weight"]
    if cfg.kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs reference log-probs")
        grad = grad + cfg.kl_coef * kl_penalty_grad(logprobs, ref_logprobs, cfg.kl_estimator)
    return grad * loss_mask.to(grad.dtype)
