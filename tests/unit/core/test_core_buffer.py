import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tide_megatron.core import (
    BufferConfig,
    GlobalBuffer,
    GroupFate,
    LedgerError,
    SignalsConfig,
    TokenLedger,
    Trajectory,
    group_advantages,
)


def traj(gid, i, *, version=0, gen=10, prompt=5, reward=0.0, is_eval=False, task="t"):
    return Trajectory(gid, i, task, version, prompt, gen, reward, is_eval=is_eval)


def buffer(mb=30, **kw):
    cfg = dict(group_size=2, b_min=2, b_ideal=4, max_staleness=1)
    cfg.update(kw)
    return GlobalBuffer(BufferConfig(**cfg), SignalsConfig(micro_batch_tokens=mb))


def test_group_advantages_are_standardised():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    assert group_advantages([3.0, 3.0], eps=1e-6) == [0.0, 0.0]


def test_group_enters_buffer_only_when_complete():
    b = buffer()
    assert b.add_trajectory(traj("g", 0, reward=1.0), now=1.0) is None
    assert b.ready_trajectories() == 0 and b.fetch(0, 1.0, 100) == []
    grp = b.add_trajectory(traj("g", 1, reward=0.0), now=2.0)
    assert grp is not None and grp.completed_at == 2.0
    assert [t.advantage for t in grp.trajectories] == pytest.approx([1.0, -1.0], rel=1e-5)
    assert b.ready_trajectories() == 2 and b.ledger.ready == 20


def test_duplicate_or_out_of_range_trajectory_rejected():
    b = buffer()
    b.add_trajectory(traj("g", 0), 0.0)
    with pytest.raises(ValueError):
        b.add_trajectory(traj("g", 0), 0.0)
    with pytest.raises(ValueError):
        b.add_trajectory(traj("g", 5), 0.0)


def test_staleness_bound_drops_and_records_old_groups():
    b = buffer(max_staleness=1)
    for gid, v in (("old", 0), ("ok", 1)):
        b.add_trajectory(traj(gid, 0, version=v), 0.0)
        b.add_trajectory(traj(gid, 1, version=v), 0.0)
    batch = b.fetch_batch(consumer_version=2, now=5.0)
    assert [g.group_id for g in batch.groups] == ["ok"]
    assert batch.max_staleness == 1
    assert b.records["old"].fate is GroupFate.DROPPED_STALE
    assert b.ledger.dropped_stale == 20 and b.ledger.consumed == 20 and b.ledger.balanced


def test_trajectory_version_is_the_oldest_of_its_group():
    b = buffer(max_staleness=0)
    b.add_trajectory(traj("g", 0, version=3), 0.0)
    b.add_trajectory(traj("g", 1, version=2), 0.0)
    assert b.fetch(3, 1.0, 10) == []
    assert b.records["g"].fate is GroupFate.DROPPED_STALE and b.records["g"].policy_version == 2


def test_completion_with_consumer_version_drops_stale_group_at_once():
    b = buffer(max_staleness=0)
    b.add_trajectory(traj("g", 0, version=0), 0.0)
    assert b.add_trajectory(traj("g", 1, version=0), 1.0, consumer_version=1) is None
    assert b.records["g"].fate is GroupFate.DROPPED_STALE and b.ready_trajectories() == 0


def test_elastic_batch_waits_for_b_min_and_caps_at_b_ideal():
    b = buffer(group_size=2, b_min=4, b_ideal=6)
    for g in range(2):
        b.add_trajectory(traj(g, 0), 0.0)
    b.add_trajectory(traj(0, 1), 1.0)
    assert b.fetch_batch(0, 1.0) is None  # 2 ready < B_min
    for g in range(1, 5):
        b.add_trajectory(traj(g, 0), 2.0) if g > 1 else None
        b.add_trajectory(traj(g, 1), 2.0 + g)
    batch = b.fetch_batch(0, 10.0)
    assert batch.num_trajectories == 6 and [g.group_id for g in batch.groups] == [0, 1, 2]  # FIFO
    assert b.ready_trajectories() == 4


