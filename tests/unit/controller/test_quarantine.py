"""Quarantine bookkeeping: the write-off of a silent rank's tokens (never booked twice, never
counted lost), the steps out and back (`Quarantine`), and CTB forgetting a dropped rank."""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import Heartbeat, RunTask, TaskAssignment
from tide_megatron.comm.weight_sync import Send
from tide_megatron.config import JobConfig
from tide_megatron.controller.ctb_placement import CTBPlacement
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.placement import RequestPlacement
from tide_megatron.controller.quarantine import Quarantine
from tide_megatron.core.ctb import TaskState


def _beat(generated: int, running: dict[int, int]) -> Heartbeat:
    return Heartbeat(generated_tokens=generated, running_tokens=sum(running.values()), running_tasks=len(running),
                     env_steps=0)


tokens = st.integers(0, 40)


@settings(max_examples=200, deadline=None)
@given(at_beat=st.lists(tokens, min_size=1, max_size=8), data=st.data())
def test_a_quarantined_ranks_tokens_are_booked_once_whether_or_not_it_comes_back(at_beat, data):
    """Tasks generate, some finish before the last heartbeat, more after it, the rank goes
    silent and is quarantined; then it wakes, generates a little more and reports every task
    it held. The ledger side (normal bookings + write-off + late excess) equals what the rank
    generated, and the heartbeat check never calls a token lost."""
    h = RolloutHealth([1], 0.0, heartbeat_timeout_s=5.0, stall_timeout_s=5.0)
    running = dict(enumerate(at_beat))
    generated = sum(at_beat)
    ledger = 0

    def finish(ids):
        nonlocal ledger
        for i in ids:
            h.booked(1, running[i], 1.0)
            ledger += running.pop(i)

    finish(data.draw(st.sets(st.sampled_from(sorted(running)))))  # reported before the beat
    h.on_heartbeat(1, _beat(generated, running), 1.0)
    assert h.lost_tokens() == 0
    for i in running:  # after the last beat: more tokens, and some tasks end and are booked
        extra = data.draw(tokens)
        running[i] += extra
        generated += extra
    finish(data.draw(st.sets(st.sampled_from(sorted(running)))) if running else ())

    written_off = h.quarantine(1, 10.0)
    ledger += written_off
    assert written_off <= sum(running.values())  # a lower bound of what its tasks hold
    assert h.is_quarantined(1) and not h.back(1, 10.0)
    assert h.lost_tokens() == 0  # if it never comes back: its last heartbeat still balances

    for i in running:  # it wakes: the in-flight turns end
        extra = data.draw(tokens)
        running[i] += extra
        generated += extra
    late_ids = sorted(running)
    half = data.draw(st.integers(0, len(late_ids)))
    for i in late_ids[:half]:
        ledger += h.late(1, running.pop(i), 11.0)
    h.on_heartbeat(1, _beat(generated, running), 11.0)  # a beat between its late reports
    assert h.lost_tokens() == 0 and h.back(1, 11.0)
    for i in late_ids[half:]:
        ledger += h.late(1, running.pop(i), 11.5)
    h.on_heartbeat(1, _beat(generated, running), 12.0)
    assert ledger == generated and h.lost_tokens() == 0

    h.rejoined(1)  # back in service: its new work is booked as usual, and a loss shows again
    h.booked(1, 7, 13.0)
    h.on_heartbeat(1, _beat(generated + 7 + 3, {}), 13.0)
    assert h.lost_tokens() == 3


def test_silent_ranks_are_named_once_and_quarantined_ones_not_again():
    h = RolloutHealth([1, 2], 0.0, heartbeat_timeout_s=2.0, stall_timeout_s=60.0)
    h.on_heartbeat(2, _beat(0, {}), 2.5)
    (rank, line), = h.silent(3.0)
    assert rank == 1 and "rollout rank 1 sent nothing for 3 s" in line and "heartbeat_timeout_s" in line
    h.quarantine(1, 3.0)
    assert [r for r, _ in h.silent(10.0)] == [2]  # rank 2 is silent by now; rank 1 is out already
    assert h.check(3.0, outstanding=True) is None


class _Mailbox:
    def __init__(self):
        self.posted = []

    def post(self, dest, msg):
        self.posted.append((dest, msg))


def _send(rank: int, version: int) -> Send:
    return Send(rank, version, work=object(), started=0.0)


