"""Trainer inputs: one trajectory, and padded micro-batches of them.

Layout choice: padding, not packing. Each micro-batch is right-padded to its own longest
trajectory (rounded up to `pad_to_multiple_of`). With a causal mask, right padding never changes
the log-probs of real tokens, so no per-sequence mask or position reset is needed, the same
explicit causal mask serves every row, and Megatron's local attention (which takes one mask) works
on CPU and GPU alike. Padding waste is bounded by grouping trajectories of similar length (the
RA2P planner orders them; `pack_micro_batches` keeps its order).

Alignment: position t of `token_ids` carries log p(token_ids[t] | token_ids[:t]); position 0 has
no prediction, so its loss mask must be 0 (it is a prompt token anyway).

Images (vision-language policies): a trajectory may carry its images' pixel values and grids,
the mask of its image pads and its MRoPE positions # [3, T]. A micro-batch concatenates the
images in row order, pads `image_mask` with False and continues each row's positions through the
padding; `MicroBatch.model_inputs()` is what the model's forward takes besides ids and positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class PendingLogprobs(Protocol):
    """Reference log-probs that may not have arrived yet (`loss_in_backward.py`'s handles).
    `wait()` blocks, returns # [B, T]."""

    def wait(self) -> torch.Tensor: ...


@dataclass
class TrajectoryTensors:
    """One finished trajectory (`core.trajectory.Trajectory`) as the trainer's tensors."""

    token_ids: torch.Tensor  # [T] int64: prompt, actions and observations, in order
    loss_mask: torch.Tensor  # [T] bool/float: 1 on tokens the policy generated, 0 on prompt/env
    old_logprobs: torch.Tensor  # [T] float32: rollout policy log-probs (0 where loss_mask is 0)
    advantage: float  # group-normalised: (r - mean(r_group)) / std(r_group)
    ref_logprobs: torch.Tensor | None = None  # [T] float32, filled by the reference when needed
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim] float32: its images, in order
    image_grid_thw: torch.Tensor | None = None  # [images, 3] int64
    image_mask: torch.Tensor | None = None  # [T] bool: the image pads that take image features
    position_ids: torch.Tensor | None = None  # [3, T] int64 MRoPE positions (None: 0..T-1)

    def __post_init__(self) -> None:
        n = self.token_ids.numel()
        if self.loss_mask.numel() != n or self.old_logprobs.numel() != n:
            raise ValueError("token_ids, loss_mask and old_logprobs must have the same length")
        if (self.pixel_values is None) != (self.image_grid_thw is None) or (
                self.pixel_values is not None and (self.image_mask is None or self.position_ids is None)):
            raise ValueError("images need pixel_values, image_grid_thw, image_mask and position_ids together")
        if n and bool(self.loss_mask.reshape(-1)[0]):
            raise ValueError("loss_mask[0] must be 0: the first token has no prediction")

    def __len__(self) -> int:
        return self.token_ids.numel()


@dataclass
class MicroBatch:
    """Right-padded trajectories; padding has loss_mask 0."""

    token_ids: torch.Tensor  # [B, T] int64, pad id 0
    position_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] float32
    old_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    ref_logprobs: "torch.Tensor | PendingLogprobs | None" = None  # [B, T] float32, or a handle
    lengths: list[int] = field(default_factory=list)  # real length of each row
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim]: every row's images, row order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    image_mask: torch.Tensor | None = None  # [B, T] bool
    # With images, position_ids is [3, B, T] (MRoPE); otherwise [B, T].

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """What the model's forward takes besides ids, positions and the attention mask."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "image_mask": self.image_mask}

    def to(self, device: torch.device | str) -> "MicroBatch":
        # ref_logprobs may be a pending handle (loss-in-backward); only tensors move.
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return MicroBatch(move(self.token_ids), move(self.position_ids), move(self.loss_mask),
                          move(self.old_logprobs), move(self.advantages), move(self.ref_logprobs),
                          list(self.lengths), move(self.pixel_values), move(self.image_grid_thw),
                          move(self.image_mask))


def collate(trajectories: list[TrajectoryTensors], pad_to_multiple_of: int = 1) -> MicroBatch:
    """Right-pad trajectories into one micro-batch."""
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    lengths = [len(t) for t in trajectories]
    seq_len = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(trajectories)
    token_ids = torch.zeros(batch, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.float32)
    old_logprobs = torch.zeros(batch, seq_len, dtype=torch.float32)
    has_ref = all(t.ref_logprobs is not None for t in trajectories)
    ref_logprobs = torch.zeros(batch, seq_len, dtype=torch.float32) if has_ref else None
    for row, (traj, n) in enumerate(zip(trajectories, lengths)):
        token_ids[row, :n] = traj.token_ids.reshape(-1)
        loss_mask[row, :n] = traj.loss_mask.reshape(-1).float()
        old_logprobs[row, :n] = traj.old_logprobs.reshape(-1).float()
        if has_ref:
            ref_logprobs[row, :n] = traj.ref_logprobs.reshape(-1).float()
    position_ids = torch.arange(seq_len, dtype=torch.long)[None].expand(batch, seq_len).contiguous()
    advantages = torch.tensor([float(t.advantage) for t in trajectories], dtype=torch.float32)
    mb = MicroBatch(token_ids, position_ids, loss_mask, old_logprobs, advantages, ref_logprobs, lengths)
    if any(t.position_ids is not None for t in trajectories):
        _collate_images(mb, trajectories, seq_len)
    return mb


def _collate_images(mb: MicroBatch, trajectories: list[TrajectoryTensors], seq_len: int) -> None:
    """MRoPE positions # [3, B, T] (padding continues each row), image mask and images."""
    positions = torch.zeros(3, len(trajectories), seq_len, dtype=torch.long)
    image_mask = torch.zeros(len(trajectories), seq_len, dtype=torch.bool)
    for row, (traj, n) in enumerate(zip(trajectories, mb.lengths)):
        own = traj.position_ids if traj.position_ids is not None else torch.arange(n)[None].expand(3, n)
        positions[:, row, :n] = own
        start = int(own.max()) + 1 if n else 0
        positions[:, row, n:] = torch.arange(start, start + seq_len - n)
        if traj.image_mask is not None:
            image_mask[row, :n] = traj.image_mask
    mb.position_ids, mb.image_mask = positions, image_mask
    with_images = [t for t in trajectories if t.pixel_values is not None]
    if with_images:
        mb.pixel_values = torch.cat([t.pixel_values for t in with_images])
        mb.image_grid_thw = torch.cat([t.image_grid_thw for t in with_images])


def pack_micro_batches(trajectories: list[TrajectoryTensors], micro_batch_tokens: int,
                       pad_to_multiple_of: int = 1) -> list[MicroBatch]:
    """Split trajectories, in the given order, into micro-batches of at most
    `micro_batch_tokens` padded tokens (rows x padded length). A trajectory longer than the budget
    gets a micro-batch of its own."""
    groups: list[list[TrajectoryTensors]] = []
    current: list[TrajectoryTensors] = []
    longest = 0
    for traj in trajectories:
        padded = -(-max(longest, len(traj)) // pad_to_multiple_of) * pad_to_multiple_of
        if current and padded * (len(current) + 1) > micro_batch_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(traj)
        longest = max(longest, len(traj))
    if current:
        groups.append(current)
    return [collate(group, pad_to_multiple_of) for group in groups]