def test_adaptive_retention_fetches_toward_b_min_and_keeps_reservoir():
    # 5 ready groups of 2 trajectories x 15 tokens = 30 tokens each; micro-batch = 30 tokens.
    b = GlobalBuffer(BufferConfig(group_size=2, b_min=4, b_ideal=8, reservoir_micro_batches=3, retention_steps=2),
                     SignalsConfig(micro_batch_tokens=30))
    def fill(n, start):
        for g in range(start, start + n):
            b.add_trajectory(traj(g, 0), 0.0)
            b.add_trajectory(traj(g, 1), 0.0)
    fill(5, 0)
    b.notify_rollout_scaled(-1)
    assert b.retaining
    batch = b.fetch_batch(0, 1.0)
    assert batch.num_trajectories == 4      # B_min, leaving 3 groups = 3 micro-batches
    assert b.ready_tokens() >= 3 * 30
    # Rollout catches up: a full B_ideal batch still leaves the reservoir -> retention ends.
    fill(8, 100)
    batch = b.fetch_batch(0, 2.0)
    assert batch.num_trajectories == 8 and not b.retaining


def test_a_streaming_step_after_a_rollout_scale_down_goes_toward_b_min_and_keeps_the_reservoir():
    # groups of 2 trajectories x 15 tokens = 30 tokens; a micro-batch is 30 tokens
    b = GlobalBuffer(BufferConfig(group_size=2, b_min=4, b_ideal=8, reservoir_micro_batches=2, retention_steps=2),
                     SignalsConfig(micro_batch_tokens=30))

    def fill(n, start, version=0):
        for g in range(start, start + n):
            b.add_trajectory(traj(g, 0, version=version), 0.0)
            b.add_trajectory(traj(g, 1, version=version), 0.0)

    fill(3, 0)
    taken, groups = b.open_stream(0, 1.0, max_groups=4)
    assert (len(taken), groups) == (3, 4)  # no retention: all ready now, the fourth as it completes
    fill(3, 10)
    b.notify_rollout_scaled(-1)
    taken, groups = b.open_stream(0, 2.0, max_groups=4)
    assert (len(taken), groups) == (2, 2) and b.ready_tokens() == 30  # B_min; the rest stays
    taken, groups = b.open_stream(0, 3.0, max_groups=4)
    assert (len(taken), groups) == (1, 2) and b.retaining is False  # B_min, one to come; retention spent
    fill(1, 20)
    taken, groups = b.open_stream(0, 4.0, max_groups=4)
    assert (len(taken), groups) == (1, 4)


def test_the_staleness_window_counts_the_steps_retention_shortens():
    # bound 1: a group admitted under version v is trained by the step of v or the one after it
    b = GlobalBuffer(BufferConfig(group_size=2, b_min=4, b_ideal=8, max_staleness=1, retention_steps=2),
                     SignalsConfig(micro_batch_tokens=30))
    assert b.window_groups(max_groups=4, admit_version=0) == 4 + 4
    b.notify_rollout_scaled(-1)
    assert b.window_groups(4, admit_version=0) == 2 + 2  # both next steps are paced toward B_min
    b.begin_step(1.0)
    b.open_stream(0, 1.0, max_groups=4)  # the first paced step opens (nothing ready: 2 groups)
    assert b.window_groups(4, admit_version=0) == 2 + 2
    b.end_step(2.0)
    b.begin_step(3.0)
    b.open_stream(1, 3.0, max_groups=4)  # the last paced step: the one after it is full again
    assert b.window_groups(4, admit_version=1) == 2 + 4  # not 4 + 4: the open step is still short
    b.end_step(4.0)
    # updated, the engines still on version 1: the step of version 1 is over, its consumption
    # (2 groups) still subtracted by the caller, so it stays counted at its size
    assert b.window_groups(4, admit_version=1) == 2 + 4
    assert b.window_groups(4, admit_version=2) == 4 + 4 and not b.retaining  # the engines moved on


def test_admission_room_is_the_window_less_live_and_consumed_groups():
    # bound 1, 4 groups a step: 8 groups fit; what the open step consumed still holds its slots
    b = GlobalBuffer(BufferConfig(group_size=2, b_min=4, b_ideal=8, max_staleness=1, retention_steps=2),
                     SignalsConfig(micro_batch_tokens=30))
    assert b.admission_room(4, 0, live_groups=0, consumed_groups=0) == 8
    assert b.admission_room(4, 0, live_groups=5, consumed_groups=2) == 1
    assert b.admission_room(4, 0, live_groups=7, consumed_groups=3) == 0  # over: none, never negative
    b.notify_rollout_scaled(-1)  # retention paces both next steps toward B_min: the window shrinks
    assert b.admission_room(4, 0, live_groups=3, consumed_groups=0) == 1


