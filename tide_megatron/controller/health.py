"""Is rollout alive and making progress, and does the ledger agree with the ranks?

Fed by the rollout service (one thread): every rollout rank's heartbeats, and every message
that books tokens from a rank. It answers two questions, both with a time bound:

- Liveness: a rank whose heartbeat is older than `heartbeat_timeout_s` is silent (dead, hung,
  or cut off); the message names it and what its tasks last waited for.
- Progress: while work is outstanding, some token must be generated, some environment step
  answered, or some task end within `stall_timeout_s`; otherwise the run is stuck, and the
  message names, per rank, the longest-waiting tasks and what they wait for.

The ledger's independent side: each heartbeat carries the rank's own count of generated
tokens and of tokens of tasks still running there. Messages from one rank arrive in order, so
at a heartbeat every trajectory, failure and cancellation the rank sent before it has been
booked; what the rank generated, minus what still runs, minus what was booked from it, is
lost (a vanished task or message). `lost_tokens()` reports the running total.
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
    """Tokens booked from this rank's messages (trajectories, failures, cancellations)."""
    booked_at_beat: int = 0
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

    def add_rank(self, rank: int, now: float) -> None:
        """A rank is ready (again, after replacing its engine: its counts carry on)."""
        if rank in self._ranks:
            self._ranks[rank].last_seen = now
        else:
            self._ranks[rank] = _Rank(last_seen=now)

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
        if beat.generated_tokens > r.generated or beat.env_steps > r.env_steps:
            self._last_progress = now
        r.last_seen = now
        r.generated, r.running_tokens, r.env_steps = beat.generated_tokens, beat.running_tokens, beat.env_steps
        r.running_tasks, r.waiting, r.idle_s = beat.running_tasks, list(beat.waiting), beat.idle_s
        r.booked_at_beat = r.booked

    def lost_tokens(self) -> int:
        """Tokens the ranks generated that were never booked, as of their last heartbeats."""
        total = 0
        for rank, r in self._ranks.items():
            gap = r.generated - r.running_tokens - r.booked_at_beat
            if gap < 0:
                logger.warning("rank %d reports %d fewer tokens than were booked from it", rank, -gap)
            total += max(gap, 0)
        return total

    def check(self, now: float, outstanding: bool) -> Optional[str]:
        """A description of a silent rank or a stalled run, or None when healthy."""
        for rank, r in sorted(self._ranks.items()):
            silent = now - r.last_seen
            if silent > self.heartbeat_timeout_s:
                return (f"rollout rank {rank} sent nothing for {silent:.0f} s (heartbeat timeout "
                        f"{self.heartbeat_timeout_s:.0f} s, scheduler.heartbeat_timeout_s); "
                        f"its tasks last waited: {'; '.join(r.waiting) or 'none running'}")
        stalled = now - self._last_progress
        if outstanding and stalled > self.stall_timeout_s:
            detail = "; ".join(f"rank {rank}: {', '.join(r.waiting) or 'no task'}"
                               for rank, r in sorted(self._ranks.items()))
            return (f"no token generated, env step answered or task finished for {stalled:.0f} s "
                    f"(scheduler.stall_timeout_s={self.stall_timeout_s:.0f}); waiting: {detail}")
        return None

    def running_tokens(self) -> int:
        """Tokens of tasks still running on the ranks, as of their last heartbeats."""
        return sum(r.running_tokens for r in self._ranks.values())

    def rank_idle_s(self) -> dict[int, float]:
        return {rank: r.idle_s for rank, r in self._ranks.items()}
