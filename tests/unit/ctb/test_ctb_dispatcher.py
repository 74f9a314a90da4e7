"""CTBDispatcher: the policy glue, the carrier contract, the plugin and engine checks (no SGLang)."""

import random

import pytest
from ctb_fakes import Recorder

from tide_megatron.core.ctb import CTBConfig, GroupCancelled, TaskState
from tide_megatron.core.ctb_deadline import TrainerClock
from tide_megatron.rollout.ctb_config import CTBDispatchConfig
from tide_megatron.rollout.ctb_dispatcher import CTBDispatcher, PluginMissing, RankMismatch, RankResources
from tide_megatron.rollout.task_runner import TaskAssignment

REPORT = {"plugin": "tide_ctb"}


def _assignments(group, n, is_eval=False):
    return [TaskAssignment(task={"env": "door_game", "task_id": f"t-{group}"}, group_id=group, index=i, is_eval=is_eval)
            for i in range(n)]


def _dispatcher(ranks=2, kv=1000, rows=33, carrier=None, dispatch=None, **policy):
    cfg = CTBDispatchConfig(kv_budget_fraction=1.0, **(dispatch or {}),
                            policy=CTBConfig(**{"probe_turn_reserve_tokens": 50, "staleness_throttle": False,
                                                       "probe_only_when_tight": False, **policy}))
    carrier = carrier or Recorder()
    d = CTBDispatcher(cfg, carrier, {r: RankResources(kv, rows) for r in range(ranks)})
    carrier.dispatcher = d
    return d, carrier


def _turn(d, c, tid, context):
    rank = c.where[tid]
    d.turn_started(rank, tid, context)
    d.turn_finished(rank, tid, context, REPORT)


def _singles(d, names, prompt=100):
    for n in names:
        d.submit(_assignments(n, 1), prompt_tokens=prompt)


def test_admission_never_exceeds_any_rank_budget_under_random_growth():
    rng = random.Random(0)
    d, c = _dispatcher(ranks=2, kv=1000)
    for g in range(12):
        d.submit(_assignments(f"g{g}", 4), prompt_tokens=100)
    contexts = {}
    for step in range(400):
        d.schedule(float(step))
        for rank in d.policy.ranks:
            used, budget = d.policy.rank_usage(rank)
            assert used <= budget or len(d.policy.residents(rank)) == 1, (step, rank, used, budget)
        assert not d.policy.audit()
        running = d.policy.tasks_in(TaskState.RUNNING)
        if not running:
            if not d.policy.tasks_in(TaskState.QUEUED) and not d.policy.tasks_in(TaskState.PAUSED):
                break
            continue
        tid = rng.choice(running)
        contexts[tid] = contexts.get(tid, 100) + rng.randint(20, 120)
        _turn(d, c, tid, contexts[tid])
        if contexts[tid] > 400 or rng.random() < 0.1:
            d.task_finished(c.where[tid], tid, contexts[tid])
    assert d.stats["admits"] == 48 and len(c.of("admit")) == 48


def test_paused_task_resumes_on_its_groups_rank_when_that_rank_has_room():
    d, c = _dispatcher(ranks=2, kv=1000, low_water=1.0)
    d.quarantine(1)  # the whole group starts on rank 0
    d.submit(_assignments("g", 3), prompt_tokens=100)
    d.schedule(0.0)  # the probe only
    assert c.of("admit") == ["g/0"]
    _turn(d, c, "g/0", 150)
    d.schedule(1.0)  # the rest of the group, now that the probe measured its footprint
    assert {c.where[t] for t in ("g/0", "g/1", "g/2")} == {0}
    d.quarantine(1, False)
    d.submit(_assignments("h", 1), prompt_tokens=100)
    d.schedule(2.0)
    assert c.where["h/0"] == 1
    _turn(d, c, "h/0", 900)  # rank 1 nearly full
    _turn(d, c, "g/1", 150)
    _turn(d, c, "g/2", 150)
    _turn(d, c, "g/1", 750)  # rank 0 over budget: the lowest priority task (g/2) is paused
    d.schedule(3.0)
    assert d.policy.tasks_in(TaskState.PAUSED) == ["g/2"] and c.of("pause") == ["g/2"]
    d.task_finished(1, "h/0", 900)  # rank 1 empty: most headroom
    d.task_finished(0, "g/0", 150)  # rank 0 has room for g/2 again
    d.schedule(4.0)
    assert c.where["g/2"] == 0
    assert d.stats["resumes"] == d.stats["resumes_with_affinity"] == 1


