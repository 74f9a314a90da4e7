import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core.ctb import PAPER_RULES
from tide_megatron.core import (
    Admit,
    CTBConfig,
    CTBScheduler,
    Pause,
    Requeue,
    Resume,
    RolloutTask,
    TaskState,
)


def group(gid, n=4, *, ttype="web", prompt=500, is_eval=False):
    return [RolloutTask(f"{gid}/{i}", gid, ttype, prompt, is_eval) for i in range(n)]


def sched(ranks=(0,), **kw):
    base = dict(rank_token_budget=10_000, env_concurrency=100, trainer_batch_trajectories=1000,
                probe_turn_reserve_tokens=500, context_norm_tokens=10_000, **PAPER_RULES)
    base.update(kw)
    return CTBScheduler(CTBConfig(**base), ranks)


def admitted(decisions):
    return [d.task.task_id for d in decisions if isinstance(d, Admit)]


def test_only_the_probe_is_admitted_until_its_first_turn_is_measured():
    s = sched()
    s.submit(group("g"))
    ds = s.schedule(0.0)
    assert admitted(ds) == ["g/0"] and ds[0].estimated_tokens == 1000  # prompt + reserve
    s.on_turn_started("g/0", 500)
    assert s.schedule(1.0) == []          # still measuring
    s.on_turn_finished("g/0", 1800)
    assert s.probe_footprint("g") == 1800
    ds = s.schedule(2.0)
    assert admitted(ds) == ["g/1", "g/2", "g/3"]
    assert all(d.estimated_tokens == 1800 for d in ds)


def test_admission_respects_the_token_budget():
    s = sched(rank_token_budget=6000)
    s.submit(group("g", 8))
    s.schedule(0.0)
    s.on_turn_started("g/0", 1000)
    s.on_turn_finished("g/0", 2000)
    ds = s.schedule(1.0)
    assert len(admitted(ds)) == 2         # 2000 + 2 * 2000 = 6000 <= 6000; a third would not fit
    assert s.rank_usage(0) == (6000, 6000)
    s.on_task_finished("g/1", 2000)
    assert admitted(s.schedule(2.0)) == ["g/3"]


def test_usage_is_updated_every_turn_with_actual_context():
    s = sched()
    s.submit(group("g", 1))
    s.schedule(0.0)
    assert s.rank_usage(0)[0] == 1000     # reservation
    s.on_turn_started("g/0", 700)
    assert s.rank_usage(0)[0] == 700
    s.on_turn_finished("g/0", 1200)
    s.on_turn_started("g/0", 1900)
    assert s.rank_usage(0)[0] == 1900
    s.on_task_finished("g/0")
    assert s.rank_usage(0)[0] == 0 and s.status("g/0").state is TaskState.FINISHED


def test_env_concurrency_counts_running_and_paused_tasks():
    s = sched(env_concurrency=3)
    for g in "abcde":
        s.submit(group(g, 1))
    assert len(admitted(s.schedule(0.0))) == 3
    assert admitted(s.schedule(1.0)) == []
    s.on_task_finished("a/0", 100)
    assert admitted(s.schedule(2.0)) == ["d/0"]


def test_staleness_throttle_bounds_outstanding_training_work():
    s = sched(max_staleness=0, trainer_batch_trajectories=4)
    for g in "abcdef":
        s.submit(group(g, 1))
    s.submit(group("ev", 1, is_eval=True))
    ds = s.schedule(0.0, unconsumed_trajectories=2)
    # Eval is exempt; training work: 2 unconsumed + 2 admitted = (0 + 1) * 4.
    assert admitted(ds) == ["ev/0", "a/0", "b/0"]
    assert admitted(s.schedule(1.0, unconsumed_trajectories=2)) == []
    assert admitted(s.schedule(2.0, unconsumed_trajectories=0)) == ["c/0", "d/0"]


def test_diversity_spreads_same_type_groups_across_ranks():
    s = sched(ranks=(0, 1), diversity_penalty=0.2)
    s.submit(group("a", 1, ttype="alfworld"))
    s.submit(group("b", 1, ttype="alfworld", prompt=200))
    s.submit(group("c", 1, ttype="webshop", prompt=100))
    ds = s.schedule(0.0)
    where = {d.task.task_id: d.rank for d in ds}
    assert where["a/0"] != where["b/0"]  # same type, other group -> other rank


