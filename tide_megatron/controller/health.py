"""Is rollout alive and making progress, and does the ledger agree with the ranks?

Fed by the rollout service (one thread): every rollout rank's heartbeats, and every message
that books tokens from a rank. It answers these questions, each with a time bound:

- Liveness: a rank whose heartbeat is older than `heartbeat_timeout_s` is silent (dead, hung,
  or cut off): `silent()` names it and what its tasks last waited for. The service then
  quarantines it (`quarantine`); a quarantined rank whose heartbeats come back is `back`.
- Progress: while work is outstanding, some token must be generated, some environment step
  answered, or some task end within `stall_timeout_s`; otherwise the run is stuck, and the
  message names, per rank, the longest-waiting tasks and what they wait for.

The ledger's independent side: each heartbeat carries the rank's own count of generated
tokens and of tokens of tasks still running there. Messages from one rank arrive in order, so
at a heartbeat every trajectory, failure and cancellation the rank sent before it has been
booked; what the rank generated, minus what still runs, minus what was booked from it, is
lost (a vanished task or message). `lost_tokens()` reports the running total.

Quarantine and the ledger: the tasks of a quarantined rank are booked at once as failed (they
run again elsewhere), with the tokens its last heartbeat showed them holding, less what it
reported since (`quarantine` returns that figure, a lower bound of what they hold). That much
is written off: it counts as booked, and also as still running there until the rank reports
those tasks itself. If it wakes and reports them (`late`), the reports draw the write-off down
first and only the excess (tokens generated after that heartbeat) is booked anew, so no token
is booked twice, and a rank that never comes back leaves its last heartbeat balanced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

from tide_megatron.comm.messages import Heartbeat

logger = logging.getLogger(__name__)


@dataclass
class _Rank:
    last_seen: float
    generated: int = 0
    running_tokens: int = 0
    env_steps: int = 0
    running_tasks: int = 0
    booked: int = 0
    """Tokens booked from this rank's messages (trajectories, failures, cancellations), and
    the write-off of its tasks at a quarantine."""
    booked_at_beat: int = 0
    written_off: int = 0
    """Of `booked`: written off at its quarantine for tasks it has not reported yet."""
    written_off_at_beat: int = 0
    quarantined_since: Optional[float] = None
    waiting: list[str] = field(default_factory=list)
    idle_s: float = 0.0


class RolloutHealth:
    def __init__(self, ranks: Iterable[int], now: float, *, heartbeat_timeout_s: float, stall_timeout_s: float):
        if heartbeat_timeout_s <= 0 or stall_timeout_s <= 0:
            raise ValueError("heartbeat and stall timeouts must be positive")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._ranks = {r: _Rank(last_seen=now) for r in ranks}
        self._last_progress = now

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def add_rank(self, rank: int, now: float, away: bool = False) -> None:
        """A rank is ready (again, after replacing its engine or a spell in the trainer: its
        counts carry on). `away`: it joins rollout but is not in service yet (as if quarantined:
        not checked for silence until `rejoined`)."""
        if rank in self._ranks:
            self._ranks[rank].last_seen = now
        else:
            self._ranks[rank] = _Rank(last_seen=now, quarantined_since=now if away else None)

    def remove_rank(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def seen(self, rank: int, now: float) -> None:
        if rank in self._ranks:
            self._ranks[rank].last_seen = now

    def progressed(self, now: float) -> None:
        """A task ended, or an env step or a token was seen."""
        self._last_progress = now

    def booked(self, rank: int, tokens: int, now: float) -> None:
        """Tokens booked from a message of `rank` (which is progress, too)."""
        if rank in self._ranks:
            self._ranks[rank].booked += tokens
            self._ranks[rank].last_seen = now
        self._last_progress = now

    def on_heartbeat(self, rank: int, beat: Heartbeat, now: float) -> None:
        r = self._ranks.get(rank)
        if r is None:
            return
        if r.quarantined_since is None and (beat.generated_tokens > r.generated or beat.env_steps > r.env_steps):
            self._last_progress = now
        r.last_seen = now
        r.generated, r.running_tokens, r.env_steps = beat.generated_tokens, beat.running_tokens, beat.env_steps
        r.running_tasks, r.waiting, r.idle_s = beat.running_tasks, list(beat.waiting), beat.idle_s
        r.booked_at_beat, r.written_off_at_beat = r.booked, r.written_off

    # -- quarantine -------------------------------------------------------------------------
    def silent(self, now: float) -> list[tuple[int, str]]:
        """Ranks in service that sent nothing for longer than the heartbeat timeout, each with
        a line saying so and what its tasks last waited for."""
        out = []
        for rank, r in sorted(self._ranks.items()):
            quiet = now - r.last_seen
            if r.quarantined_since is None and quiet > self.heartbeat_timeout_s:
                out.append((rank, f"rollout rank {rank} sent nothing for {quiet:.0f} s (heartbeat timeout "
                                  f"{self.heartbeat_timeout_s:.0f} s, scheduler.heartbeat_timeout_s); "
                                  f"its tasks last waited: {'; '.join(r.waiting) or 'none running'}"))
        return out

    def quarantine(self, rank: int, now: float, write_off: bool = True) -> int:
        """Take the rank out; returns the tokens its tasks are booked with (see the module
        docstring): what its last heartbeat showed running, less what it reported since.
        Without `write_off` (a live rank that will report each task itself) none are."""
        r = self._ranks[rank]
        tokens = max(r.running_tokens - (r.booked - r.booked_at_beat), 0) if write_off else 0
        r.booked += tokens
        r.written_off += tokens
        r.quarantined_since = now
        return tokens

    def late(self, rank: int, tokens: int, now: float) -> int:
        """A report from a quarantined rank of a task it no longer owns, holding `tokens`;
        returns the part not written off at its quarantine (to book now)."""
        r = self._ranks[rank]
        covered = min(tokens, r.written_off)
        r.written_off -= covered
        r.booked += tokens - covered
        r.last_seen = now
        return tokens - covered

    def is_quarantined(self, rank: int) -> bool:
        r = self._ranks.get(rank)
        return r is not None and r.quarantined_since is not None

    def back(self, rank: int, now: float) -> bool:
        """A quarantined rank that has been heard from since, within the heartbeat timeout."""
        r = self._ranks.get(rank)
        return (r is not None and r.quarantined_since is not None and r.last_seen > r.quarantined_since
                and now - r.last_seen <= self.heartbeat_timeout_s)

    def rejoined(self, rank: int) -> None:
        """The rank is in service again. It has reported every task it held (it answered
        `CancelAll`), and those reports hold at least the write-off (a task's tokens only
        grow), so none is left; if some were, it would show as a warning at the next
        heartbeat (more booked than the rank generated) rather than hide later losses."""
        r = self._ranks[rank]
        r.written_off = 0
        r.quarantined_since = None

    def last_seen(self, rank: int) -> float:
        return self._ranks[rank].last_seen

    # -- the ledger and progress ------------------------------------------------------------
    def lost_tokens(self) -> int:
        """Tokens the ranks generated that were never booked, as of their last heartbeats."""
        total = 0
        for rank, r in self._ranks.items():
            gap = r.generated - r.running_tokens - (r.booked_at_beat - r.written_off_at_beat)
            if gap < 0:
                logger.warning("rank %d reports %d fewer tokens than were booked from it", rank, -gap)
            total += max(gap, 0)
        return total

    def check(self, now: float, outstanding: bool) -> Optional[str]:
        """A description of a stalled run, or None while it progresses (silent ranks: `silent`)."""
        stalled = now - self._last_progress
        if outstanding and stalled > self.stall_timeout_s:
            detail = "; ".join(f"rank {rank}: {', '.join(r.waiting) or 'no task'}"
                               for rank, r in sorted(self._ranks.items()) if r.quarantined_since is None)
            return (f"no token generated, env step answered or task finished for {stalled:.0f} s "
                    f"(scheduler.stall_timeout_s={self.stall_timeout_s:.0f}); waiting: {detail}")
        return None

    def running_tokens(self) -> int:
        """Tokens of tasks still running on the ranks in service, as of their last heartbeats
        (a quarantined rank's were booked as failed)."""
        return sum(r.running_tokens for r in self._ranks.values() if r.quarantined_since is None)

    def rank_idle_s(self) -> dict[int, float]:
        return {rank: r.idle_s for rank, r in self._ranks.items()}