def test_retention_never_leaves_a_group_on_its_last_chance_behind():
    b = GlobalBuffer(BufferConfig(group_size=2, b_min=2, b_ideal=8, max_staleness=1, reservoir_micro_batches=5),
                     SignalsConfig(micro_batch_tokens=30))
    for g in range(3):  # produced by version 0: consumer version 1 is their last chance
        b.add_trajectory(traj(g, 0, version=0), 0.0)
        b.add_trajectory(traj(g, 1, version=0), 0.0)
    b.add_trajectory(traj(9, 0, version=0), 0.0)  # a group still running, also on its last chance
    b.notify_rollout_scaled(-1)
    taken, groups = b.open_stream(1, 1.0, max_groups=8)
    assert len(taken) == 3 and groups == 4 and b.ledger.dropped_stale == 0  # room for it too


def test_scale_up_ends_retention():
    b = buffer()
    b.notify_rollout_scaled(-2)
    b.notify_rollout_scaled(+1)
    assert not b.retaining


def test_eval_groups_are_scored_not_trained():
    b = buffer()
    b.add_trajectory(traj("e", 0, is_eval=True, reward=1.0), 0.0)
    b.add_trajectory(traj("e", 1, is_eval=True), 0.0)
    assert b.ready_trajectories() == 0
    assert [g.group_id for g in b.pop_eval_groups()] == ["e"] and b.pop_eval_groups() == []
    assert b.records["e"].fate is GroupFate.EVALUATED and b.ledger.evaluated == 20 and b.ledger.balanced


def test_live_token_reports_and_abort_feed_the_ledger():
    b = buffer()
    b.open_group("g", "t", 0.0)
    b.record_tokens("g", 0, 4, policy_version=0)
    b.record_tokens("g", 1, 7)
    assert b.ledger.in_flight == 11
    assert b.abort_trajectory("g", 1) == 7
    assert b.ledger.failed == 7 and b.ledger.lost == 0
    b.add_trajectory(traj("g", 0, gen=10), 1.0)   # 6 more than reported live
    b.add_trajectory(traj("g", 1, gen=3), 1.0)    # the retry
    assert b.ledger.generated == 4 + 7 + 6 + 3 and b.ledger.ready == 13 and b.ledger.balanced
    with pytest.raises(LedgerError):
        b.open_group("h", "t", 0.0)
        b.record_tokens("h", 0, 10)
        b.add_trajectory(traj("h", 0, gen=5), 1.0)  # reports fewer than were recorded live


def test_doomed_and_abandoned_groups_are_recorded():
    b = buffer(max_staleness=1)
    b.open_group("g", "t", 0.0)
    b.record_tokens("g", 0, 5, policy_version=0)
    assert b.doomed_groups(consumer_version=1) == []
    assert b.doomed_groups(consumer_version=2) == ["g"]
    assert b.abandon_group("g", 3.0, stale=True, consumer_version=2) == 5
    assert b.records["g"].fate is GroupFate.CANCELLED and b.ledger.cancelled == 5 and b.ledger.wasted == 5


def test_a_group_is_doomed_from_its_admission_version():
    b = buffer(max_staleness=1)
    b.open_group("g", "t", 0.0, admitted_version=3)   # nothing finished yet
    assert b.doomed_groups(consumer_version=4) == [] and b.doomed_groups(consumer_version=5) == ["g"]
    b.open_group("f", "t", 0.0, admitted_version=3)
    b.add_trajectory(traj("f", 0, version=3, gen=6), 1.0)
    assert b.fail_group("f", 2.0) == 6
    assert b.records["f"].fate is GroupFate.FAILED and b.ledger.failed == 6 and b.ready_trajectories() == 0


def test_task_attempts_and_unbooked_tokens_land_in_their_buckets():
    led = TokenLedger()
    led.book_attempt(5, fate="failed")
    led.book_attempt(3, fate="cancelled")
    led.lose(2)
    assert (led.failed, led.cancelled, led.lost, led.generated, led.wasted) == (5, 3, 2, 10, 10)
    with pytest.raises(LedgerError):
        led.book_attempt(1, fate="consumed")


