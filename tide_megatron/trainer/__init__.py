"""Megatron actor and reference, the GRPO loss (ordinary and loss-in-backward), checkpointing."""

import importlib

# Each name below is imported from its module on first use (PEP 562), not here: importing one
# submodule runs this file first, and the job config (`trainer.config`) must import without
# torch and Megatron, which the actor and the losses import.
_EXPORTS = {name: module for module, names in {
    "actor": ("MegatronActor", "ReferenceModel", "StepResult"),
    "batch": ("MicroBatch", "TrajectoryTensors", "collate", "pack_micro_batches"),
    "checkpoint": ("latest_checkpoint", "load_checkpoint", "load_latest_checkpoint", "save_checkpoint"),
    "config": ("KL_ESTIMATORS", "TrainerConfig"),
    "grpo_loss": ("grpo_loss", "grpo_loss_grad_wrt_logprobs", "kl_penalty"),
    "logprobs": ("forward_logprobs", "logprobs_from_logits"),
    "loss_in_backward": ("FutureLogprobs", "PendingLogprobs", "ReadyLogprobs", "ReceivedLogprobs",
                         "deferred_grpo_loss"),
}.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
