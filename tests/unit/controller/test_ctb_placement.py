"""Rank 0's CTB over remote ranks: decisions become typed mailbox messages; a configuration that
can never admit anything is an error, not a silent stall."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import ResumeTask, RunTask, TaskAssignment, TurnEvent
from tide_megatron.config import JobConfig
from tide_megatron.controller.ctb_placement import CTBPlacement
from tide_megatron.rollout.ctb_config import check_ctb_resources


def _group(gid: str, n: int = 2, is_eval: bool = False):
    task = {"env": "door_game", "task_id": f"train/{gid}", "task_type": "door_game/rooms2", "split": "train"}
    return [TaskAssignment(task=task, group_id=gid, index=i, is_eval=is_eval) for i in range(n)]


def _placement(pool_tokens: int, probe_reserve: int = 64):
    cfg = JobConfig()
    cfg.rollout.engine.max_total_tokens = pool_tokens
    cfg.ctb = dataclasses.replace(cfg.ctb, prompt_tokens_estimate=100, kv_budget_fraction=1.0,
                                  policy=dataclasses.replace(cfg.ctb.policy, probe_turn_reserve_tokens=probe_reserve))
    store = dist.HashStore()
    return CTBPlacement(cfg, Mailbox(store, 0), [1, 2]), {r: Mailbox(store, r) for r in (1, 2)}


def _turn(tid: str, phase: str, ctx: int, report=None) -> TurnEvent:
    return TurnEvent(tid, phase, ctx, report)


def test_admits_probe_first_then_group_after_its_first_turn():
    ctb, ranks = _placement(4000)
    ctb.submit(_group("g0"))
    ctb.dispatch(0.0, unconsumed_trajectories=0)
    sent = [m for r in ranks.values() for m in r.poll()]
    assert [type(m) for m in sent] == [RunTask]  # only the group's probe until it measured a turn
    probe = sent[0]
    assert {"priority", "footprint_tokens", "turn_reserve_tokens"} <= set(probe.tag)
    tid = probe.assignment.trajectory_id
    ctb.on_turn(_turn(tid, "started", 120))
    ctb.on_turn(_turn(tid, "finished", 130, {"context_tokens": 131}))
    ctb.dispatch(0.1, unconsumed_trajectories=0)
    assert [type(m) for r in ranks.values() for m in r.poll()] == [RunTask]  # the rest of the group


def test_eval_tasks_are_admitted_first():
    ctb, ranks = _placement(4000)
    ctb.submit(_group("train0"))
    ctb.submit(_group("eval0", is_eval=True))
    ctb.dispatch(0.0, unconsumed_trajectories=0)
    first = [m for r in ranks.values() for m in r.poll()]
    assert first and first[0].assignment.is_eval


def test_a_paused_task_resumes_on_the_rank_that_holds_it():
    ctb, ranks = _placement(1000)
    ctb.submit(_group("g0", n=3))
    ctb.dispatch(0.0)
    probe = [m for r in ranks.values() for m in r.poll()][0]
    home = probe.src if probe.src >= 0 else None
    tid = probe.assignment.trajectory_id
    ctb.on_turn(_turn(tid, "started", 100))
    ctb.on_turn(_turn(tid, "finished", 120))
    ctb.dispatch(0.1)
    for r in ranks.values():
        r.poll()
    holder = ctb.running_on(tid)
    assert holder in (1, 2) and home is not None
    # Grow every resident past the budget: the lowest-priority ones pause, and resume where they are held.
    for t in list(ctb.assignments):
        if ctb.running_on(t) is not None:
            ctb.on_turn(_turn(t, "started", 600))
    ctb.dispatch(0.2)
    for t in list(ctb.assignments):
        if ctb.running_on(t) is not None and ctb.policy.status(t).state.value == "running":
            ctb.on_turn(_turn(t, "finished", 100))
    ctb.dispatch(0.3)
    resumes = [(rank, m) for rank, r in ranks.items() for m in r.poll() if isinstance(m, ResumeTask)]
    assert all(ctb.running_on(m.task_id) == rank for rank, m in resumes)


def test_unadmittable_probe_is_a_clear_error_at_start():
    cfg = JobConfig()
    cfg.ctb = dataclasses.replace(cfg.ctb, prompt_tokens_estimate=100,
                                  policy=dataclasses.replace(cfg.ctb.policy, probe_turn_reserve_tokens=2048))
    with pytest.raises(ValueError, match="ctb.prompt_tokens_estimate \\+ ctb.policy.probe_turn_reserve_tokens"):
        check_ctb_resources(cfg.ctb, max_running_requests=cfg.rollout.engine.max_running_requests, max_total_tokens=500)
