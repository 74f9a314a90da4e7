"""CTB placement in the simulator: a thin adapter over the core `CTBScheduler`.

Glue only, no decision of its own: the simulator reports what happens (turn started/finished
with the real context, task finished, ranks added/removed, weight sync) and carries out the
decisions of the very policy object real runs use (`CTBScheduler.schedule`: Admit, Pause,
Resume), with the same `CTBConfig` options (hysteresis, pause bounds, own-rank resumption).
Differences from the real system are the simulator's physics, not policy: engines pin waiting
prefixes and drop a paused task's KV at once (no release to confirm: `confirm_release=False`),
and they model no request rows (`max_resident_per_rank` as configured, None by default).

Every submitted task goes to the scheduler at once (its backlog is bounded by the simulator's
feed); once a group is over, it is dropped with `CTBScheduler.forget` so the scheduler's tables
stay bounded over a long run.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from tide_megatron.core.ctb import (
    Admit,
    CTBConfig,
    CTBScheduler,
    GroupCancelled,
    Pause,
    Resume,
    RolloutTask,
    TaskState,
)
from tide_megatron.core.ctb_deadline import TrainerClock
from tide_megatron.sim.rollout_cluster import PlacementPolicy
from tide_megatron.sim.workload import SimTrajectory


class CTBPolicy(PlacementPolicy):
    """Task-level admission, priority pausing and affinity resumption via the core CTB."""

    pinned = True
    decision_tick_s = 0.1
    """The controller runs `schedule` on a 100 ms loop rather than after every token-level
    event; admissions wait 50 ms on average for it."""

    def __init__(self, config: CTBConfig, budget_tokens: int, unconsumed_fn,
                 clock_fn: Optional[Callable[[float], TrainerClock]] = None,
                 on_group_cancelled: Optional[Callable[[int], None]] = None):
        """`clock_fn(now)`: the simulated trainer's clock, which turns on deadline-aware admission
        and the cancellation of doomed groups (`CTBConfig.deadline_admission`, `cancel_doomed`);
        `on_group_cancelled(group_id)`: the simulator stops that group's trajectories and books
        them as wasted (required with `clock_fn`). Without a clock: no deadlines."""
        if clock_fn is not None and on_group_cancelled is None:
            raise ValueError("a clock_fn needs on_group_cancelled: CTB may cancel doomed groups")
        self.sched = CTBScheduler(config)
        self.budget = budget_tokens
        self.unconsumed_fn = unconsumed_fn
        self.clock_fn = clock_fn
        self.on_group_cancelled = on_group_cancelled
        self.trajs: Dict[int, SimTrajectory] = {}
        self.group_members: Dict[int, List[int]] = {}

    # ------------------------------------------------------------------------ task stream
    def submit(self, trajs: List[SimTrajectory]) -> None:
        self.sched.submit(RolloutTask(t.traj_id, t.group_id, t.task_type, t.prompt_tokens, t.is_eval) for t in trajs)
        for t in trajs:
            self.trajs[t.traj_id] = t
            self.group_members.setdefault(t.group_id, []).append(t.traj_id)

    def backlog(self) -> int:
        return self.sched.queued_tasks()

    # ---------------------------------------------------------------------------- decisions
    def dispatch(self, now: float) -> None:
        c = self.cluster
        clock = self.clock_fn(now) if self.clock_fn is not None else None
        for d in self.sched.schedule(now, unconsumed_trajectories=self.unconsumed_fn(), clock=clock):
            if isinstance(d, GroupCancelled):  # the simulator stops every member (its Cancels follow)
                self.on_group_cancelled(d.group_id)
                continue
            traj = self.trajs.get(d.task.task_id)
            if isinstance(d, Admit):
                c.admit(traj, d.rank, now)
            elif isinstance(d, Resume):
                c.resume(traj, d.rank, now)
            elif isinstance(d, Pause):
                c.pause(traj, now)

    # ------------------------------------------------------------------------------- events
    def on_rank_added(self, rank_id: int) -> None:
        self.sched.add_rank(rank_id, self.budget)

    def on_rank_removed(self, rank_id: int, residents: List[SimTrajectory]) -> None:
        self.sched.remove_rank(rank_id)  # residents become PAUSED and resume elsewhere

    def on_weight_sync(self) -> None:
        self.sched.on_weight_sync()

    def on_turn_started(self, traj: SimTrajectory) -> None:
        if self.sched.status(traj.traj_id).state is TaskState.RUNNING:
            self.sched.on_turn_started(traj.traj_id, traj.context + traj.gen[traj.turn])

    def on_turn_finished(self, traj: SimTrajectory) -> None:
        if self.sched.status(traj.traj_id).state is TaskState.RUNNING:
            self.sched.on_turn_finished(traj.traj_id, traj.context + traj.gen[traj.turn])

    def on_finished(self, traj: SimTrajectory) -> None:
        """A trajectory ended, or (simulators that cancel stale groups) was cancelled."""
        gid = traj.group_id
        members = self.group_members.get(gid)
        if members is None:
            return  # its group was cancelled and forgotten already
        if getattr(traj, "cancelled", False):  # the cluster stops each member itself
            self.sched.cancel_group(gid)  # no-op when CTB cancelled the group
        else:
            self.sched.on_task_finished(traj.traj_id, traj.context)
        if all(self.sched.status(t).state in (TaskState.FINISHED, TaskState.CANCELLED) for t in members):
            self.sched.forget(gid)
            for tid in self.group_members.pop(gid):
                self.trajs.pop(tid, None)
