"""Trainer hyper-parameters: optimisation, GRPO objective, batching, parallelism."""

from __future__ import annotations

from dataclasses import dataclass

from tide_megatron.core.memory_estimate import RECOMPUTE_MODES

KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_MODES = ("none", "truncate", "mask")
LAYER_SPECS = ("auto", "te", "local")


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
    """Token budget of one micro-batch for memory estimates and benchmarks (tokens computed:
    the sum of lengths when packed, rows x longest when padded). Real steps take their
    micro-batches from RA2P's planner (`ra2p.cost_model.tokens_per_rank`)."""

    packing: bool = True
    """Pack each micro-batch's trajectories end to end in one row, attending within each (no
    padding, attention cost = sum of squared lengths; `trainer/batch.py`). false: right-pad rows
    under a dense causal mask (the reference layout)."""

    pad_to_multiple_of: int = 1
    """Padded layout only: round each micro-batch's padded length up to this (8 or 64 helps GPU
    kernels)."""

    layer_spec: str = "auto"
    """Transformer layer spec: "te" (Transformer Engine: fused kernels, THD attention, sequence
    parallelism under TP; needs transformer_engine and a GPU), "local" (Megatron's local spec with
    per-trajectory packed attention, `models/layer_spec.py`), "auto" (te when it can run)."""

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

    overlap_grad_reduce: bool = False
    """Megatron DDP's bucketed gradient all-reduce launched during the last micro-batch's backward
    (each bucket as soon as its grads are final) instead of one reduce after it. Changes no number;
    saves the reduce's time on DP > 1 (the GPU recipes set it). The distributed optimizer's
    overlapped parameter all-gather is not offered: it delays the gather to the next forward,
    and the weight push to the engines reads the parameters before that."""

    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (optimizer state sharded over the DP ranks). Saves memory
    but fixes the DP size for the run: ERS can then not change the number of actor ranks (the
    plain optimizer keeps a full copy on every DP rank, so ranks can leave and join)."""

    loss_in_backward: bool = False
    """Decoupled RA2P: evaluate the GRPO loss (KL included) in the actor's backward pass, so the
    actor's forward never waits for the reference log-probs (see `loss_in_backward.py`)."""

    recompute_old_logprobs: bool = False
    """Recompute the old (pre-update) log-probs with the trainer's own actor: a no-grad forward
    of each micro-batch right before its training forward (`MegatronActor._forward_step`). The
    trainer takes ONE optimizer step per RL step, so during the step's forward the actor's
    weights are the pre-update weights and the forward's own `logprobs.detach()` already are
    these numbers (same weights, same kernels, dropout 0): off (the default), the loss uses them
    at no extra cost; on, it pays one more forward per micro-batch for the same numbers (a
    check, or a base for several optimizer steps per RL step). Used by `tis_mode` and by the
    `mismatch/*` metrics, never by the ratio when `tis_mode` is "none"."""

    tis_mode: str = "none"
    """Train-inference mismatch correction (`grpo_loss.py`): per token w = exp(old_trainer -
    old_rollout), the trainer's old log-prob against SGLang's sampling log-prob. "none": today's
    objective, the PPO ratio taken against the rollout log-probs. "truncate" (TIS): the PPO ratio
    is pi_theta / pi_old_trainer and each token's policy-gradient term is multiplied by the
    detached min(w, tis_cap). "mask" (verl's token-level `rollout_is_mode: mask`, IcePop): the
    term is multiplied by w where 1 / tis_cap <= w <= tis_cap and by 0 elsewhere; a masked token
    still counts in the step's token mean and keeps its KL term (verl's `rollout_is_weights *
    mask`; verl's later rejection sampling also drops it from the mean)."""

    tis_cap: float = 2.0
    """Upper bound C on the importance weight w ("truncate": w = min(w, C); "mask": tokens with
    w > C or w < 1 / C get weight 0). 2.0 is slime's default (`--tis-clip 2.0`,
    slime/utils/arguments.py) and verl's (`rollout_is_threshold: 2.0`, whose mask mode takes the
    lower bound 1 / C when none is given). Must be >= 1; infinity (`trainer.tis_cap=inf` on the
    command line, `.inf` in YAML) turns the cap off."""

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ValueError("need 0 <= clip_eps_low < 1 and clip_eps_high >= 0")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"trainer.recompute={self.recompute!r}: expected one of {RECOMPUTE_MODES}")
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(f"trainer.layer_spec={self.layer_spec!r}: expected one of {LAYER_SPECS}")
        if self.tis_mode not in TIS_MODES:
            raise ValueError(f"trainer.tis_mode={self.tis_mode!r}: expected one of {TIS_MODES}")
        # `not >=` also rejects NaN; a bool is no cap.
        cap = self.tis_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0:
            raise ValueError(f"trainer.tis_cap={self.tis_cap!r}: expected a number >= 1 (inf: no cap); the "
                             "importance weight is capped at tis_cap (and, in mask mode, bounded below by 1/tis_cap)")
        if self.micro_batch_tokens <= 0 or self.pad_to_multiple_of <= 0:
            raise ValueError("micro_batch_tokens and pad_to_multiple_of must be positive")
