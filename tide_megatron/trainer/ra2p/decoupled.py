"""RA2P decoupled mode: a Ref rank streams reference log-probs to the Actor ranks it serves.

Paper, "Decoupled Streaming Mode": the Ref runs on its own rank(s), one Ref rank serving several
Actor ranks (a forward is about a third of forward + backward). The Ref computes log-probs micro-
batch by micro-batch and sends each as soon as it is done; the Actor evaluates its GRPO loss,
KL included, in the backward pass (`loss_in_backward.py`), so its forward of micro-batch i runs
while the Ref is still computing micro-batch i, and only its backward can wait. No model ever
swaps.

Transport. The log-probs travel over a gloo process group that spans the Ref and the Actor ranks
(`LogprobStream`), held as an object next to the trainers' default group: the Actor ranks'
default group is their Megatron DP world and must not contain the Ref rank (DDP all-reduces and
Megatron's own collectives run on it), and the Ref rank has its own. This is the same pattern as
the controller's job-wide weight group (`comm/topology.py`); the job group itself can be
passed in. Each send is a non-blocking `send` on that group with the micro-batch index as tag;
each Actor posts every `recv` up front (gloo matches by source and tag), wraps it in a
`ReceivedLogprobs` handle and hands that to the loss-in-backward graph.

Order. Both sides iterate the micro-batches in dispatch order, which is the core planner's
decoupled plan (largest first, the smallest last: the pipeline drains on the shortest backward).
The Ref interleaves the Actors it serves micro-batch by micro-batch (mb 0 of every actor, then
mb 1, ...) so no Actor starves while another is served far ahead.

Tensor parallelism. An Actor DP rank with TP ranks needs the log-probs on each of them; a Ref
with TP ranks computes each micro-batch on all of them (every TP rank ends with the whole
# [B, T] result). So the Ref serves Actor DP ranks, and each Ref TP rank sends to the Actor
ranks `trainer.assignment.TrainerAssignment.ref_destinations` gives it.

Data. The controller dispatches each micro-batch's inputs (token ids, a few KB) to both its
Actor rank and its Ref rank; only the log-probs (# [B, T] fp32) cross between them. On GPU the
log-probs are copied to host for gloo; an NCCL group would send them device to device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from tide_megatron.trainer.actor import MegatronActor, ReferenceModel, UpdateResult
from tide_megatron.trainer.batch import MicroBatch
from tide_megatron.trainer.loss_in_backward import ReceivedLogprobs
from tide_megatron.trainer.ra2p.source import MicroBatchSource, as_source, iterate
from tide_megatron.trainer.ra2p.timing import ActorPassTimer, CostMeter, StepReport, finish_actor_step, now


@dataclass
class DecoupledConfig:
    """The decoupled streaming pipeline."""

    ref_rank: int = 0
    """The serving Ref rank, as a rank of the stream group."""

    actor_ranks: tuple[int, ...] = (1,)
    """The Actor ranks this Ref serves, as ranks of the stream group (`actors_per_ref` of them)."""

    send_timeout_s: float = 600.0
    """How long the Ref waits for its sends to complete at the end of a step."""


class LogprobStream:
    """A gloo group over a Ref rank and its Actor ranks, carrying reference log-probs.

    `group` is any `ProcessGroup` containing them (the job group, or one made by `create`);
    ranks are ranks of that group.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int, prefix: str = "ra2p/logprobs",
               timeout_s: float = 600.0) -> "LogprobStream":
        """A new gloo group over `world_size` ranks from a shared store (not the default group)."""
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size,
                                      timedelta(seconds=timeout_s))
        return cls(group)

    def send(self, logprobs: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Non-blocking send of # [B, T] fp32; keep `logprobs` alive until the work completes."""
        return self.group.send([logprobs], dst, tag)

    def recv(self, shape: tuple[int, ...], src: int, tag: int) -> ReceivedLogprobs:
        """Post a receive of # `shape` fp32 log-probs; resolved when the loss's backward waits."""
        buffer = torch.empty(shape, dtype=torch.float32)
        return ReceivedLogprobs(buffer, self.group.recv([buffer], src, tag))

    def close(self) -> None:
        if hasattr(self.group, "shutdown"):
            self.group.shutdown()


class RefStreamServer:
    """The Ref rank's side: forward each Actor's micro-batches in turn, send each result at once.

        server = RefStreamServer(ref, stream, cfg, meter)
        report = server.serve_step({actor_rank: micro_batches, ...})
    """

    def __init__(self, ref: ReferenceModel, stream: LogprobStream, cfg: DecoupledConfig,
                 meter: Optional[CostMeter] = None):
        self.ref = ref
        self.stream = stream
        self.cfg = cfg
        self.meter = meter

    def serve_step(self, micro_batches: Mapping[int, "Sequence[MicroBatch] | MicroBatchSource"],
                   destinations: Optional[Mapping[int, Sequence[int]]] = None) -> StepReport:
        """Serve one step: `micro_batches[key]` are one Actor DP rank's, in its dispatch order.

        `destinations[key]`: the stream-group ranks that receive that DP rank's log-probs
        (default: the key itself, one Actor rank per key). A key with no destination here is
        still computed: the TP ranks of a Ref compute together and each sends its own share.
        Sources may still be filling (arrivals); each is read in order, blocking when empty.
        """
        if destinations is None:
            destinations = {key: (key,) for key in micro_batches}
        unknown = {r for key in micro_batches for r in destinations.get(key, ())} - set(self.cfg.actor_ranks)
        if unknown:
            raise ValueError(f"not an actor rank this Ref serves: {sorted(unknown)}")
        iterators = {rank: iterate(as_source(mbs)) for rank, mbs in micro_batches.items()}
        report = StepReport(mode="decoupled_ref")
        started = now()
        in_flight: list[tuple[dist.Work, torch.Tensor]] = []
        tag = 0
        while iterators:
            for key in list(iterators):
                mb = next(iterators[key], None)
                if mb is None:
                    del iterators[key]
                    continue
                t0 = now()
                logprobs = self.ref.logprobs(mb).to("cpu", torch.float32).contiguous()  # [B, T]
                seconds = now() - t0
                report.ref_fwd_s += seconds
                report.num_micro_batches += 1
                report.tokens += mb.num_tokens
                if self.meter is not None:
                    self.meter.observe("ref_fwd", seconds, mb.num_tokens)
                in_flight += [(self.stream.send(logprobs, dst, tag), logprobs) for dst in destinations.get(key, ())]
            tag += 1
        for work, _ in in_flight:
            work.wait(timedelta(seconds=self.cfg.send_timeout_s))
        report.wall_s = now() - started
        return report


class DecoupledActorExecutor:
    """The Actor rank's side: train on streamed reference log-probs, loss in backward.

        executor = DecoupledActorExecutor(actor, stream, cfg, meter)
        result, report = executor.run_step(micro_batches)   # this rank's DP shard, dispatch order
    """

    def __init__(self, actor: MegatronActor, stream: LogprobStream, cfg: DecoupledConfig,
                 meter: Optional[CostMeter] = None):
        self.actor = actor
        self.stream = stream
        self.cfg = cfg
        self.meter = meter

    def _feed(self, source: MicroBatchSource, timer: ActorPassTimer, report: StepReport) -> Iterable[MicroBatch]:
        need_ref = self.actor.cfg.kl_coef != 0.0
        for tag, mb in enumerate(iterate(source)):
            timer.exclude(source.last_wait_s)  # waiting for an arrival is not backward
            report.tokens += mb.num_tokens
            mb = dataclasses.replace(mb)
            if need_ref:
                mb.ref_logprobs = self.stream.recv(tuple(mb.token_ids.shape), self.cfg.ref_rank, tag)
            yield mb

    def run_step(self, micro_batches: "Sequence[MicroBatch] | MicroBatchSource") -> tuple[UpdateResult, StepReport]:
        """One optimizer step; the actor's forward never waits for the Ref, its backward may."""
        source = as_source(micro_batches)
        n = len(source)
        report = StepReport(mode="decoupled", num_micro_batches=n)
        started = now()
        saved_cfg = self.actor.cfg
        self.actor.cfg = dataclasses.replace(saved_cfg, loss_in_backward=True)
        try:
            with ActorPassTimer(self.actor.model) as timer:
                # The receive of micro-batch i is posted when Megatron pulls it, just before its
                # forward; the Ref may already have sent it (gloo buffers unmatched sends).
                reports = self.actor.forward_backward_iter(iter(self._feed(source, timer, report)), n)
        finally:
            self.actor.cfg = saved_cfg
        report.ref_wait_s = sum(float(r.get("ref_wait_s", 0.0)) for r in reports)
        report.actor_fwd_s = timer.fwd_s
        report.actor_bwd_s = max(timer.bwd_s - report.ref_wait_s, 0.0)
        return finish_actor_step(self.actor, reports, report, started, self.meter)