def test_eval_tasks_are_never_starved_by_training_tasks():
    d, c = _dispatcher(ranks=1, kv=1000)
    for g in range(10):
        d.submit(_assignments(f"train{g}", 4), prompt_tokens=200)
    d.schedule(0.0)
    d.submit(_assignments("eval", 2, is_eval=True), prompt_tokens=200)
    for step in range(1, 300):
        admitted = {a.task.task_id for a in d.schedule(float(step)) if type(a).__name__ == "Admit"}
        for tid in d.policy.tasks_in(TaskState.RUNNING):
            st = d.policy.status(tid)
            _turn(d, c, tid, (st.context_tokens or 200) + 60)
        # Whenever a training task is admitted, no eval task may still wait in the queue.
        if any(not t.startswith("eval") for t in admitted):
            assert not [t for t in d.policy.tasks_in(TaskState.QUEUED) if t.startswith("eval")]
        # Eval tasks are never the ones paused while training tasks are resident.
        assert not [t for t in d.policy.tasks_in(TaskState.PAUSED) if t.startswith("eval")]
        for tid in d.policy.tasks_in(TaskState.RUNNING):
            if (d.policy.status(tid).context_tokens or 0) > 420:
                d.task_finished(c.where[tid], tid, 420)
        if d.policy.status("eval/1").state is TaskState.FINISHED:
            break
    assert d.policy.status("eval/0").state is TaskState.FINISHED
    assert d.policy.status("eval/1").state is TaskState.FINISHED
    assert d.policy.tasks_in(TaskState.QUEUED)  # training work was still waiting behind them


def test_vanilla_mode_dispatches_everything_at_once_without_tags():
    c = Recorder()
    d = CTBDispatcher(CTBDispatchConfig(enabled=False), c, {0: RankResources(100, None), 1: RankResources(100, None)})
    d.submit(_assignments("g", 6) + _assignments("h", 2, is_eval=True))
    admits = d.schedule(0.0)
    assert len(admits) == 8 and {a.rank for a in admits} == {0, 1} and len(c.of("admit")) == 8
    d.turn_started(0, "g/0", 50)
    d.turn_finished(0, "g/0", 60, None)  # no plugin report needed
    assert d.task_finished(0, "g/0", 60)


def test_a_rank_without_the_plugin_is_refused():
    d, c = _dispatcher(ranks=1)
    d.submit(_assignments("g", 1))
    d.schedule(0.0)
    tag = d.tag_fields("g/0").task_tag("admit", d.assignments["g/0"], 50)
    assert tag.task_id == "g/0" and tag.kind == "admit" and tag.footprint_tokens > 0
    d.turn_started(0, "g/0", 50)
    with pytest.raises(PluginMissing, match="rank 0"):
        d.turn_finished(0, "g/0", 60, None)


def test_first_report_of_a_rank_checks_its_engine_against_the_budgets():
    d, c = _dispatcher(ranks=2, kv=1000, rows=9)
    d.submit(_assignments("g", 1) + _assignments("h", 1))
    d.schedule(0.0)
    d.turn_finished(c.where["g/0"], "g/0", 60, {**REPORT, "kv_total": 1200, "rows_total": 9})  # consistent
    with pytest.raises(RankMismatch, match="KV pool holds 900"):
        d.turn_finished(c.where["h/0"], "h/0", 60, {**REPORT, "kv_total": 900, "rows_total": 9})
    d2, c2 = _dispatcher(ranks=1, kv=1000, rows=9)
    d2.submit(_assignments("g", 1))
    d2.schedule(0.0)
    with pytest.raises(RankMismatch, match="4 request rows"):
        d2.turn_finished(0, "g/0", 60, {**REPORT, "kv_total": 2000, "rows_total": 4})


