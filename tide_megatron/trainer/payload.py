"""The rollout's trajectory record (`core.trajectory.Trajectory`) -> the trainer's tensors.

The actor and a reference rank build the same tensors from the same message, so the shapes of a
micro-batch's log-probs agree on both ends of the decoupled stream.
"""

from __future__ import annotations

import torch

from tide_megatron.core.trajectory import Trajectory
from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
from tide_megatron.trainer.batch import BatchLayout, MicroBatch, TrajectoryTensors


def to_train_trajectory(traj: Trajectory, images: TrajectoryImages | None = None) -> TrajectoryTensors:
    """A trajectory as the trainer's tensors; `images` turns its images (if any) into the vision
    inputs of a vision-language policy. Its group must be complete (the advantage is set)."""
    if traj.advantage is None:
        raise ValueError(f"trajectory {traj.trajectory_id} has no advantage: its group is not complete")
    if images is None and traj.images:
        raise ValueError(f"trajectory {traj.trajectory_id} has images, but the policy is a text-only model")
    token_ids = torch.tensor(traj.token_ids, dtype=torch.long)  # [T]
    loss_mask = torch.tensor(traj.loss_mask, dtype=torch.float32)  # [T]
    return TrajectoryTensors(
        token_ids=token_ids, loss_mask=loss_mask,
        old_logprobs=torch.tensor(traj.logprobs, dtype=torch.float32),  # [T]
        advantage=float(traj.advantage),
        **(images.fields(traj, token_ids, loss_mask) if images is not None else {}),
    )


def micro_batch_of(trajectories: list[Trajectory], layout: BatchLayout = BatchLayout(),
                   images: TrajectoryImages | None = None, device_time=None) -> MicroBatch:
    """One micro-batch of rollout trajectories, in `layout` (packed by default). With
    `device_time` (`emulation.trainer_time.TrainerDeviceTime`), each trajectory is trimmed for the
    model and the micro-batch remembers the full lengths its modelled time is charged for."""
    if device_time is None:
        return layout.micro_batch([to_train_trajectory(t, images) for t in trajectories])
    mb = layout.micro_batch([to_train_trajectory(device_time.trim(t), images) for t in trajectories])
    mb.modelled_lengths = [len(t.token_ids) for t in trajectories]
    return mb


def empty_micro_batch(with_ref: bool) -> MicroBatch:
    """A micro-batch that trains nothing (one masked token): what a DP rank runs in a step that
    gave it no work, so it still joins the step's gradient all-reduce."""
    zeros = torch.zeros(1, 2)
    return MicroBatch(token_ids=torch.zeros(1, 2, dtype=torch.long), position_ids=torch.arange(2)[None],
                      loss_mask=zeros.clone(), old_logprobs=zeros.clone(), advantages=torch.zeros(1),
                      ref_logprobs=zeros.clone() if with_ref else None, lengths=[2])
