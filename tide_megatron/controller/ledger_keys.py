"""Names of the rollout side's token bookings in the ledger's per-account audit.

The buffer's ledger is kept per account (`core.buffer.TokenAudit`): the buffer books each
trajectory attempt under its trajectory id, and every booking made here, of tokens that never
reach the buffer, names the event it books. The event, not the task: a task ends several
times (retried, handed over, a late answer of a rank that lost it), and each end is booked
once. So one event booked twice (two branches both booking one message, one carry written off
twice) raises `LedgerError` naming it, instead of leaving a count that is silently too high.

Each name holds a number drawn once per event, so names never repeat across events: a second
booking of one event can only come from booking the same name again. A task end's name is
drawn when the message is received (`RolloutService._on_task_end`) and handed to whichever
part books it; a part called without one (a unit test) draws its own.
"""

from __future__ import annotations

import itertools

from tide_megatron.comm.messages import TaskFailed, TrajectoryDone

_numbers = itertools.count(1)  # one per event booked here; only the rollout service's thread draws


def task_end(msg) -> str:
    """The booking of a task end message (`TrajectoryDone`, `TaskFailed`, `TaskCancelled`,
    `TaskCarried`) and of the carried tokens booked with it."""
    if isinstance(msg, TrajectoryDone):
        tid = msg.trajectory.trajectory_id
    else:
        tid = msg.assignment.trajectory_id if isinstance(msg, TaskFailed) else msg.task_id
    return f"{tid}: {type(msg).__name__} from rank {msg.src} (end #{next(_numbers)})"


def carried_part(end_key: str) -> str:
    """The carried tokens of a task end, when they are booked apart from the end's own."""
    return f"{end_key}, carried"


def carry(task_id: str) -> str:
    """Tokens a task carries from the ranks that handed it over, booked without a task end
    (the rank it was on quarantined, its carry dropped with its group)."""
    return f"{task_id}: carried tokens (carry #{next(_numbers)})"


def write_off(rank: int, epoch: int, kind: str) -> str:
    """What a rank taken out of rollout service had generated on its unfinished tasks."""
    return f"rank {rank}: written off ({kind}, epoch {epoch})"


def lost() -> str:
    """Tokens the ranks generated that no booking accounts for (one reconciliation's finding)."""
    return f"lost tokens (reconciliation #{next(_numbers)})"
