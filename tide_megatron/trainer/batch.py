"""Trainer inputs: one trajectory, and micro-batches of them, packed or padded.

Two layouts (`BatchLayout`, `trainer.packing`):
- packed (the default): a micro-batch is one row holding its trajectories end to end, no
  padding; `cu_seqlens` # [S + 1] marks where each starts. The model attends within each
  trajectory only (Megatron's THD `PackedSeqParams`: Transformer Engine's attention on GPU, the
  segment-wise attention of `models/packed_attention.py` with the local spec), so attention costs
  the sum of squared trajectory lengths and no token is spent on padding. Positions restart at 0
  with each trajectory (MRoPE positions are each trajectory's own).
- padded: rows right-padded to the micro-batch's longest trajectory (rounded up to
  `pad_to_multiple_of`) under one dense causal mask # [1, 1, T, T]. With a causal mask, right
  padding never changes the log-probs of real tokens. Kept as the reference the packed layout is
  tested against, and for the padded-vs-packed benchmark.

Alignment: position t of a trajectory carries log p(token t | tokens before t in the same
trajectory); its first position has no prediction, so its loss mask must be 0 (a prompt token
anyway). Advantages are one per token in the packed layout (a row holds many trajectories), one
per row in the padded one (`grpo_loss.per_token` takes both).

Images (vision-language policies): a trajectory may carry its images' pixel values and grids,
the mask of its image pads and its MRoPE positions # [3, T]. A micro-batch concatenates the
images in trajectory order; `MicroBatch.model_inputs()` is what the model's forward takes
besides ids and positions.
"""

from __future__ import annotations

import dataclasses

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
    """Trajectories as one packed row (`cu_seqlens` set) or as right-padded rows (padding has
    loss_mask 0). B = 1 and T = the sum of the lengths when packed."""

    token_ids: torch.Tensor  # [B, T] int64, pad id 0
    position_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] float32
    old_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32 per padded row, or [1, T] per token when packed
    ref_logprobs: "torch.Tensor | PendingLogprobs | None" = None  # [B, T] float32, or a handle
    lengths: list[int] = field(default_factory=list)  # each trajectory's real length, in order
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim]: every row's images, row order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    image_mask: torch.Tensor | None = None  # [B, T] bool
    cu_seqlens: torch.Tensor | None = None  # [S + 1] int32 trajectory starts (packed); None: padded
    modelled_lengths: list[int] | None = None
    """Emulated device time (`emulation/trainer_time.py`): the trajectories' full lengths, which
    the passes' modelled time is charged for (the tensors hold their trimmed tails)."""
    # With images, position_ids is [3, B, T] (MRoPE); otherwise [B, T].

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_tokens(self) -> int:
        """Trajectory tokens (padding and the packed filler excluded): what RA2P's costs count
        (with emulated device time, the full trajectories' that the time is charged for)."""
        if self.modelled_lengths:
            return sum(self.modelled_lengths)
        return sum(self.lengths) if self.lengths else self.token_ids.numel()

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def packed_seq_params(self):
        """Megatron's THD description of a packed micro-batch (None when padded)."""
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def model_inputs(self) -> dict:
        """What the model's forward takes besides ids, positions and the attention mask."""
        inputs: dict = {}
        if self.cu_seqlens is not None:
            inputs["packed_seq_params"] = self.packed_seq_params()
        if self.pixel_values is not None:
            inputs.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                          image_mask=self.image_mask)
        return inputs

    def to(self, device: torch.device | str) -> "MicroBatch":
        # ref_logprobs may be a pending handle (loss-in-backward); only tensors move.
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return dataclasses.replace(self, **{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)},
                                   lengths=list(self.lengths))