def test_hysteresis_pauses_above_the_budget_and_resumes_only_below_low_water():
    d, c = _dispatcher(ranks=1, kv=1000, low_water=0.8)
    _singles(d, "abcde")
    d.schedule(0.0)
    assert len(d.policy.residents(0)) == 5  # 5 x 150 = 750 <= 800 (low water)
    for tid, ctx in (("a/0", 300), ("b/0", 300), ("c/0", 200), ("d/0", 150), ("e/0", 150)):
        _turn(d, c, tid, ctx)
    for step in range(20):  # 1100 > 1000: one pause, then quiet between low and high water
        d.schedule(1.0 + step * 0.01)
    assert d.policy.tasks_in(TaskState.PAUSED) == ["e/0"] and d.stats["pauses"] == 1
    assert d.policy.rank_usage(0)[0] == 950
    d.task_finished(0, "d/0", 150)  # 800: a resume (+150) would cross low water again
    d.schedule(2.0)
    assert d.stats["resumes"] == 0
    d.task_finished(0, "c/0", 200)  # 600 + 150 <= 800
    d.schedule(2.1)
    assert d.stats["resumes"] == 1 and c.where["e/0"] == 0
    assert d.stats["pauses"] == 1 and not d.policy.audit()


def test_tasks_near_their_end_or_out_of_pauses_are_not_paused_below_hard_water():
    d, c = _dispatcher(ranks=1, kv=1000, task_max_turns=3, max_pauses_per_task=1, hard_water=1.2, low_water=0.8)
    _singles(d, "ab")
    d.schedule(0.0)
    _turn(d, c, "a/0", 500)
    _turn(d, c, "b/0", 100)
    _turn(d, c, "b/0", 560)  # b has done 2 of 3 turns: its last turn is next -> protected
    d.schedule(1.0)  # 1060 > 1000 but <= 1200: only a (not protected) can go
    assert d.policy.tasks_in(TaskState.PAUSED) == ["a/0"]
    d.task_finished(0, "b/0", 560)
    d.schedule(2.0)
    assert c.where["a/0"] == 0  # resumed (its one pause is spent)
    _singles(d, "c")
    d.schedule(2.1)
    _turn(d, c, "c/0", 300)
    _turn(d, c, "a/0", 750)  # 1050: a is out of pauses, c is the only candidate
    d.schedule(3.0)
    assert d.policy.tasks_in(TaskState.PAUSED) == ["c/0"]
    _turn(d, c, "a/0", 1250)  # alone on the rank: nothing to pause, never below one resident
    d.schedule(4.0)
    assert d.policy.residents(0) == ["a/0"]
    assert not d.policy.audit()


def test_protection_is_lifted_above_hard_water():
    d, c = _dispatcher(ranks=1, kv=1000, task_max_turns=2, hard_water=1.1, low_water=0.8)
    _singles(d, "ab")
    d.schedule(0.0)
    _turn(d, c, "a/0", 600)
    _turn(d, c, "b/0", 590)  # both on their last turn, 1190 > 1100
    d.schedule(1.0)
    assert len(d.policy.tasks_in(TaskState.PAUSED)) == 1 and not d.policy.audit()


def _a_and_b_on_rank_0_then_one_paused(d, c):
    d.quarantine(1)
    _singles(d, "ab")
    d.schedule(0.0)
    d.quarantine(1, False)
    _turn(d, c, "a/0", 600)
    _turn(d, c, "b/0", 500)
    d.schedule(1.0)  # 1100 > 1000: one of them is paused on rank 0


