"""Request-level placement: the one rule the baselines use to put a task on a rollout rank.

Request-level systems (and `tide` with `ctb.enabled=false`) leave batching to the engine and
only choose a rank per task: a GRPO group's members go to the rank its first member went to
while it has room (they share the prompt's prefix there), otherwise to the rank with the fewest
running tasks, the lowest rank id on a tie. A rank takes at most `max_tasks_per_rank` tasks at
once when that is set (the real stack's `scheduler.max_tasks_per_rank`; the simulator and the
one-process CTB rollout bound only the total, by their env slots).

The real controller (`controller/placement.py`), the one-process CTB rollout's request-level
path (`rollout/ctb_dispatcher.py`) and the simulator (`sim/rollout_cluster.py`) all place
through this class. It books loads itself: every `place` is matched by one `release` when the
task ends, is cancelled, or leaves the rank.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Optional


class LeastLoadedPlacer:
    """Loads per rank and each group's home rank; decides where the next task runs."""

    def __init__(self, ranks: Iterable[int] = (), max_tasks_per_rank: Optional[int] = None):
        if max_tasks_per_rank is not None and max_tasks_per_rank < 1:
            raise ValueError(f"max_tasks_per_rank must be >= 1 (or None: no per-rank cap), "
                             f"got {max_tasks_per_rank}")
        self.max_tasks_per_rank = max_tasks_per_rank
        self._load: dict[int, int] = {r: 0 for r in ranks}
        self._home: dict[Hashable, int] = {}  # group -> the rank its first member went to
        self._closed: set[int] = set()  # ranks that keep their tasks but take no new ones

    @property
    def ranks(self) -> list[int]:
        return sorted(self._load)

    def load(self, rank: int) -> int:
        return self._load[rank]

    def loads(self) -> dict[int, int]:
        return dict(self._load)

    def add_rank(self, rank: int) -> None:
        self._load.setdefault(rank, 0)

    def remove_rank(self, rank: int) -> None:
        """The rank left rollout: its tasks are gone with it, and no group calls it home."""
        self._load.pop(rank, None)
        self._closed.discard(rank)
        self._home = {g: r for g, r in self._home.items() if r != rank}

    def set_accepting(self, rank: int, accepting: bool) -> None:
        """A quarantined rank keeps its running tasks (and their load) but takes no new ones."""
        (self._closed.discard if accepting else self._closed.add)(rank)

    def _has_room(self, rank: Optional[int]) -> bool:
        if rank not in self._load or rank in self._closed:
            return False
        return self.max_tasks_per_rank is None or self._load[rank] < self.max_tasks_per_rank

    def choose(self, group_id: Hashable) -> Optional[int]:
        """Where the group's next task would run, or None when no rank has room (books nothing)."""
        home = self._home.get(group_id)
        if self._has_room(home):
            return home
        open_ranks = [r for r in self._load if r not in self._closed]
        if not open_ranks:
            return None
        rank = min(open_ranks, key=lambda r: (self._load[r], r))
        return rank if self._has_room(rank) else None

    def place(self, group_id: Hashable) -> Optional[int]:
        """Book one task of the group on the rank `choose` names (the first one sets its home)."""
        rank = self.choose(group_id)
        if rank is not None:
            self._home.setdefault(group_id, rank)
            self._load[rank] += 1
        return rank

    def is_placed(self, group_id: Hashable) -> bool:
        """Some member of the group has been placed (since it was last forgotten)."""
        return group_id in self._home

    def release(self, rank: int) -> None:
        """One task on the rank ended (finished, failed, cancelled); a rank gone already is fine."""
        if rank in self._load:
            if self._load[rank] < 1:
                raise ValueError(f"release on rank {rank} with no task placed there")
            self._load[rank] -= 1

    def forget_group(self, group_id: Hashable) -> None:
        """The group ended: forget its home."""
        self._home.pop(group_id, None)
