"""Interim: the unified `CTBDispatcher` over the mailbox, with the interface `streaming.py` calls.

The lead's mailbox carrier replaces this module. Until then it carries decisions as the old
`RemoteCTB` did (`task`, `pause`, `resume` messages; the rank reports `turn` messages), with
two limits of today's rollout worker made explicit: the worker does not confirm releases, so a
pause counts as released when it is posted (`task_released` right away: the race this leaves
is what confirmed releases close), and it cannot cancel a task (`cancel` raises).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.rollout.ctb_carrier import TagFields
from tide_megatron.rollout.ctb_config import CTBDispatchConfig
from tide_megatron.rollout.ctb_dispatcher import CTBDispatcher, RankResources
from tide_megatron.rollout.task_runner import TaskAssignment


class _WorkerMailboxCarrier:
    can_move_tasks = False

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox
        self.dispatcher: Optional[CTBDispatcher] = None

    def admit(self, rank: int, assignment: TaskAssignment, tag: Optional[TagFields]) -> None:
        self.mailbox.post(rank, "task", assignment=assignment.__dict__, ctb=tag.to_json() if tag else None)

    def pause(self, rank: int, task_id: str) -> None:
        self.mailbox.post(rank, "pause", task_id=task_id)
        self.dispatcher.task_released(rank, task_id)

    def resume(self, rank: int, task_id: str, tag: TagFields) -> None:
        self.mailbox.post(rank, "resume", task_id=task_id, ctb=tag.to_json())

    def cancel(self, rank: int, task_id: str) -> None:
        raise NotImplementedError("the rollout worker cannot cancel a task yet")


class RemoteCTB:
    """The CTB dispatcher of rank 0 for rollout ranks in other processes (interim)."""

    def __init__(self, cfg: CTBDispatchConfig, mailbox: Mailbox, ranks: dict[int, RankResources]):
        carrier = _WorkerMailboxCarrier(mailbox)
        self.dispatcher = carrier.dispatcher = CTBDispatcher(cfg, carrier, ranks)
        self.stats = self.dispatcher.stats
        self.assignments = self.dispatcher.assignments

    def submit(self, assignments: Iterable[TaskAssignment]) -> None:
        self.dispatcher.submit(assignments)

    def schedule(self, now: float, unconsumed_trajectories: int) -> None:
        self.dispatcher.schedule(now, unconsumed_trajectories)

    def on_turn(self, msg: dict[str, Any]) -> None:
        d, rank, tid, ctx = self.dispatcher, msg["src"], msg["task_id"], int(msg["context_tokens"])
        if msg["phase"] == "started":
            d.turn_started(rank, tid, ctx)
        else:
            d.turn_finished(rank, tid, ctx, msg.get("report"))

    def on_finished(self, task_id: str, context_tokens: int) -> None:
        self.dispatcher.task_finished(self.dispatcher.runner_rank[task_id], task_id, context_tokens)

    def forget_group(self, group_id: str) -> None:
        self.dispatcher.forget_group(group_id)

    def on_weight_sync(self) -> None:
        self.dispatcher.on_weight_sync()
