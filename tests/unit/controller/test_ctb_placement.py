"""Rank 0's CTB over remote ranks: decisions become typed mailbox messages; a configuration that
can never admit anything is an error, not a silent stall."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import PauseTask, ReleaseCarry, ResumeTask, RunTask, TaskAssignment, TurnEvent
from tide_megatron.config import JobConfig
from tide_megatron.controller.ctb_placement import CTBPlacement
from tide_megatron.rollout.ctb_config import check_ctb_resources


def _group(gid: str, n: int = 2, is_eval: bool = False):
    task = {"env": "door_game", "task_id": f"train/{gid}", "task_type": "door_game/rooms2", "split": "train"}
    return [TaskAssignment(task=task, group_id=gid, index=i, is_eval=is_eval) for i in range(n)]


def _placement(pool_tokens: int, probe_reserve: int = 64, rank_ids=(1, 2)):
    cfg = JobConfig()
    cfg.rollout.engine.max_total_tokens = pool_tokens
    cfg.ctb = dataclasses.replace(cfg.ctb, prompt_tokens_estimate=100, kv_budget_fraction=1.0,
                                  policy=dataclasses.replace(cfg.ctb.policy, probe_turn_reserve_tokens=probe_reserve,
                                                                     probe_only_when_tight=False))
    store = dist.HashStore()
    return CTBPlacement(cfg, Mailbox(store, 0), list(rank_ids)), {r: Mailbox(store, r) for r in rank_ids}


def _turn(tid: str, phase: str, ctx: int, report=None, rank: int = 1) -> TurnEvent:
    event = TurnEvent(tid, phase, ctx, report if report is not None else {"context_tokens": ctx})
    event.src = rank  # set by the mailbox on receipt
    return event


def test_admits_probe_first_then_group_after_its_first_turn():
    ctb, ranks = _placement(4000)
    ctb.submit(_group("g0"))
    ctb.dispatch(0.0, unconsumed_trajectories=0)
    sent = [m for r in ranks.values() for m in r.poll()]
    assert [type(m) for m in sent] == [RunTask]  # only the group's probe until it measured a turn
    probe = sent[0]
    assert {"priority", "footprint_tokens", "turn_reserve_tokens"} <= set(probe.tag)
    tid = probe.assignment.trajectory_id
    rank = ctb.dispatcher.runner_rank[tid]
    ctb.on_turn(_turn(tid, "started", 120, rank=rank))
    ctb.on_turn(_turn(tid, "finished", 130, {"context_tokens": 131}, rank=rank))
    ctb.dispatch(0.1, unconsumed_trajectories=0)
    assert [type(m) for r in ranks.values() for m in r.poll()] == [RunTask]  # the rest of the group


def test_eval_tasks_are_admitted_first():
    ctb, ranks = _placement(4000)
    ctb.submit(_group("train0"))
    ctb.submit(_group("eval0", is_eval=True))
    ctb.dispatch(0.0, unconsumed_trajectories=0)
    first = [m for r in ranks.values() for m in r.poll()]
    assert first and first[0].assignment.is_eval


def test_a_paused_task_resumes_on_the_rank_that_holds_it_after_its_release():
    ctb, ranks = _placement(1000)
    d, _, _ = _admitted(ctb, ranks, n=3)
    # Every resident grows past its rank's budget: the lowest-priority ones are paused.
    for t, rank in list(d.runner_rank.items()):
        ctb.on_turn(_turn(t, "started", 600, rank=rank))
    ctb.dispatch(0.2)
    pauses = [(rank, m) for rank, r in ranks.items() for m in r.poll() if isinstance(m, PauseTask)]
    assert pauses
    for t, rank in list(d.runner_rank.items()):
        if d.policy.status(t).state.value == "running":
            ctb.on_turn(_turn(t, "finished", 100, rank=rank))
    ctb.dispatch(0.3)
    # No resume before the rank confirms it released the paused task's session and row.
    assert not any(isinstance(m, ResumeTask) for r in ranks.values() for m in r.poll())
    for rank, m in pauses:
        ctb.released(m.task_id, rank)
    ctb.dispatch(0.4)
    resumes = [(rank, m) for rank, r in ranks.items() for m in r.poll() if isinstance(m, ResumeTask)]
    assert resumes and all(d.runner_rank[m.task_id] == rank for rank, m in resumes)


def test_unadmittable_probe_is_a_clear_error_at_start():
    cfg = JobConfig()
    cfg.ctb = dataclasses.replace(cfg.ctb, prompt_tokens_estimate=100,
                                  policy=dataclasses.replace(cfg.ctb.policy, probe_turn_reserve_tokens=2048))
    with pytest.raises(ValueError, match="ctb.prompt_tokens_estimate \\+ ctb.policy.probe_turn_reserve_tokens"):
        check_ctb_resources(cfg.ctb, max_running_requests=cfg.rollout.engine.max_running_requests, max_total_tokens=500)


def _admitted(ctb, ranks, gid="g0", n=4):
    """Submit a group and admit every member (the probe measured first)."""
    d = ctb.dispatcher
    ctb.submit(_group(gid, n=n))
    ctb.dispatch(0.0)
    (probe,) = [m for r in ranks.values() for m in r.poll()]
    tid = probe.assignment.trajectory_id
    ctb.on_turn(_turn(tid, "started", 100, rank=d.runner_rank[tid]))
    ctb.on_turn(_turn(tid, "finished", 120, rank=d.runner_rank[tid]))
    ctb.dispatch(0.1)
    for r in ranks.values():
        r.poll()
    assert len(d.runner_rank) == n
    src = d.runner_rank[tid]  # CTB keeps a group together: the rank that leaves
    return d, src, 3 - src


def test_a_rank_leaving_rollout_hands_its_tasks_over_and_ctb_starts_each_elsewhere_once_its_state_is_here():
    ctb, ranks = _placement(100_000)
    d, src, dst = _admitted(ctb, ranks)
    leaving = sorted(t for t, r in d.runner_rank.items() if r == src)
    assert leaving and ctb.hands_over
    assert ctb.hand_off_rank(src) == leaving
    assert all(ctb.in_transit(t) for t in leaving)
    first, *rest = leaving
    ctb.carried(first, {"claim": "c0"})  # its state arrives before CTB resumes it
    ctb.dispatch(0.2)  # CTB resumes the handed-over tasks on the other rank
    started = [m for m in ranks[dst].poll() if isinstance(m, RunTask)]
    assert [(m.assignment.trajectory_id, m.carry) for m in started] == [(first, {"claim": "c0"})]
    for i, tid in enumerate(rest):  # resumed already: each starts the moment its state comes
        assert ctb.carried(tid, {"claim": f"c{i + 1}"})
        (m,) = ranks[dst].poll()
        assert isinstance(m, RunTask) and m.assignment.trajectory_id == tid and m.carry == {"claim": f"c{i + 1}"}
    assert not ranks[src].poll() and not any(ctb.in_transit(t) for t in leaving)
    assert {d.runner_rank[t] for t in leaving} == {dst} and d.stats["carried"] == len(leaving)
    for tid in list(d.runner_rank):
        assert ctb.finished(tid, dst)
    assert not d.policy.audit()


def test_a_task_resumed_on_a_second_leaving_rank_before_its_state_came_is_not_handed_over_twice():
    """Two ranks leave: CTB resumed the first one's tasks on the second while their states were
    on their way. The second never held them, so it hands none of them over (the first answers
    for them); their states start them on a rank that stays. Handed over twice, the first
    rank's answer read as a stranger's and the task waited for the second's, which never came
    (seen as a stalled run when the cold-start loan returned two ranks)."""
    ctb, ranks = _placement(100_000, rank_ids=(1, 2, 3))
    d = ctb.dispatcher
    d.quarantine(3)  # no task goes there yet
    _, src, dst = _admitted(ctb, ranks)
    leaving = sorted(t for t, r in d.runner_rank.items() if r == src)
    assert ctb.hand_off_rank(src) == leaving
    ctb.dispatch(0.2)  # resumed on the other rank, each waiting for its state
    assert all(d.runner_rank[t] == dst for t in leaving) and not ranks[dst].poll()
    assert ctb.hand_off_rank(dst) == [] and all(ctb.in_transit(t) for t in leaving)
    assert "handed over: 4 awaiting the leaving rank's state" in ctb.describe()
    d.quarantine(3, False)
    ctb.dispatch(0.3)
    for i, tid in enumerate(leaving):
        assert ctb.carried(tid, {"claim": f"c{i}"})
        (m,) = ranks[3].poll()
        assert isinstance(m, RunTask) and m.assignment.trajectory_id == tid and m.carry == {"claim": f"c{i}"}
    assert not ranks[dst].poll() and not any(ctb.in_transit(t) for t in leaving)
    assert "resident: rank 3: 4 (" in ctb.describe()
    for tid in leaving:
        assert ctb.finished(tid, 3)
    assert not d.policy.audit()


def test_a_task_the_leaving_rank_could_not_hand_over_starts_afresh():
    ctb, ranks = _placement(100_000)
    d, src, dst = _admitted(ctb, ranks)
    tid = next(t for t, r in d.runner_rank.items() if r == src)
    ctb.hand_off_rank(src)
    ctb.dispatch(0.2)  # resumed on the other rank, waiting for a state that will not come
    assert d.runner_rank[tid] == dst and not ranks[dst].poll()
    assert ctb.not_carried(tid)
    ctb.dispatch(0.3)
    (m,) = [m for m in ranks[dst].poll() if m.assignment.trajectory_id == tid]
    assert isinstance(m, RunTask) and m.carry is None
    assert not d.policy.audit()


def test_a_handed_over_task_whose_group_ends_is_dropped_and_its_state_reported():
    ctb, ranks = _placement(100_000)
    d, src, dst = _admitted(ctb, ranks)
    leaving = sorted(t for t, r in d.runner_rank.items() if r == src)
    d.quarantine(dst)  # no rank takes them: the states wait at rank 0
    ctb.hand_off_rank(src)
    ctb.dispatch(0.2)
    assert ctb.carried(leaving[0], {"claim": "c0"})
    ctb.cancel_group("g0", "too stale")
    assert [t for t, _ in ctb.take_dropped_carries()] == [leaving[0]]
    assert not ctb.take_dropped_carries()
    for tid in leaving[1:]:  # still coming: dropped when it comes
        assert not ctb.carried(tid, {"claim": "late"})
    ctb.forget_group("g0")
    assert not any(ctb.in_transit(t) for t in leaving)
    sent = [m for r in ranks.values() for m in r.poll()]
    # no rank takes work (one left, one quarantined): the env server's idle reaper closes the sessions
    assert not [m for m in sent if isinstance(m, (RunTask, ReleaseCarry))] and d.stats["released"] == 0
    assert not d.policy.audit()


def test_a_rollout_rank_closes_the_env_session_of_a_dropped_hand_over():
    """A handed-over task whose group ends before it starts again leaves a detached env session
    (an OSWorld VM): the rollout rank with the fewest residents is told to close it, whether
    the task's state was already at rank 0 or came after the group ended."""
    ctb, ranks = _placement(100_000)
    d, src, dst = _admitted(ctb, ranks)
    leaving = sorted(t for t, r in d.runner_rank.items() if r == src)
    ctb.hand_off_rank(src)
    assert ctb.carried(leaving[0], {"claim": "c0"})  # here before CTB resumed it anywhere
    ctb.cancel_group("g0", "too stale")
    assert [t for t, _ in ctb.take_dropped_carries()] == [leaving[0]]
    for i, tid in enumerate(leaving[1:]):  # still coming: dropped when it comes
        assert not ctb.carried(tid, {"claim": f"late{i}"})
    released = [m.claim for m in ranks[dst].poll() if isinstance(m, ReleaseCarry)]
    assert released == ["c0"] + [f"late{i}" for i in range(len(leaving) - 1)]
    assert d.stats["released"] == len(leaving) and not ranks[src].poll()
