"""Rollout trajectories as they travel in control messages (JSON) -> the trainer's tensors.

The actor and a reference rank build the same tensors from the same message, so the shapes of a
micro-batch's log-probs agree on both ends of the decoupled stream.
"""

from __future__ import annotations

from typing import Any

import torch

from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
from tide_megatron.trainer.batch import MicroBatch, Trajectory, collate


def to_train_trajectory(data: dict[str, Any], images: TrajectoryImages | None = None) -> Trajectory:
    """A rollout trajectory (JSON) as the trainer's tensors; `images` turns its images (if any)
    into the vision inputs of a vision-language policy."""
    token_ids = torch.tensor(data["token_ids"], dtype=torch.long)  # [T]
    loss_mask = torch.tensor(data["loss_mask"], dtype=torch.float32)  # [T]
    if images is None and data.get("images"):
        raise ValueError(f"trajectory {data.get('group_id')}/{data.get('index')} has images, "
                         "but the policy is a text-only model")
    return Trajectory(
        token_ids=token_ids, loss_mask=loss_mask,
        old_logprobs=torch.tensor(data["logprobs"], dtype=torch.float32),  # [T]
        advantage=float(data["advantage"]),
        **(images.fields(data, token_ids, loss_mask) if images is not None else {}),
    )


def micro_batch_of(trajectories: list[dict[str, Any]], pad_to_multiple_of: int = 1,
                   images: TrajectoryImages | None = None) -> MicroBatch:
    """One micro-batch of rollout trajectories."""
    return collate([to_train_trajectory(t, images) for t in trajectories], pad_to_multiple_of)


def empty_micro_batch(with_ref: bool) -> MicroBatch:
    """A micro-batch that trains nothing (one masked token): what a DP rank runs in a step that
    gave it no work, so it still joins the step's gradient all-reduce."""
    zeros = torch.zeros(1, 2)
    return MicroBatch(token_ids=torch.zeros(1, 2, dtype=torch.long), position_ids=torch.arange(2)[None],
                      loss_mask=zeros.clone(), old_logprobs=zeros.clone(), advantages=torch.zeros(1),
                      ref_logprobs=zeros.clone() if with_ref else None, lengths=[2])
