"""What becomes of a rollout rank's tasks when it leaves service, and of a rank that joins.

A rank leaves rollout service in two ways: quarantined (silent, or its weights unconfirmed in
time), or moved to the trainer by ERS. Either way `Quarantine.take_out` takes it out of the
placement and posts its `CancelAll`; what differs is its tasks:

- quarantined: each failed there, like the tasks of a dead engine: retried elsewhere or its
  group given up, and the tokens it carried from ranks it left before are booked as failed.
  The run stops when fewer than `scheduler.min_rollout_ranks` ranks are left in service.
- moved, with CTB: the rank, alive, hands each task over (`TaskCarried`: its episode and env
  session go on where CTB resumes it, re-prefilled under the new weights; a task that had not
  begun is cancelled and starts afresh). Until it has answered for a task, that task's end is
  its to report; the tokens generated on it go with the task and are booked at its end.
- moved, without CTB: its tasks start afresh elsewhere at once (no retry charged, their tokens
  wasted) and the rank drops them.

A rank ERS moves to rollout receives the next weights and takes tasks once it loaded them
(`Quarantine.return_to_rollout`); the buffer's data retention follows both kinds of move.

Owned by the rollout service's thread; the retries and the group ends are `GroupBook`'s.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from tide_megatron.comm.messages import TaskCancelled, TaskCarried
from tide_megatron.controller import ledger_keys
from tide_megatron.controller.errors import RunError
from tide_megatron.controller.groups import GroupBook
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.quarantine import Quarantine
from tide_megatron.core.buffer import GlobalBuffer

logger = logging.getLogger(__name__)


class Handover:
    def __init__(self, *, quarantine: Quarantine, groups: GroupBook, buffer: GlobalBuffer, placement,
                 health: RolloutHealth, counters: dict[str, int], min_rollout_ranks: int = 1,
                 hand_over_tasks: bool = True):
        self.quarantine, self.groups, self.buffer, self.placement, self.health = \
            quarantine, groups, buffer, placement, health
        self.counters = counters  # tasks moved and carried, carried tokens
        self.min_rollout_ranks = min_rollout_ranks
        self.hand_over_tasks = hand_over_tasks and placement.hands_over
        self._handing_over: dict[str, int] = {}  # task -> the rank leaving rollout that hands it over
        self.notify: Callable[[str, str], None] = lambda kind, text: None
        """`notify(kind, text)`: a fault for the metric sinks (`MetricsLogger.event`; quarantines)."""

    # -- quarantine -------------------------------------------------------------------------
    def quarantine_rank(self, rank: int, reason: str, now: float) -> None:
        """Take a silent or unconfirming rank out of service (see `quarantine.py`)."""
        task_ids, written_off = self.quarantine.take_out(rank, reason, now)
        retried = 0
        for tid in task_ids:  # like the tasks of a dead engine: each attempt failed there
            carried, key = self.groups.take_carry(tid)  # (the tokens it generated on earlier ranks)
            if key is not None:
                self.buffer.ledger.book_attempt(carried, fate="failed", key=key)
            retried += self.groups.fail_with_rank(tid, rank, now)
        logger.warning("quarantined rollout rank %d: %s; %d task(s) taken back (%d retried on other ranks, "
                       "%d tokens booked as failed)", rank, reason, len(task_ids), retried, written_off)
        self.notify("quarantine", f"rollout rank {rank} quarantined: {reason}; {len(task_ids)} task(s) taken back")
        left = self.quarantine.serving
        if len(left) < self.min_rollout_ranks:
            raise RunError(f"{reason}; {len(left)} rollout rank(s) left in service, fewer than "
                           f"scheduler.min_rollout_ranks={self.min_rollout_ranks}")

    # -- ERS moves --------------------------------------------------------------------------
    def move_to_trainer(self, rank: int, reason: str, retain: bool = True) -> int:
        """ERS moves rollout rank `rank` to the trainer: it takes no new task, and its tasks go
        on on the other ranks (handed over with CTB, afresh without; module docstring).
        `retain`: the move starts adaptive data retention (a rollout scale-down). Returns the
        tasks moved."""
        now = time.monotonic()
        if rank not in self.quarantine.serving:
            raise ValueError(f"rank {rank} is not a rollout rank in service")
        hand_over = self.hand_over_tasks
        task_ids, written_off = self.quarantine.take_out(rank, reason, now, kind="trainer", hand_over=hand_over)
        if retain:
            self.buffer.notify_rollout_scaled(-1)  # adaptive data retention
        if hand_over:
            self._handing_over.update((tid, rank) for tid in task_ids)
            self.counters["tasks_moved"] += len(task_ids)
            logger.info("rank %d leaves rollout for the trainer (%s): it hands %d task(s) over", rank, reason,
                        len(task_ids))
            return len(task_ids)
        moved = sum(self.groups.restart(tid) for tid in task_ids)
        self.counters["tasks_moved"] += moved
        logger.info("rank %d leaves rollout for the trainer (%s): %d task(s) re-dispatched, %d tokens wasted",
                    rank, reason, moved, written_off)
        return moved

    def return_to_rollout(self, rank: int) -> None:
        """ERS moves trainer rank `rank` to rollout: it receives the next weights (its engine
        may still be starting) and takes tasks once it has loaded them."""
        self.quarantine.return_to_rollout(rank, time.monotonic())
        self.buffer.notify_rollout_scaled(+1)
        logger.info("rank %d joins rollout; tasks go to it once it has loaded the next weights", rank)

    # -- the leaving rank's answers ---------------------------------------------------------
    def answers(self, task_id: str, rank: int) -> bool:
        """`rank` is the rank leaving rollout that still answers for task `task_id`: this end
        of the task is that answer (from now on the task is no longer handed over)."""
        if self._handing_over.get(task_id) != rank:
            return False
        del self._handing_over[task_id]
        return True

    def on_answer(self, msg, carried: int, now: float, key: Optional[str] = None) -> bool:
        """Book the leaving rank's answer for a task (after `answers`); False when it is a plain
        end of the task (it finished or failed before it could be handed over). `key`: the
        end's name in the ledger (`ledger_keys.task_end`; drawn here when not given)."""
        key = key or ledger_keys.task_end(msg)
        if isinstance(msg, TaskCarried):
            self._on_carried(msg, carried, now, key)
            return True
        if isinstance(msg, TaskCancelled):  # it had not begun: it starts afresh elsewhere
            self.health.booked(msg.src, msg.generated_tokens, now)
            self.buffer.ledger.book_attempt(msg.generated_tokens + carried, fate="cancelled", key=key)
            self.placement.not_carried(msg.task_id)
            return True
        return False

    def _on_carried(self, msg: TaskCarried, carried: int, now: float, key: str) -> None:
        """A rank leaving rollout handed a task over: it goes on where CTB resumes it."""
        self.health.booked(msg.src, msg.generated_tokens, now)
        total = msg.generated_tokens + carried
        if self.placement.carried(msg.task_id, msg.carry):
            self.groups.carry(msg.task_id, total)
            self.counters["tasks_carried"] += 1
            self.counters["carried_tokens"] += total
        else:  # its group ended meanwhile
            self.buffer.ledger.book_attempt(total, fate="cancelled", key=key)
