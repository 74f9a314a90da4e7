"""Deadline-aware CTB: measured group latency, admission within the staleness deadline, earliest
deadline first among equal priorities, cancellation of doomed groups, the consumption-rate throttle."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core.ctb import (
    PAPER_RULES,
    Admit,
    Cancel,
    CTBConfig,
    CTBScheduler,
    GroupCancelled,
    Pause,
    Resume,
    RolloutTask,
    TaskState,
)
from tide_megatron.core.ctb_deadline import ConsumptionMeter, GroupLatency, TrainerClock

DEADLINE_RULES = {k: v for k, v in PAPER_RULES.items()
                  if k not in ("deadline_admission", "throttle_from_consumption", "cancel_doomed")}


def group(gid, n=4, prompt=100, is_eval=False):
    return [RolloutTask(f"{gid}/{i}", gid, "web", prompt, is_eval) for i in range(n)]


def sched(**kw):
    base = dict(rank_token_budget=100_000, env_concurrency=1000, trainer_batch_trajectories=1000,
                probe_turn_reserve_tokens=100, context_norm_tokens=10_000, max_staleness=1, **DEADLINE_RULES)
    base.update(kw)
    return CTBScheduler(CTBConfig(**base), (0,))


def started(decisions):
    return [d.task.group_id for d in decisions if isinstance(d, Admit) and d.task.task_id.endswith("/0")]


def test_group_latency_is_a_high_quantile_of_recent_groups():
    lat = GroupLatency(window=5, quantile=0.9)
    assert lat.estimate() is None  # cold start
    for x in (3.0, 1.0, 2.0):
        lat.record(x)
    assert lat.estimate() == 3.0  # few samples: the largest seen
    for x in range(4, 11):
        lat.record(float(x))
    assert lat.samples == 5 and lat.estimate() == 10.0  # the window holds 6..10
    half = GroupLatency(window=5, quantile=0.5)
    for x in range(6, 11):
        half.record(float(x))
    assert half.estimate() == 8.0
    with pytest.raises(ValueError):
        lat.record(-1.0)


def test_consumption_meter_averages_the_last_steps():
    meter = ConsumptionMeter(window_steps=2)
    assert meter.rate() is None
    meter.record_step(0.0, 10.0, 100)
    meter.record_step(10.0, 30.0, 20)
    assert meter.rate() == pytest.approx(120 / 30)
    meter.record_step(30.0, 40.0, 50)  # the first step leaves the window
    assert meter.rate() == pytest.approx(70 / 30)


def test_deadline_is_the_end_of_the_last_step_that_may_consume_the_group():
    clock = TrainerClock(version=5, step_time_s=10.0, next_sync_at=100.0)
    assert clock.deadline(5, max_staleness=1) == 110.0  # consumed by the step producing version 7
    assert clock.deadline(4, max_staleness=1) == 100.0  # its last chance is the step running now
    s = sched()
    s.submit(group("g", 1))
    s.schedule(50.0, clock=clock)
    assert s.deadline("g", clock, 50.0) == 110.0
    assert s.deadline("g", clock, 105.0) == 115.0  # a step running late cannot end before now


def test_completion_latency_is_measured_from_the_groups_start_to_its_last_trajectory():
    s = sched()
    clock = TrainerClock(version=0, step_time_s=10.0, next_sync_at=10.0)
    s.submit(group("g", 2))
    s.schedule(5.0, clock=clock)
    s.on_turn_finished("g/0", 300)
    s.schedule(6.0, clock=clock)
    s.on_task_finished("g/0", now=20.0)
    assert s.latency.samples == 0
    s.on_task_finished("g/1", now=42.0)
    assert s.latency.estimate() == 37.0


def test_a_group_predicted_to_miss_its_deadline_does_not_start_while_other_work_is_outstanding():
    s = sched()
    s.latency.record(30.0)
    clock = TrainerClock(version=0, step_time_s=10.0, next_sync_at=5.0)  # a new group's deadline: 15
    s.submit(group("a", 2) + group("b", 2))
    assert started(s.schedule(0.0, clock=clock)) == ["a"]  # nothing outstanding: the trainer needs it
    assert not s.predicted_in_time(0.0, clock)
    assert started(s.schedule(1.0, clock=clock)) == []  # a is outstanding: b would miss its deadline
    later = TrainerClock(version=0, step_time_s=40.0, next_sync_at=5.0)  # slower steps: deadline 45
    assert s.predicted_in_time(1.0, later) and started(s.schedule(1.0, clock=later)) == ["b"]


def test_without_a_measured_latency_admission_falls_back_to_the_throttle():
    s = sched(trainer_batch_trajectories=2, max_staleness=0)  # fixed cap: 2 trajectories
    clock = TrainerClock(version=0, step_time_s=1.0, next_sync_at=0.5)
    s.submit(group("a", 2) + group("b", 2))
    assert started(s.schedule(0.0, clock=clock)) == ["a"]  # cold start: no prediction, the cap decides
    assert started(s.schedule(0.1, clock=clock)) == []


def test_the_throttle_follows_the_measured_consumption_rate():
    clock = TrainerClock(version=0, step_time_s=10.0, next_sync_at=10.0, consumed_per_s=1.0)
    # horizon of a group started at 0: the deadline 10 + 1 x 10 = 20 s; the trainer consumes 20 in it
    s = sched()
    for g in range(10):
        s.submit(group(f"g{g}", 4))
    assert len(started(s.schedule(0.0, clock=clock))) == 5  # 5 x 4 = 20 outstanding
    fixed = sched(throttle_from_consumption=False, trainer_batch_trajectories=8)  # (1 + 1) x 8 = 16
    for g in range(10):
        fixed.submit(group(f"g{g}", 4))
    assert len(started(fixed.schedule(0.0, clock=clock))) == 4
    no_rate = TrainerClock(version=0, step_time_s=10.0, next_sync_at=10.0)
    cold = sched(trainer_batch_trajectories=8)
    for g in range(10):
        cold.submit(group(f"g{g}", 4))
    assert len(started(cold.schedule(0.0, clock=no_rate))) == 4  # no rate measured yet: the fixed cap


def test_doomed_groups_are_cancelled_at_once_and_only_when_certain():
    s = sched()
    v0 = TrainerClock(version=0, step_time_s=10.0, next_sync_at=10.0)
    s.submit(group("a", 2) + group("done", 1) + group("ev", 2, is_eval=True))
    s.schedule(0.0, clock=v0)
    s.on_turn_finished("a/0", 300)
    s.schedule(1.0, clock=v0)  # a/1 joins
    s.on_task_finished("done/0", now=2.0)
    late = TrainerClock(version=1, step_time_s=10.0, next_sync_at=5.0)  # far past its time estimate
    assert [d for d in s.schedule(100.0, clock=late) if isinstance(d, (GroupCancelled, Cancel))] == []
    v2 = TrainerClock(version=2, step_time_s=10.0, next_sync_at=30.0)  # 0 + 1 < 2: a can never be consumed
    ds = s.schedule(101.0, clock=v2)
    assert ds[0] == GroupCancelled("a", 0)
    assert sorted(d.task.task_id for d in ds if isinstance(d, Cancel)) == ["a/0", "a/1"]
    assert s.status("a/0").state is TaskState.CANCELLED and s.status("done/0").state is TaskState.FINISHED
    assert s.status("ev/0").state is TaskState.RUNNING  # eval has no staleness deadline
    assert s.doomed_groups(2) == [] and s.audit() == []


def _clock(version):
    return TrainerClock(version=version, step_time_s=10.0, next_sync_at=10.0 * (version + 1))


def test_members_of_started_groups_are_admitted_earliest_deadline_first():
    s = sched(rank_token_budget=900)
    s.submit(group("ev", 1, prompt=200, is_eval=True) + group("late", 3, prompt=600) + group("early", 3, prompt=100))
    assert started(s.schedule(0.0, clock=_clock(0))) == ["ev", "early"]  # late's probe (700) does not fit beside ev
    s.on_task_finished("ev/0")
    assert started(s.schedule(1.0, clock=_clock(1))) == ["late"]  # late starts one version later
    s.on_turn_finished("late/0", 300)
    s.on_turn_finished("early/0", 300)  # 600 of 900: room for one more 300-token member
    ds = [d.task.task_id for d in s.schedule(2.0, clock=_clock(1)) if isinstance(d, Admit)]
    assert ds == ["early/1"]  # version 0 before version 1, though late was submitted first


def _inverted_pair(s):
    """a (submitted first) starts at version 1, b (submitted later) at version 0; equal P(t)."""
    s.submit(group("ev", 1, prompt=700, is_eval=True) + group("a", 1, prompt=250) + group("b", 1, prompt=50))
    assert started(s.schedule(0.0, clock=_clock(0))) == ["ev", "b"]  # a (350) does not fit beside ev (800)
    s.on_task_finished("ev/0")
    assert started(s.schedule(1.0, clock=_clock(1))) == ["a"]


def test_among_equal_priorities_the_latest_deadline_is_paused_first():
    s = sched(rank_token_budget=1000, w_context=0.0)  # waiting tasks of fresh groups: equal P(t)
    _inverted_pair(s)
    s.on_turn_finished("b/0", 500)
    s.on_turn_finished("a/0", 600)  # 1100 > 1000
    assert [d.task.task_id for d in s.schedule(2.0, clock=_clock(1)) if isinstance(d, Pause)] == ["a/0"]
    # (submission order alone would have paused b, the most recently submitted)


def test_among_equal_priorities_the_earliest_deadline_resumes_first():
    s = sched(rank_token_budget=1000, w_context=0.0)
    _inverted_pair(s)
    s.submit(group("f", 1, prompt=300, is_eval=True))
    s.schedule(1.5, clock=_clock(1))
    for tid, ctx in (("b/0", 300), ("a/0", 300), ("f/0", 500)):
        s.on_turn_finished(tid, ctx)  # 1100: a (version 1) is paused
    s.schedule(2.0, clock=_clock(1))
    s.on_turn_finished("f/0", 800)  # 1100 again: b is paused
    s.schedule(3.0, clock=_clock(1))
    assert s.tasks_in(TaskState.PAUSED) == ["a/0", "b/0"]
    s.on_turn_started("f/0", 500)  # room for one of them
    assert [d.task.task_id for d in s.schedule(4.0, clock=_clock(1)) if isinstance(d, Resume)] == ["b/0"]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), staleness=st.integers(0, 2))
def test_deadline_admission_never_starts_a_group_predicted_to_miss_while_work_is_outstanding(seed, staleness):
    rng = random.Random(seed)
    s = sched(max_staleness=staleness, rank_token_budget=rng.randint(2000, 20000),
              trainer_batch_trajectories=rng.randint(4, 64), latency_window=rng.randint(1, 16))
    version, now, next_sync = 0, 0.0, rng.uniform(5, 30)
    step_time = rng.uniform(5, 30)
    gid = 0
    for _ in range(120):
        now += rng.uniform(0.1, 5.0)
        if now > next_sync and rng.random() < 0.5:
            version += 1
            step_time = max(1.0, step_time * rng.uniform(0.7, 1.4))
            next_sync = now + step_time
        clock = TrainerClock(version, step_time, next_sync, consumed_per_s=rng.choice([None, rng.uniform(0.5, 8)]))
        if rng.random() < 0.3:
            s.submit(group(f"g{gid}", rng.randint(1, 4), prompt=rng.randint(50, 400), is_eval=rng.random() < 0.1))
            gid += 1
        unconsumed = rng.randint(0, 8)
        for doomed in s.doomed_groups(version):  # what schedule() cancels first
            s.cancel_group(doomed)
        outstanding = unconsumed + s.outstanding_training_tasks()
        predicted_ok = s.predicted_in_time(now, clock)
        new_train = [d.task.group_id for d in s.schedule(now, unconsumed_trajectories=unconsumed, clock=clock)
                     if isinstance(d, Admit) and s._groups[d.task.group_id].started_at == now
                     and not d.task.is_eval and d.task.task_id == f"{d.task.group_id}/0"]
        if not predicted_ok:
            # Only the liveness exception: with nothing outstanding, one group starts (not more).
            assert len(new_train) <= (1 if outstanding == 0 else 0), (new_train, outstanding)
        for g in new_train:  # a group started now must be consumed by the step producing version + S + 1
            assert s.deadline(g, clock, now) == pytest.approx(max(next_sync, now) + staleness * step_time)
        running = s.tasks_in(TaskState.RUNNING)
        for tid in rng.sample(running, k=min(len(running), 3)):
            if rng.random() < 0.5:
                s.on_turn_finished(tid, rng.randint(100, 800))
            else:
                s.on_task_finished(tid, now=now)
        assert s.audit() == []
