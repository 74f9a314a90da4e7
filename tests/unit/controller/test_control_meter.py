"""Rank 0's control-plane figures (`control/*`): messages counted once each, the rollout
service's own CPU time and passes taken per step, and placement latencies booked only for passes that decided
something."""

from __future__ import annotations

import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import Stop, TaskAssignment
from tide_megatron.config import JobConfig
from tide_megatron.controller.ctb_placement import CTBPlacement
from tide_megatron.controller.control_meter import ControlMeter, DecisionTimer, quantile
from tide_megatron.controller.placement import RequestPlacement


def _group(gid: str, n: int = 2):
    task = {"env": "door_game", "task_id": f"train/{gid}", "task_type": "door_game/rooms2", "split": "train"}
    return [TaskAssignment(task=task, group_id=gid, index=i) for i in range(n)]


@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=200), st.floats(0.01, 1.0))
def test_quantile_is_a_value_with_at_least_that_share_at_or_below_it(xs, q):
    xs = sorted(xs)
    v = quantile(xs, q)
    assert v in xs
    assert sum(x <= v for x in xs) >= q * len(xs)
    assert sum(x < v for x in xs) < q * len(xs)


class Rollout:
    """What the rollout service books each pass, and its placement's timer."""

    def __init__(self, loops: int = 0, cpu_s: float = 0.0):
        self.loops, self.cpu_s = loops, cpu_s
        self.placement = RequestPlacement(Mailbox(dist.HashStore(), 0), [1], max_tasks_per_rank=1)


def test_messages_sent_and_read_are_counted_per_step():
    store = dist.HashStore()
    rank0, rank1 = Mailbox(store, 0), Mailbox(store, 1)
    meter = ControlMeter(rank0, Rollout(), DecisionTimer())
    for _ in range(3):
        rank0.post(1, Stop())
    rank1.post(0, Stop())
    assert len(rank0.poll()) == 1
    first = meter.step_metrics()
    assert (first["control/messages_sent"], first["control/messages_received"]) == (3, 1)
    second = meter.step_metrics()
    assert (second["control/messages_sent"], second["control/messages_received"]) == (0, 0)


def test_the_rollout_services_cpu_time_and_passes_are_taken_per_step():
    rollout = Rollout(loops=10, cpu_s=0.5)
    meter = ControlMeter(Mailbox(dist.HashStore(), 0), rollout, DecisionTimer())
    meter.start()
    rollout.loops, rollout.cpu_s = 25, 0.75
    first = meter.step_metrics()
    assert (first["control/loops"], first["control/cpu_rollout_thread_s"]) == (15, 0.25)
    second = meter.step_metrics()
    assert (second["control/loops"], second["control/cpu_rollout_thread_s"]) == (0, 0)


def test_only_placement_passes_that_decide_are_timed():
    cfg = JobConfig()
    cfg.rollout.engine.max_total_tokens = 4000
    ctb = CTBPlacement(cfg, Mailbox(dist.HashStore(), 0), [1, 2])
    ctb.dispatch(0.0, unconsumed_trajectories=0)  # nothing queued
    assert ctb.decision_times.take() == []
    ctb.submit(_group("g0"))
    ctb.dispatch(0.1, unconsumed_trajectories=0)  # admits the probe
    assert len(ctb.decision_times.take()) == 1

    store = dist.HashStore()
    request = RequestPlacement(Mailbox(store, 0), [1, 2], max_tasks_per_rank=4)
    request.dispatch(0.0)
    assert request.decision_times.take() == []
    request.submit(_group("g1"))
    request.dispatch(0.1)
    assert len(request.decision_times.take()) == 1


def test_both_placements_count_the_tasks_each_rank_was_sent():
    """`dispatched_to` (the step log's `placement/ranks_fed` and `busiest_rank_share`)."""
    store = dist.HashStore()
    request = RequestPlacement(Mailbox(store, 0), [1, 2], max_tasks_per_rank=4)
    request.submit(_group("g1") + _group("g2"))
    request.dispatch(0.0)
    assert sorted(request.dispatched_to.values()) == [len(_group("g1"))] * 2  # a group per rank

    cfg = JobConfig()
    cfg.rollout.engine.max_total_tokens = 4000
    ctb = CTBPlacement(cfg, Mailbox(dist.HashStore(), 0), [1, 2])
    ctb.submit(_group("g0"))
    ctb.dispatch(0.0, unconsumed_trajectories=0)  # admits the group's probe
    assert sum(ctb.dispatched_to.values()) == 1 and set(ctb.dispatched_to) <= {1, 2}