def test_paused_task_waits_for_its_own_rank_then_moves_and_other_ranks_keep_admitting():
    d, c = _dispatcher(ranks=2, kv=1000, low_water=0.8, move_after_s=5.0)
    _a_and_b_on_rank_0_then_one_paused(d, c)
    (paused,) = d.policy.tasks_in(TaskState.PAUSED)
    _singles(d, "c")
    d.schedule(2.0)  # rank 1 is empty but the paused task waits for rank 0 (its cache)
    assert d.policy.tasks_in(TaskState.PAUSED) == [paused]
    assert c.where["c/0"] == 1  # rank 1 is not blocked: new work still goes there
    _singles(d, "d")
    d.schedule(2.5)
    assert c.where["d/0"] == 1  # rank 0 admits nothing while a task waits for it
    d.schedule(6.5)  # waited 5.5 s: moves to wherever it fits
    assert c.where[paused] == 1 and d.stats["resumes"] == 1
    assert not d.policy.audit()


def test_a_pause_keeps_the_tasks_row_and_tokens_booked_until_the_rank_confirms_the_release():
    d, c = _dispatcher(ranks=1, kv=1000, rows=4, carrier=Recorder(auto_release=False), low_water=1.0)
    _singles(d, "abc")
    d.schedule(0.0)
    assert d.policy.rank_tasks(0) == (3, 3)  # rows - 1
    _turn(d, c, "a/0", 400)
    _turn(d, c, "b/0", 400)
    _turn(d, c, "c/0", 300)  # 1100 > 1000: c is paused
    _singles(d, "d")
    d.schedule(1.0)
    assert c.of("pause") == ["c/0"]
    assert d.policy.rank_tasks(0)[0] == 3 and d.policy.rank_usage(0)[0] == 800
    assert d.policy.rank_releasing(0) == (300, 1)
    d.task_finished(0, "b/0", 400)
    d.schedule(2.0)
    assert c.of("resume") == ["c/0"]  # resume-before-admit: d still waits
    assert d.policy.rank_tasks(0)[0] == 3  # c counted twice until its pause's release is confirmed
    d.task_released(0, "c/0")
    assert d.policy.rank_tasks(0)[0] == 2 and d.policy.rank_releasing(0) == (0, 0)
    d.schedule(3.0)
    assert c.of("admit")[-1] == "d/0" and not d.policy.audit()


def test_a_carrier_that_cannot_move_tasks_restarts_the_tasks_of_a_leaving_rank():
    d, c = _dispatcher(ranks=2, kv=1000, carrier=Recorder(can_move_tasks=False), low_water=1.0)
    _a_and_b_on_rank_0_then_one_paused(d, c)
    assert c.of("pause") == ["b/0"]  # with move_after_s = inf it waits for rank 0 only
    d.schedule(100.0)
    assert c.of("resume") == []
    assert sorted(d.remove_rank(0)) == ["a/0", "b/0"]  # both runners were on rank 0
    assert sorted(c.of("cancel")) == ["a/0", "b/0"]
    assert d.policy.tasks_in(TaskState.QUEUED) == ["a/0", "b/0"] and d.stats["restarts"] == 2
    assert not d.task_finished(0, "a/0", 600)  # the old runner's late report is ignored
    d.schedule(101.0)  # from scratch on rank 1, each with its group's measured footprint
    assert c.where["a/0"] == 1 and d.policy.status("b/0").state is TaskState.QUEUED  # 600 + 500 > 1000
    d.task_finished(1, "a/0", 600)
    d.schedule(102.0)
    assert c.where["b/0"] == 1 and not d.policy.audit()


