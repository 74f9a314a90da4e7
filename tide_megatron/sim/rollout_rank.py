"""One rollout rank: an inference engine with a KV prefix cache and continuous batching.

Decode is a fluid model: every running sequence emits one token per iteration, so one
"virtual clock" v (iterations done) serves the whole batch and a sequence that needs g tokens
finishes at v_start + g. An iteration takes base(n) + k*S(v) seconds, where S(v) = S0 + n*v is
the batch's total context, growing by n tokens per iteration; the time to advance the clock
therefore has a closed form (a quadratic), and the rank needs one event per finishing turn,
not one per token.

Prefill has priority over decode (SGLang's default schedule): a request that needs p uncached
tokens freezes the batch for prefill_s(p). Its cached prefix is a hit.

KV cache: `RadixPrefixCache` (tide_megatron/sim/prefix_cache.py), SGLang's radix tree with LRU
eviction, the same model under both schedulers. A running request holds its input (locked in the
tree) and its reserved output; a trajectory waiting for its env keeps its prefix in the tree, and
its next turn re-uses whatever of it is still there. Under request-level scheduling
(`pinned=False`) that prefix is unreferenced cache, evicted least-recently-used first when a new
request needs room (the C1 collapse of the paper when far more tasks run than the pool holds).
Under CTB (`pinned=True`) the prefixes of the tasks resident on the rank stay; when a request
does not fit, it waits, and CTB, seeing the pressure in its ledger, decides which task to pause.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

from tide_megatron.sim.hardware import HardwareModel
from tide_megatron.sim.prefix_cache import RadixPrefixCache
from tide_megatron.sim.workload import SimTrajectory


@dataclass
class RankStats:
    """Counters of one rank (and, summed, of the cluster)."""

    prompt_tokens: int = 0
    """Context tokens of every submitted turn (the hit-rate denominator)."""
    hit_tokens: int = 0
    """Of those, tokens found in the prefix cache."""
    recompute_tokens: int = 0
    """Tokens prefilled a second time after an eviction, pause or flush."""
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    batch_seq_s: float = 0.0
    """Integral of the running sequences over decode time (mean decode batch = this / decode_s)."""
    kv_token_s: float = 0.0
    """Integral of the KV tokens held over time (mean KV use = this / time)."""
    iterations: float = 0.0
    """Decode iterations run (mean iteration time = decode_s / iterations)."""
    evictions: int = 0
    """Evictions of an unfinished trajectory's cached prefix (at most one per trajectory per
    request that needed room)."""
    idle_s: float = 0.0
    """Time with nothing to decode or prefill (rollout waiting time, RWT)."""

    def add(self, other: "RankStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RolloutRank:
    """The engine of one rollout rank."""

    def __init__(self, rank_id: int, hw: HardwareModel, pinned: bool):
        self.rank_id = rank_id
        self.hw = hw
        self.capacity = hw.kv_capacity_tokens
        self.pinned = pinned
        # decode cost constants, read on every event (see HardwareModel.decode_iteration_s)
        self._w = hw.decode_weight_s
        self._c = hw.decode_token_compute_s
        self._kv = hw.decode_kv_s_per_token
        self.wake_token = 0
        """Identifies the one pending wake-up event that is valid (the cluster's lazy schedule)."""
        self.wake_at: Optional[float] = None
        """Time of the pending wake-up event, None when none is pending."""
        self.stats = RankStats()
        self.reset(0.0)

    def reset(self, now: float) -> None:
        """Empty engine (role change into rollout)."""
        self.running: Dict[int, tuple] = {}  # traj_id -> (traj, start_v, reserved)
        self._finish: List[tuple] = []  # heap of (finish_v, traj_id)
        self.s0 = 0.0  # sum over running of (context_at_start - start_v)
        self.vclock = 0.0
        self.last_t = now
        self.freeze_until = now
        self.kv = RadixPrefixCache(self.capacity, self.pinned)
        self.queue: Deque[SimTrajectory] = deque()
        self.resident: Dict[int, SimTrajectory] = {}  # every trajectory placed here and not done
        self.footprint = 0  # sum of resident trajectories' next-turn footprints (CTB ledger)
        self.wake_token = getattr(self, "wake_token", 0) + 1  # drops any pending wake-up
        self.wake_at = None

    # -------------------------------------------------------------------------------- clock
    def _rates(self) -> tuple:
        n = len(self.running)
        base = self._w if self._w >= n * self._c else n * self._c
        return base + self._kv * self.s0, self._kv * n

    def advance(self, now: float) -> None:
        """Move the decode clock to wall time `now`."""
        last = self.last_t
        if now <= last:
            return
        stats = self.stats
        stats.kv_token_s += self.used * (now - last)
        self.last_t = now
        start = last if last >= self.freeze_until else self.freeze_until
        if now <= start:
            return
        n = len(self.running)
        dt = now - start
        if not n:
            stats.idle_s += dt
            return
        stats.batch_seq_s += n * dt
        a, b = self._rates()
        slope = a + b * self.vclock
        dv = (-slope + math.sqrt(slope * slope + 2 * b * dt)) / b if b > 0 else dt / slope
        self.vclock += dv
        stats.iterations += dv
        stats.decode_s += dt

    def next_wake(self) -> Optional[float]:
        """Wall time at which the next running turn finishes (None: nothing running)."""
        if not self._finish:
            return None
        dv = self._finish[0][0] - self.vclock
        if dv < 0.0:
            dv = 0.0
        a, b = self._rates()
        start = self.last_t if self.last_t >= self.freeze_until else self.freeze_until
        return start + (a + b * self.vclock) * dv + 0.5 * b * dv * dv

    # ------------------------------------------------------------------------------- KV cache
    @property
    def used(self) -> int:
        """KV tokens held: the radix tree (cached prefixes, running inputs) + running outputs."""
        return self.kv.used

    def _evict_for(self, traj: SimTrajectory, need: int, force: bool = False) -> None:
        """Free room for `traj`'s request (its own prefix is protected, as SGLang locks it before
        allocating) by LRU eviction; pinned prefixes only with `force` (an engine with nothing
        running must evict even those or it would deadlock)."""
        kv = self.kv
        if self.queue:
            kv.refresh_waiting((t.traj_id, t.group_id) for t in self.queue)
        before = kv.evictions
        kv.evict(kv.used + need - self.capacity, (traj.traj_id, traj.group_id), force)
        self.stats.evictions += kv.evictions - before

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.used

    # ------------------------------------------------------------------------------- requests
    def place(self, traj: SimTrajectory) -> None:
        """Make `traj` resident here (admission or resume); its turns arrive with `submit`."""
        traj.rank = self.rank_id
        self.resident[traj.traj_id] = traj
        self.footprint += traj.footprint()

    def _try_start(self, traj: SimTrajectory, now: float) -> bool:
        # new tokens the request allocates: its input after the cached prefix, and its output
        need = traj.footprint() - self.kv.match(traj.traj_id, traj.group_id)
        if self.used + need > self.capacity:
            self._evict_for(traj, need)
            if self.used + need > self.capacity and self.running:
                return False
            if self.used + need > self.capacity:
                self._evict_for(traj, need, force=True)
        self._start(traj, now)
        return True

    def submit(self, traj: SimTrajectory, now: float) -> None:
        """A turn of `traj` asks for generation; it starts now or waits in the engine queue."""
        self.advance(now)
        if self.queue or not self._try_start(traj, now):
            self.queue.append(traj)

    def _start(self, traj: SimTrajectory, now: float) -> None:
        ctx = traj.context
        gen = traj.gen[traj.turn]
        hit = self.kv.start(traj.traj_id, traj.group_id, traj.prompt_tokens, ctx, gen)
        new = ctx - hit
        if traj.turn > 0:
            # everything before the latest observation was computed once already
            self.stats.recompute_tokens += max(0, ctx - traj.obs[traj.turn - 1] - hit)
        self.stats.prompt_tokens += ctx
        self.stats.hit_tokens += hit
        if new > 0:
            p = self.hw.prefill_s(new, hit)
            self.freeze_until = max(now, self.freeze_until) + p
            self.stats.prefill_s += p
        reserved = ctx + gen
        self.running[traj.traj_id] = (traj, self.vclock, reserved)
        self.s0 += ctx - self.vclock
        heapq.heappush(self._finish, (self.vclock + gen, traj.traj_id))

    def wake(self, now: float) -> tuple:
        """Finish every turn due by `now`: (finished trajectories, queued ones that started)."""
        self.advance(now)
        done: List[SimTrajectory] = []
        eps = 1e-6
        while self._finish and self._finish[0][0] <= self.vclock + eps:
            _, tid = heapq.heappop(self._finish)
            entry = self.running.pop(tid, None)
            if entry is None:
                continue
            traj, start_v, reserved = entry
            self.s0 -= traj.context - start_v
            gen = traj.gen[traj.turn]
            self.stats.generated_tokens += gen
            # the prefix (context + this turn's action) stays cached while the env works;
            # evictable unless pinned. traj.context itself grows when the observation returns.
            self.kv.finish_turn(tid, traj.context + gen)
            done.append(traj)
        started: List[SimTrajectory] = []
        if done:
            started = self._drain_queue(now)
        return done, started

    def _drain_queue(self, now: float) -> List[SimTrajectory]:
        started = []
        while self.queue and self._try_start(self.queue[0], now):
            started.append(self.queue.popleft())
        return started

    def abort(self, traj: SimTrajectory, now: float) -> None:
        """Stop `traj`'s decode (CTB paused an active task): the turn restarts when resumed."""
        self.advance(now)
        entry = self.running.pop(traj.traj_id, None)
        if entry is not None:
            _, start_v, _ = entry
            self.s0 -= traj.context - start_v
            self.kv.abort(traj.traj_id)
        if traj in self.queue:
            self.queue.remove(traj)

    def release(self, traj: SimTrajectory, now: float) -> List[SimTrajectory]:
        """Drop `traj` from this rank (finished, paused, migrated or cancelled). It must not be
        running. A finished trajectory's KV stays in the tree, unpinned, until LRU evicts it (as
        SGLang keeps a finished request's); a paused or cancelled one's is freed at once."""
        if self.resident.pop(traj.traj_id, None) is not None:
            self.footprint -= traj.footprint()
        if traj.turn >= traj.n_turns and not traj.cancelled:
            self.kv.finish_task(traj.traj_id)
            freed = self.pinned  # its KV became evictable
        else:
            freed = self.kv.drop(traj.traj_id) > 0
        if freed and self.queue:
            return self._drain_queue(now)
        return []

    def flush(self, now: float, stall_s: float) -> None:
        """Weight sync: stall for the broadcast, drop every cached prefix (they were computed with
        the old weights) and re-prefill the running sequences under the new ones."""
        self.advance(now)
        self.kv.flush()
        redo = 0
        for traj, start_v, _ in self.running.values():
            redo += traj.context + int(self.vclock - start_v)
        self.stats.recompute_tokens += redo
        extra = self.hw.prefill_s(redo) if redo else 0.0
        self.stats.prefill_s += extra
        self.freeze_until = max(now, self.freeze_until) + stall_s + extra

    # ------------------------------------------------------------------------------ queries
    def waiting_trajectories(self) -> List[SimTrajectory]:
        """Resident trajectories that are neither running nor queued (with the env)."""
        queued = {t.traj_id for t in self.queue}
        return [t for tid, t in self.resident.items() if tid not in self.running and tid not in queued]

    def is_running(self, traj: SimTrajectory) -> bool:
        return traj.traj_id in self.running

    def progress(self, traj: SimTrajectory, now: float) -> int:
        """Tokens `traj`'s running turn has generated by `now` (0 if it is not running)."""
        entry = self.running.get(traj.traj_id)
        if entry is None:
            return 0
        self.advance(now)
        return min(traj.gen[traj.turn], int(self.vclock - entry[1]))

