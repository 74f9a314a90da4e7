"""The parts the rollout service wires, each on its own with fakes around it: the main
thread's request queue, ERS's meter, the group bookkeeping, the rank hand-over and the
trainer's step feed. (The whole service against fake ranks: `test_rollout_service.py`.)"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest

from tide_megatron.comm.messages import TaskAssignment, TaskCancelled, TaskCarried, TaskFailed, TrajectoryDone
from tide_megatron.controller.call_queue import CallQueue
from tide_megatron.controller.errors import RunError
from tide_megatron.controller.eval_aggregator import EvalAggregator
from tide_megatron.controller.groups import GroupBook
from tide_megatron.controller.handover import Handover
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import mode_policy
from tide_megatron.controller.rollout_meter import RolloutMeter
from tide_megatron.controller.step_intake import StepIntake
from tide_megatron.core.buffer import BufferConfig, GlobalBuffer
from tide_megatron.core.trajectory import Segment, Trajectory

G = 2
TASKS = [{"env": "door_game", "task_id": f"t{i}"} for i in range(3)]


# -- CallQueue ----------------------------------------------------------------------------------
def test_requests_run_in_order_when_served_and_conditional_ones_once_their_condition_holds():
    q, ran, gate = CallQueue(), [], []
    a = q.submit(lambda: ran.append("a") or 1)
    c = q.submit(lambda: ran.append("c") or 3, when=lambda: bool(gate))
    b = q.submit(lambda: ran.append("b") or 2)
    assert ran == [] and not a.done() and q.arrived.is_set()  # a submit wakes the service's wait
    assert q.serve() == 2
    assert ran == ["a", "b"] and (a.result(), b.result()) == (1, 2) and not c.done()
    gate.append(True)
    assert q.serve() == 1
    assert ran == ["a", "b", "c"] and c.result() == 3
    assert q.serve() == 0
    assert ran == ["a", "b", "c"]  # each runs once


def test_a_request_raising_fails_its_future_and_fail_all_fails_every_one_left():
    q = CallQueue()
    bad = q.submit(lambda: 1 / 0)
    q.serve()
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=0)
    waiting = q.submit(lambda: None, when=lambda: False)
    q.serve()
    queued = q.submit(lambda: None)
    errors = []
    q.fail_all(lambda: errors.append(RuntimeError("gone")) or errors[-1])
    for fut in (waiting, queued):
        with pytest.raises(RuntimeError, match="gone"):
            fut.result(timeout=0)
    assert len(errors) == 2 and errors[0] is not errors[1]  # each its own


# -- RolloutMeter -------------------------------------------------------------------------------
def _meter(serving=(1,), running=0):
    placement = SimpleNamespace(running=lambda: running)
    return RolloutMeter(placement=placement, quarantine=SimpleNamespace(serving=list(serving)))


def test_the_meter_counts_delivery_only_while_admission_is_open_and_times_full_slots():
    m = _meter()
    m.note_slots(10.0, full=True)
    m.delivered(SimpleNamespace(is_eval=False, total_tokens=100))  # the throttle's, not rollout's
    m.note_slots(12.0, full=False)
    m.delivered(SimpleNamespace(is_eval=False, total_tokens=7))
    m.delivered(SimpleNamespace(is_eval=True, total_tokens=5))
    m.note_slots(13.0, full=True)
    w = m.take_window(now=14.0)
    assert (w["fresh_tokens"], w["eval_tokens"], w["slots_full_s"]) == (7, 5, pytest.approx(3.0))
    w = m.take_window(now=16.5)  # still full: the next window goes on counting from the last
    assert (w["fresh_tokens"], w["slots_full_s"]) == (0, pytest.approx(2.5))


def test_a_turn_report_without_decode_counters_books_nothing():
    m = _meter()
    m.decode_report(1, {"pid": 3})
    assert m.take_window(now=1.0)["decode_iteration_s"] == 0.0


# -- GroupBook ----------------------------------------------------------------------------------
class FakePlacement:
    hands_over = True

    def __init__(self):
        self.submitted, self.retried, self.cancelled, self.dropped_carries = [], [], [], []
        self.on_group_started = None

    def submit(self, members, front=False):
        self.submitted += members

    def retry(self, a):
        self.retried.append(a)

    def cancel_group(self, gid, reason):
        self.cancelled.append((gid, reason))

    def forget_group(self, gid):
        pass

    def take_dropped_carries(self):
        out, self.dropped_carries = self.dropped_carries, []
        return out

    def finished(self, tid, rank, context_tokens=None):
        return True

    def failed(self, tid, rank, error):
        return True

    def released(self, tid, rank):
        pass

    def queued(self):
        return 0

    def on_weight_sync(self):
        pass


def _book(mode="sync", retries=1, max_failed_groups=3, placement=None, task_order="random"):
    buffer = GlobalBuffer(BufferConfig(group_size=G, b_min=G, b_ideal=G, max_staleness=1))
    health = RolloutHealth([1], time.monotonic(), heartbeat_timeout_s=30, stall_timeout_s=30)
    placement = placement or FakePlacement()
    meter = _meter()
    groups = GroupBook(buffer=buffer, placement=placement, health=health, mode=mode_policy(mode), meter=meter,
                       evals=EvalAggregator(), counters=defaultdict(int), tasks=TASKS, rng=random.Random(0),
                       group_size=G, groups_per_step=1, max_task_retries=retries,
                       max_failed_groups=max_failed_groups, version=0, task_order=task_order)
    return groups, buffer, placement


def test_sequential_order_draws_the_tasks_in_turn_and_eval_groups_do_not_take_a_turn():
    groups, _, placement = _book(task_order="sequential")
    groups.start()
    groups.submit_eval(0, TASKS, 1)
    for _ in range(3):
        groups.start()
    training = [a.task["task_id"] for a in placement.submitted if not a.is_eval and a.index == 0]
    assert training == ["t0", "t1", "t2", "t0"] and groups.drawn == 4


def test_live_training_groups_count_running_and_ready_training_groups_only():
    groups, buffer, placement = _book(mode="async_static")
    g0, g1, g2 = groups.start(), groups.start(), groups.start()
    groups.submit_eval(0, TASKS, 1)
    assert groups.live_training_groups() == 3
    groups.give_up_if_live([g1, "no-such-group"], "test", time.monotonic())
    assert groups.live_training_groups() == 2
    for a in [a for a in placement.submitted if a.group_id == g0]:
        groups.on_task_end(_traj(a), 0, time.monotonic())
    assert g0 in {g.group_id for g in buffer.ready_groups()} and groups.live_training_groups() == 2
    groups.give_up_if_live([g2], "test", time.monotonic())
    assert groups.live_training_groups() == 1


def test_random_order_draws_from_the_seeded_sampler():
    groups, _, placement = _book()
    for _ in range(12):
        groups.start()
    rng = random.Random(0)
    assert [a.task["task_id"] for a in placement.submitted if a.index == 0] == \
        [rng.choice(TASKS)["task_id"] for _ in range(12)]


def _failed(a: TaskAssignment, tokens: int = 4) -> TaskFailed:
    msg = TaskFailed(a, "EnvError: boom", generated_tokens=tokens)
    msg.src = 1
    return msg


def _traj(a: TaskAssignment, gen: int = 5, version: int = 0) -> TrajectoryDone:
    msg = TrajectoryDone(Trajectory(a.group_id, a.index, a.task["task_id"], version, 3, gen, float(a.index),
                                    token_ids=[1] * (3 + gen), loss_mask=[0] * 3 + [1] * gen,
                                    logprobs=[0.0] * (3 + gen), segments=[Segment(3, 3 + gen, version)]))
    msg.src = 1
    return msg


def test_a_failed_task_is_retried_then_its_group_given_up_and_replaced_in_sync_mode():
    groups, buffer, placement = _book(retries=1)
    groups.request(1)
    groups.start_due(0)
    assert [a.trajectory_id for a in placement.submitted] == ["g0v0/0", "g0v0/1"]
    now = time.monotonic()
    groups.on_task_end(_failed(placement.submitted[0]), 0, now)
    assert [a.attempt for a in placement.retried] == [1] and groups.counters["retries"] == 1
    groups.on_task_end(_failed(placement.retried[0]), 3, now)  # 3 tokens carried from an earlier rank
    assert placement.cancelled == [("g0v0", "g0v0/0 failed: EnvError: boom")]
    assert not buffer.is_pending("g0v0") and groups.counters["groups_failed"] == 1
    assert buffer.ledger.failed == 4 + 4 + 3
    groups.start_due(0)  # the sync batch still needs a whole group
    assert placement.submitted[-1].group_id == "g1v0"


def test_too_many_groups_failing_in_a_row_stops_the_run():
    groups, _, placement = _book(retries=0, max_failed_groups=0)
    groups.request(1)
    groups.start_due(0)
    with pytest.raises(RunError, match="1 groups in a row failed.*max_failed_groups=0"):
        groups.on_task_end(_failed(placement.submitted[0]), 0, time.monotonic())


def test_a_completed_group_enters_the_buffer_and_its_tokens_count_for_ers():
    groups, buffer, placement = _book(mode="async_static")
    groups.start_due(0)  # the staleness window: (max_staleness + 1) x groups_per_step groups
    assert groups.live_training_groups() == 2 and groups.outstanding()
    for a in placement.submitted[:G]:
        groups.on_task_end(_traj(a), 0, time.monotonic())
    assert [g.group_id for g in buffer.ready_groups()] == ["g0v0"]
    assert groups.meter.take_window()["fresh_tokens"] == G * (3 + 5)


def test_carried_tokens_go_with_the_tasks_end_or_their_groups():
    groups, buffer, placement = _book(retries=0)
    groups.request(1)
    groups.start_due(0)
    groups.carry("g0v0/1", 7)
    assert groups.take_carried("g0v0/1") == 7 and groups.take_carried("g0v0/1") == 0
    groups.carry("g0v0/1", 6)
    placement.dropped_carries = [("g0v0/1", {"claim": "c"})]  # handed over, never started again
    groups.give_up("g0v0", failed=False, reason="stale", now=time.monotonic())
    assert buffer.ledger.cancelled == 6 and groups.take_carried("g0v0/1") == 0


def test_a_rank_taken_out_fails_or_restarts_its_tasks_unless_their_group_ended():
    groups, _, placement = _book(retries=1)
    groups.request(1)
    groups.start_due(0)
    assert groups.member("g0v0/1").index == 1 and groups.member("g9v0/0") is None
    assert groups.fail_with_rank("g0v0/0", 2, time.monotonic())  # retried: attempt 1
    assert groups.restart("g0v0/1")  # afresh, no retry charged
    assert [(a.trajectory_id, a.attempt) for a in placement.retried] == [("g0v0/0", 1), ("g0v0/1", 0)]
    assert groups.counters["task_failures"] == 1 and groups.counters["retries"] == 1
    assert not groups.fail_with_rank("g9v0/0", 2, time.monotonic()) and not groups.restart("g9v0/0")


# -- Handover -----------------------------------------------------------------------------------
class FakeQuarantine:
    def __init__(self, serving, task_ids):
        self.serving, self.task_ids, self.taken = list(serving), task_ids, []

    def take_out(self, rank, reason, now, kind="quarantine", hand_over=False):
        self.taken.append((rank, kind, hand_over))
        self.serving.remove(rank)
        return self.task_ids, 0


def _handover(serving=(1, 2), task_ids=("g0v0/0", "g0v0/1"), hands_over=True, min_rollout_ranks=1):
    groups, buffer, placement = _book(retries=1)
    placement.hands_over = hands_over
    placement.carried = lambda tid, carry: True
    placement.not_carried = lambda tid: None
    groups.request(1)
    groups.start_due(0)
    quarantine = FakeQuarantine(serving, list(task_ids))
    h = Handover(quarantine=quarantine, groups=groups, buffer=buffer, placement=placement, health=groups.health,
                 counters=groups.counters, min_rollout_ranks=min_rollout_ranks)
    return h, groups, buffer, placement, quarantine


def test_a_move_with_hand_over_waits_for_the_leaving_ranks_answer_for_each_task():
    h, groups, buffer, _, quarantine = _handover()
    assert h.move_to_trainer(2, "ERS") == 2 and quarantine.taken == [(2, "trainer", True)]
    assert not h.answers("g0v0/0", 1)  # another rank's report: not the answer
    assert h.answers("g0v0/0", 2) and not h.answers("g0v0/0", 2)  # answered once
    carried = TaskCarried("g0v0/0", {"claim": "c", "episode": {}}, generated_tokens=4, carried_tokens=0)
    carried.src = 2
    assert h.on_answer(carried, 3, time.monotonic())
    assert groups.take_carried("g0v0/0") == 4 + 3 and h.counters["tasks_carried"] == 1
    assert h.answers("g0v0/1", 2)
    cancelled = TaskCancelled("g0v0/1", generated_tokens=2)
    cancelled.src = 2
    assert h.on_answer(cancelled, 0, time.monotonic()) and buffer.ledger.cancelled == 2
    assert not h.on_answer(_failed(groups.member("g0v0/0")), 0, time.monotonic())  # a plain end


def test_a_move_without_hand_over_restarts_the_tasks_of_live_groups():
    h, _, _, placement, quarantine = _handover(hands_over=False, task_ids=("g0v0/0", "g7v0/0"))
    with pytest.raises(ValueError, match="rank 5 is not a rollout rank in service"):
        h.move_to_trainer(5, "ERS")
    assert h.move_to_trainer(2, "ERS") == 1 and quarantine.taken == [(2, "trainer", False)]
    assert [a.trajectory_id for a in placement.retried] == ["g0v0/0"] and h.counters["tasks_moved"] == 1


def test_quarantining_below_the_minimum_of_ranks_stops_the_run():
    h, groups, buffer, _, _ = _handover(serving=(1, 2), task_ids=("g0v0/0",), min_rollout_ranks=2)
    groups.carry("g0v0/0", 5)
    with pytest.raises(RunError, match=r"silent; 1 rollout rank\(s\) left in service.*min_rollout_ranks=2"):
        h.quarantine_rank(2, "silent", time.monotonic())
    assert buffer.ledger.failed == 5 and groups.counters["retries"] == 1  # its task was retried first


# -- StepIntake -----------------------------------------------------------------------------------
def test_the_step_intake_streams_groups_as_they_complete_and_counts_what_the_step_took():
    groups, buffer, placement = _book(mode="stream")
    feed = StepIntake(buffer=buffer, continuous_rollout=True, group_size=G, groups_per_step=2)
    assert feed.clock(time.monotonic(), 0) is None  # no step measured yet
    ras, hol, taken, size = feed.open(2, 0)
    assert taken == [] and size == 2 and feed.consumed_groups == 0
    got, failed = [], []
    feed.stream_into(SimpleNamespace(fail=failed.append), 2, got.append, 0)
    groups.start_due(0)
    for a in placement.submitted[:G]:
        groups.on_task_end(_traj(a), 0, time.monotonic())
    feed.feed(0)
    assert [g.group_id for g in got] == ["g0v0"] and feed.consumed_groups == 1
    feed.fail(RunError("x"))
    assert len(failed) == 1
    feed.close()
    feed.fail(RunError("y"))  # no open stream: nothing to fail
    assert len(failed) == 1
    assert feed.clock(time.monotonic(), 0) is not None  # a step was measured
