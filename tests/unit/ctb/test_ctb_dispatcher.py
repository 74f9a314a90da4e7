"""CTBDispatcher policy glue, with stand-in engines (no SGLang)."""

import asyncio
import random
from types import SimpleNamespace

import pytest

from tide_megatron.core.ctb import CTBConfig, TaskState
from tide_megatron.rollout.ctb_dispatcher import CTBDispatchConfig, CTBDispatcher, PluginMissing
from tide_megatron.rollout.task_runner import TaskAssignment


class FakeEngine:
    def __init__(self, kv_tokens):
        self.cfg = SimpleNamespace(max_total_tokens=kv_tokens)
        self.weight_version = 0
        self.closed = []

    async def close_session(self, session_id):
        self.closed.append(session_id)


REPORT = {"plugin": "tide_ctb"}


def _assignments(group, n, is_eval=False):
    return [TaskAssignment(task={"env": "door_game", "task_id": f"t-{group}"}, group_id=group, index=i, is_eval=is_eval)
            for i in range(n)]


def _dispatcher(ranks=2, kv=1000, resident=32, dispatch=None, **policy):
    cfg = CTBDispatchConfig(kv_budget_fraction=1.0, max_resident_tasks_per_rank=resident, **(dispatch or {}),
                            policy=CTBConfig(probe_turn_reserve_tokens=50, staleness_throttle=False, **policy))
    return CTBDispatcher(cfg, {r: FakeEngine(kv) for r in range(ranks)})


def _turn(d, tid, context):
    d.turn_started(tid, context, "turn")
    d.turn_finished(tid, context, REPORT)


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_admission_never_exceeds_any_rank_budget_under_random_growth():
    async def body():
        rng = random.Random(0)
        d = _dispatcher(ranks=2, kv=1000)
        for g in range(12):
            d.submit(_assignments(f"g{g}", 4), prompt_tokens=100)
        contexts = {}
        for step in range(400):
            d.schedule(float(step))
            for rank in d.policy.ranks:
                used, budget = d.policy.rank_usage(rank)
                residents = d.policy.residents(rank)
                assert used <= budget or len(residents) == 1, (step, rank, used, budget)
            assert not d.policy.audit()
            running = d.policy.tasks_in(TaskState.RUNNING)
            if not running:
                if not d.policy.tasks_in(TaskState.QUEUED) and not d.policy.tasks_in(TaskState.PAUSED):
                    break
                continue
            tid = rng.choice(running)
            contexts[tid] = contexts.get(tid, 100) + rng.randint(20, 120)
            _turn(d, tid, contexts[tid])
            if contexts[tid] > 400 or rng.random() < 0.1:
                d.task_finished(tid, contexts[tid])
        assert d.stats["admits"] == 48
        await asyncio.sleep(0)
    run(body)


def test_paused_task_resumes_on_its_groups_rank_when_that_rank_has_room():
    async def body():
        d = _dispatcher(ranks=2, kv=1000, dispatch={"low_water": 1.0})
        d.quarantine(1)  # the whole group starts on rank 0
        d.submit(_assignments("g", 3), prompt_tokens=100)
        d.schedule(0.0)  # the probe only
        _turn(d, "g/0", 150)
        d.schedule(1.0)  # the rest of the group, now that the probe measured its footprint
        assert {d.handles[t].rank for t in ("g/0", "g/1", "g/2")} == {0}
        d.quarantine(1, False)
        d.submit(_assignments("h", 1), prompt_tokens=100)
        d.schedule(2.0)
        assert d.handles["h/0"].rank == 1
        _turn(d, "h/0", 900)  # rank 1 nearly full
        _turn(d, "g/1", 150)
        _turn(d, "g/2", 150)
        d.handles["g/2"].session_id, d.handles["g/2"].session_rank = "s-g2", 0
        _turn(d, "g/1", 750)  # rank 0 over budget: the lowest priority task (g/2) is paused
        d.schedule(3.0)
        assert d.policy.tasks_in(TaskState.PAUSED) == ["g/2"] and d.handles["g/2"].rank is None
        await asyncio.sleep(0.01)
        assert d.engines[0].closed == ["s-g2"]  # pausing released its session: KV now evictable
        d.task_finished("h/0", 900)  # rank 1 empty: most headroom
        d.task_finished("g/0", 150)  # rank 0 has room for g/2 again
        d.schedule(4.0)
        assert d.handles["g/2"].rank == 0
        assert d.stats["resumes"] == d.stats["resumes_with_affinity"] == 1
    run(body)


