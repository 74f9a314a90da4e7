"""Megatron actor and reference, the GRPO loss (ordinary and loss-in-backward), checkpointing."""

from tide_megatron.utils.lazy_exports import lazy_exports

# Each name below is imported from its module on first use (`utils/lazy_exports.py`), not here:
# importing one submodule runs this file first, and the job config (`trainer.config`) must import
# without torch and Megatron, which the actor and the losses import.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "actor": ("MegatronActor", "ReferenceModel", "UpdateResult"),
    "batch": ("BatchLayout", "MicroBatch", "TrajectoryTensors", "collate", "micro_batches_by_budget", "pack"),
    "checkpoint": ("latest_checkpoint", "load_checkpoint", "load_latest_checkpoint", "save_checkpoint"),
    "config": ("KL_ESTIMATORS", "TrainerConfig"),
    "grpo_loss": ("grpo_loss", "grpo_loss_grad_wrt_logprobs", "kl_penalty"),
    "logprobs": ("forward_logprobs", "logprobs_from_logits"),
    "loss_in_backward": ("FutureLogprobs", "PendingLogprobs", "ReadyLogprobs", "ReceivedLogprobs",
                         "deferred_grpo_loss"),
})