def test_fetch_takes_the_group_closest_to_its_staleness_bound_first():
    b = buffer(max_staleness=1, group_size=2)
    b.add_trajectory(traj("new0", 0, version=4), 0.0)
    b.add_trajectory(traj("new0", 1, version=4), 0.0)     # completes first, version 4
    b.add_trajectory(traj("old0", 0, version=3), 1.0)
    b.add_trajectory(traj("old0", 1, version=3), 1.0)     # completes later, version 3: nearer its bound
    taken = b.fetch(consumer_version=4, now=2.0, max_trajectories=2)
    assert [g.group_id for g in taken] == ["old0"]


def test_head_of_line_latency_and_step_readiness():
    b = buffer(mb=30)
    assert b.head_of_line_latency(5.0) == 0.0
    b.add_trajectory(traj("a", 0), 1.0)
    b.add_trajectory(traj("a", 1), 2.0)  # 30 tokens ready at t=2
    assert b.head_of_line_latency(5.0) == 3.0
    assert b.begin_step(5.0) == pytest.approx(1.0)
    b.fetch_batch(0, 5.0)
    for i, t in enumerate((7.0, 9.0)):
        b.add_trajectory(traj(f"n{i}", 0), t)
        b.add_trajectory(traj(f"n{i}", 1), t)
    step = b.end_step(12.0)
    assert step.ras == pytest.approx(1.0) and step.hol_latency_s == 3.0
    assert step.arrivals == 2 and step.tprm_s == 2.0 and step.batch_trajectories == 2
    assert b.estimate().steps_observed == 1


def test_ledger_rejects_impossible_moves():
    led = TokenLedger()
    led.produce(5)
    with pytest.raises(LedgerError):
        led.consume(1)
    with pytest.raises(LedgerError):
        led.fail(6)
    with pytest.raises(LedgerError):
        led.lose(-1)
    led.complete(5)
    led.consume(5)
    assert led.balanced and led.consumed == 5


