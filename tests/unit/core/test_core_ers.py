import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core import (
    CTBConfig,
    CTBScheduler,
    Deficits,
    ERSConfig,
    ERSPlanner,
    RA2PMode,
    Role,
    RolePlan,
    RolloutTask,
    TaskState,
)

GEN = Deficits(generation=True, consumption=False, reasons=("gen",))
CONS = Deficits(generation=False, consumption=True, reasons=("cons",))
NONE = Deficits(False, False)
BOTH = Deficits(True, True)


def plan_of(roles, mode):
    return RolePlan(dict(enumerate(roles)), mode)


R, A, F, AR = Role.ROLLOUT, Role.ACTOR, Role.REF, Role.ACTOR_REF


def test_initial_plan_is_maximal_rollout_colocated():
    p = ERSPlanner(ERSConfig(min_trainer_ranks=2), 8).initial_plan()
    assert p.mode is RA2PMode.COLOCATED and p.trainer_ranks == [0, 1] and len(p.rollout_ranks) == 6
    assert all(p.roles[r] is AR for r in (0, 1))


def test_deficit_must_persist_trigger_steps():
    ers = ERSPlanner(ERSConfig(trigger_steps=3, cooldown_steps=0), 6)
    cur = plan_of([AR, AR, AR, R, R, R], RA2PMode.COLOCATED)
    assert not ers.plan(cur, GEN, step=0).changed
    assert not ers.plan(cur, GEN, step=1).changed
    assert ers.plan(cur, GEN, step=2).changed


def test_interrupted_streak_restarts():
    ers = ERSPlanner(ERSConfig(trigger_steps=2, cooldown_steps=0), 6)
    cur = plan_of([AR, AR, AR, R, R, R], RA2PMode.COLOCATED)
    ers.plan(cur, CONS, step=0)
    ers.plan(cur, NONE, step=1)
    assert not ers.plan(cur, CONS, step=2).changed
    assert ers.plan(cur, CONS, step=3).changed


def test_cooldown_blocks_back_to_back_changes():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=2), 6)
    cur = plan_of([AR, AR, AR, R, R, R], RA2PMode.COLOCATED)
    cur = ers.plan(cur, CONS, step=0)
    assert cur.changed
    assert not ers.plan(cur, CONS, step=1).changed and ers.plan(cur, CONS, step=2).reason == "cooldown"
    assert ers.plan(cur, CONS, step=3).changed


def test_consumption_deficit_decouples_with_a_reclaimed_ref_rank():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0), 6)
    cur = plan_of([AR, AR, AR, R, R, R], RA2PMode.COLOCATED)
    nxt = ers.plan(cur, CONS, step=0, rollout_load={3: 50.0, 4: 10.0, 5: 10.0})
    assert nxt.mode is RA2PMode.DECOUPLED
    assert nxt.roles[5] is F  # least loaded; tie -> highest id
    assert [nxt.roles[r] for r in (0, 1, 2, 3, 4)] == [A, A, A, R, R]
    assert nxt.ranks_leaving_rollout(cur) == [5]


def test_consumption_deficit_when_decoupled_adds_one_trainer_rank():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0, actors_per_ref=2), 8)
    cur = plan_of([A, A, F, R, R, R, R, R], RA2PMode.DECOUPLED)
    nxt = ers.plan(cur, CONS, step=0)
    assert len(nxt.trainer_ranks) == 4 and nxt.roles[7] is A
    nxt2 = ers.plan(nxt, CONS, step=1)
    assert nxt2.roles[6] is F  # 3 actors > 2 per ref


def test_consumption_deficit_without_spare_rollout_turns_a_colocated_rank_into_ref():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0, min_rollout_ranks=2), 4)
    cur = plan_of([AR, AR, R, R], RA2PMode.COLOCATED)
    nxt = ers.plan(cur, CONS, step=0)
    assert nxt.mode is RA2PMode.DECOUPLED and [nxt.roles[r] for r in range(4)] == [A, F, R, R]
    single = plan_of([AR, R, R], RA2PMode.COLOCATED)
    ers2 = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0, min_rollout_ranks=2), 3)
    assert not ers2.plan(single, CONS, step=0).changed


def test_generation_deficit_returns_ref_ranks_to_rollout():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0), 8)
    cur = plan_of([A, A, A, F, R, R, R, R], RA2PMode.DECOUPLED)
    nxt = ers.plan(cur, GEN, step=0)
    assert nxt.mode is RA2PMode.COLOCATED
    assert [nxt.roles[r] for r in range(4)] == [AR, AR, AR, R]
    assert nxt.ranks_joining_rollout(cur) == [3]


def test_generation_deficit_when_colocated_releases_one_trainer_rank_down_to_minimum():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0, min_trainer_ranks=2), 6)
    cur = plan_of([AR, AR, AR, R, R, R], RA2PMode.COLOCATED)
    nxt = ers.plan(cur, GEN, step=0)
    assert nxt.trainer_ranks == [0, 1] and nxt.roles[2] is R
    assert not ers.plan(nxt, GEN, step=1).changed


def test_generation_wins_when_both_deficits_fire():
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0), 6)
    cur = plan_of([A, A, F, R, R, R], RA2PMode.DECOUPLED)
    assert ers.plan(cur, BOTH, step=0).mode is RA2PMode.COLOCATED