def test_eval_tasks_are_never_starved_by_training_tasks():
    async def body():
        d = _dispatcher(ranks=1, kv=1000)
        for g in range(10):
            d.submit(_assignments(f"train{g}", 4), prompt_tokens=200)
        d.schedule(0.0)
        d.submit(_assignments("eval", 2, is_eval=True), prompt_tokens=200)
        for step in range(1, 300):
            admitted = {a.task.task_id for a in d.schedule(float(step))}
            for tid in d.policy.tasks_in(TaskState.RUNNING):
                st = d.policy.status(tid)
                _turn(d, tid, (st.context_tokens or 200) + 60)
            # Whenever a training task is admitted, no eval task may still wait in the queue.
            if any(not t.startswith("eval") for t in admitted):
                assert not [t for t in d.policy.tasks_in(TaskState.QUEUED) if t.startswith("eval")]
            # Eval tasks are never the ones paused while training tasks are resident.
            for tid in d.policy.tasks_in(TaskState.PAUSED):
                assert not tid.startswith("eval")
            for tid in d.policy.tasks_in(TaskState.RUNNING):
                if (d.policy.status(tid).context_tokens or 0) > 420:
                    d.task_finished(tid, 420)
            if d.policy.status("eval/1").state is TaskState.FINISHED:
                break
        assert d.policy.status("eval/0").state is TaskState.FINISHED
        assert d.policy.status("eval/1").state is TaskState.FINISHED
        assert d.policy.tasks_in(TaskState.QUEUED)  # training work was still waiting behind them
    run(body)


def test_resident_task_bound_keeps_session_slots_free():
    async def body():
        d = _dispatcher(ranks=1, kv=100_000, resident=5)
        d.submit(_assignments("g", 1), prompt_tokens=10)
        d.schedule(0.0)
        _turn(d, "g/0", 20)
        d.submit(_assignments("h", 20), prompt_tokens=10)
        d.schedule(1.0)
        _turn(d, "h/0", 20)
        admits = d.schedule(2.0)
        placed = [t for t, h in d.handles.items() if h.rank == 0]
        assert len(placed) == 5 and len(admits) > 5  # the rest hold a reservation and wait for a slot
        d.task_finished(placed[-1], 30)
        d.schedule(3.0)
        assert len([t for t, h in d.handles.items() if h.rank == 0]) == 5
    run(body)


def test_vanilla_mode_dispatches_everything_at_once_without_tags():
    async def body():
        cfg = CTBDispatchConfig(enabled=False)
        d = CTBDispatcher(cfg, {0: FakeEngine(100), 1: FakeEngine(100)})
        d.submit(_assignments("g", 6) + _assignments("h", 2, is_eval=True))
        admits = d.schedule(0.0)
        assert len(admits) == 8 and {a.rank for a in admits} == {0, 1}
        assert d.turn_started("g/0", 50, "admit") is None
        d.turn_finished("g/0", 60, None)  # no plugin report needed
    run(body)


def test_a_rank_without_the_plugin_is_refused():
    async def body():
        d = _dispatcher(ranks=1)
        d.submit(_assignments("g", 1))
        d.schedule(0.0)
        tag = d.turn_started("g/0", 50, "admit")
        assert tag.task_id == "g/0" and tag.kind == "admit" and tag.footprint_tokens > 0
        with pytest.raises(PluginMissing):
            d.turn_finished("g/0", 60, None)
    run(body)


def _singles(d, names, prompt=100):
    for n in names:
        d.submit(_assignments(n, 1), prompt_tokens=prompt)


