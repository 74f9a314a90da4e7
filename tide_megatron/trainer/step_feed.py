"""The controller's half of the trainer protocol (the ranks' half is `worker.py`).

One step over N actor DP ranks (each a TP block) and R reference ranks:

    feed = StepFeed(mailbox, assignment, mode, {dp: num_micro_batches, ...}, local=worker0)
    # a thread (the rollout feed) routes each ready micro-batch, in each DP rank's order:
    feed.put(dp, trajectories)
    # the main thread of rank 0 trains its own share meanwhile:
    result, report = worker0.run_step(mode, feed.local_source)
    # then wait for feed.replies_expected(): `Trained` from every other actor rank, `RefDone`
    # from every reference rank (decoupled)

The counts per DP rank are fixed when the step opens (Megatron's schedule needs them); a DP rank
may get 0 (it then trains nothing but joins the all-reduce). Role changes go out with
`post_roles` at the post-update boundary, before the weight sync, to every rank in the
same order.
"""

from __future__ import annotations

from typing import Any, Mapping

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (Message, OpenRefStep, OpenStep, RefDone, RefMicroBatch, Trained,
                                         TrainMicroBatch)
from tide_megatron.core.trajectory import Trajectory
from tide_megatron.trainer.assignment import TrainerAssignment
from tide_megatron.trainer.batch import BatchLayout
from tide_megatron.trainer.payload import micro_batch_of
from tide_megatron.trainer.ra2p.source import ArrivingSource


class StepFeed:
    """Opens one step on every actor and reference rank and routes its micro-batches."""

    def __init__(self, mailbox: Mailbox, assignment: TrainerAssignment, mode: str,
                 num_micro_batches: Mapping[int, int], local=None, layout: BatchLayout = BatchLayout(),
                 source_options: Mapping[str, Any] | None = None):
        """`local`: the posting rank's own `TrainerWorker` when it is an actor (rank 0); its
        micro-batches go into `local_source` instead of the mailbox, an `ArrivingSource` built
        with `source_options` (its arrival timeout and health check)."""
        if mode not in assignment.modes:
            raise ValueError(f"a {mode} step is not possible under this assignment ({sorted(assignment.modes)})")
        unknown = set(num_micro_batches) - set(range(assignment.dp_size))
        if unknown:
            raise ValueError(f"DP ranks {sorted(unknown)} outside 0..{assignment.dp_size - 1}")
        self.mailbox, self.assignment, self.mode, self.layout = mailbox, assignment, mode, layout
        self.counts = {dp: int(num_micro_batches.get(dp, 0)) for dp in range(assignment.dp_size)}
        self._sent = dict.fromkeys(self.counts, 0)
        me = mailbox.owner
        self.local_source: ArrivingSource | None = None
        self.images = local.images if local is not None else None
        self.device_time = local.device_time if local is not None else None
        for rank in assignment.actor_ranks:
            n = self.counts[assignment.dp_rank(rank)]
            if rank == me:
                if local is None:
                    raise ValueError(f"rank {me} is an actor: pass its TrainerWorker as `local`")
                self.local_source = local.begin_step(n, **(source_options or {}))
            else:
                mailbox.post(rank, OpenStep(mode, n))
        if self.decoupled:
            for ref in assignment.ref_ranks:
                mailbox.post(ref, OpenRefStep({dp: self.counts[dp] for dp in assignment.served_dp_ranks(ref)}))

    @property
    def decoupled(self) -> bool:
        return self.mode == "decoupled"

    def put(self, dp: int, trajectories: list[Trajectory]) -> None:
        """Route DP rank `dp`'s next micro-batch to its actor ranks (and its reference unit)."""
        if self._sent[dp] >= self.counts[dp]:
            raise ValueError(f"DP rank {dp} was opened with {self.counts[dp]} micro-batches; one more sent")
        self._sent[dp] += 1
        for rank in self.assignment.dp_members(dp):
            if rank == self.mailbox.owner:
                self.local_source.put(micro_batch_of(trajectories, self.layout, self.images, self.device_time))
            else:
                self.mailbox.post(rank, TrainMicroBatch(trajectories))
        if self.decoupled:
            for ref in self.assignment.ref_unit_of(dp):
                self.mailbox.post(ref, RefMicroBatch(dp, trajectories))

    def replies_expected(self) -> dict[type[Message], list[int]]:
        """Reply type -> the ranks that will post it when the step is done."""
        me = self.mailbox.owner
        out: dict[type[Message], list[int]] = {Trained: [r for r in self.assignment.actor_ranks if r != me]}
        if self.decoupled:
            out[RefDone] = list(self.assignment.ref_ranks)
        return out


def post_roles(mailbox: Mailbox, old: TrainerAssignment, new: TrainerAssignment, ranks) -> None:
    """Tell `ranks` (every rank but the poster, which calls `TrainerWorker.apply` itself) the
    new trainer configuration and the one it replaces. Each affected rank answers `RolesDone`."""
    for rank in ranks:
        if rank != mailbox.owner:
            mailbox.post(rank, new.to_message(old))
