"""The Megatron actor (trained) and the frozen reference, both loaded from one HF checkpoint.

The actor is a Megatron GPTModel wrapped in Megatron DDP, with `get_megatron_optimizer`, trained
by `get_forward_backward_func` over a list of micro-batches. The GRPO loss is returned per
micro-batch as (sum, tokens, metrics) with `calculate_per_token_loss=True`, so the step's
gradient is that of the token mean over all micro-batches and DP ranks.

With `TrainerConfig.loss_in_backward`, the loss function does not read the reference log-probs in
the forward pass; it wraps them in a pending handle that the backward pass waits on (RA2P's
decoupled mode, see `loss_in_backward.py`).

Process groups come from the start-up registry (`comm/groups.py`) as a Megatron
`ProcessGroupCollection`; `MegatronActor.set_data_parallel` switches the actor to the collection
of another DP size between steps (ERS), without creating a group.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from tide_megatron.models.policy import PolicyConfig, banned_token_ids, build_model, hf_weights, load_hf_weights
from tide_megatron.models.weight_conversion import unwrap_model
from tide_megatron.trainer.batch import MicroBatch
from tide_megatron.trainer.config import TrainerConfig
from tide_megatron.trainer.grpo_loss import METRIC_KEYS, grpo_loss
from tide_megatron.trainer.logprobs import forward_logprobs


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _timed_logprobs(model, banned, device_time, micro_batch: MicroBatch) -> torch.Tensor:
    """Per-token log-probs of `micro_batch` under `model`, the emulated device's forward time
    booked when there is one. # [B, T]"""
    started = time.perf_counter()
    mb = micro_batch.to(_device())
    out = forward_logprobs(model, mb.token_ids, mb.position_ids, banned, **mb.model_inputs())
    if device_time is not None:
        device_time.forward(mb.modelled_lengths, started)
    return out