def test_the_steps_out_and_back():
    q = Quarantine([1, 2, 3])
    epoch = q.put_out(2, "silent", now=5.0, tasks_moved=3)
    assert q.in_service([1, 2, 3]) == [1, 3] and q.counts == {"quarantines": 1, "rejoins": 0, "moves_out": 0, "moves_in": 0}
    # out, not drained: no weights for it, even when it is heard from
    assert q.receivers([1, 2, 3], heard_from=lambda r: True) == [1, 3]
    assert not q.drained(2, epoch + 1)  # an answer to another quarantine
    assert q.drained(2, epoch)
    assert q.receivers([1, 2, 3], heard_from=lambda r: False) == [1, 3]  # drained but silent again
    assert q.receivers([1, 2, 3], heard_from=lambda r: True) == [1, 2, 3]
    q.sent([_send(1, 7), _send(2, 7), _send(3, 7)], deadline=20.0)
    assert q.receivers([1, 2, 3], heard_from=lambda r: True) == [1, 3]  # its rejoin is under way
    assert not q.settled(7)
    assert not q.loaded(1, 7) and not q.loaded(3, 7)  # in service all along
    assert q.loaded(2, 7)  # back
    assert q.settled(7) and q.in_service([1, 2, 3]) == [1, 2, 3] and q.counts["rejoins"] == 1
    assert q.unconfirmed() == []  # every buffer released


def test_unconfirmed_weights_are_reported_once_and_keep_their_buffer():
    q = Quarantine([1, 2])
    q.sent([_send(1, 3), _send(2, 3)], deadline=10.0)
    assert q.overdue_sends(9.0) == []
    q.loaded(1, 3)
    assert q.overdue_sends(11.0) == [(2, 3)] and q.overdue_sends(12.0) == []
    assert q.settled(3)  # a sync mode step no longer waits for rank 2
    assert q.unconfirmed() == [(2, 3)]  # gloo may still read the buffer until rank 2 takes it
    q.put_out(2, "weights not confirmed", 11.0)
    assert not q.loaded(2, 3) and q.unconfirmed() == []  # a late confirmation: no rejoin, buffer freed


def test_a_rank_taken_out_mid_sync_settles_the_sync_and_is_not_reported_again():
    q = Quarantine([1, 2])
    q.sent([_send(1, 4), _send(2, 4)], deadline=10.0)
    q.loaded(1, 4)
    q.put_out(2, "silent", 5.0)
    assert q.settled(4) and q.overdue_sends(100.0) == []


def test_a_rejoin_that_times_out_leaves_the_rank_out_for_a_later_try():
    q = Quarantine([1, 2])
    q.drained(2, q.put_out(2, "silent", 0.0))
    q.sent([_send(1, 5), _send(2, 5)], deadline=10.0)
    q.loaded(1, 5)
    assert q.overdue(11.0) == []  # not a second quarantine
    assert q.is_out(2) and q.receivers([1, 2], heard_from=lambda r: True) == [1, 2]


def _group(gid: str, n: int = 2):
    task = {"env": "door_game", "task_id": f"train/{gid}", "task_type": "door_game/rooms2", "split": "train"}
    return [TaskAssignment(task=task, group_id=gid, index=i) for i in range(n)]


def _ctb():
    cfg = JobConfig()
    cfg.rollout.engine.max_total_tokens = 8000
    cfg.ctb = dataclasses.replace(cfg.ctb, prompt_tokens_estimate=100, kv_budget_fraction=1.0,
                                  policy=dataclasses.replace(cfg.ctb.policy, probe_only_when_tight=False))
    store = dist.HashStore()
    return CTBPlacement(cfg, Mailbox(store, 0), [1, 2]), {r: Mailbox(store, r) for r in (1, 2)}


def test_ctb_forgets_a_dropped_rank_and_its_tasks_run_again_elsewhere():
    ctb, ranks = _ctb()
    for g in ("g0", "g1", "g2"):
        ctb.submit(_group(g, 1))  # single-task groups: no probe wait
    ctb.dispatch(0.0)
    held = {r: [m.assignment.trajectory_id for m in mb.poll() if isinstance(m, RunTask)] for r, mb in ranks.items()}
    assert held[1] and held[2]
    dropped = ctb.drop_rank(2)
    assert sorted(dropped) == sorted(held[2])
    assert all(ctb.dispatcher.policy.status(t).state is TaskState.FAILED for t in dropped)
    assert 2 not in ctb.dispatcher.policy.ranks
    assert not ctb.finished(dropped[0], 2)  # a late report from it is stale
    for tid in dropped:
        ctb.retry(TaskAssignment({}, tid.rsplit("/", 1)[0], 0))
    ctb.dispatch(1.0)
    assert ranks[2].poll() == []  # nothing goes to it: not the retries, not a cancel
    again = [m.assignment.trajectory_id for m in ranks[1].poll() if isinstance(m, RunTask)]
    assert sorted(again) == sorted(dropped)
    ctb.add_rank(2)  # it rejoins
    ctb.submit(_group("g3", 1))
    ctb.submit(_group("g4", 1))
    ctb.dispatch(2.0)
    assert any(isinstance(m, RunTask) for m in ranks[2].poll())


