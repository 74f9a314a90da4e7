"""Which rollout ranks are out of service, why, and where each stands on its way back; and
which weight sends still wait for their receiver.

A rollout rank is quarantined when it sends nothing for `scheduler.heartbeat_timeout_s`
(`health.py` says so) or does not confirm the weights it was sent within
`scheduler.weight_sync_timeout_s`. Quarantine, in the order the rollout service does it:

1. out: the placement drops the rank (no new dispatch; its resident and paused tasks come back
   as failed and are retried elsewhere, re-prefilling there, or their groups given up, as for
   the tasks of a dead engine); its tasks' tokens are booked as failed (`health.quarantine`);
   it is left out of every weight sync; one `CancelAll` is posted to it at once. A mailbox is
   a FIFO, so that is the first thing the rank reads after what was queued for it already.
2. drained: the rank answers `AllCancelled` (after a `TaskCancelled` for each task it still
   had). Its reports of tasks it no longer owns are late: never booked into the buffer, their
   tokens drawn from the write-off (`health.late`).
3. rejoining: once drained and heard from within the heartbeat timeout, it is one of the
   receivers of the next weight sync.
4. in service again: its `WeightsLoaded` for that version arrives; the placement adds it back
   and dispatches to it from then on.

The run stops (with the silent rank's message) only when fewer than
`scheduler.min_rollout_ranks` ranks are left in service.

ERS moves ranks between rollout and the trainer along the same path, planned instead of
forced (`kind`): a rank leaving for the trainer is taken out as in step 1, except that with
CTB it hands its tasks over (they go on elsewhere, see `rollout/task_carry.py`; nothing is
written off, as the rank answers for each) and without CTB they start afresh elsewhere (their
tokens wasted, not failed); once drained it stays out while it trains ("trainer"). A trainer
rank that joins rollout (again, or for the first time) is "returning": it receives the weights
at the very sync of its move, without first being heard from (its engine may still be
starting; the send waits for its receive), and enters service as in step 4.

Owned by the rollout service thread, which calls everything here (nothing is locked or
threaded); `groups.py` keeps the retries, `handover.py` the stop rule, this class the rest.
A weight send (`weight_sync.Send`) is kept until its receiver confirms it: its buffer must
outlive the transfer (a dropped gloo send never arrives, and its receiver would wait for it),
and a quarantined receiver that wakes up reads its `LoadWeights` in order and completes each.
The cost: a rank that hangs holds on rank 0 the buffers of the syncs sent to it before its
quarantine (those within one heartbeat timeout) until it wakes or the job ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from tide_megatron.comm.messages import (AllCancelled, CancelAll, TaskCancelled, TaskCarried, TaskFailed, TaskReleased,
                                         TrajectoryDone, TurnEvent, WeightsLoaded)
from tide_megatron.controller import ledger_keys

logger = logging.getLogger(__name__)

_LATE = (TrajectoryDone, TaskFailed, TaskCancelled, TaskCarried, TaskReleased, TurnEvent)


@dataclass
class OutOfService:
    """A quarantined rank."""

    rank: int
    reason: str
    since: float
    """`time.monotonic()` when it was taken out."""
    epoch: int
    """Matches its `AllCancelled` to the `CancelAll` of this quarantine."""
    tasks_moved: int = 0
    drained: bool = False
    """It answered `CancelAll`: it holds no task any more."""
    rejoin_version: Optional[int] = None
    """The weights sent for its rejoin, until it confirms them (or fails to in time)."""
    kind: str = "quarantine"
    """Why it is out: "quarantine" (silent or unconfirming), "trainer" (ERS moved it to the
    trainer; it does not rejoin until moved back) or "returning" (ERS moved it to rollout)."""


@dataclass
class _BroadcastSend:
    """A member's part of a broadcast sync (`weight_sync.Send`'s fields that are read here)."""

    rank: int
    version: int


class Quarantine:
    def __init__(self, ranks: Iterable[int] = (), *, placement=None, health=None, ledger=None, mailbox=None,
                 weight_sender=None, weight_sync_timeout_s: float = 300.0):
        self.ranks = list(ranks)
        self.placement, self.health, self.ledger, self.mailbox = placement, health, ledger, mailbox
        self.weight_sender = weight_sender  # weight_sync.WeightSender
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.out: dict[int, OutOfService] = {}
        self.counts = {"quarantines": 0, "rejoins": 0, "moves_out": 0, "moves_in": 0}
        self.notify: Callable[[str, str], None] = lambda kind, text: None
        """`notify(kind, text)`: a fault for the metric sinks (`MetricsLogger.event`; the rejoins)."""
        self._epochs = 0
        self._sends: dict[tuple[int, int], Any] = {}  # (rank, version) -> its unconfirmed Send
        self._deadlines: dict[tuple[int, int], float] = {}  # sends still bounded (rank not out)
        self._awaiting: dict[int, set[int]] = {}  # version -> receivers a sync mode step waits for
        self.confirmed: dict[int, int] = {}  # rank -> the latest version it confirmed

    # -- the steps (side effects on the placement, health, ledger and mailbox) ----------------
    def take_out(self, rank: int, reason: str, now: float, kind: str = "quarantine",
                 hand_over: bool = False) -> tuple[list[str], int]:
        """Step 1: returns the ids of the tasks taken back (each failed there: the caller
        retries it or gives its group up; moved to the trainer, `kind="trainer"`: each is
        re-dispatched) and the tokens booked for them as failed (cancelled for a move).

        `hand_over` (a move with CTB): the rank hands each task over instead
        (`placement.hand_off_rank`, `CancelAll(carry=True)`); nothing is written off, as the
        rank, alive, answers for every task itself."""
        task_ids = self.placement.hand_off_rank(rank) if hand_over else self.placement.drop_rank(rank)
        written_off = self.health.quarantine(rank, now, write_off=not hand_over)
        epoch = self.put_out(rank, reason, now, len(task_ids), kind)
        self.ledger.book_attempt(written_off, fate="failed" if kind == "quarantine" else "cancelled",
                                 key=ledger_keys.write_off(rank, epoch, kind))
        self.mailbox.post(rank, CancelAll(epoch, reason, carry=hand_over))
        return task_ids, written_off

    def return_to_rollout(self, rank: int, now: float) -> None:
        """ERS moved trainer rank `rank` to rollout: it receives the next weights (module docstring)."""
        q = self.out.get(rank)
        if q is not None and q.kind != "trainer":
            raise ValueError(f"rank {rank} is out of rollout service as {q.kind!r}, not in the trainer")
        if q is None:
            if rank in self.ranks:
                raise ValueError(f"rank {rank} is a rollout rank in service already")
            self._epochs += 1
            q = self.out[rank] = OutOfService(rank, "joins rollout", now, self._epochs, drained=True)
            self.health.add_rank(rank, now, away=True)
        if rank not in self.ranks:
            self.ranks = sorted(self.ranks + [rank])
        q.kind, q.since = "returning", now

    def in_trainer(self, rank: int) -> bool:
        """Moved to the trainer, and drained: it holds no rollout task any more."""
        q = self.out.get(rank)
        return q is not None and q.kind == "trainer" and q.drained

    def returning(self, rank: int) -> bool:
        """Moved to rollout by ERS, and not yet in service (its weights not loaded)."""
        q = self.out.get(rank)
        return q is not None and q.kind == "returning"

    @property
    def serving(self) -> list[int]:
        """The rollout ranks in service now."""
        return self.in_service(self.ranks)

    @property
    def rollout_side(self) -> list[int]:
        """Ranks that are rollout ranks now: in service, quarantined or returning (not moved to
        the trainer)."""
        return [r for r in self.ranks if r not in self.out or self.out[r].kind != "trainer"]

    def handles(self, msg, now: float, key: Optional[str] = None) -> bool:
        """Steps 2 and 4, and weight confirmations: True when `msg` was taken care of here.
        `key`: a task end's name in the ledger (`ledger_keys.task_end`; drawn here when not given)."""
        if isinstance(msg, WeightsLoaded):
            kind = self.out[msg.src].kind if msg.src in self.out else None
            if self.loaded(msg.src, msg.version):
                self.placement.add_rank(msg.src)
                self.health.rejoined(msg.src)
                self.health.seen(msg.src, now)
                if kind == "returning":
                    logger.info("rank %d joined rollout with the weights of version %d", msg.src, msg.version)
                else:
                    logger.warning("rollout rank %d rejoined with the weights of version %d; tasks are dispatched "
                                   "to it again", msg.src, msg.version)
                    self.notify("rejoin", f"rollout rank {msg.src} rejoined with the weights of version {msg.version}")
            return True
        if isinstance(msg, AllCancelled):
            if self.drained(msg.src, msg.epoch) and self.out[msg.src].kind == "quarantine":
                logger.info("quarantined rollout rank %d holds no task any more; it rejoins at the next weight "
                            "sync", msg.src)
            return True
        if not isinstance(msg, _LATE) or msg.src not in self.out:  # (trainer ranks post plain dicts)
            return False
        # A task it no longer owns: never into the buffer; its tokens beyond the write-off are
        # wasted (those of ranks that handed it over are the caller's to book).
        tokens = msg.trajectory.generated_tokens - msg.carried_tokens if isinstance(msg, TrajectoryDone) else \
            getattr(msg, "generated_tokens", 0)
        if tokens:
            self.ledger.book_attempt(self.health.late(msg.src, tokens, now), fate="cancelled",
                                     key=key or ledger_keys.task_end(msg))
        return True

    def send_weights(self, weights, now: float, receivers: Optional[list[int]] = None) -> list[int]:
        """Step 3 (and every sync): send to the ranks in service and those ready to rejoin (or
        to `receivers`, a part of them: the rest take the broadcast path, `broadcast_sent`)."""
        if receivers is None:
            receivers = self.weight_receivers(now)
        self.sent(self.weight_sender.send(weights, receivers), now + self.weight_sync_timeout_s)
        return receivers

    def weight_receivers(self, now: float) -> list[int]:
        """Who gets the next weights (`receivers`, with rank 0's view of who was heard from)."""
        return self.receivers(self.ranks, lambda r: self.health.back(r, now))

    def steady(self, receivers: Iterable[int]) -> list[int]:
        """Of `receivers`, the ranks in service with no send awaiting confirmation: their
        engines run, and hold every version sent to them (the broadcast path's members)."""
        pending = {rank for rank, _ in self._deadlines}
        return [r for r in receivers if r not in self.out and r not in pending]

    def broadcast_sent(self, loads: dict[int, Any], version: int, now: float) -> None:
        """The broadcast path's sync of `version`: post each member its `LoadWeights` and wait
        for its confirmation as for any send (nothing to keep: no buffer is shared)."""
        for rank, msg in loads.items():
            self.mailbox.post(rank, msg)
        self.sent([_BroadcastSend(rank, version) for rank in loads], now + self.weight_sync_timeout_s)

    def lost_weights(self, rank: int, engine_version: int) -> bool:
        """A rank in service reports an engine holding an older version than it confirmed
        (its engine restarted, with no host copy to reload: the broadcast path)."""
        return rank not in self.out and engine_version < self.confirmed.get(rank, engine_version)

    def overdue(self, now: float) -> list[tuple[int, str]]:
        """Ranks in service whose weights were not confirmed in time, with the reason to take
        them out; a rejoining rank in that case just stays out (it may try at a later sync)."""
        out = []
        for rank, version in self.overdue_sends(now):
            why = (f"rollout rank {rank} did not confirm the weights of version {version} within "
                   f"{self.weight_sync_timeout_s:.0f} s (scheduler.weight_sync_timeout_s)")
            if rank in self.out:
                logger.warning("%s: it stays quarantined", why)
            else:
                out.append((rank, why))
        return out

    # -- out and back (bookkeeping) ---------------------------------------------------------
    def is_out(self, rank: int) -> bool:
        return rank in self.out

    def in_service(self, ranks: Iterable[int]) -> list[int]:
        return [r for r in ranks if r not in self.out]

    def put_out(self, rank: int, reason: str, now: float, tasks_moved: int = 0, kind: str = "quarantine") -> int:
        """Take `rank` out of service; returns the epoch for its `CancelAll`."""
        if rank in self.out:
            raise ValueError(f"rollout rank {rank} is out of service already ({self.out[rank].kind})")
        self._epochs += 1
        self.out[rank] = OutOfService(rank, reason, now, self._epochs, tasks_moved, kind=kind)
        self.counts["quarantines" if kind == "quarantine" else "moves_out"] += 1
        self._forget_rank(rank)
        return self._epochs

    def drained(self, rank: int, epoch: int) -> bool:
        """The rank answered `CancelAll` of `epoch`; False for an answer to an older quarantine."""
        q = self.out.get(rank)
        if q is None or q.epoch != epoch:
            return False
        q.drained = True
        return True

    def receivers(self, ranks: Iterable[int], heard_from: Callable[[int], bool]) -> list[int]:
        """Who gets the next weights: the ranks in service, quarantined ones ready to rejoin
        (drained, heard from lately, no rejoin under way), and ranks returning from the trainer."""
        back = [r for r, q in sorted(self.out.items()) if q.drained and q.rejoin_version is None
                and (q.kind == "returning" or (q.kind == "quarantine" and heard_from(r)))]
        return sorted(set(self.in_service(ranks)) | set(back))

    # -- weight sends -----------------------------------------------------------------------
    def sent(self, sends: Iterable[Any], deadline: float) -> None:
        """Sends of one sync (`weight_sync.Send`s): each must be confirmed by `deadline`."""
        for s in sends:
            key = (s.rank, s.version)
            self._sends[key] = s
            self._deadlines[key] = deadline
            self._awaiting.setdefault(s.version, set()).add(s.rank)
            if s.rank in self.out:
                self.out[s.rank].rejoin_version = s.version

    def loaded(self, rank: int, version: int) -> bool:
        """The rank confirmed `version`: its send is done. True when this brings a quarantined
        rank back into service (the caller adds it to the placement)."""
        self.confirmed[rank] = max(version, self.confirmed.get(rank, version))
        # This version, and any older one still open: the rank reads its `LoadWeights` in order,
        # so it is done with those transfers too, and a newer version supersedes one it could
        # not load (a broadcast that failed): it must not be quarantined for that one later.
        for key in [k for k in set(self._sends) | set(self._deadlines) if k[0] == rank and k[1] <= version]:
            self._sends.pop(key, None)  # the transfer is over: gloo no longer reads the buffer
            self._deadlines.pop(key, None)
            self._settle(key[1], rank)
        self._settle(version, rank)
        q = self.out.get(rank)
        if q is None or q.rejoin_version != version:
            return False
        del self.out[rank]
        self.counts["moves_in" if q.kind == "returning" else "rejoins"] += 1
        return True

    def overdue_sends(self, now: float) -> list[tuple[int, int]]:
        """(rank, version) of sends not confirmed in time, each reported once. A quarantined
        rank that was rejoining stays out and may try again at a later sync."""
        late = sorted(k for k, deadline in self._deadlines.items() if now > deadline)
        for rank, version in late:
            del self._deadlines[(rank, version)]
            self._settle(version, rank)
            q = self.out.get(rank)
            if q is not None and q.rejoin_version == version:
                q.rejoin_version = None
        return late

    def settled(self, version: int) -> bool:
        """Every receiver of `version` confirmed it or was given up (a sync mode step waits for this)."""
        return not self._awaiting.get(version)

    def unconfirmed(self) -> list[tuple[int, int]]:
        return sorted(self._sends)

    def _forget_rank(self, rank: int) -> None:
        """A rank just taken out is waited for by no sync; its sends stay until it confirms them."""
        for key in [k for k in self._deadlines if k[0] == rank]:
            del self._deadlines[key]
        for version in list(self._awaiting):
            self._settle(version, rank)

    def _settle(self, version: int, rank: int) -> None:
        waiting = self._awaiting.get(version)
        if waiting is not None:
            waiting.discard(rank)
            if not waiting:
                del self._awaiting[version]
