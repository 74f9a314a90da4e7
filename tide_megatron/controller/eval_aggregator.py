"""Evaluation during training: per-model-version metrics of eval trajectories.

Paper: the eval tasks of step i's model run concurrently with step i+1's training rollout,
at the top CTB priority (I_eval), and their metrics are aggregated just before step i+1's
weight sync. The controller:
  1. `expect(version, assignments)` when it submits eval tasks for the model `version`;
  2. `record(trajectory)` for every finished eval trajectory (its `policy_version` says which
     model generated it);
  3. before syncing new weights, `ready(version)` (all expected trajectories are in) and
     `pop(version)` -> metrics to log, or `pop(version, partial=True)` to report what is in.
Metrics per version: mean reward, pass rate (reward >= `pass_threshold`), best-of-N (mean over
eval groups of the best reward among the group's N samples) and pass@N (a group passes when any
sample passes), and the evaluation's duration: seconds from `expect` to the trajectory that
completed it (ERS's evaluation loan sizes itself by the last one). The aggregator is clock-free:
callers pass `now`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from tide_megatron.comm.messages import TaskAssignment
from tide_megatron.core.trajectory import Trajectory


@dataclass
class EvalMetrics:
    version: int
    trajectories: int
    groups: int
    mean_reward: float
    pass_rate: float
    best_of_n_reward: float
    pass_at_n: float
    expected: int
    complete: bool
    duration_s: float = float("nan")
    """Seconds from submission to the last expected trajectory (nan: not complete)."""

    def to_log(self, prefix: str = "eval/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items() if v == v}  # nan: not measured


@dataclass
class EvalAggregator:
    pass_threshold: float = 1.0
    """A trajectory passes when its reward is at least this."""
    _expected: dict[int, set] = field(default_factory=lambda: defaultdict(set))
    _rewards: dict[int, dict[str, dict[str, float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(dict)))
    _owner: dict[str, int] = field(default_factory=dict)
    _started: dict[int, float] = field(default_factory=dict)
    _completed: dict[int, float] = field(default_factory=dict)

    def expect(self, version: int, assignments: Iterable[TaskAssignment], now: float = 0.0) -> None:
        """Eval trajectories submitted to evaluate the model `version`."""
        self._started.setdefault(version, now)
        for a in assignments:
            if not a.is_eval:
                raise ValueError(f"{a.trajectory_id} is not an eval task")
            self._expected[version].add(a.trajectory_id)
            self._owner[a.trajectory_id] = version

    def record(self, trajectory: Trajectory, now: float = 0.0) -> None:
        if not trajectory.is_eval:
            return
        tid = f"{trajectory.group_id}/{trajectory.index}"
        # Booked under the version it was submitted for; a trajectory that a weight sync caught
        # mid-way still counts there (its policy_version is the oldest weights it used).
        version = self._owner.get(tid, trajectory.policy_version)
        self._rewards[version][trajectory.group_id][tid] = trajectory.reward
        self._note_complete(version, now)

    def _note_complete(self, version: int, now: float) -> None:
        if version not in self._completed and self.ready(version):
            self._completed[version] = now

    def abandon(self, version: int, trajectory_ids: Iterable[str], now: float = 0.0) -> None:
        """Trajectories of `version`'s evaluation that will never report (their group failed):
        the evaluation completes without them, and its metrics count fewer trajectories."""
        for tid in trajectory_ids:
            self._expected.get(version, set()).discard(tid)
            self._owner.pop(tid, None)
            for group in self._rewards.get(version, {}).values():
                group.pop(tid, None)
        self._note_complete(version, now)

    def outstanding(self, version: int) -> int:
        got = sum(len(g) for g in self._rewards.get(version, {}).values())
        return max(len(self._expected.get(version, ())) - got, 0)

    def ready(self, version: int) -> bool:
        return version in self._expected and self.outstanding(version) == 0

    def versions(self) -> list[int]:
        return sorted(set(self._expected) | set(self._rewards))

    def pop(self, version: int, partial: bool = False) -> EvalMetrics | None:
        """Metrics of `version` (and forget it); None if not complete and not `partial`."""
        if not partial and not self.ready(version):
            return None
        groups = self._rewards.pop(version, {})
        expected = self._expected.pop(version, set())
        for tid in expected:
            self._owner.pop(tid, None)
        started, completed = self._started.pop(version, None), self._completed.pop(version, None)
        duration = completed - started if started is not None and completed is not None else float("nan")
        rewards = [r for g in groups.values() for r in g.values()]
        if not rewards:
            return EvalMetrics(version, 0, 0, 0.0, 0.0, 0.0, 0.0, len(expected), False, duration)
        best = [max(g.values()) for g in groups.values() if g]
        return EvalMetrics(
            version=version, trajectories=len(rewards), groups=len(best),
            mean_reward=sum(rewards) / len(rewards),
            pass_rate=sum(r >= self.pass_threshold for r in rewards) / len(rewards),
            best_of_n_reward=sum(best) / len(best),
            pass_at_n=sum(b >= self.pass_threshold for b in best) / len(best),
            expected=len(expected), complete=len(rewards) >= len(expected), duration_s=duration,
        )