@pytest.mark.parametrize("kw", [dict(b_min=0), dict(b_min=9, b_ideal=8), dict(group_size=8, b_ideal=4),
                                dict(group_size=4, b_min=5, b_ideal=7), dict(max_staleness=-1)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        BufferConfig(**{**dict(group_size=2, b_min=2, b_ideal=8), **kw})


class BufferMachine(RuleBasedStateMachine):
    """Random producer/consumer interleavings; invariants checked after every step."""

    def __init__(self):
        super().__init__()
        self.cfg = BufferConfig(group_size=3, b_min=3, b_ideal=9, max_staleness=1,
                                reservoir_micro_batches=1, retention_steps=2)
        self.buf = GlobalBuffer(self.cfg, SignalsConfig(micro_batch_tokens=50))
        self.now = 0.0
        self.version = 0
        self.next_gid = 0
        self.open: dict[int, set[int]] = {}
        self.batches = []
        self.completed_ever: set = set()

    def _tick(self):
        self.now += 1.0
        return self.now

    @rule(is_eval=st.sampled_from([False, False, False, True]))
    def open_group(self, is_eval):
        gid = self.next_gid
        self.next_gid += 1
        self.buf.open_group(gid, f"task{gid % 3}", self._tick(), is_eval=is_eval)
        self.open[gid] = set()

    @precondition(lambda self: self.open)
    @rule(data=st.data(), tokens=st.integers(0, 40), lag=st.integers(0, 3))
    def progress(self, data, tokens, lag):
        gid = data.draw(st.sampled_from(sorted(self.open)))
        free = [i for i in range(3) if i not in self.open[gid]]
        i = data.draw(st.sampled_from(free))
        self.buf.record_tokens(gid, i, tokens, policy_version=max(self.version - lag, 0))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), gen=st.integers(0, 60), lag=st.sampled_from([0, 0, 0, 1, 2, 3]), reward=st.floats(-1, 1))
    def finish(self, data, gen, lag, reward):
        gid = data.draw(st.sampled_from(sorted(self.open)))
        i = data.draw(st.sampled_from([i for i in range(3) if i not in self.open[gid]]))
        self._finish(data, gid, i, gen, lag, reward)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), gen=st.integers(0, 60), lag=st.sampled_from([0, 0, 1, 2]))
    def finish_whole_group(self, data, gen, lag):
        gid = min(self.open)
        for i in [i for i in range(3) if i not in self.open[gid]]:
            self._finish(data, gid, i, gen + i, lag, float(i % 2))

    def _finish(self, data, gid, i, gen, lag, reward):
        already = self.buf._pending[gid].recorded_tokens.get(i, 0)
        is_eval = self.buf._pending[gid].is_eval
        t = Trajectory(gid, i, f"task{gid % 3}", max(self.version - lag, 0), 7, already + gen, reward,
                       is_eval=is_eval)
        done = self.buf.add_trajectory(t, self._tick(), consumer_version=data.draw(st.sampled_from([None, self.version])))
        self.open[gid].add(i)
        if len(self.open[gid]) == 3:
            del self.open[gid]
            self.completed_ever.add(gid)
        else:
            assert done is None

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def abort(self, data):
        gid = data.draw(st.sampled_from(sorted(self.open)))
        free = [i for i in range(3) if i not in self.open[gid]]
        self.buf.abort_trajectory(gid, data.draw(st.sampled_from(free)))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), stale=st.booleans())
    def abandon(self, data, stale):
        gid = data.draw(st.sampled_from(sorted(self.open)))
        self.buf.abandon_group(gid, self._tick(), stale=stale, consumer_version=self.version)
        del self.open[gid]

    @rule(streaming=st.booleans(), n=st.integers(1, 12))
    def consume(self, streaming, n):
        now = self._tick()
        if streaming:
            groups = self.buf.fetch(self.version, now, n)
        else:
            batch = self.buf.fetch_batch(self.version, now)
            groups = list(batch.groups) if batch else []
            if batch:
                assert self.cfg.b_min <= batch.num_trajectories <= self.cfg.b_ideal
        self.batches.append((self.version, groups))

    @rule(roll=st.integers(0, 3))
    def update_weights(self, roll):
        self.version += roll == 0  # rarer than the other events, as in a real step

    @rule(delta=st.integers(-2, 2))
    def scale(self, delta):
        self.buf.notify_rollout_scaled(delta)

    @invariant()
    def consumed_trajectories_respect_staleness_and_are_whole_groups(self):
        for version, groups in self.batches:
            for g in groups:
                assert len(g.trajectories) == self.cfg.group_size
                assert sorted(t.index for t in g.trajectories) == list(range(self.cfg.group_size))
                assert not g.is_eval
                for t in g.trajectories:
                    assert version - t.policy_version <= self.cfg.max_staleness
                    assert t.advantage is not None and math.isfinite(t.advantage)
                if len(g.trajectories) > 1:
                    assert abs(statistics.fmean(t.advantage for t in g.trajectories)) < 1e-6

    @invariant()
    def ledger_balances_and_every_completed_group_is_accounted_for(self):
        assert self.buf.ledger.balanced
        assert self.buf.audit() == []
        ready = {g.group_id for g in self.buf.ready_groups()}
        for gid in self.completed_ever:
            assert (gid in ready) != (gid in self.buf.records)
        consumed = [g.group_id for _, gs in self.batches for g in gs]
        assert len(consumed) == len(set(consumed))
        assert self.buf.ledger.consumed == sum(g.generated_tokens for _, gs in self.batches for g in gs)


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


import random  # noqa: E402