def test_priority_formula():
    cfg = dict(w_eval=1000, w_group=100, w_active=10, w_context=1, context_norm_tokens=1000)
    s = sched(**cfg)
    s.submit(group("g", 4))
    s.schedule(0.0)
    s.on_turn_started("g/0", 500)
    assert s.priority("g/0") == pytest.approx(10 + 0.5)
    s.on_turn_finished("g/0", 2000)       # context clipped to 1
    assert s.priority("g/0") == pytest.approx(1.0)
    s.schedule(1.0)
    s.on_task_finished("g/1", 100)
    assert s.priority("g/0") == pytest.approx(100 * 0.25 + 1.0)


def _three_residents(**kw):
    s = sched(rank_token_budget=6000, **kw)
    s.submit(group("ev", 1, is_eval=True, prompt=100))
    s.submit(group("a", 1, prompt=100))
    s.submit(group("b", 1, prompt=100))
    s.schedule(0.0)
    for tid, ctx in (("ev/0", 1000), ("a/0", 1000), ("b/0", 1000)):
        s.on_turn_started(tid, ctx)
        s.on_turn_finished(tid, ctx)
    return s


def test_pause_lowest_priority_first_when_over_budget():
    s = _three_residents()
    s.on_turn_started("a/0", 2500)        # a is generating: I_active = 1
    s.on_turn_started("ev/0", 2000)       # ev grows: total 2000 + 2500 + 1000 = 5500
    assert [d for d in s.schedule(1.0) if isinstance(d, Pause)] == []
    s.on_turn_finished("b/0", 3000)       # 7500 > 6000
    pauses = [d for d in s.schedule(2.0) if isinstance(d, Pause)]
    assert [p.task.task_id for p in pauses] == ["b/0"]  # waiting, non-eval: lowest
    assert s.status("b/0").state is TaskState.PAUSED and s.rank_usage(0)[0] == 4500


def test_paused_tasks_resume_before_new_admissions():
    s = _three_residents()
    s.submit(group("new", 1, prompt=100))
    s.on_turn_started("b/0", 5000)        # 7000 > 6000: b paused (ev and a outrank it? a=b tie)
    ds = s.schedule(1.0)
    paused = [d.task.task_id for d in ds if isinstance(d, Pause)]
    assert paused and admitted(ds) == []  # paused one cannot come back yet, so nothing new
    for tid in ("ev/0", "a/0", "b/0"):
        if s.status(tid).state is TaskState.RUNNING:
            s.on_task_finished(tid)
    ds = s.schedule(2.0)
    kinds = [type(d).__name__ for d in ds]
    assert kinds.index("Resume") < kinds.index("Admit")


def test_resume_prefers_the_rank_holding_the_group_prefix():
    s = sched(ranks=(0, 1), rank_token_budget=5000)
    s.set_accepting(1, False)             # everything lands on rank 0 first
    s.submit(group("g", 2, prompt=100))
    s.schedule(0.0)
    s.on_turn_finished("g/0", 1000)
    s.schedule(1.0)
    assert s.status("g/1").rank == 0
    s.on_turn_started("g/1", 4500)        # 5500 > 5000 on rank 0
    ds = s.schedule(2.0)
    assert [d.task.task_id for d in ds if isinstance(d, Pause)] == ["g/0"]  # waiting < active
    assert not [d for d in ds if isinstance(d, Resume)]  # no room anywhere yet
    s.set_accepting(1, True)              # an empty rank with the most headroom appears...
    s.on_task_finished("g/1")             # ...and the group's home rank frees up
    r = [d for d in s.schedule(3.0) if isinstance(d, Resume)]
    assert len(r) == 1 and r[0].rank == 0 and r[0].prefix_affinity
    assert s.status("g/0").needs_prefill


def test_resume_falls_back_to_the_roomiest_rank_without_affinity():
    s = sched(ranks=(0, 1), rank_token_budget=5000)
    s.set_accepting(1, False)
    s.submit(group("g", 2, prompt=100))
    s.schedule(0.0)
    s.on_turn_finished("g/0", 1000)
    s.schedule(1.0)
    s.set_accepting(1, True)
    s.on_turn_started("g/1", 4500)
    ds = s.schedule(2.0)
    r = [d for d in ds if isinstance(d, Resume)]
    assert [d.task.task_id for d in ds if isinstance(d, Pause)] == ["g/0"]
    assert len(r) == 1 and r[0].rank == 1 and not r[0].prefix_affinity


def test_weight_sync_resets_affinity_to_current_residents():
    s = sched(ranks=(0, 1))
    s.submit(group("g", 1))
    s.schedule(0.0)
    s.on_weight_sync()
    st = s.status("g/0")
    assert st.needs_prefill and s._groups["g"].prefix_ranks == {st.rank: 1}


