"""The rollout side's token bookings name their events in the ledger's per-account audit
(`ledger_keys.py`): one event booked twice fails naming it, distinct events of one task do
not collide, and a broken ledger at a step's end stops the run with a one-line `RunError`."""

from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import TaskAssignment, TaskCancelled, TaskFailed
from tide_megatron.controller import ledger_keys
from tide_megatron.controller.errors import RunError
from tide_megatron.controller.eval_aggregator import EvalAggregator
from tide_megatron.controller.groups import GroupBook
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import mode_policy
from tide_megatron.controller.placement import RequestPlacement
from tide_megatron.controller.rollout_meter import RolloutMeter
from tide_megatron.controller.rollout_service import RolloutService
from tide_megatron.core.buffer import BufferConfig, GlobalBuffer, LedgerError

G = 2
TASKS = [{"env": "door_game", "task_id": "t0"}]


class FakePlacement:
    """Every task end is fresh; nothing is handed over."""

    hands_over = False

    def __init__(self):
        self.submitted, self.dropped_carries = [], []
        self.on_group_started = None

    def submit(self, members, front=False):
        self.submitted += members

    def retry(self, a):
        self.submitted.append(a)

    def cancel_group(self, gid, reason):
        pass

    def forget_group(self, gid):
        pass

    def take_dropped_carries(self):
        out, self.dropped_carries = self.dropped_carries, []
        return out

    def failed(self, tid, rank, error):
        return True

    def released(self, tid, rank):
        pass


def _book():
    buffer = GlobalBuffer(BufferConfig(group_size=G, b_min=G, b_ideal=G, max_staleness=1))
    health = RolloutHealth([1], time.monotonic(), heartbeat_timeout_s=30, stall_timeout_s=30)
    placement = FakePlacement()
    meter = RolloutMeter(placement=placement, quarantine=None)
    groups = GroupBook(buffer=buffer, placement=placement, health=health, mode=mode_policy("sync"), meter=meter,
                       evals=EvalAggregator(), counters=defaultdict(int), tasks=TASKS, rng=random.Random(0),
                       group_size=G, groups_per_step=1, max_task_retries=3, max_failed_groups=3, version=0)
    groups.request(1)
    groups.start_due(0)
    return groups, buffer, placement


def _failed(a: TaskAssignment, tokens: int = 4) -> TaskFailed:
    msg = TaskFailed(a, "EnvError: boom", generated_tokens=tokens)
    msg.src = 1
    return msg


def test_one_task_end_booked_twice_fails_naming_it():
    groups, buffer, placement = _book()
    msg = _failed(placement.submitted[0])
    key = ledger_keys.task_end(msg)
    groups.on_task_end(msg, 0, time.monotonic(), key)
    # the bug: a second part books the same end again (e.g. a hand-over answer that fell through)
    with pytest.raises(LedgerError, match=r"'g0v0/0: TaskFailed from rank 1 \(end #\d+\)' booked twice"):
        groups.on_task_end(msg, 0, time.monotonic(), key)
    assert buffer.ledger.failed == 4  # booked once


def test_distinct_ends_of_one_task_are_distinct_events():
    groups, buffer, placement = _book()
    a = placement.submitted[0]
    for _ in range(2):  # the same task fails twice (retried between): two ends, no collision
        groups.on_task_end(_failed(a, tokens=3), 0, time.monotonic())
    cancelled = TaskCancelled(a.trajectory_id, generated_tokens=2)
    cancelled.src = 1
    groups.on_task_end(cancelled, 0, time.monotonic())
    assert (buffer.ledger.failed, buffer.ledger.cancelled) == (6, 2)
    buffer.verify_ledger()


def test_a_carry_is_booked_once():
    groups, buffer, placement = _book()
    groups.carry("g0v0/1", 5)
    tokens, key = groups.take_carry("g0v0/1")
    buffer.ledger.book_attempt(tokens, fate="failed", key=key)  # written off with its quarantined rank
    assert groups.take_carry("g0v0/1") == (0, None)  # gone: its group's end books nothing more
    with pytest.raises(LedgerError, match=r"'g0v0/1: carried tokens \(carry #\d+\)' booked twice"):
        buffer.ledger.book_attempt(tokens, fate="cancelled", key=key)


def test_a_broken_ledger_at_the_end_of_a_step_stops_the_run_with_one_line():
    mailbox = Mailbox(dist.HashStore(), 0)
    buffer = GlobalBuffer(BufferConfig(group_size=G, b_min=G, b_ideal=G))
    svc = RolloutService(mailbox=mailbox, buffer=buffer, placement=RequestPlacement(mailbox, [1], 8),
                         mode=mode_policy("sync"), rollout_ranks=[1], tasks=TASKS, group_size=G, groups_per_step=1,
                         max_staleness=1, max_task_retries=1, max_failed_groups=3, seed=0, start_version=0,
                         health=RolloutHealth([], 0.0, heartbeat_timeout_s=30.0, stall_timeout_s=30.0))
    # not started: this test is its only thread
    buffer.open_group("g0v0", "t0", 0.0)
    buffer.record_tokens("g0v0", 0, 7)
    buffer.begin_step(0.0)
    svc.close_step()  # healthy
    buffer._pending.clear()  # the bug: a running group vanishes, its tokens booked nowhere
    buffer.begin_step(1.0)
    with pytest.raises(RunError) as err:
        svc.close_step()
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("the token ledger is broken at the end of the step: token account 'g0v0/0' "
                                     "holds 7 in_flight tokens that nothing holds")