@dataclass(frozen=True)
class BatchLayout:
    """How trajectories become a micro-batch (`BatchLayout.of(trainer_cfg)`). Every rank that
    builds micro-batches of one step (actor and reference) must use the same layout: the
    reference's log-probs stream into the actor's micro-batch by shape."""

    packed: bool = True
    pad_to_multiple_of: int = 1
    """Round each micro-batch's computed length up to this: the padded rows' length, or the
    packed row's (a masked filler segment at its end)."""

    @classmethod
    def of(cls, trainer_cfg) -> "BatchLayout":
        """The layout a `TrainerConfig` asks for."""
        return cls(trainer_cfg.packing, trainer_cfg.pad_to_multiple_of)

    def micro_batch(self, trajectories: list[TrajectoryTensors]) -> MicroBatch:
        if self.packed:
            return pack(trajectories, self.pad_to_multiple_of)
        return collate(trajectories, self.pad_to_multiple_of)

    def cost_tokens(self, lengths: list[int]) -> int:
        """Tokens the model computes for a micro-batch of these lengths (padding included)."""
        if self.packed:
            return -(-sum(lengths) // self.pad_to_multiple_of) * self.pad_to_multiple_of
        longest = -(-max(lengths) // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return longest * len(lengths)


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


def pack(trajectories: list[TrajectoryTensors], pad_to_multiple_of: int = 1) -> MicroBatch:
    """Trajectories end to end in one row. With `pad_to_multiple_of` > 1 a filler segment (pad
    id 0, loss mask 0, attending only to itself) rounds the row up to a multiple: GPU matmuls
    whose token dimension is a multiple of 8 (64 for the best kernels) run markedly faster."""
    if not trajectories:
        raise ValueError("cannot pack an empty list of trajectories")
    lengths = [len(t) for t in trajectories]
    if min(lengths) == 0:
        raise ValueError("cannot pack an empty trajectory")
    filler = -sum(lengths) % pad_to_multiple_of
    if filler:
        zeros = torch.zeros(filler)
        trajectories = [*trajectories, TrajectoryTensors(torch.zeros(filler, dtype=torch.long), zeros, zeros, 0.0,
                                                         ref_logprobs=zeros if trajectories[0].ref_logprobs is not None
                                                         else None)]
    cat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])[None]  # noqa: E731  # [1, T]
    token_ids = cat([t.token_ids for t in trajectories]).long()
    loss_mask = cat([t.loss_mask for t in trajectories]).float()
    old_logprobs = cat([t.old_logprobs for t in trajectories]).float()
    has_ref = all(t.ref_logprobs is not None for t in trajectories)
    ref_logprobs = cat([t.ref_logprobs for t in trajectories]).float() if has_ref else None
    segments = lengths + ([filler] if filler else [])
    advantages = cat([torch.full((n,), float(t.advantage)) for t, n in zip(trajectories, segments)])
    position_ids = cat([torch.arange(n) for n in segments])  # each trajectory from 0
    cu_seqlens = torch.tensor([0] + segments, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [S + 1]
    mb = MicroBatch(token_ids, position_ids, loss_mask, old_logprobs, advantages, ref_logprobs, lengths,
                    cu_seqlens=cu_seqlens)
    if any(t.position_ids is not None for t in trajectories):
        own = [t.position_ids if t.position_ids is not None else torch.arange(n)[None].expand(3, n)
               for t, n in zip(trajectories, segments)]
        mb.position_ids = torch.cat(own, dim=1)[:, None]  # [3, 1, T]
        mb.image_mask = torch.cat([t.image_mask if t.image_mask is not None else torch.zeros(n, dtype=torch.bool)
                                   for t, n in zip(trajectories, segments)])[None]  # [1, T]
        with_images = [t for t in trajectories if t.pixel_values is not None]
        if with_images:
            mb.pixel_values = torch.cat([t.pixel_values for t in with_images])
            mb.image_grid_thw = torch.cat([t.image_grid_thw for t in with_images])
    return mb


def micro_batches_by_budget(trajectories: list[TrajectoryTensors], micro_batch_tokens: int,
                            layout: BatchLayout = BatchLayout()) -> list[MicroBatch]:
    """Split trajectories, in the given order, into micro-batches of at most
    `micro_batch_tokens` computed tokens (`BatchLayout.cost_tokens`: the sum of lengths packed,
    rows x padded length padded). A trajectory longer than the budget gets a micro-batch of its
    own. (Real steps are planned by RA2P, `trainer/ra2p/dispatch.py`; this serves benchmarks.)"""
    groups: list[list[TrajectoryTensors]] = []
    current: list[TrajectoryTensors] = []
    for traj in trajectories:
        if current and layout.cost_tokens([len(t) for t in current] + [len(traj)]) > micro_batch_tokens:
            groups.append(current)
            current = []
        current.append(traj)
    if current:
        groups.append(current)
    return [layout.micro_batch(group) for group in groups]