def test_removed_rank_hands_back_every_task_which_resumes_elsewhere():
    s = sched(ranks=(0, 1))
    s.submit(group("g", 3, prompt=100))
    s.schedule(0.0)
    s.on_turn_finished("g/0", 500)
    s.schedule(1.0)
    on0 = s.residents(0)
    requeued = s.remove_rank(0)
    assert isinstance(requeued[0], Requeue) and [r.task.task_id for r in requeued] == on0
    assert all(s.status(t).state is TaskState.PAUSED and s.status(t).needs_prefill for t in on0)
    resumed = [d for d in s.schedule(2.0) if isinstance(d, Resume)]
    assert {d.task.task_id for d in resumed} == set(on0) and all(d.rank == 1 for d in resumed)
    assert s.audit() == []


def test_quarantined_rank_gets_no_new_tasks():
    s = sched(ranks=(0, 1))
    s.set_accepting(0, False)
    for g in "abc":
        s.submit(group(g, 1))
    assert {d.rank for d in s.schedule(0.0)} == {1}


def test_context_larger_than_any_budget_runs_alone():
    s = sched(ranks=(0, 1), rank_token_budget=2000)
    s.set_accepting(1, False)
    s.submit(group("big", 1, prompt=100))
    s.submit(group("small", 1, prompt=100))
    s.schedule(0.0)
    s.on_turn_started("small/0", 300)
    s.on_turn_finished("big/0", 2500)     # grew past every budget, sharing rank 0
    ds = s.schedule(1.0)
    assert [(type(d), d.task.task_id) for d in ds] == [(Pause, "big/0")]  # no rank has room
    s.set_accepting(1, True)               # an idle rank: the oversize task may run there alone
    ds = s.schedule(2.0)
    assert [(type(d), d.rank) for d in ds] == [(Resume, 1)]
    assert s.residents(1) == ["big/0"]
    s.on_turn_finished("big/0", 2600)
    assert [d for d in s.schedule(3.0) if isinstance(d, Pause)] == []  # alone: never paused


def test_invalid_events_are_rejected():
    s = sched()
    s.submit(group("g", 2))
    with pytest.raises(ValueError):
        s.submit(group("g", 1))
    with pytest.raises(ValueError):
        s.on_task_finished("g/1")          # never admitted
    with pytest.raises(ValueError):
        s.on_turn_started("g/1", 10)


def test_schedule_is_deterministic():
    def run():
        s = sched(ranks=(0, 1, 2), rank_token_budget=4000)
        for g in range(6):
            s.submit(group(g, 3, ttype=f"t{g % 2}", prompt=300 + g))
        out = []
        for step in range(5):
            ds = s.schedule(float(step))
            out.append([(type(d).__name__, d.task.task_id, getattr(d, "rank", None)) for d in ds])
            for d in ds:
                if isinstance(d, (Admit, Resume)):
                    s.on_turn_finished(d.task.task_id, 900 + step * 100)
        return out
    assert run() == run()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_ranks=st.integers(1, 4), budget=st.integers(3000, 20000))