def test_a_carrier_that_moves_tasks_resumes_a_leaving_ranks_tasks_elsewhere():
    d, c = _dispatcher(ranks=2, kv=1000)
    d.quarantine(1)
    d.submit(_assignments("g", 2), prompt_tokens=100)
    d.schedule(0.0)
    _turn(d, c, "g/0", 200)
    d.schedule(1.0)
    d.quarantine(1, False)
    assert sorted(d.remove_rank(0)) == ["g/0", "g/1"] and sorted(c.of("pause")) == ["g/0", "g/1"]
    d.schedule(2.0)
    assert sorted(c.of("resume")) == ["g/0", "g/1"] and c.where["g/0"] == c.where["g/1"] == 1
    assert d.task_finished(1, "g/0", 300) and not d.policy.audit()


def test_a_group_past_its_staleness_deadline_is_cancelled_on_its_ranks_and_reported():
    d, c = _dispatcher(ranks=1, kv=10_000)
    d.submit(_assignments("g", 2), prompt_tokens=100)
    d.schedule(0.0, clock=TrainerClock(0, 10.0, 10.0))
    _turn(d, c, "g/0", 200)
    d.schedule(1.0, clock=TrainerClock(0, 10.0, 10.0))
    assert c.of("admit") == ["g/0", "g/1"]
    decisions = d.schedule(30.0, clock=TrainerClock(2, 10.0, 40.0))  # bound 1: version 0 is done for
    assert GroupCancelled("g", 0) in decisions
    assert sorted(c.of("cancel")) == ["g/0", "g/1"] and d.stats["groups_cancelled"] == 1
    assert not d.task_finished(0, "g/0", 300)  # a late finish of a cancelled task does not count
    d.forget_group("g")
    assert not d.assignments and not d.policy.audit()


def test_a_cancelled_group_is_forgotten_once_its_ranks_confirm_every_release():
    """Giving up a group (a member out of retries) while another member runs: the controller is
    done with it at once, the dispatcher keeps its tables until the rank releases the task (a
    soak run stopped here when `forget` refused the unreleased task)."""
    d, c = _dispatcher(ranks=1, kv=10_000, carrier=Recorder(auto_release=False))
    d.submit(_assignments("g", 2), prompt_tokens=100)
    d.schedule(0.0)
    _turn(d, c, "g/0", 200)  # the probe's footprint lets the rest of the group in
    d.schedule(1.0)
    assert c.of("admit") == ["g/0", "g/1"]
    assert d.task_failed(0, "g/0", "env failure")
    d.cancel_group("g")
    assert c.of("cancel") == ["g/1"]
    d.forget_group("g")  # g/1's release is not confirmed yet
    assert "g/1" in d.assignments and d.policy.rank_releasing(0)[1] == 1
    d.task_released(0, "g/1")
    assert not d.assignments and d.policy.rank_releasing(0) == (0, 0) and not d.policy.audit()


def test_a_ranks_budget_follows_what_its_engine_allocated():
    """`rollout.engine.max_total_tokens: null` leaves the pool to SGLang: the engine's report
    (`RankReady`), not the config, sizes CTB's budget and task cap, and admission uses them."""
    from tide_megatron.rollout.ctb_config import resident_cap_for_rows

    d, c = _dispatcher(ranks=2, kv=1000, rows=9)
    assert d.policy.rank_usage(0)[1] == 1000 and d.policy.rank_tasks(0)[1] == resident_cap_for_rows(9)
    assert d.engine_sized(1, RankResources(5000, 33)) == (5000, resident_cap_for_rows(33))
    assert d.policy.rank_usage(1)[1] == 5000 and d.policy.rank_tasks(1)[1] == resident_cap_for_rows(33)
    d.submit(_assignments("big", 1), prompt_tokens=3000)  # fits rank 1's pool only
    d.schedule(0.0)
    assert c.where["big/0"] == 1
    # A rank that leaves rollout and comes back keeps its engine's numbers.
    d.remove_rank(0)
    d.engine_sized(0, RankResources(4000, 17))
    d.add_rank(0, RankResources(1000, 9))
    assert d.policy.rank_usage(0)[1] == 4000 and d.policy.rank_tasks(0)[1] == resident_cap_for_rows(17)