def test_request_placement_drops_a_rank_without_posting_to_it():
    store = dist.HashStore()
    placement, rank2 = RequestPlacement(Mailbox(store, 0), [1, 2], max_tasks_per_rank=4), Mailbox(store, 2)
    placement.submit(_group("g0") + _group("g1"))
    placement.dispatch(0.0)
    on2 = [m.assignment.trajectory_id for m in rank2.poll()]
    placement.cancel_group(on2[0].rsplit("/", 1)[0], "stale")  # a cancel it will never answer
    rank2.poll()
    assert sorted(placement.drop_rank(2)) == sorted(on2)
    assert 2 not in placement.ranks
    placement.submit(_group("g2"))
    placement.dispatch(1.0)
    assert rank2.poll() == []


def test_a_rank_that_does_not_answer_stop_is_named_in_bounded_time():
    from tide_megatron.comm.messages import Heartbeat as Beat, Stopped
    from tide_megatron.controller.loop import not_stopped

    store = dist.HashStore()
    Mailbox(store, 1).post(0, Beat(generated_tokens=0, running_tokens=0, running_tasks=0, env_steps=0))
    Mailbox(store, 1).post(0, Stopped())
    t0 = time.monotonic()
    assert not_stopped(Mailbox(store, 0), [1, 2], timeout_s=0.5) == [2]  # rank 2 never answers
    assert time.monotonic() - t0 < 3


def test_the_broadcast_path_takes_only_steady_ranks_and_books_each_member_like_a_send():
    """Steady: in service, every send confirmed. A rank rejoining or with a send pending takes
    the host path that sync; a member that does not confirm its broadcast is overdue as ever."""
    mailbox = _Mailbox()
    q = Quarantine([1, 2, 3], mailbox=mailbox)
    q.drained(3, q.put_out(3, "silent", 0.0))
    assert q.steady([1, 2, 3]) == [1, 2]  # 3 rejoins by the host path
    q.sent([_send(2, 1)], deadline=10.0)
    assert q.steady([1, 2]) == [1]  # 2 has not confirmed version 1 yet
    q.loaded(2, 1)
    assert q.steady([1, 2]) == [1, 2]
    q.broadcast_sent({1: "load-1", 2: "load-2"}, version=2, now=0.0)
    assert mailbox.posted == [(1, "load-1"), (2, "load-2")] and not q.settled(2)
    q.loaded(1, 2)
    assert q.overdue_sends(q.weight_sync_timeout_s + 1.0) == [(2, 2)] and q.settled(2)


def test_an_engine_that_restarted_behind_the_version_it_confirmed_has_lost_its_weights():
    q = Quarantine([1, 2])
    assert not q.lost_weights(1, 0)  # nothing confirmed yet: the initial weights are current
    q.sent([_send(1, 3)], deadline=10.0)
    q.loaded(1, 3)
    assert q.lost_weights(1, 0) and not q.lost_weights(1, 3)
    q.put_out(1, "restarted without its weights", 1.0)
    assert not q.lost_weights(1, 0)  # out already: it rejoins by the next sync


def test_a_newer_confirmation_settles_an_older_version_the_rank_could_not_load():
    """A member whose broadcast of version 4 failed takes version 5 by the host path: once it
    confirms 5 it is steady again and is never quarantined for 4."""
    q = Quarantine([1, 2])
    q.sent([_send(1, 4), _send(2, 4)], deadline=10.0)
    q.loaded(2, 4)
    assert q.steady([1, 2]) == [2]  # 1 owes version 4: the next sync sends it by the host path
    q.sent([_send(1, 5), _send(2, 5)], deadline=20.0)
    q.loaded(1, 5)
    assert q.settled(4) and q.overdue(15.0) == [] and q.unconfirmed() == [(2, 5)]  # past 4's deadline
    assert q.steady([1, 2]) == [1]
