"""The rollout side: rollout ranks, the env cluster, and the mechanics of placing tasks.

A trajectory's life: submitted -> admitted onto a rank (takes an env slot, env reset) ->
[turn: submit to the engine, decode, env step] x n -> done (booked in the global buffer by the
simulator). Pausing drops its KV; resuming places it on a rank again (fresh prefill). A
trajectory whose group missed its staleness deadline is cancelled wherever it is: its decode
stops, its KV and env slot are released at once.

Who goes where is a `PlacementPolicy`'s decision:

- `RequestLevelPolicy` (the baselines): a FIFO of tasks placed by the real stack's rule (a
  group's home rank, else the one with the fewest tasks; `core.request_placement`), limited
  only by env concurrency; the engine's LRU cache evicts waiting prefixes when new requests
  need room (the paper's C1).
- `CTBPolicy` (`tide_megatron.sim.ctb_policy`): the core `CTBScheduler` decides admission,
  pausing and resumption; engines pin waiting prefixes.

The env cluster is `env_concurrency` slots: a task holds one from admission to its last turn,
paused or not (its env instance stays alive).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Deque, Dict, List, Optional

from tide_megatron.core.request_placement import LeastLoadedPlacer
from tide_megatron.sim.events import EventLoop
from tide_megatron.sim.hardware import HardwareModel
from tide_megatron.sim.rollout_rank import RankStats, RolloutRank
from tide_megatron.sim.workload import SimTrajectory


class PlacementPolicy:
    """Decides admission, pausing and resumption. Hooks see every state change."""

    pinned = False
    """Whether engines keep waiting prefixes resident (CTB) instead of LRU-evicting them."""
    decision_tick_s = 0.0
    """0: decide on every change; > 0: decide on a fixed tick (a controller loop)."""

    def bind(self, cluster: "RolloutCluster") -> None:
        self.cluster = cluster

    def submit(self, trajs: List[SimTrajectory]) -> None: ...
    def dispatch(self, now: float) -> None: ...
    def backlog(self) -> int: return 0
    def on_rank_added(self, rank_id: int) -> None: ...
    def on_rank_removed(self, rank_id: int, residents: List[SimTrajectory]) -> None: ...
    def on_weight_sync(self) -> None: ...
    def on_turn_started(self, traj: SimTrajectory) -> None: ...
    def on_turn_finished(self, traj: SimTrajectory) -> None: ...
    def on_finished(self, traj: SimTrajectory) -> None: ...


class RequestLevelPolicy(PlacementPolicy):
    """Request-level continuous batching: each task to a rank by the real stack's rule
    (`core.request_placement.LeastLoadedPlacer`), nothing pinned; the env slots bound the total."""

    def __init__(self) -> None:
        self.queue: Deque[SimTrajectory] = deque()
        self.homeless: Deque[SimTrajectory] = deque()  # from ranks that left rollout
        self.placer = LeastLoadedPlacer()
        self._where: Dict[int, int] = {}  # trajectory -> the rank it was placed on

    def submit(self, trajs: List[SimTrajectory]) -> None:
        # eval tasks are queued like any other: a request-level engine has no task priorities
        self.queue.extend(trajs)

    def backlog(self) -> int:
        return len(self.queue) + len(self.homeless)

    def on_rank_added(self, rank_id: int) -> None:
        self.placer.add_rank(rank_id)

    def on_rank_removed(self, rank_id: int, residents: List[SimTrajectory]) -> None:
        self.placer.remove_rank(rank_id)
        for traj in residents:
            self._where.pop(traj.traj_id, None)
        self.homeless.extend(residents)

    def on_finished(self, traj: SimTrajectory) -> None:
        rank = self._where.pop(traj.traj_id, None)
        if rank is not None:
            self.placer.release(rank)

    def _place(self, traj: SimTrajectory) -> int:
        rank = self.placer.place(traj.group_id)
        assert rank is not None, "no per-rank cap here: an active rank always has room"
        self._where[traj.traj_id] = rank
        return rank

    def dispatch(self, now: float) -> None:
        c = self.cluster
        while self.homeless:
            traj = self.homeless.popleft()
            if not traj.cancelled:
                c.resume(traj, self._place(traj), now)
        while self.queue and c.live < c.env_concurrency:
            traj = self.queue.popleft()
            if not traj.cancelled:
                c.admit(traj, self._place(traj), now)


class RolloutCluster:
    """All rollout ranks and the env slots; executes the placement policy's decisions."""

    def __init__(self, loop: EventLoop, hw: HardwareModel, policy: PlacementPolicy, env_concurrency: int,
                 on_done: Callable[[SimTrajectory], None], on_admit: Callable[[SimTrajectory], None]):
        self.loop = loop
        self.hw = hw
        self.policy = policy
        self.env_concurrency = env_concurrency
        self.on_done = on_done
        self.on_admit = on_admit
        self.ranks: Dict[int, RolloutRank] = {}
        self.active: set = set()
        self.live = 0  # trajectories holding an env slot
        self._live_s = 0.0  # time-integral of `live` up to `_live_at` (the real run's tasks in flight)
        self._live_at = loop.now
        self.version = 0  # policy version the engines serve (set at every weight sync)
        self.retired_stats = RankStats()
        self.pauses = 0
        self.migrations = 0
        self._scheduled = False
        policy.bind(self)

    # --------------------------------------------------------------------------- rank roles
    def add_rank(self, rank_id: int, now: float, stall_s: float = 0.0) -> None:
        rank = self.ranks.get(rank_id)
        if rank is None:
            rank = self.ranks[rank_id] = RolloutRank(rank_id, self.hw, self.policy.pinned)
        rank.reset(now)
        rank.freeze_until = now + stall_s  # it loads the new weights with the broadcast
        self.active.add(rank_id)
        self.policy.on_rank_added(rank_id)
        self.kick()

    def remove_rank(self, rank_id: int, now: float) -> None:
        """The rank leaves rollout: its tasks are handed back and will prefill afresh."""
        rank = self.ranks[rank_id]
        rank.advance(now)
        self.active.discard(rank_id)
        moved = sorted(rank.resident.values(), key=lambda t: t.traj_id)
        for traj in moved:
            traj.rank = -1
            traj.paused = True
            self.migrations += 1
        self.retired_stats.add(rank.stats)
        rank.stats = RankStats()
        rank.reset(now)
        self.policy.on_rank_removed(rank_id, moved)
        self.kick()

    def active_ranks(self) -> List[RolloutRank]:
        return [self.ranks[r] for r in sorted(self.active)]

    def flush_all(self, now: float, stall_s: float) -> None:
        """Weight sync: every engine stalls for the broadcast and drops its caches."""
        for rid in sorted(self.active):
            self.ranks[rid].flush(now, stall_s)
            self._reschedule(self.ranks[rid])
        self.policy.on_weight_sync()

    # ------------------------------------------------------------------ policy -> mechanics
    def submit(self, trajs: List[SimTrajectory]) -> None:
        self.policy.submit(trajs)
        self.kick()

    def admit(self, traj: SimTrajectory, rank_id: int, now: float) -> None:
        """New task onto a rank: it takes an env slot and the env resets."""
        if traj.cancelled:  # its group was cancelled while this member still queued
            self.policy.on_finished(traj)
            return
        self._count_live(+1, now)
        traj.admitted = True
        traj.start_time = now
        self.on_admit(traj)
        self.ranks[rank_id].place(traj)
        traj.env_busy = True
        self.loop.after(traj.reset_s, self._env_done, traj)

    def resume(self, traj: SimTrajectory, rank_id: int, now: float) -> None:
        """A paused task onto a rank; it re-submits at once unless its env is still working."""
        rank = self.ranks[rank_id]
        rank.place(traj)
        traj.paused = False
        if not traj.env_busy:
            self._submit(traj, rank, now)

    def pause(self, traj: SimTrajectory, now: float) -> None:
        """Drop the task's KV state (aborting its decode if it is generating)."""
        rank = self.ranks.get(traj.rank) if traj.rank >= 0 else None
        if rank is not None:
            rank.abort(traj, now)
            self._started(rank.release(traj, now))
            self._reschedule(rank)
        traj.rank = -1
        traj.paused = True
        self.pauses += 1

    def cancel(self, traj: SimTrajectory, now: float) -> int:
        """Stop a trajectory of a cancelled group; returns the tokens it had generated."""
        if traj.cancelled or traj.end_time >= 0:
            return 0
        traj.cancelled = True
        tokens = traj.generated_so_far
        rank = self.ranks.get(traj.rank) if traj.rank >= 0 else None
        if rank is not None:
            tokens += rank.progress(traj, now)
            rank.abort(traj, now)
            self._started(rank.release(traj, now))
            self._reschedule(rank)
            traj.rank = -1
        if traj.admitted:
            traj.admitted = False
            self._count_live(-1, now)
            self.policy.on_finished(traj)
            self.kick()
        return tokens

    # ---------------------------------------------------------------------------- dispatch
    def kick(self) -> None:
        """Run the policy once, at the current instant or at the policy's next decision tick
        (coalesces bursts of changes into one decision)."""
        if not self._scheduled:
            self._scheduled = True
            tick = self.policy.decision_tick_s
            at = self.loop.now if tick <= 0 else math.ceil(self.loop.now / tick + 1e-9) * tick
            self.loop.at(at, self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        if self.active:
            self.policy.dispatch(self.loop.now)

    def _submit(self, traj: SimTrajectory, rank: RolloutRank, now: float) -> None:
        if len(traj.segment_versions) <= traj.turn:
            traj.segment_versions.append(self.version)
        rank.submit(traj, now)
        if rank.is_running(traj):
            self.policy.on_turn_started(traj)
        self._reschedule(rank)

    def _started(self, trajs: List[SimTrajectory]) -> None:
        for traj in trajs:  # engine-queued requests that got room
            self.policy.on_turn_started(traj)

    # ------------------------------------------------------------------------------ events
    def _reschedule(self, rank: RolloutRank) -> None:
        """Make sure a wake-up is pending no later than the rank's next turn end. Lazy: a
        pending wake-up that is due earlier stays (it finds nothing due, and reschedules), so a
        burst of submissions costs one event, not one per submission."""
        t = rank.next_wake()
        if t is None or (rank.wake_at is not None and rank.wake_at <= t + 1e-9):
            return
        rank.wake_token += 1
        rank.wake_at = t
        self.loop.at(t, self._wake, rank.rank_id, rank.wake_token)

    def _wake(self, rank_id: int, token: int) -> None:
        rank = self.ranks[rank_id]
        if token != rank.wake_token or rank_id not in self.active:
            return
        rank.wake_at = None
        now = self.loop.now
        done, started = rank.wake(now)
        for traj in done:
            traj.generated_so_far += traj.gen[traj.turn]
            traj.env_busy = True
            self.policy.on_turn_finished(traj)
            self.loop.after(traj.env_s[traj.turn], self._env_done, traj)
        self._started(started)
        self._reschedule(rank)
        if done:
            self.kick()

    def _env_done(self, traj: SimTrajectory) -> None:
        """The env answered (reset, or a step): next turn, or the trajectory is over."""
        if traj.cancelled:
            return
        now = self.loop.now
        traj.env_busy = False
        rank = self.ranks.get(traj.rank) if traj.rank >= 0 else None
        if traj.started:
            old = traj.footprint()
            traj.context += traj.gen[traj.turn] + traj.obs[traj.turn]
            traj.turn += 1
            if rank is not None:
                rank.footprint += traj.footprint() - old
        traj.started = True
        if traj.turn >= traj.n_turns:
            self._finish(traj, rank, now)
        elif rank is not None:
            self._submit(traj, rank, now)
        else:
            self.kick()  # paused or migrated while the env worked: the policy resumes it

    def _finish(self, traj: SimTrajectory, rank: Optional[RolloutRank], now: float) -> None:
        if rank is not None:
            self._started(rank.release(traj, now))
            self._reschedule(rank)
        self._count_live(-1, now)
        traj.admitted = False
        traj.end_time = now
        self.policy.on_finished(traj)
        self.on_done(traj)
        self.kick()

    # ------------------------------------------------------------------------------ metrics
    def total_stats(self) -> RankStats:
        total = RankStats()
        total.add(self.retired_stats)
        for rid in sorted(self.ranks):
            total.add(self.ranks[rid].stats)
        return total

    def _count_live(self, delta: int, now: float) -> None:
        self._live_s += self.live * (now - self._live_at)
        self._live_at = now
        self.live += delta

    def live_s_at(self, now: float) -> float:
        """Trajectory-seconds of admitted trajectories (on a rank, paused or with their env) up
        to `now`: the real run's tasks in flight, integrated."""
        return self._live_s + self.live * (now - self._live_at)

    def idle_s_at(self, now: float) -> float:
        """Rollout idle seconds (RWT) of every rank up to `now`, read without moving any decode
        clock: advancing mid-run would only split the integration, but would change the float
        rounding of every later event against an unobserved run."""
        total = self.total_stats().idle_s
        for rid in self.active:
            rank = self.ranks[rid]
            start = max(rank.last_t, rank.freeze_until)
            if not rank.running and now > start:
                total += now - start
        return total

    def settle(self, now: float) -> None:
        for rid in sorted(self.active):
            self.ranks[rid].advance(now)