def test_random_rollout_never_overfills_ranks_and_never_loses_tasks(seed, n_ranks, budget):
    rng = random.Random(seed)
    s = sched(ranks=range(n_ranks), rank_token_budget=budget, env_concurrency=rng.randint(4, 40),
              trainer_batch_trajectories=rng.randint(4, 32), max_staleness=rng.randint(0, 2))
    submitted: set = set()
    finished: set = set()
    next_rank = n_ranks
    max_ctx = budget // 2  # contexts stay admissible alone on a rank
    for g in range(rng.randint(2, 12)):
        tasks = group(g, rng.randint(1, 6), ttype=rng.choice("ab"), prompt=rng.randint(50, 800),
                      is_eval=rng.random() < 0.1)
        s.submit(tasks)
        submitted |= {t.task_id for t in tasks}
    for step in range(150):
        ds = s.schedule(float(step), unconsumed_trajectories=rng.randint(0, 8))
        touched = {d.rank for d in ds if isinstance(d, (Admit, Resume))}
        for r in touched:
            used, cap = s.rank_usage(r)
            assert used <= cap, f"rank {r} overfilled: {used} > {cap}"
        running = s.tasks_in(TaskState.RUNNING)
        roll = rng.random()
        if running and roll < 0.6:
            tid = rng.choice(running)
            st_ = s.status(tid)
            ctx = min(max_ctx, (st_.context_tokens or st_.task.prompt_tokens) + rng.randint(0, 1500))
            if rng.random() < 0.5:
                s.on_turn_started(tid, ctx)
            else:
                s.on_turn_finished(tid, ctx)
        elif (running or s.tasks_in(TaskState.PAUSED)) and roll < 0.85:
            pool = running + s.tasks_in(TaskState.PAUSED)
            tid = rng.choice(pool)
            if rng.random() < 0.8:
                s.on_task_finished(tid)
                finished.add(tid)
            else:  # a failure: retried from scratch, or its whole group given up
                s.on_task_failed(tid)
                if rng.random() < 0.6:
                    s.requeue(tid)
                else:
                    s.cancel_group(s.status(tid).task.group_id)
        elif roll < 0.93 and len(s.ranks) > 1:
            victim = rng.choice(s.ranks)
            before = set(s.residents(victim))
            back = s.remove_rank(victim)
            assert {r.task.task_id for r in back} == before
            assert all(s.status(t).state is TaskState.PAUSED for t in before)
        elif roll < 0.97:
            s.add_rank(next_rank, budget)
            next_rank += 1
        else:
            s.on_weight_sync()
        # Every task is queued, running, paused or finished; none is lost or duplicated.
        by_state = {state: set(s.tasks_in(state)) for state in TaskState}
        assert set().union(*by_state.values()) == submitted
        assert sum(len(v) for v in by_state.values()) == len(submitted)
        assert by_state[TaskState.FINISHED] == finished
        assert s.audit() == []


def test_throttle_gates_whole_groups_and_started_groups_finish_first():
    # Cap (0 + 1) * 8 = 8 trajectories: exactly two groups of 4 may be under way.
    s = sched(max_staleness=0, trainer_batch_trajectories=8)
    for g in "abc":
        s.submit(group(g, 4, prompt=100))
    assert admitted(s.schedule(0.0)) == ["a/0", "b/0"]     # probes of two groups; c is throttled
    s.on_turn_finished("a/0", 400)
    s.on_turn_finished("b/0", 400)
    ds = admitted(s.schedule(1.0, unconsumed_trajectories=0))
    assert ds == ["a/1", "a/2", "a/3", "b/1", "b/2", "b/3"]  # members of started groups: never throttled
    for tid in ("a/0", "a/1", "a/2", "a/3"):
        s.on_task_finished(tid)
    # a's 4 trajectories now sit unconsumed in the buffer: still no room for c.
    assert admitted(s.schedule(2.0, unconsumed_trajectories=4)) == []
    assert admitted(s.schedule(3.0, unconsumed_trajectories=0)) == ["c/0"]


def test_forget_drops_a_finished_group_and_refuses_an_unfinished_one():
    s = sched()
    s.submit(group("a", 2) + group("b", 2))
    s.schedule(0.0)
    s.on_turn_started("a/0", 500)
    s.on_turn_finished("a/0", 900)
    s.schedule(1.0)
    with pytest.raises(ValueError):
        s.forget("a")                      # a/1 is still running
    s.on_task_finished("a/0")
    s.on_task_finished("a/1")
    assert sorted(s.forget("a")) == ["a/0", "a/1"]
    assert s.forget("a") == []            # idempotent
    with pytest.raises(KeyError):
        s.status("a/0")
    assert s.audit() == [] and s.counts()["finished"] == 0
    with pytest.raises(ValueError):
        s.forget("b")                      # queued tasks are work, not history


def _running_pair(confirm_release=False, **kw):
    s = CTBScheduler(CTBConfig(rank_token_budget=10_000, env_concurrency=100, trainer_batch_trajectories=1000,
                               probe_turn_reserve_tokens=500, context_norm_tokens=10_000, **PAPER_RULES, **kw),
                     (0,), confirm_release=confirm_release)
    s.submit(group("g", 2, prompt=100))
    s.schedule(0.0)
    s.on_turn_finished("g/0", 800)
    s.schedule(1.0)
    return s


def test_a_failed_task_frees_what_it_held_and_restarts_from_scratch_when_requeued():
    s = _running_pair()
    s.on_turn_started("g/1", 900)
    s.on_task_failed("g/1")
    assert s.status("g/1").state is TaskState.FAILED and s.rank_usage(0)[0] == 800
    assert s.schedule(2.0) == []  # a failed task waits for the caller's decision
    with pytest.raises(ValueError):
        s.on_task_failed("g/1")
    s.requeue("g/1")
    st_ = s.status("g/1")
    assert st_.state is TaskState.QUEUED and st_.context_tokens is None and st_.turns_done == 0
    ds = s.schedule(3.0)
    assert admitted(ds) == ["g/1"] and ds[0].estimated_tokens == 800  # the group's measured footprint
    assert s.audit() == []


