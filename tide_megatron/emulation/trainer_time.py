"""Modelled device time of the trainer's passes (`cluster.device=emulated`).

The trainer ranks run their real code: Megatron actor and reference (on the small checkpoint at
`model.path`), DDP and the optimizer, RA2P's executors with the decoupled log-prob stream, the
state transfers of ERS moves, checkpoints; every collective is real, on that model's small
tensors. What is emulated is only the compute over the trajectories' tokens:
- each trajectory reaches the model cut to its last `keep_tokens` tokens (its last answer, so
  the loss still has tokens), both on actor and reference ranks, so the two ends of the
  decoupled stream agree on shapes;
- each pass then takes what the cost model (`sim.hardware.HardwareModel.train_s`, the
  simulator's) gives for the micro-batch's full trajectories, each at its own length (packed
  attention grows with the sum of squared lengths): a forward (reference, old log-probs, the
  actor's forward) sleeps its time, and the actor's backward sleeps its time inside autograd,
  after the loss-in-backward wait for the reference log-probs, as a real backward would.
Times are multiplied by `EmulationConfig.dilation`. The host's own time (the small model's
passes) is taken out of each forward's sleep, so a pass never takes less than the model says
and not much more.

A role change moves training state over PCIe on a GPU (`TrainerWorker.apply`): an actor that
leaves parks its state in host memory, one that joins loads it, a new reference loads its
weights. Each takes the cost model's `swap_s` for those bytes (`state_move`), the figures the
simulator charges for a rank joining the trainer (ERS, the end of the cold-start loan) and for
sync's switch each way.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch

from tide_megatron.core.trajectory import Trajectory
from tide_megatron.sim.hardware import HardwareModel


class TrainerDeviceTime:
    """The cost model's time for the trainer's passes over whole trajectories."""

    def __init__(self, cost: HardwareModel, dilation: float, keep_tokens: int = 8):
        if keep_tokens < 2:
            raise ValueError("keep_tokens must be >= 2 (a trajectory needs a token to predict)")
        self.cost = cost
        self.dilation = dilation
        self.keep_tokens = keep_tokens
        self.gpus = cost.model.train_gpus_per_rank
        self.device_s = 0.0
        """Modelled seconds charged so far (undilated)."""

    def trim(self, traj: Trajectory) -> Trajectory:
        """The trajectory the small model sees: its last `keep_tokens` tokens."""
        k = self.keep_tokens
        if len(traj.token_ids) <= k:
            return traj
        # The first token has no prediction: it leaves the loss (the model's input rule).
        return replace(traj, token_ids=traj.token_ids[-k:], loss_mask=[0.0] + list(traj.loss_mask[1 - k:]),
                       logprobs=traj.logprobs[-k:], segments=[])

    def pass_s(self, lengths: Sequence[int], backward: bool) -> float:
        """Modelled seconds of a forward (or forward + backward) over trajectories of these lengths."""
        return sum(self.cost.train_s(n, n, backward, self.gpus) for n in lengths)

    def wait(self, seconds: float, since: float | None = None) -> None:
        """Let `seconds` of modelled time pass (dilated), less the host time since `since`."""
        self.device_s += seconds
        left = seconds * self.dilation - (time.perf_counter() - since if since is not None else 0.0)
        if left > 0:
            time.sleep(left)

    def state_move(self, state: str, dp: int, since: float) -> None:
        """`state` ("actor": weights, main grads and the Adam shard at DP size `dp`; "ref": the
        reference's weights) crossing PCIe in one direction, less the host time since `since`."""
        if state not in ("actor", "ref"):
            raise ValueError(f"state={state!r}: expected 'actor' or 'ref'")
        size = self.cost.actor_state_bytes_per_gpu(dp) if state == "actor" else self.cost.ref_state_bytes_per_gpu
        self.wait(self.cost.swap_s(0, size), since)

    def forward(self, lengths: Sequence[int] | None, since: float) -> None:
        if lengths:
            self.wait(self.pass_s(lengths, backward=False), since)

    def backward_after(self, logprobs: torch.Tensor, lengths: Sequence[int] | None) -> torch.Tensor:
        """`logprobs` unchanged, with the backward's modelled time charged when autograd reaches it."""
        if not lengths or not logprobs.requires_grad:
            return logprobs
        seconds = self.pass_s(lengths, backward=True) - self.pass_s(lengths, backward=False)
        return _ChargeInBackward.apply(logprobs, self, seconds)


class _ChargeInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock: TrainerDeviceTime, seconds: float):
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.wait(ctx.seconds)
        return grad, None, None
