"""CTB placement: the core `CTBScheduler` driving the simulated rollout ranks.

This is glue only. The simulator reports what happens (turn started/finished with the real
context, task finished, ranks added/removed, weight sync) and carries out the decisions of
`CTBScheduler.schedule` (Admit, Pause, Resume). Engines run with pinned prefixes: only CTB
pauses free KV, the engine never evicts a waiting task behind CTB's back.

Adapter notes:
- Once a group has finished, this adapter drops it with `CTBScheduler.forget(group_id)`, so
  the scheduler's tables (and its scans) stay bounded over a long run.
- `schedule` admits from every submitted group; to keep its scans short we hand it groups
  just ahead of need (`lookahead_groups` queued at a time) instead of the whole task stream.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List

from tide_megatron.core.ctb import Admit, CTBConfig, CTBScheduler, Pause, Resume, RolloutTask, TaskState
from tide_megatron.sim.rollout_cluster import PlacementPolicy
from tide_megatron.sim.workload import Trajectory


class CTBPolicy(PlacementPolicy):
    """Task-level admission, priority pausing and affinity resumption via the core CTB."""

    pinned = True
    decision_tick_s = 0.1
    """The core `schedule` scans every live task, so the controller runs it on a 100 ms loop
    rather than after every token-level event; admissions wait 50 ms on average for it."""

    def __init__(self, config: CTBConfig, budget_tokens: int, unconsumed_fn, lookahead_groups: int = 4):
        self.sched = CTBScheduler(config)
        self.budget = budget_tokens
        self.unconsumed_fn = unconsumed_fn
        self.lookahead = lookahead_groups
        self.trajs: Dict[int, Trajectory] = {}
        self.waiting: Deque[List[Trajectory]] = deque()  # groups not yet handed to CTB
        self.group_left: Dict[int, int] = {}
        self.group_members: Dict[int, List[int]] = {}
        self.queued = 0  # tasks handed to CTB and not yet admitted

    # ------------------------------------------------------------------------ task stream
    def submit(self, trajs: List[Trajectory]) -> None:
        by_group: Dict[int, List[Trajectory]] = {}
        for t in trajs:
            by_group.setdefault(t.group_id, []).append(t)
        for gid, members in by_group.items():
            if members[0].is_eval:
                self.waiting.appendleft(members)  # eval first: it gates the weight sync
            else:
                self.waiting.append(members)

    def backlog(self) -> int:
        return sum(len(g) for g in self.waiting) + self.queued

    def _feed(self) -> None:
        """Hand CTB the next groups when its own queue runs short."""
        queued = self.queued
        while self.waiting and queued < self.lookahead * max(1, len(self.waiting[0])):
            members = self.waiting.popleft()
            tasks = [RolloutTask(t.traj_id, t.group_id, t.task_type, t.prompt_tokens, t.is_eval) for t in members]
            self.sched.submit(tasks)
            for t in members:
                self.trajs[t.traj_id] = t
            self.group_left[members[0].group_id] = len(members)
            self.group_members[members[0].group_id] = [t.traj_id for t in members]
            queued += len(members)
            self.queued += len(members)

    # ---------------------------------------------------------------------------- decisions
    def dispatch(self, now: float) -> None:
        self._feed()
        decisions = self.sched.schedule(now, unconsumed_trajectories=self.unconsumed_fn())
        c = self.cluster
        for d in decisions:
            traj = self.trajs[d.task.task_id]
            if isinstance(d, Admit):
                self.queued -= 1
                c.admit(traj, d.rank, now)
            elif isinstance(d, Resume):
                c.resume(traj, d.rank, now)
            elif isinstance(d, Pause):
                c.pause(traj, now)
        if self.waiting and any(isinstance(d, Admit) for d in decisions):
            c.kick()  # more groups may fit now that the lookahead moved

    # ------------------------------------------------------------------------------- events
    def on_rank_added(self, rank_id: int) -> None:
        self.sched.add_rank(rank_id, self.budget)

    def on_rank_removed(self, rank_id: int, residents: List[Trajectory]) -> None:
        self.sched.remove_rank(rank_id)  # residents become PAUSED and resume elsewhere

    def on_weight_sync(self) -> None:
        self.sched.on_weight_sync()

    def on_turn_started(self, traj: Trajectory) -> None:
        if self.sched.status(traj.traj_id).state is TaskState.RUNNING:
            self.sched.on_turn_started(traj.traj_id, traj.context + traj.gen[traj.turn])

    def on_turn_finished(self, traj: Trajectory) -> None:
        if self.sched.status(traj.traj_id).state is TaskState.RUNNING:
            self.sched.on_turn_finished(traj.traj_id, traj.context + traj.gen[traj.turn])

    def on_finished(self, traj: Trajectory) -> None:
        self.sched.on_task_finished(traj.traj_id, traj.context)
        gid = traj.group_id
        self.group_left[gid] -= 1
        if self.group_left[gid] == 0:
            self._forget_group(gid)

    def _forget_group(self, group_id: int) -> None:
        """Drop a finished group from the scheduler's tables (see module docstring)."""
        del self.group_left[group_id]
        self.sched.forget(group_id)
        for tid in self.group_members.pop(group_id, []):
            self.trajs.pop(tid, None)