def test_cold_start_and_eval_phase_maximise_rollout_preemptively():
    ers = ERSPlanner(ERSConfig(trigger_steps=5, min_trainer_ranks=1), 6)
    cur = plan_of([A, A, A, F, R, R], RA2PMode.DECOUPLED)
    nxt = ers.plan(cur, NONE, step=0, eval_phase=True)
    assert nxt.changed and nxt.trainer_ranks == [0] and nxt.roles[0] is AR and nxt.mode is RA2PMode.COLOCATED
    assert "evaluation" in nxt.reason
    assert ers.plan(cur, NONE, step=0, cold_start=True).trainer_ranks == [0]


def test_disabled_ers_keeps_the_plan():
    ers = ERSPlanner(ERSConfig(enabled=False, trigger_steps=1), 4)
    cur = plan_of([AR, R, R, R], RA2PMode.COLOCATED)
    nxt = ers.plan(cur, CONS, step=0, cold_start=True)
    assert not nxt.changed and nxt.roles == cur.roles


def test_role_plan_validation():
    with pytest.raises(ValueError):
        plan_of([AR, F, R], RA2PMode.DECOUPLED)
    with pytest.raises(ValueError):
        plan_of([A, R], RA2PMode.DECOUPLED)   # no ref
    with pytest.raises(ValueError):
        plan_of([A, F], RA2PMode.COLOCATED)
    with pytest.raises(ValueError):
        ERSPlanner(ERSConfig(min_rollout_ranks=3, min_trainer_ranks=2), 4)


@settings(max_examples=100, deadline=None)
@given(world=st.integers(2, 12), seq=st.lists(st.sampled_from(["gen", "cons", "none", "both", "eval"]), max_size=40),
       k=st.integers(1, 3), cooldown=st.integers(0, 2), min_roll=st.integers(0, 2), min_train=st.integers(1, 2))
def test_random_signal_sequences_give_legal_bounded_plans(world, seq, k, cooldown, min_roll, min_train):
    if world < min_roll + min_train:
        return
    cfg = ERSConfig(trigger_steps=k, cooldown_steps=cooldown, min_rollout_ranks=min_roll, min_trainer_ranks=min_train)
    ers = ERSPlanner(cfg, world)
    cur = ers.initial_plan()
    last_reactive = None
    for step, sig in enumerate(seq):
        d = {"gen": GEN, "cons": CONS, "none": NONE, "both": BOTH, "eval": NONE}[sig]
        nxt = ers.plan(cur, d, step=step, eval_phase=sig == "eval")
        assert set(nxt.roles) == set(range(world))
        assert len(nxt.trainer_ranks) - len(cur.trainer_ranks) <= 1
        assert len(nxt.actor_ranks) >= min_train
        if nxt.changed and sig != "eval":
            assert len(nxt.rollout_ranks) >= min(min_roll, len(cur.rollout_ranks))
            if last_reactive is not None:
                assert step - last_reactive > cooldown
            last_reactive = step
        elif nxt.changed:
            last_reactive = step
        cur = nxt


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), world=st.integers(3, 8))
def test_role_changes_never_lose_a_rollout_task(seed, world):
    """ERS plans drive CTB rank membership: every task stays queued, running, paused or finished."""
    rng = random.Random(seed)
    ers = ERSPlanner(ERSConfig(trigger_steps=1, cooldown_steps=0, min_rollout_ranks=1), world)
    plan = ers.initial_plan()
    ctb = CTBScheduler(CTBConfig(rank_token_budget=8000, env_concurrency=64, trainer_batch_trajectories=64,
                                 probe_turn_reserve_tokens=300), plan.rollout_ranks)
    tasks = [RolloutTask(f"{g}/{i}", g, "t", 200) for g in range(12) for i in range(4)]
    ctb.submit(tasks)
    finished = set()
    for step in range(30):
        for _ in range(rng.randint(1, 8)):
            for d in ctb.schedule(float(step)):
                pass
            running = ctb.tasks_in(TaskState.RUNNING)
            if running:
                tid = rng.choice(running)
                if rng.random() < 0.3:
                    ctb.on_task_finished(tid)
                    finished.add(tid)
                else:
                    ctb.on_turn_finished(tid, rng.randint(200, 2500))
        d = rng.choice([GEN, CONS, NONE])
        nxt = ers.plan(plan, d, step=step, rollout_load={r: ctb.rank_usage(r)[0] for r in plan.rollout_ranks})
        for r in nxt.ranks_leaving_rollout(plan):
            held = set(ctb.residents(r))
            back = {q.task.task_id for q in ctb.remove_rank(r)}
            assert back == held and all(ctb.status(t).state is TaskState.PAUSED for t in held)
        for r in nxt.ranks_joining_rollout(plan):
            ctb.add_rank(r)
        ctb.on_weight_sync()
        plan = nxt
        assert ctb.ranks == plan.rollout_ranks
        states = {s: set(ctb.tasks_in(s)) for s in TaskState}
        assert sum(map(len, states.values())) == len(tasks)
        assert set().union(*states.values()) == {t.task_id for t in tasks}
        assert states[TaskState.FINISHED] == finished
        assert ctb.audit() == []
