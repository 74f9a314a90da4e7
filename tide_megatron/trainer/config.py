"""Trainer hyper-parameters: optimisation, GRPO objective, batching, parallelism."""

from __future__ import annotations

from dataclasses import dataclass

from tide_megatron.core.memory_estimate import RECOMPUTE_MODES

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class TrainerConfig:
    """Everything the Megatron actor and its GRPO loss need to know."""

    lr: float = 1e-6
    """Adam learning rate (constant: RL steps are few and each is a full policy update)."""

    adam_beta1: float = 0.9
    """Adam first-moment decay."""

    adam_beta2: float = 0.999
    """Adam second-moment decay."""

    adam_eps: float = 1e-8
    """Adam denominator epsilon."""

    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; Megatron exempts norms and biases."""

    clip_grad: float = 1.0
    """Global gradient-norm clip across TP/DP; 0 disables."""

    kl_coef: float = 0.0
    """Weight of the KL penalty against the frozen reference. 0 skips the reference entirely."""

    kl_estimator: str = "k3"
    """Per-token estimator of KL(actor || ref) from samples of the rollout: "k1" = log r,
    "k2" = (log r)^2 / 2, "k3" = r^-1 - 1 + log r with r = pi_actor / pi_ref (Schulman's)."""

    clip_eps_low: float = 0.2
    """PPO clip: the ratio pi_actor / pi_old is clipped below at 1 - clip_eps_low."""

    clip_eps_high: float = 0.2
    """PPO clip: ... and above at 1 + clip_eps_high (DAPO's clip-higher sets it larger)."""

    micro_batch_tokens: int = 4096
    """Padded-token budget of one micro-batch (rows x per-micro-batch max length)."""

    pad_to_multiple_of: int = 1
    """Round each micro-batch's padded length up to this (8 or 64 helps GPU kernels)."""

    seed: int = 1234
    """Seeds Megatron's RNG tracker (model init before HF weights load) and data order."""

    tp_size: int = 1
    """Tensor-parallel size of actor and reference."""

    pp_size: int = 1
    """Pipeline-parallel size of actor and reference. The rank plan and the dry run lay out
    PP > 1 (stages of whole TP groups, `core/rank_plan.py`); the trainer runs PP = 1 only."""

    recompute: str = "none"
    """Activation recompute: "none"; "selective" recomputes core attention in the backward pass
    (its O(L^2) scores are then held for one layer at a time, the setting for long contexts with
    the local layer spec); "full" recomputes every layer from its input."""

    bf16: bool = False
    """bf16 params with fp32 master weights (GPU). fp32 on CPU."""

    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (optimizer state sharded over the DP ranks). Saves memory
    but fixes the DP size for the run: ERS can then not change the number of actor ranks (the
    plain optimizer keeps a full copy on every DP rank, so ranks can leave and join)."""

    loss_in_backward: bool = False
    """Decoupled RA2P: evaluate the GRPO loss (KL included) in the actor's backward pass, so the
    actor's forward never waits for the reference log-probs (see `loss_in_backward.py`)."""

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ValueError("need 0 <= clip_eps_low < 1 and clip_eps_high >= 0")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"trainer.recompute={self.recompute!r}: expected one of {RECOMPUTE_MODES}")
        if self.micro_batch_tokens <= 0 or self.pad_to_multiple_of <= 0:
            raise ValueError("micro_batch_tokens and pad_to_multiple_of must be positive")