@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), staleness=st.integers(0, 2), retention=st.booleans())
def test_random_workload_keeps_every_invariant(seed, staleness, retention):
    """A producer/consumer run with interleaved groups, aborts, scale-downs and weight updates."""
    rng = random.Random(seed)
    G, total_groups = 4, 60
    cfg = BufferConfig(group_size=G, b_min=8, b_ideal=16, max_staleness=staleness, retention_steps=2)
    buf = GlobalBuffer(cfg, SignalsConfig(micro_batch_tokens=100))
    now, version, consumed = 0.0, 0, []
    running: dict[int, dict] = {}
    completed = set()
    next_gid = 0
    while next_gid < total_groups or running or buf.ready_trajectories():
        now += rng.random()
        while len(running) < 6 and next_gid < total_groups:
            running[next_gid] = {"left": list(range(G)), "start": version}
            buf.open_group(next_gid, next_gid % 5, now)
            next_gid += 1
        if running and rng.random() < 0.85:
            gid = rng.choice(sorted(running))
            i = rng.choice(running[gid]["left"])
            roll = rng.random()
            if roll < 0.1:
                buf.record_tokens(gid, i, rng.randint(1, 30), policy_version=running[gid]["start"])
                continue
            if roll < 0.13:
                buf.abort_trajectory(gid, i)  # retried later, same slot
                continue
            running[gid]["left"].remove(i)
            already = buf._pending[gid].recorded_tokens.get(i, 0)
            t = Trajectory(gid, i, gid % 5, running[gid]["start"], 20, already + rng.randint(0, 80), rng.random())
            buf.add_trajectory(t, now)
            if not running[gid]["left"]:
                del running[gid]
                completed.add(gid)
        else:
            if retention and rng.random() < 0.2:
                buf.notify_rollout_scaled(-1)
            buf.begin_step(now)
            batch = buf.fetch_batch(version, now)
            if batch is None and not running:
                batch_groups = buf.fetch(version, now, cfg.b_ideal)  # drain the tail
            else:
                batch_groups = list(batch.groups) if batch else []
            consumed += [(version, g) for g in batch_groups]
            buf.end_step(now + 1.0)
            version += bool(batch_groups)
        assert buf.ledger.balanced and buf.audit() == []
    for v, g in consumed:
        assert len(g) == G and all(v - t.policy_version <= staleness for t in g.trajectories)
    assert completed == set(buf.records) | {g.group_id for g in buf.ready_groups()}
    assert buf.ledger.in_flight == 0
    assert buf.ledger.consumed + buf.ledger.dropped_stale + buf.ledger.failed == buf.ledger.generated
    assert sum(g.generated_tokens for _, g in consumed) == buf.ledger.consumed
    assert consumed, "the workload must exercise consumption"


def test_a_step_keeps_room_for_groups_on_their_last_chance():
    """Younger groups that finish first must not push an older group past its bound."""
    b = buffer(max_staleness=1, group_size=2, b_min=4, b_ideal=4)
    b.open_group("old", "t", 0.0, admitted_version=3)          # consumer 4 is its last fresh chance
    for gid in ("y1", "y2"):
        b.open_group(gid, "t", 0.0, admitted_version=4)
        b.add_trajectory(traj(gid, 0, version=4), 1.0)
        b.add_trajectory(traj(gid, 1, version=4), 1.0)
    assert b.last_chance_reserve(4) == 2 and b.fetchable_trajectories(4, 4) == 2
    assert not b.batch_available(4) and b.fetch_batch(4, 2.0) is None  # one younger group fits beside the old one: wait
    taken = b.fetch(4, 2.0, max_trajectories=4)
    assert [g.group_id for g in taken] == ["y1"]      # the other slot stays reserved
    b.add_trajectory(traj("old", 0, version=3), 3.0)
    b.add_trajectory(traj("old", 1, version=3), 3.0)
    assert [g.group_id for g in b.fetch(4, 4.0, max_trajectories=2)] == ["old"]
    assert b.records["old"].fate is GroupFate.CONSUMED and b.ledger.wasted == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=10), st.integers(2, 4))
def test_batch_available_says_exactly_when_fetch_batch_returns_a_batch(groups, consumer):
    """(admission version, finished?) per group: the readiness test the controller waits on
    and the fetch it then makes agree, whatever mix of stale, last-chance and young groups."""
    b = buffer(max_staleness=1, group_size=2, b_min=4, b_ideal=6)
    for i, (version, finished) in enumerate(groups):
        gid = f"g{i}"
        b.open_group(gid, "t", 0.0, admitted_version=version)
        b.add_trajectory(traj(gid, 0, version=version), 0.0)
        if finished:
            b.add_trajectory(traj(gid, 1, version=version), 0.0)
    available = b.batch_available(consumer)
    batch = b.fetch_batch(consumer, 1.0)
    assert available == (batch is not None)
    if batch is not None:
        assert 4 <= batch.num_trajectories <= 6 and batch.max_staleness <= 1
