"""Megatron actor and reference, the GRPO loss (ordinary and loss-in-backward), checkpointing."""

from tide_megatron.trainer.actor import MegatronActor, ReferenceModel, StepResult
from tide_megatron.trainer.batch import MicroBatch, TrajectoryTensors, collate, pack_micro_batches
from tide_megatron.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from tide_megatron.trainer.config import KL_ESTIMATORS, TrainerConfig
from tide_megatron.trainer.grpo_loss import grpo_loss, grpo_loss_grad_wrt_logprobs, kl_penalty
from tide_megatron.trainer.logprobs import forward_logprobs, logprobs_from_logits
from tide_megatron.trainer.loss_in_backward import (
    FutureLogprobs,
    PendingLogprobs,
    ReadyLogprobs,
    ReceivedLogprobs,
    deferred_grpo_loss,
)

__all__ = [
    "FutureLogprobs", "KL_ESTIMATORS", "MegatronActor", "MicroBatch", "PendingLogprobs",
    "ReadyLogprobs", "ReceivedLogprobs", "ReferenceModel", "StepResult", "TrainerConfig",
    "TrajectoryTensors", "collate", "deferred_grpo_loss", "forward_logprobs", "grpo_loss",
    "grpo_loss_grad_wrt_logprobs", "kl_penalty", "latest_checkpoint", "load_checkpoint",
    "load_latest_checkpoint", "logprobs_from_logits", "pack_micro_batches", "save_checkpoint",
]