def test_a_failed_probe_is_probed_again():
    s = sched()
    s.submit(group("g", 3, prompt=100))
    s.schedule(0.0)
    s.on_task_failed("g/0")
    s.requeue("g/0")
    assert admitted(s.schedule(1.0)) == ["g/0"]  # still the probe: nobody else until it measures a turn
    s.on_turn_finished("g/0", 700)
    assert admitted(s.schedule(2.0)) == ["g/1", "g/2"]


def test_cancel_group_stops_running_and_paused_tasks_and_forgets_queued_ones():
    s = sched(rank_token_budget=3000, max_staleness=0, trainer_batch_trajectories=4)  # one group at a time
    s.submit(group("g", 4, prompt=100) + group("h", 4, prompt=100))
    s.schedule(0.0)
    s.on_turn_finished("g/0", 1000)
    s.schedule(1.0)  # g/1 and g/2 fit (3000), g/3 queued
    s.on_turn_started("g/1", 1400)  # 3400 > 3000: g/2 (waiting) paused
    paused = [d.task.task_id for d in s.schedule(2.0) if isinstance(d, Pause)]
    assert paused == ["g/2"]
    s.on_task_finished("g/0")
    cancels = s.cancel_group("g")
    assert [(c.task.task_id, c.rank) for c in cancels] == [("g/1", 0), ("g/2", None)]
    assert {t: s.status(t).state for t in ("g/0", "g/1", "g/2", "g/3")} == {
        "g/0": TaskState.FINISHED, "g/1": TaskState.CANCELLED, "g/2": TaskState.CANCELLED, "g/3": TaskState.CANCELLED}
    assert s.cancel_group("g") == [] and s.rank_usage(0)[0] == 0
    assert admitted(s.schedule(3.0)) == ["h/0"]  # the throttle's room came back with the cancel
    assert sorted(s.forget("g")) == ["g/0", "g/1", "g/2", "g/3"] and s.audit() == []
    with pytest.raises(ValueError):
        s.submit(group("h", 1))  # h/0 exists: ids stay unique


def test_with_confirmed_release_a_cancelled_task_holds_its_booking_until_released():
    s = _running_pair(confirm_release=True)
    (cancel_g1, cancel_g0) = sorted(s.cancel_group("g"), key=lambda c: c.task.task_id, reverse=True)
    assert s.rank_usage(0)[0] == 0 and s.rank_releasing(0) == (1600, 2)
    with pytest.raises(ValueError):
        s.forget("g")  # not released yet
    s.on_released(0, "g/0")
    s.on_released(0, "g/1")
    s.on_released(0, "g/1")  # a repeated confirmation is harmless
    assert s.rank_releasing(0) == (0, 0) and sorted(s.forget("g")) == ["g/0", "g/1"] and s.audit() == []


def test_removing_a_rank_drops_its_pending_releases_and_frees_tasks_waiting_for_it():
    s = CTBScheduler(CTBConfig(rank_token_budget=2000, probe_turn_reserve_tokens=100, staleness_throttle=False,
                               move_after_s=math.inf, low_water=1.0), (0, 1), confirm_release=True)
    s.set_accepting(1, False)
    s.submit(group("a", 1, prompt=100) + group("b", 1, prompt=100))
    s.schedule(0.0)
    s.on_turn_finished("a/0", 1200)
    s.on_turn_finished("b/0", 1000)
    assert [d.task.task_id for d in s.schedule(1.0) if isinstance(d, Pause)] == ["b/0"]
    s.set_accepting(1, True)
    assert s.schedule(2.0) == []  # b waits for rank 0 (move_after_s = inf), which is full
    requeued = s.remove_rank(0)
    assert [r.task.task_id for r in requeued] == ["a/0"]
    resumed = {d.task.task_id: d.rank for d in s.schedule(3.0) if isinstance(d, Resume)}
    assert resumed == {"a/0": 1} and s.status("b/0").state is TaskState.PAUSED  # 1200 + 1000 > 2000
    s.on_task_finished("a/0")
    assert {d.task.task_id: d.rank for d in s.schedule(4.0) if isinstance(d, Resume)} == {"b/0": 1}
    assert s.audit() == []
