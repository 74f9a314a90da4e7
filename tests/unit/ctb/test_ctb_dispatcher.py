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


def _dispatcher(ranks=2, kv=1000, resident=32, **policy):
    cfg = CTBDispatchConfig(kv_budget_fraction=1.0, max_resident_tasks_per_rank=resident,
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
        d = _dispatcher(ranks=2, kv=1000)
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