class ReferenceModel:
    """A frozen GPTModel: forward-only per-token log-probs for the KL penalty."""

    def __init__(self, model_cfg: PolicyConfig, hf_checkpoint_dir: str | os.PathLike, bf16: bool = False,
                 groups=None, layer_spec: str = "auto", device_time=None):
        """`groups`: the `ProcessGroupCollection` to run on (default: this rank's home TP group,
        `GroupRegistry.model_groups()`); `layer_spec`: the actor's (`trainer.layer_spec`);
        `device_time`: emulated device time (`emulation.trainer_time.TrainerDeviceTime`)."""
        self.model_cfg = model_cfg
        self.device_time = device_time
        self.banned_token_ids = banned_token_ids(model_cfg)
        self.model = build_model(model_cfg, groups, bf16=bf16, layer_spec=layer_spec)
        load_hf_weights(self.model, hf_checkpoint_dir, model_cfg)
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Reference log-probs of a micro-batch. # [B, T]"""
        return _timed_logprobs(self.model, self.banned_token_ids, self.device_time, micro_batch)

    def attach_logprobs(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """Fill `ref_logprobs` of each micro-batch in place (colocated mode); returns them."""
        for mb in micro_batches:
            mb.ref_logprobs = self.logprobs(mb).to(mb.token_ids.device)
        return micro_batches


@dataclass
class UpdateResult:
    """What one optimizer step reports (token means are over the whole step)."""

    loss: float
    pg_loss: float
    kl: float
    clip_frac: float
    num_tokens: int
    grad_norm: float | None
    update_successful: bool
    step: int
    ref_wait_s: float = 0.0  # loss-in-backward: time backward passes waited for the reference
    # Train-inference mismatch over the loss tokens (`grpo_loss.tis_weights`): trainer's old
    # log-probs q against the rollout's o. Reported whatever `trainer.tis_mode` is.
    mismatch_abs: float = 0.0  # token mean of |q - o|
    mismatch_kl: float = 0.0  # token mean of the k3 estimate of KL(rollout || trainer)
    tis_clip_frac: float = 0.0  # share of tokens whose weight the cap truncated or masked


class MegatronActor:
    """The trained policy: Megatron GPTModel + DDP + Megatron optimizer."""

    def __init__(self, model_cfg: PolicyConfig, trainer_cfg: TrainerConfig,
                 hf_checkpoint_dir: str | os.PathLike | None, groups=None, device_time=None):
        """`hf_checkpoint_dir` None leaves Megatron's random init (a joining rank that receives
        the current weights and optimizer state). `groups`: the `ProcessGroupCollection` of this
        rank's actor configuration (default: every TP block of the job trains,
        `GroupRegistry.actor_groups`). `device_time`: emulated device time
        (`emulation.trainer_time.TrainerDeviceTime`). Construction communicates with no other rank."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from tide_megatron.comm.groups import as_default_group, registry

        if groups is None:
            groups = registry().actor_groups(registry().layout.num_blocks)
        self.model_cfg = model_cfg
        self.banned_token_ids = banned_token_ids(model_cfg)
        self.cfg = trainer_cfg
        self.groups = groups
        self.device_time = device_time
        self.step = 0
        model = build_model(model_cfg, groups, bf16=trainer_cfg.bf16, recompute=trainer_cfg.recompute,
                            layer_spec=trainer_cfg.layer_spec)
        # Load before DDP wraps the params: DDP re-points them into its contiguous buffers.
        if hf_checkpoint_dir is not None:
            load_hf_weights(model, hf_checkpoint_dir, model_cfg)
        # Token mean over the step across DP ranks: the schedule all-reduces the token count and
        # divides by it, so DDP must not also scale by 1/DP (it reads this flag when built).
        model.config.calculate_per_token_loss = True
        distributed = trainer_cfg.distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=trainer_cfg.overlap_grad_reduce,
            use_distributed_optimizer=distributed)
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                             pg_collection=groups)
        # Megatron aligns param groups with an all_gather_object over the default group (the
        # whole job, rollout ranks included). Every rank builds the same model, so there is
        # nothing to align: the rank alone (its PP group) stands in, and a rank can build its
        # actor whenever it joins, without the others.
        with as_default_group(groups.pp):
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=trainer_cfg.lr, min_lr=trainer_cfg.lr,
                    weight_decay=trainer_cfg.weight_decay, adam_beta1=trainer_cfg.adam_beta1,
                    adam_beta2=trainer_cfg.adam_beta2, adam_eps=trainer_cfg.adam_eps,
                    clip_grad=trainer_cfg.clip_grad, bf16=trainer_cfg.bf16,
                    params_dtype=torch.bfloat16 if trainer_cfg.bf16 else torch.float32,
                    use_distributed_optimizer=distributed),
                [self.model], pg_collection=groups, use_gloo_process_groups=False)
        # Megatron's schedule reads these hooks from the model config.
        config = model.config
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    @property
    def module(self) -> torch.nn.Module:
        """The bare Megatron model (for conversion and checkpointing)."""
        return unwrap_model(self.model)

    @property
    def dp_size(self) -> int:
        return self.groups.dp.size()

    def set_data_parallel(self, groups) -> None:
        """Train under another DP size from the next step on: `groups` is the registry's
        collection for the new configuration (same TP group). Between steps only.

        With the plain optimizer nothing else depends on the DP size: every DP rank holds the
        whole optimizer state, DDP's grad buffer is laid out without DP padding, and the
        per-token loss scales gradients by the step's all-reduced token count, not by 1/DP. So
        the switch re-points DDP's reduce groups (megatron-core 0.16.1 attributes; the
        integration test checks the gradients against a fresh actor). The distributed optimizer
        shards state and pads buffers by DP size: not switchable here.
        """
        if groups.tp is not self.groups.tp:
            raise ValueError("set_data_parallel keeps the TP group; a new TP layout needs a new actor")
        if groups is self.groups:
            return
        if self.cfg.distributed_optimizer:
            raise NotImplementedError(
                "changing the DP size with trainer.distributed_optimizer=true: the optimizer shards "
                "would have to be regathered and the buffers re-padded; use the plain optimizer for "
                "elastic trainers")
        dp = groups.dp
        ddp = self.model
        for name in ("dp_group", "dp_cp_group", "intra_dp_cp_group", "expt_dp_group", "intra_expt_dp_group"):
            setattr(ddp, name, dp)
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            buffer.data_parallel_group, buffer.data_parallel_world_size, buffer.dp_cp_group = dp, dp.size(), dp
        for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            bucket_group.data_parallel_group = dp
        self.groups = groups

    @torch.no_grad()
    def logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Current-policy log-probs of a micro-batch, no gradient. # [B, T]"""
        return _timed_logprobs(self.model, self.banned_token_ids, self.device_time, micro_batch)

    # ---- one optimizer step ------------------------------------------------------------

    def _loss_func(self, mb: MicroBatch, trainer_old: torch.Tensor | None, logprobs: torch.Tensor):
        # trainer_old: # [B, T] recomputed old log-probs, or None: the loss takes logprobs.detach()
        ref = mb.ref_logprobs if self.cfg.kl_coef != 0.0 else None
        if self.cfg.loss_in_backward:
            from tide_megatron.trainer.loss_in_backward import deferred_grpo_loss

            return deferred_grpo_loss(logprobs, mb, self.cfg, trainer_old)
        return grpo_loss(logprobs, mb.old_logprobs, mb.advantages, ref, mb.loss_mask, self.cfg, trainer_old)

    def _forward_step(self, data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb = next(data_iterator).to(_device())
        # `trainer.recompute_old_logprobs`: the old log-probs from a no-grad forward of this
        # micro-batch, here, just before its training forward (the iterator stays lazy). Weights
        # change only at the step's one optimizer step, so these are the pre-update numbers.
        trainer_old = self.logprobs(mb) if self.cfg.recompute_old_logprobs else None  # [B, T]
        started = time.perf_counter()
        logprobs = forward_logprobs(model, mb.token_ids, mb.position_ids, self.banned_token_ids,
                                    **mb.model_inputs())  # [B, T]
        if self.device_time is not None:
            self.device_time.forward(mb.modelled_lengths, started)
            logprobs = self.device_time.backward_after(logprobs, mb.modelled_lengths)
        return logprobs, partial(self._loss_func, mb, trainer_old)

    def forward_backward(self, micro_batches: list[MicroBatch]) -> list[dict]:
        """Zero the grads, then forward + backward every micro-batch (no optimizer step).

        Leaves the step's gradient (token mean over all micro-batches and DP ranks) in the DDP
        grad buffers (`param.main_grad`). Returns Megatron's per-micro-batch metric dicts.
        """
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        if self.cfg.kl_coef != 0.0 and any(mb.ref_logprobs is None for mb in micro_batches):
            raise ValueError("kl_coef != 0: every micro-batch needs ref_logprobs (or a pending handle)")
        return self.forward_backward_iter(iter(micro_batches), len(micro_batches))

    def forward_backward_iter(self, data_iterator: Iterator[MicroBatch], num_micro_batches: int) -> list[dict]:
        """`forward_backward` over micro-batches pulled lazily from `data_iterator`.

        Megatron's schedule calls `next(data_iterator)` right before each micro-batch's forward,
        after the previous micro-batch's backward, so the iterator may produce a micro-batch (and
        its reference log-probs) just in time: RA2P's colocated executors swap the Ref in and
        out inside it. Each micro-batch it yields must carry `ref_logprobs` when `kl_coef != 0`.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if num_micro_batches <= 0:
            raise ValueError("a step needs at least one micro-batch")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        forward_backward = get_forward_backward_func(pp_size=1, vp_size=None)
        return forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=data_iterator,
            model=[self.model],
            num_microbatches=num_micro_batches,
            seq_length=1,  # unused without PP
            micro_batch_size=1,  # unused without PP
            forward_only=False,
            pg_collection=self.groups,  # the DP group of the current configuration
        )

    def train_step(self, micro_batches: list[MicroBatch]) -> UpdateResult:
        """One GRPO update: `forward_backward` over the micro-batches, then the optimizer step.

        With `kl_coef != 0` and the ordinary loss, each micro-batch needs `ref_logprobs`
        (`ReferenceModel.attach_logprobs`); with `loss_in_backward`, `ref_logprobs` may instead
        be a pending handle (`loss_in_backward.PendingLogprobs`) resolved during backward.
        """
        return self.optimizer_step(self.forward_backward(micro_batches))

    def train_step_iter(self, data_iterator: Iterator[MicroBatch], num_micro_batches: int) -> UpdateResult:
        """`train_step` over lazily produced micro-batches (see `forward_backward_iter`)."""
        return self.optimizer_step(self.forward_backward_iter(data_iterator, num_micro_batches))

    def optimizer_step(self, reports: list[dict]) -> UpdateResult:
        """The optimizer step after a forward/backward pass; reduces its metric reports."""
        update_successful, grad_norm, _ = self.optimizer.step()
        self.step += 1
        totals = self._reduce_reports(reports)
        count = max(totals["loss"][1], 1.0)
        return UpdateResult(
            loss=totals["loss"][0] / count, pg_loss=totals["pg_loss"][0] / count,
            kl=totals["kl"][0] / count, clip_frac=totals["clip_frac"][0] / count,
            num_tokens=int(totals["loss"][1]),
            grad_norm=None if grad_norm is None else float(grad_norm),
            update_successful=bool(update_successful), step=self.step,
            ref_wait_s=sum(float(r.get("ref_wait_s", 0.0)) for r in reports),
            mismatch_abs=totals["mismatch_abs"][0] / count, mismatch_kl=totals["mismatch_kl"][0] / count,
            tis_clip_frac=totals["tis_clip_frac"][0] / count)

    def _reduce_reports(self, reports: list[dict]) -> dict[str, list[float]]:
        """Sum [sum, count] metric pairs over micro-batches, then over the DP group."""
        keys = METRIC_KEYS
        stacked = torch.zeros(len(keys), 2, dtype=torch.float64)
        for report in reports:
            for i, key in enumerate(keys):
                stacked[i] += report[key].detach().to("cpu", torch.float64)
        if self.groups.dp.size() > 1:
            buf = stacked.to(_device())
            torch.distributed.all_reduce(buf, group=self.groups.dp)
            stacked = buf.cpu()
        return {key: stacked[i].tolist() for i, key in enumerate(keys)}

    # ---- weights out -------------------------------------------------------------------

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, gathered over TP (collective: every TP rank must iterate)."""
        return hf_weights(self.model, self.model_cfg)
