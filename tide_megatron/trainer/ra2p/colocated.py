"""RA2P colocated mode: Ref and Actor on the same ranks, ready-batch aggregation, offloading.

Paper, "Optimized Colocated Mode": when the Ref and the Actor share GPUs, the idle model lives in
host memory, and alternating per micro-batch (R1 -> A1 -> R2 -> A2, StreamRL's vanilla
streaming) pays two swaps per micro-batch. Ready-batch aggregation instead loads the Ref once,
runs it over every micro-batch that is ready (up to `aggregation_limit`), swaps once to the
Actor and runs the Actor over them; only micro-batches that arrive later cost another round.

One executor covers the paper's colocated mode and both vanilla-streaming baselines, because
they differ only in two knobs:

    mode                       aggregation_limit   offload
    colocated (CM)             all ready (None)    yes      Ref once per ready burst
    vanilla streaming + offl.  1                   yes      VSO: swap at every micro-batch
    vanilla streaming          1                   no       VS: both resident, alternate

How a round fits in one optimizer step: Megatron's schedule pulls micro-batch i from the data
iterator right before its forward, after micro-batch i-1's backward (`forward_backward_iter`).
The iterator here, when it has no Ref-processed micro-batch left, swaps the Actor out (params
and grad buffers: the gradient accumulated so far is parked bit-exactly), brings the Ref in,
computes reference log-probs for the next ready round, swaps back and yields. So every round
contributes to one gradient, one optimizer step, with the same token-mean normalisation as the
plain path, whatever the rounds are.

Zero-copy hand-off. Ref and Actor are in the same process here: each micro-batch is moved to the
device once, the Ref's log-probs (# [B, T], on the device) are attached to it as they are, and
the Actor reads the same tensor; no serialisation, no host round trip, no extra allocation.
(Within a node but across processes, e.g. a Ref and an Actor in different ranks of one GPU, the
same is done by sharing the CUDA allocation through `torch.multiprocessing` (CUDA IPC handles:
the receiver maps the producer's memory, the producer keeps the tensor alive until the consumer
signals it is done) or, on CPU, through `share_memory_()` tensors; that cross-process path is not
implemented here because the executors colocate both models in one process.)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from tide_megatron.trainer.actor import MegatronActor, ReferenceModel, UpdateResult, _device
from tide_megatron.trainer.batch import MicroBatch
from tide_megatron.trainer.offload import ModelOffloader, OffloadConfig
from tide_megatron.trainer.ra2p.source import MicroBatchSource, as_source
from tide_megatron.trainer.ra2p.timing import ActorPassTimer, CostMeter, StepReport, finish_actor_step, now


@dataclass
class ColocatedConfig:
    """How the colocated executor alternates and swaps."""

    aggregation_limit: Optional[int] = None
    """Most ready micro-batches one Ref load serves. None: every ready one (the paper's CM);
    1: vanilla streaming (R1 -> A1 -> R2 -> A2)."""

    offload: bool = True
    """Keep only the running model on the device; the idle one is offloaded to host memory.
    False keeps both resident (needs memory for both; the VS baseline)."""

    actor_offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What of the Actor is moved: params and grad buffers by default (see `offload.py`)."""

    ref_offload: OffloadConfig = field(default_factory=lambda: OffloadConfig(grads=False))
    """What of the Ref is moved: its params (it has no grads or optimizer)."""

    name: str = "colocated"
    """Label in the step report."""

    @classmethod
    def vanilla_streaming(cls, offload: bool) -> "ColocatedConfig":
        """The StreamRL-style baselines: VSO (offload=True) and VS (offload=False)."""
        return cls(aggregation_limit=1, offload=offload,
                   name="vanilla_streaming_offload" if offload else "vanilla_streaming")


class ColocatedExecutor:
    """Runs RA2P steps with Ref and Actor on this rank.

        executor = ColocatedExecutor(actor, ref, ColocatedConfig(), meter)
        result, report = executor.run_step(micro_batches)   # or a MicroBatchSource

    Between steps the Actor is resident and (with offload) the Ref is in host memory; that is
    the state `run_step` starts from and leaves behind.
    """

    def __init__(self, actor: MegatronActor, ref: ReferenceModel, cfg: Optional[ColocatedConfig] = None,
                 meter: Optional[CostMeter] = None, ref_offloader: Optional[ModelOffloader] = None):
        """`ref_offloader`: the Ref's offloader when its owner parks it too (a role change then
        finds it parked, not resident); it must keep a host copy."""
        self.actor = actor
        self.ref = ref
        self.cfg = cfg or ColocatedConfig()
        self.meter = meter
        self.actor_offloader = ModelOffloader(actor.model, self.cfg.actor_offload, optimizer=actor.optimizer)
        self.ref_offloader = ref_offloader or ModelOffloader(ref.model, self.cfg.ref_offload)
        if self.cfg.offload:
            self.ref_offloader.offload()
        if actor.cfg.loss_in_backward:
            raise ValueError("colocated mode computes reference log-probs before the actor's forward; "
                             "use the ordinary loss (TrainerConfig.loss_in_backward=False)")

    # ---- swaps ---------------------------------------------------------------------------

    def _swap(self, out: ModelOffloader, into: ModelOffloader, report: StepReport) -> float:
        """Offload `out`, restore `into`: one Ref<->Actor alternation. Returns seconds."""
        if not self.cfg.offload:
            return 0.0
        started = now()
        out.offload()
        into.restore()
        seconds = now() - started
        report.swap_s += seconds
        report.num_swaps += 1
        if self.meter is not None:
            self.meter.observe("swap", seconds)
        return seconds

    # ---- one step ------------------------------------------------------------------------

    def _ref_round(self, batch: list[MicroBatch], report: StepReport) -> float:
        """Reference log-probs for one aggregated round, Ref swapped in and out. Returns seconds."""
        spent = self._swap(self.actor_offloader, self.ref_offloader, report)
        for mb in batch:
            started = now()
            mb.ref_logprobs = self.ref.logprobs(mb)  # [B, T], stays on the device: zero-copy
            seconds = now() - started
            report.ref_fwd_s += seconds
            spent += seconds
            if self.meter is not None:
                self.meter.observe("ref_fwd", seconds, mb.num_tokens)
        spent += self._swap(self.ref_offloader, self.actor_offloader, report)
        report.ref_rounds += 1
        return spent

    def _feed(self, source: MicroBatchSource, report: StepReport, timer: ActorPassTimer) -> Iterator[MicroBatch]:
        limit = self.cfg.aggregation_limit or len(source)
        device = _device()
        need_ref = self.actor.cfg.kl_coef != 0.0
        processed: collections.deque[MicroBatch] = collections.deque()
        pending: list[MicroBatch] = []  # taken from the source, left for the next round
        while True:
            if not processed:
                # Everything ready now (at least one: blocks for an arrival), up to the limit.
                if pending:
                    candidates = pending
                else:
                    candidates = source.take_ready(limit)
                    timer.exclude(source.last_wait_s)  # waiting for an arrival is not backward
                if not candidates:
                    return
                n = self._agree_round_size(len(candidates)) if limit > 1 else 1
                batch = [mb.to(device) for mb in candidates[:n]]  # one device copy
                pending = candidates[n:]
                report.tokens += sum(mb.num_tokens for mb in batch)
                if need_ref:
                    timer.exclude(self._ref_round(batch, report))
                processed.extend(batch)
            yield processed.popleft()

    def _agree_round_size(self, ready: int) -> int:
        """The TP ranks of an actor run the Ref and Actor passes together, so a round must hold
        the same micro-batches on each: the fewest any of them has ready (they all receive the
        same micro-batches in the same order, only at different times)."""
        tp = self.actor.groups.tp
        if tp.size() == 1:
            return ready
        count = torch.tensor([ready], dtype=torch.int64, device=_device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=tp)
        return int(count.item())

    def run_step(self, micro_batches: "Sequence[MicroBatch] | MicroBatchSource") -> tuple[UpdateResult, StepReport]:
        """One optimizer step over the step's micro-batches (this rank's DP shard)."""
        source = as_source(micro_batches)
        n = len(source)
        report = StepReport(mode=self.cfg.name, num_micro_batches=n)
        started = now()
        if not self.actor_offloader.resident:
            raise RuntimeError("the actor must be resident between steps")
        with ActorPassTimer(self.actor.model) as timer:
            reports = self.actor.forward_backward_iter(self._feed(source, report, timer), n)
        report.actor_fwd_s, report.actor_bwd_s = timer.fwd_s, timer.bwd_s
        return finish_actor_step(self.actor, reports, report, started, self.meter)

    def close(self) -> None:
        """Leave both models resident (e.g. before a checkpoint or a role change)."""
        self.ref_offloader.restore()
        self.actor_offloader.restore()
