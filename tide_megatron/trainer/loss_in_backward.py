"""Loss-in-backward: the GRPO loss evaluated in the actor's backward pass (RA2P decoupled mode).

In the ordinary graph, the loss (KL term included) is computed at the end of the actor's forward,
so the forward cannot finish until the reference rank has sent that micro-batch's log-probs. Here
the actor's forward ends at its per-token log-probs; the loss node is a custom autograd Function
whose forward needs only what the actor already has (rollout log-probs, advantages, loss mask) and
whose backward waits on the pending reference log-probs, then returns the closed-form gradient

    d loss / d logprobs = mask * (d pg / d logprobs + kl_coef * d kl / d logprobs)

(`grpo_loss.grpo_loss_grad_wrt_logprobs`). Megatron's schedule runs forward(mb_i), backward(mb_i)
in turn, so the reference's forward of mb_i overlaps the actor's forward of mb_i, and only the
actor's backward can wait, never its forward.

The scalar the Function returns carries the policy-gradient part of the loss (the KL value is
unknown in forward); the metrics dict it hands to Megatron is completed in backward with the full
loss and KL, so the numbers reported after `forward_backward` are the same as the ordinary path's.

Train-inference mismatch correction (`trainer.tis_mode`) needs nothing from the reference: its
weights come from the trainer's old log-probs (the forward's own detached ones, or the recomputed
ones the actor passes) and the rollout's, so forward computes them and backward scales the
closed-form gradient by them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import torch

from tide_megatron.trainer.batch import MicroBatch, PendingLogprobs
from tide_megatron.trainer.config import TrainerConfig
from tide_megatron.trainer.grpo_loss import METRIC_KEYS, grpo_loss_grad_wrt_logprobs, grpo_token_loss, loss_metrics


class ReadyLogprobs:
    """Already available (colocated mode, tests)."""

    def __init__(self, logprobs: torch.Tensor):
        self._logprobs = logprobs

    def wait(self) -> torch.Tensor:
        return self._logprobs


class FutureLogprobs:
    """Delivered by another thread through a `concurrent.futures.Future` or `torch.futures.Future`."""

    def __init__(self, future: "concurrent.futures.Future | torch.futures.Future", timeout_s: float | None = 600.0):
        self._future = future
        self._timeout_s = timeout_s

    def wait(self) -> torch.Tensor:
        if isinstance(self._future, concurrent.futures.Future):
            return self._future.result(timeout=self._timeout_s)
        return self._future.wait()


class ReceivedLogprobs:
    """Arriving from a reference rank over torch.distributed (an `irecv` into `buffer`)."""

    def __init__(self, buffer: torch.Tensor, work: "torch.distributed.Work"):
        self._buffer = buffer
        self._work = work

    @classmethod
    def irecv(cls, shape: tuple[int, ...], src: int, group=None, device: torch.device | str = "cpu"
              ) -> "ReceivedLogprobs":
        buffer = torch.empty(shape, dtype=torch.float32, device=device)
        return cls(buffer, torch.distributed.irecv(buffer, src=src, group=group))

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._buffer


def as_pending(ref: "torch.Tensor | PendingLogprobs | None") -> PendingLogprobs | None:
    if ref is None or isinstance(ref, PendingLogprobs) and not isinstance(ref, torch.Tensor):
        return ref
    return ReadyLogprobs(ref)


class _DeferredGRPOLoss(torch.autograd.Function):
    """loss_sum(logprobs), with the loss's dependence on the reference resolved in backward."""

    @staticmethod
    def forward(ctx, logprobs, old_logprobs, advantages, loss_mask, pending, cfg, report, trainer_old=None):
        # logprobs, old_logprobs, loss_mask, trainer_old: # [B, T]; advantages: # [B] or [B, T]
        # trainer_old None: the forward's own log-probs (`grpo_loss.grpo_token_loss`).
        trainer_old = logprobs.detach() if trainer_old is None else trainer_old.detach()
        ctx.save_for_backward(logprobs.detach(), old_logprobs, advantages, loss_mask, trainer_old)
        ctx.pending, ctx.cfg, ctx.report = pending, cfg, report
        no_kl = dataclasses.replace(cfg, kl_coef=0.0)
        terms = grpo_token_loss(logprobs.detach(), old_logprobs, advantages, None, no_kl, trainer_old)
        mask = loss_mask.to(logprobs.dtype)
        metrics = loss_metrics(terms, mask)  # "loss" and "kl" lack the KL until backward adds it
        for key, value in metrics.items():
            report[key].copy_(value)
        return metrics["pg_loss"][0].clone()

    @staticmethod
    def backward(ctx, grad_output):
        logprobs, old_logprobs, advantages, loss_mask, trainer_old = ctx.saved_tensors
        cfg, report = ctx.cfg, ctx.report
        ref = None
        if cfg.kl_coef != 0.0:
            started = time.perf_counter()
            ref = ctx.pending.wait().to(device=logprobs.device, dtype=logprobs.dtype)
            report["ref_wait_s"] = time.perf_counter() - started
            terms = grpo_token_loss(logprobs, old_logprobs, advantages, ref, cfg, trainer_old)
            mask = loss_mask.to(logprobs.dtype)
            report["kl"][0] = (terms["kl"] * mask).sum()
            report["loss"][0] = (terms["loss"] * mask).sum()
        grad = grpo_loss_grad_wrt_logprobs(logprobs, old_logprobs, advantages, ref, loss_mask, cfg, trainer_old)
        return grad * grad_output, None, None, None, None, None, None, None


def deferred_grpo_loss(logprobs: torch.Tensor, mb: MicroBatch, cfg: TrainerConfig,
                       trainer_old_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron loss-function contract, like `grpo_loss`, with the reference read in backward.

    `mb.ref_logprobs` may be a tensor or a `PendingLogprobs`; it is not touched until backward.
    The returned metrics dict is filled in completely once backward has run.
    trainer_old_logprobs: # [B, T] the recomputed old log-probs (`trainer.recompute_old_logprobs`),
    None: the forward's own.
    """
    pending = as_pending(mb.ref_logprobs) if cfg.kl_coef != 0.0 else None
    if cfg.kl_coef != 0.0 and pending is None:
        raise ValueError("kl_coef != 0 needs reference log-probs (a tensor or a pending handle)")
    report = {key: torch.zeros(2, dtype=torch.float32, device=logprobs.device) for key in METRIC_KEYS}
    loss_sum = _DeferredGRPOLoss.apply(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask,
                                       pending, cfg, report, trainer_old_logprobs)
    num_tokens = mb.loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, report