def test_hysteresis_pauses_above_the_budget_and_resumes_only_below_low_water():
    async def body():
        d = _dispatcher(ranks=1, kv=1000, dispatch={"low_water": 0.8})
        _singles(d, "abcde")
        d.schedule(0.0)
        assert len(d.policy.residents(0)) == 5  # 5 x 150 = 750 <= 800 (low water)
        for tid, ctx in (("a/0", 300), ("b/0", 300), ("c/0", 200), ("d/0", 150), ("e/0", 150)):
            _turn(d, tid, ctx)
        for step in range(20):  # 1100 > 1000: one pause, then quiet between low and high water
            d.schedule(1.0 + step * 0.01)
        assert d.policy.tasks_in(TaskState.PAUSED) == ["e/0"] and d.stats["pauses"] == 1
        assert d.policy.rank_usage(0)[0] == 950
        d.task_finished("d/0", 150)  # 800: a resume (+150) would cross low water again
        d.schedule(2.0)
        assert d.stats["resumes"] == 0
        d.task_finished("c/0", 200)  # 600 + 150 <= 800
        d.schedule(2.1)
        assert d.stats["resumes"] == 1 and d.handles["e/0"].rank == 0
        assert d.stats["pauses"] == 1 and not d.policy.audit()
    run(body)


def test_tasks_near_their_end_or_out_of_pauses_are_not_paused_below_hard_water():
    async def body():
        d = _dispatcher(ranks=1, kv=1000, dispatch={"task_max_turns": 3, "max_pauses_per_task": 1,
                                                    "hard_water": 1.2, "low_water": 0.8})
        _singles(d, "ab")
        d.schedule(0.0)
        _turn(d, "a/0", 500)
        _turn(d, "b/0", 100)
        _turn(d, "b/0", 560)  # b has done 2 of 3 turns: its last turn is next -> protected
        d.schedule(1.0)  # 1060 > 1000 but <= 1200: only a (not protected) can go
        assert d.policy.tasks_in(TaskState.PAUSED) == ["a/0"]
        d.task_finished("b/0", 560)
        d.schedule(2.0)
        assert d.handles["a/0"].rank == 0  # resumed (its one pause is spent)
        _singles(d, "c")
        d.schedule(2.1)
        _turn(d, "c/0", 300)
        _turn(d, "a/0", 750)  # 1050: a is out of pauses, c is the only candidate
        d.schedule(3.0)
        assert d.policy.tasks_in(TaskState.PAUSED) == ["c/0"]
        _turn(d, "a/0", 1250)  # alone on the rank: nothing to pause, never below one resident
        d.schedule(4.0)
        assert d.policy.residents(0) == ["a/0"]
        assert not d.policy.audit()
    run(body)


def test_protection_is_lifted_above_hard_water():
    async def body():
        d = _dispatcher(ranks=1, kv=1000, dispatch={"task_max_turns": 2, "hard_water": 1.1, "low_water": 0.8})
        _singles(d, "ab")
        d.schedule(0.0)
        _turn(d, "a/0", 600)
        _turn(d, "b/0", 590)  # both on their last turn, 1190 > 1100
        d.schedule(1.0)
        assert len(d.policy.tasks_in(TaskState.PAUSED)) == 1 and not d.policy.audit()
    run(body)


def test_paused_task_waits_for_its_own_rank_then_moves_and_other_ranks_keep_admitting():
    async def body():
        d = _dispatcher(ranks=2, kv=1000, dispatch={"low_water": 0.8, "move_after_s": 5.0})
        d.quarantine(1)
        _singles(d, "ab")
        d.schedule(0.0)
        d.quarantine(1, False)
        _turn(d, "a/0", 600)
        _turn(d, "b/0", 500)
        d.schedule(1.0)
        (paused,) = d.policy.tasks_in(TaskState.PAUSED)
        _singles(d, "c")
        d.schedule(2.0)  # rank 1 is empty but the paused task waits for rank 0 (its cache)
        assert d.policy.tasks_in(TaskState.PAUSED) == [paused]
        assert d.handles["c/0"].rank == 1  # rank 1 is not blocked: new work still goes there
        _singles(d, "d")
        d.schedule(2.5)
        assert d.handles["d/0"].rank == 1  # rank 0 admits nothing while a task waits for it
        d.schedule(6.5)  # waited 5.5 s: moves to wherever it fits
        assert d.handles[paused].rank == 1 and d.stats["resumes"] == 1
        assert not d.policy.audit()
    run(body)
