"""No configuration the start-up check accepts lets resident tasks hold every request row.

An independent model of the engines' rows (what `benchmarks/ctb_rows.py` measured): a task holds
one row on a rank from its first turn there until the rank has released it (a confirmed pause
or cancel), or it finished or failed. Releases are confirmed late, in random order; pauses,
resumes, moves, failures, retries, cancels and rank changes happen at random. At every step each
rank keeps at least one row free, so any resident task's next turn can be admitted."""

import math
import random

from ctb_fakes import Recorder
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core.ctb import CTBConfig, TaskState
from tide_megatron.rollout.ctb_config import CTBDispatchConfig, check_ctb_resources
from tide_megatron.rollout.ctb_dispatcher import CTBDispatcher, RankResources
from tide_megatron.rollout.task_runner import TaskAssignment


def _group(gid, n):
    return [TaskAssignment(task={"env": "e", "task_id": gid}, group_id=gid, index=i) for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(2, 10), n_ranks=st.integers(1, 3),
       movable=st.booleans(), kv=st.integers(400, 4000))
def test_resident_tasks_never_hold_every_row(seed, rows, n_ranks, movable, kv):
    rng = random.Random(seed)
    cap = rng.choice([None, rng.randint(1, rows - 1)])
    cfg = CTBDispatchConfig(max_resident_tasks_per_rank=cap, prompt_tokens_estimate=50,
                            policy=CTBConfig(probe_turn_reserve_tokens=50, staleness_throttle=False,
                                             env_concurrency=rng.randint(4, 64),
                                             move_after_s=rng.choice([0.0, 2.0, math.inf])))
    check_ctb_resources(cfg, max_running_requests=rows, max_total_tokens=kv)  # an accepted configuration
    carrier = Recorder(can_move_tasks=movable, auto_release=False)
    d = CTBDispatcher(cfg, carrier, {r: RankResources(kv, rows) for r in range(n_ranks)})
    carrier.dispatcher = d
    holding = {r: set() for r in range(n_ranks)}  # the model: rows held by tasks on each rank
    pending: list[tuple[int, str]] = []  # pauses and cancels not yet released by their rank
    seen_calls = 0
    next_rank, groups = n_ranks, 0
    context: dict[str, int] = {}

    def drop_everywhere(tid):
        for held in holding.values():
            held.discard(tid)
        pending[:] = [(r, t) for r, t in pending if t != tid]

    for step in range(250):
        d.schedule(float(step))
        for kind, rank, tid in carrier.calls[seen_calls:]:
            if kind in ("pause", "cancel"):
                pending.append((rank, tid))
        seen_calls = len(carrier.calls)
        for r, held in holding.items():
            assert len(held) <= rows - 1, f"rank {r}: tasks hold {len(held)} of {rows} rows"
        roll = rng.random()
        running = [t for t in d.policy.tasks_in(TaskState.RUNNING)
                   if carrier.where.get(t) is not None and all(t != p for _r, p in pending)]
        if roll < 0.08 or not (running or pending):
            d.submit(_group(f"g{groups}", rng.randint(1, 4)))
            groups += 1
        elif roll < 0.55 and running:
            tid = rng.choice(running)
            rank = carrier.where[tid]
            holding[rank].add(tid)  # its session takes (or keeps) a row there
            context[tid] = context.get(tid, 50) + rng.randint(0, kv // 6)
            d.turn_started(rank, tid, context[tid])
            d.turn_finished(rank, tid, context[tid], {"plugin": "tide_ctb"})
        elif roll < 0.75 and pending:
            rank, tid = pending.pop(rng.randrange(len(pending)))
            if rank in holding:
                holding[rank].discard(tid)
            d.task_released(rank, tid)
        elif roll < 0.85:
            live = d.policy.tasks_in(TaskState.RUNNING) + d.policy.tasks_in(TaskState.PAUSED)
            if live:
                tid = rng.choice(live)
                rank = d.runner_rank[tid]
                drop_everywhere(tid)
                if rng.random() < 0.7:
                    assert d.task_finished(rank, tid, context.get(tid))
                else:
                    assert d.task_failed(rank, tid, "boom")
                    if rng.random() < 0.5:
                        d.requeue_failed(tid)
                    else:
                        d.cancel_group(d.assignments[tid].group_id)
        elif roll < 0.9 and groups:
            d.cancel_group(f"g{rng.randrange(groups)}")
        elif roll < 0.95 and len(d.policy.ranks) > 1:
            victim = rng.choice(d.policy.ranks)
            d.remove_rank(victim)
            del holding[victim]  # its engine is gone, rows and all
            pending[:] = [(r, t) for r, t in pending if r != victim]
        else:
            d.add_rank(next_rank, RankResources(kv, rows))
            holding[next_rank] = set()
            next_rank += 1
        assert not d.policy.audit()
