"""The rollout service against fake rollout ranks over a real (in-memory) store mailbox.

Fake ranks answer `RunTask` the way rollout ranks do (trajectories, failures, cancellations,
heartbeats with their own token counts), so these tests exercise the service's booking,
retries, admission bound, cancellation, ledger reconciliation and stall detection without
SGLang."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import pytest
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (AllCancelled, CancelAll, CancelTask, EngineFacts, Heartbeat, LoadWeights,
                                         RankReady, RunTask, Stop, TaskCancelled, TaskCarried, TaskFailed,
                                         TrajectoryDone, TurnEvent, WeightsLoaded)
from tide_megatron.comm.weight_sync import Send
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import mode_policy
from tide_megatron.config import JobConfig
from tide_megatron.controller.ctb_placement import CTBPlacement
from tide_megatron.controller.placement import RequestPlacement
from tide_megatron.controller.rollout_service import RolloutService, RunError
from tide_megatron.core.buffer import BufferConfig, GlobalBuffer
from tide_megatron.core.trajectory import Segment, Trajectory
from tide_megatron.trainer.ra2p.source import ArrivingSource, SourceError

TASKS = [{"env": "door_game", "task_id": f"t{i}"} for i in range(4)]
G = 2


class FakeRank(threading.Thread):
    """Answers each RunTask after `delay_s` with a trajectory of `gen` tokens, unless `fate(tid,
    attempt)` says 'fail', 'vanish' (never answer, as if the message were lost) or 'hang'. A task
    generates its `gen` tokens when it starts. While `frozen` is set the rank does nothing at
    all (a hung process: no heartbeat, no answer). On `CancelAll(carry=True)` it hands its tasks
    over (`TaskCarried`); a task it is handed (`RunTask.carry`) ends holding the carried tokens."""

    def __init__(self, store, rank: int, *, gen: int = 5, delay_s: float = 0.01,
                 fate: Callable[[str, int], str] = lambda tid, attempt: "ok", heartbeat_s: float = 0.05,
                 beat: bool = True):
        super().__init__(daemon=True)
        self.mb = Mailbox(store, rank)
        self.rank, self.gen, self.delay_s, self.fate, self.heartbeat_s, self.beat = rank, gen, delay_s, fate, heartbeat_s, beat
        self.generated = 0
        self.running: dict[str, tuple[float, RunTask]] = {}
        self.hung: set[str] = set()
        self.carried_in: dict[str, int] = {}
        self.stop = threading.Event()
        self.frozen = threading.Event()
        self.seen: list = []

    def run(self) -> None:
        self.mb.post(0, RankReady(engine=EngineFacts(max_running_requests=8)))
        next_beat = 0.0
        while not self.stop.is_set():
            if self.frozen.is_set():
                time.sleep(0.01)
                continue
            now = time.monotonic()
            for msg in self.mb.poll():
                self.seen.append(msg)
                if isinstance(msg, RunTask):
                    self.running[msg.assignment.trajectory_id] = (now + self.delay_s, msg)
                    self.generated += self.gen
                    self.carried_in[msg.assignment.trajectory_id] = msg.carry["episode"]["generated"] if msg.carry else 0
                elif isinstance(msg, CancelTask):
                    if self.running.pop(msg.task_id, None) or msg.task_id in self.hung:
                        self.hung.discard(msg.task_id)
                        self.mb.post(0, TaskCancelled(msg.task_id, self.gen, self.carried_in.get(msg.task_id, 0)))
                    else:
                        self.mb.post(0, TaskCancelled(msg.task_id, 0))
                elif isinstance(msg, CancelAll):
                    for tid in [*self.running, *self.hung]:
                        carried = self.carried_in.get(tid, 0)
                        if msg.carry:
                            episode = {"generated": carried + self.gen}
                            self.mb.post(0, TaskCarried(tid, {"claim": f"c-{tid}", "episode": episode, "started_at": 0.0},
                                                        self.gen, carried))
                        else:
                            self.mb.post(0, TaskCancelled(tid, self.gen, carried))
                    self.running.clear()
                    self.hung.clear()
                    self.mb.post(0, AllCancelled(msg.epoch))
                elif isinstance(msg, LoadWeights):
                    self.mb.post(0, WeightsLoaded(msg.manifest["version"]))
                elif isinstance(msg, Stop):
                    return
            for tid, (due, run) in list(self.running.items()):
                if now < due:
                    continue
                del self.running[tid]
                a = run.assignment
                fate = self.fate(tid, a.attempt)
                carried = self.carried_in.get(tid, 0)
                n = carried + self.gen
                if fate == "ok":
                    self.mb.post(0, TrajectoryDone(Trajectory(
                        a.group_id, a.index, a.task["task_id"], 0, 3, n, float(a.index), is_eval=a.is_eval,
                        token_ids=[1] * (3 + n), loss_mask=[0] * 3 + [1] * n,
                        logprobs=[0.0] * (3 + n), segments=[Segment(3, 3 + n, 0)]), carried))
                elif fate == "fail":
                    self.mb.post(0, TaskFailed(a, "EnvError: boom", generated_tokens=self.gen, carried_tokens=carried))
                elif fate == "hang":  # generated its first turn, then waits for an env that never answers
                    self.hung.add(tid)
                # "vanish": generated, never reported
            if self.beat and now >= next_beat:
                running_tokens = self.gen * (len(self.running) + len(self.hung))
                self.mb.post(0, Heartbeat(generated_tokens=self.generated, running_tokens=running_tokens,
                                          running_tasks=len(self.running) + len(self.hung), env_steps=self.generated // self.gen,
                                          waiting=[f"{t}: env step for 1 s" for t in self.hung]))
                next_beat = now + self.heartbeat_s
            time.sleep(0.002)


class FakeSender:
    """`weight_sync.WeightSender` without the transfer: the manifest goes by mailbox only."""

    def __init__(self, store):
        self.mb = Mailbox(store, 0)

    def send(self, weights, receivers):
        for r in receivers:
            self.mb.post(r, LoadWeights({"version": weights.version}))
        return [Send(r, weights.version, None, 0.0) for r in receivers]


def make_service(store, mode="async_static", *, groups_per_step=2, retries=1, stall_s=30.0, heartbeat_timeout_s=30.0,
                 max_failed_groups=3, ranks=(1,), start=True, ctb=False, tasks_per_rank=8, poll_s=0.02):
    mailbox = Mailbox(store, 0)
    placement = (CTBPlacement(JobConfig(), mailbox, list(ranks)) if ctb
                 else RequestPlacement(mailbox, list(ranks), tasks_per_rank))
    buffer = GlobalBuffer(BufferConfig(group_size=G, b_min=G * groups_per_step, b_ideal=G * groups_per_step,
                                       max_staleness=1))
    health = RolloutHealth([], time.monotonic(), heartbeat_timeout_s=heartbeat_timeout_s, stall_timeout_s=stall_s)
    svc = RolloutService(mailbox=mailbox, buffer=buffer, placement=placement,
                         mode=mode_policy(mode), rollout_ranks=list(ranks), tasks=TASKS, group_size=G,
                         groups_per_step=groups_per_step, max_staleness=1, max_task_retries=retries,
                         max_failed_groups=max_failed_groups, seed=0, start_version=0, health=health,
                         weight_sender=FakeSender(store), poll_s=poll_s)
    if start:
        svc.start()
    return svc


def wait_batch(svc, timeout=20.0):
    got = None
    deadline = time.monotonic() + timeout
    while got is None:
        got = svc.wait(svc.submit(svc.fetch_batch, when=svc.batch_ready), timeout, "a batch")
        assert time.monotonic() < deadline
    return got


@contextlib.contextmanager
def serving(store, rank_kwargs: dict, mode="async_static", **service_kwargs):
    """Rollout rank 1 (a `FakeRank` of `rank_kwargs`) and a service over it, both stopped after."""
    rank = FakeRank(store, 1, **rank_kwargs)
    rank.start()
    svc = make_service(store, mode, **service_kwargs)
    try:
        yield svc, rank
    finally:
        svc.stop()
        rank.stop.set()


@pytest.fixture
def store():
    return dist.HashStore()


def test_async_mode_admits_within_the_staleness_bound_and_books_consumption(store):
    with serving(store, dict(delay_s=0.05)) as (svc, _):
        batch, ras, hol = wait_batch(svc)
        assert batch.num_trajectories == 2 * G and all(len(g) == G for g in batch.groups)
        # (max_staleness + 1) x groups_per_step groups may be live; never more were started.
        time.sleep(0.3)
        assert svc.call(svc.groups.live_training_groups) <= 4
        led = svc.call(svc.ledger_snapshot)
        assert led["consumed"] == 2 * G * 5 and led["lost"] == 0


def test_a_failed_task_is_retried_and_its_tokens_booked_as_failed(store):
    with serving(store, dict(fate=lambda tid, attempt: "fail" if tid.endswith("/1") and attempt == 0 else "ok"),
                 mode="sync") as (svc, rank):
        svc.call(lambda: svc.request_groups(2))
        batch, _, _ = wait_batch(svc)
        assert batch.num_trajectories == 2 * G
        retried = [m for m in rank.seen if isinstance(m, RunTask) and m.assignment.attempt == 1]
        assert len(retried) == 2  # member 1 of each group, once
        led = svc.call(svc.ledger_snapshot)
        assert led["failed"] == 2 * 5 and led["consumed"] == 2 * G * 5


def test_a_group_failing_past_its_retries_is_given_up_and_replaced_never_trained_partially(store):
    with serving(store, dict(fate=lambda tid, attempt: "fail" if tid.startswith("g0v0/0") else "ok"),
                 mode="sync", retries=1) as (svc, _):
        svc.call(lambda: svc.request_groups(2))
        batch, _, _ = wait_batch(svc)
        ids = {g.group_id for g in batch.groups}
        assert "g0v0" not in ids and len(ids) == 2  # a replacement group filled the batch
        assert svc.call(lambda: dict(svc.counters))["groups_failed"] == 1


def test_a_vanished_task_shows_up_as_lost_tokens(store):
    with serving(store, dict(fate=lambda tid, attempt: "vanish" if tid == "g1v0/0" else "ok"),
                 mode="sync", stall_s=60.0) as (svc, _):
        svc.call(lambda: svc.request_groups(3))
        deadline = time.monotonic() + 10
        while svc.call(svc.ledger_snapshot)["lost"] == 0:
            assert time.monotonic() < deadline, "the ledger never noticed the vanished task"
            time.sleep(0.05)
        assert svc.call(svc.ledger_snapshot)["lost"] == 5


def test_a_stuck_env_stops_the_run_within_the_stall_bound_naming_what_waits(store):
    with serving(store, dict(fate=lambda tid, attempt: "hang"), mode="sync", stall_s=0.6) as (svc, _):
        svc.call(lambda: svc.request_groups(1))
        started = time.monotonic()
        with pytest.raises(RunError, match=r"no token generated.*env step.*request placement: 0 queued; running: rank 1: 2"):
            wait_batch(svc, timeout=20)
        assert time.monotonic() - started < 10  # bounded: the stall bound plus polling, not the batch timeout


def test_a_silent_rank_is_named(store):
    with serving(store, dict(beat=False, delay_s=100.0), mode="sync", heartbeat_timeout_s=0.5) as (svc, _):
        svc.call(lambda: svc.request_groups(1))
        with pytest.raises(RunError, match="rollout rank 1 sent nothing"):
            wait_batch(svc, timeout=20)


def test_a_dead_rollout_side_wakes_a_trainer_blocked_on_arrivals(store):
    with serving(store, dict(fate=lambda tid, attempt: "hang"), mode="stream", stall_s=0.6) as (svc, _):
        source = ArrivingSource(3, timeout_s=60, health=svc.check)
        svc.call(lambda: svc.stream_into(source, 3, lambda g: source.put(g)))
        started = time.monotonic()
        with pytest.raises(SourceError):
            source.take_ready(1)
        assert time.monotonic() - started < 10


def test_doomed_groups_are_cancelled_at_once_and_their_tokens_wasted(store):
    with serving(store, dict(fate=lambda tid, attempt: "hang" if tid.startswith("g0v0") else "ok"),
                 mode="async_static") as (svc, rank):
        wait_batch(svc)
        svc.call(lambda: svc.close_step())
        svc.call(lambda: svc.set_version(1))
        svc.call(lambda: svc.set_version(2))  # g0v0 was admitted at version 0: stale for consumer 2
        deadline = time.monotonic() + 10
        while not any(isinstance(m, CancelTask) and m.task_id.startswith("g0v0") for m in rank.seen):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while svc.call(svc.ledger_snapshot)["cancelled"] < G * 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert svc.call(lambda: dict(svc.counters))["groups_cancelled"] >= 1


def _until(what: str, cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class _Manifest:
    version = 1


def test_a_silent_rank_is_quarantined_its_tasks_run_elsewhere_and_it_rejoins(store):
    ranks = {1: FakeRank(store, 1, delay_s=0.05), 2: FakeRank(store, 2, delay_s=100.0)}  # rank 2's tasks run long
    for r in ranks.values():
        r.start()
    svc = make_service(store, mode="sync", heartbeat_timeout_s=0.5, ranks=(1, 2))
    try:
        _until("both ranks", lambda: svc.call(lambda: len(svc.engines)) == 2)
        svc.call(lambda: svc.request_groups(2))  # a group on each rank
        _until("rank 2's tasks", lambda: len(ranks[2].running) == 2)
        time.sleep(0.2)  # a heartbeat shows them running, then it hangs
        ranks[2].frozen.set()
        batch, _, _ = wait_batch(svc)
        assert batch.num_trajectories == 2 * G  # its group ran again on rank 1
        assert svc.call(svc.quarantine_counts) == {"quarantines": 1, "rejoins": 0, "moves_out": 0, "moves_in": 0, "out_of_service": 1}
        assert svc.call(lambda: svc.counters["retries"]) == G
        assert svc.call(svc.ledger_snapshot)["failed"] == G * 5  # written off at once: it may never come back
        assert svc.call(lambda: svc.send_weights(_Manifest)) == [1]  # left out of the sync

        ranks[2].frozen.clear()  # it wakes, drops what it held, answers
        _until("the drain", lambda: svc.call(lambda: svc.quarantine.out[2].drained))
        assert svc.call(lambda: svc.send_weights(type("M", (), {"version": 2}))) == [1, 2]
        _until("the rejoin", lambda: svc.call(svc.quarantine_counts)["rejoins"] == 1)
        assert svc.call(lambda: svc.weights_settled(2))
        ranks[2].delay_s = 0.05
        before = sum(isinstance(m, RunTask) for m in ranks[2].seen)
        svc.call(lambda: svc.close_step())
        svc.call(lambda: svc.request_groups(2))
        wait_batch(svc)
        assert sum(isinstance(m, RunTask) for m in ranks[2].seen) > before  # dispatched to again
        time.sleep(0.3)  # the last heartbeats
        led = svc.call(svc.ledger_snapshot)
        # its late cancellations were covered by the write-off: nothing booked twice, nothing lost
        assert led["lost"] == 0 and led["failed"] == G * 5 and led["cancelled"] == 0
        assert led["generated"] == ranks[1].generated + ranks[2].generated
        assert svc.call(svc.quarantine_counts) == {"quarantines": 1, "rejoins": 1, "moves_out": 0, "moves_in": 0, "out_of_service": 0}
    finally:
        svc.stop()
        for r in ranks.values():
            r.stop.set()


def test_ers_moves_a_loaded_rank_to_the_trainer_and_back_and_a_new_rank_in_losing_no_task(store):
    """A move under load: rank 2's resident tasks start afresh on rank 1 (no retry charged,
    their tokens wasted, nothing lost); while it trains it is neither sent weights nor expected
    to beat; moved back, it gets the next weights before it is heard from and takes tasks once
    it has loaded them. Rank 3 joins rollout for the first time the same way."""
    ranks = {1: FakeRank(store, 1, delay_s=0.05), 2: FakeRank(store, 2, delay_s=100.0),
             3: FakeRank(store, 3, delay_s=0.05)}
    for r in (1, 2):
        ranks[r].start()
    svc = make_service(store, mode="sync", heartbeat_timeout_s=0.5, ranks=(1, 2), retries=0)
    try:
        _until("both ranks", lambda: svc.call(lambda: len(svc.engines)) == 2)
        svc.call(lambda: svc.request_groups(2))  # a group on each rank
        _until("rank 2's tasks", lambda: len(ranks[2].running) == 2)
        time.sleep(0.2)  # a heartbeat shows them running
        assert svc.call(lambda: svc.move_to_trainer(2, "ERS: the trainer needs a rank")) == G
        _until("the drain", lambda: svc.call(lambda: svc.in_trainer(2)))
        ranks[2].beat = False  # a trainer rank sends no heartbeat; it must not be quarantined for it
        batch, _, _ = wait_batch(svc)
        assert batch.num_trajectories == 2 * G  # its group ran afresh on rank 1
        assert svc.call(lambda: (svc.counters["retries"], svc.counters["tasks_moved"])) == (0, G)
        assert svc.call(lambda: svc.rollout_ranks) == [1]
        assert svc.call(lambda: svc.send_weights(_Manifest)) == [1]
        time.sleep(0.7)  # past the heartbeat timeout
        assert svc.call(svc.quarantine_counts)["quarantines"] == 0

        svc.call(lambda: svc.return_to_rollout(2))
        svc.call(lambda: svc.return_to_rollout(3))
        # both get the weights at once: rank 3 has not even started (its send waits for it)
        assert svc.call(lambda: svc.send_weights(type("M", (), {"version": 2}))) == [1, 2, 3]
        ranks[2].beat, ranks[2].delay_s = True, 0.05
        ranks[3].start()
        _until("both in service", lambda: svc.call(svc.quarantine_counts)["moves_in"] == 2)
        assert svc.call(lambda: svc.rollout_ranks) == [1, 2, 3]
        svc.call(lambda: svc.close_step())
        before = {r: sum(isinstance(m, RunTask) for m in ranks[r].seen) for r in (2, 3)}
        svc.call(lambda: svc.request_groups(3))
        wait_batch(svc)
        time.sleep(0.3)  # the last heartbeats
        assert all(sum(isinstance(m, RunTask) for m in ranks[r].seen) > before[r] for r in (2, 3))
        led = svc.call(svc.ledger_snapshot)
        # the moved tasks' tokens were written off as cancelled once; nothing lost or failed
        assert led["lost"] == 0 and led["failed"] == 0 and led["cancelled"] == G * 5
        assert led["generated"] == sum(r.generated for r in ranks.values())
        assert svc.call(svc.quarantine_counts) == {"quarantines": 0, "rejoins": 0, "moves_out": 1, "moves_in": 2,
                                                   "out_of_service": 0}
    finally:
        svc.stop()
        for r in ranks.values():
            r.stop.set()


def _ctb_move(store, *, cancel_in_transit: bool):
    """Two ranks under CTB, groups on both; rank 2 (its tasks never end by themselves) moves to
    the trainer. With `cancel_in_transit` its answer is held back while the groups on it are
    cancelled, so the states it hands over arrive for groups that ended."""
    ranks = {1: FakeRank(store, 1, delay_s=0.05), 2: FakeRank(store, 2, delay_s=100.0)}
    for r in ranks.values():
        r.start()
    svc = make_service(store, mode="sync", ranks=(1, 2), retries=0, ctb=True, groups_per_step=4)
    _until("both ranks", lambda: svc.call(lambda: len(svc.engines)) == 2)
    svc.call(lambda: svc.request_groups(4))
    _until("tasks on rank 2", lambda: len(ranks[2].running) >= G)
    on_2 = sorted(ranks[2].running)
    time.sleep(0.2)  # a heartbeat shows them running
    if cancel_in_transit:
        ranks[2].frozen.set()
    assert svc.call(lambda: svc.move_to_trainer(2, "ERS: the trainer needs a rank")) == len(on_2)
    if cancel_in_transit:
        now = time.monotonic()
        for gid in sorted({t.rsplit("/", 1)[0] for t in on_2}):
            svc.call(lambda gid=gid: svc.groups.give_up(gid, failed=False, reason="too stale", now=now))
        ranks[2].frozen.clear()
    _until("the hand-over", lambda: svc.call(lambda: svc.in_trainer(2)))
    ranks[2].beat = False  # a trainer rank sends no heartbeat
    return svc, ranks, on_2


def test_a_move_under_ctb_hands_the_tasks_over_and_books_every_token_once(store):
    svc, ranks, on_2 = _ctb_move(store, cancel_in_transit=False)
    try:
        batch, _, _ = wait_batch(svc)
        assert batch.num_trajectories == 4 * G
        carried = {m.assignment.trajectory_id for m in ranks[1].seen if isinstance(m, RunTask) and m.carry}
        assert carried == set(on_2)  # each went on on rank 1 from its state
        assert svc.call(lambda: (svc.counters["tasks_carried"], svc.counters["carried_tokens"],
                                 svc.counters["retries"])) == (len(on_2), 5 * len(on_2), 0)
        time.sleep(0.3)  # the last heartbeats
        led = svc.call(svc.ledger_snapshot)
        # trained trajectories hold the tokens of both ranks; nothing was wasted, lost or booked twice
        assert led["lost"] == 0 and led["failed"] == 0 and led["cancelled"] == 0
        assert led["generated"] == sum(r.generated for r in ranks.values())
        assert led["consumed"] == sum(t.generated_tokens for t in batch.trajectories)
    finally:
        svc.stop()
        for r in ranks.values():
            r.stop.set()


def test_a_task_handed_over_after_its_group_ended_is_wasted_once(store):
    svc, ranks, on_2 = _ctb_move(store, cancel_in_transit=True)
    try:
        time.sleep(0.3)
        assert not [m for m in ranks[1].seen if isinstance(m, RunTask) and m.carry]
        assert svc.call(lambda: svc.counters["tasks_carried"]) == 0
        led = svc.call(svc.ledger_snapshot)
        groups = {t.rsplit("/", 1)[0] for t in on_2}  # every member of theirs is wasted, once
        assert led["lost"] == 0 and led["cancelled"] == 5 * G * len(groups)
        assert led["generated"] == sum(r.generated for r in ranks.values())
    finally:
        svc.stop()
        for r in ranks.values():
            r.stop.set()


def test_a_quarantine_of_the_rank_a_task_was_handed_to_books_its_carried_tokens_as_failed_once(store):
    """Rank 2's tasks are handed over to rank 1, which then hangs: they are retried on rank 3
    (joined meanwhile); the tokens generated on rank 2 are booked as failed with rank 1's."""
    ranks = {1: FakeRank(store, 1, delay_s=0.05), 2: FakeRank(store, 2, delay_s=100.0),
             3: FakeRank(store, 3, delay_s=0.05)}
    for r in (1, 2):
        ranks[r].start()
    svc = make_service(store, mode="sync", ranks=(1, 2), retries=1, ctb=True, heartbeat_timeout_s=0.5)
    try:
        _until("both ranks", lambda: svc.call(lambda: len(svc.engines)) == 2)
        svc.call(lambda: svc.request_groups(2))
        _until("tasks on rank 2", lambda: len(ranks[2].running) >= G)
        _until("rank 1's own tasks done (room for the handed-over ones)", lambda: not ranks[1].running)
        on_2 = sorted(ranks[2].running)
        ranks[1].delay_s = 100.0  # what it is handed now runs until it hangs
        time.sleep(0.2)
        svc.call(lambda: svc.move_to_trainer(2, "ERS"))
        _until("the hand-over", lambda: svc.call(lambda: svc.in_trainer(2)))
        ranks[2].beat = False
        _until("the carried tasks on rank 1", lambda: set(on_2) <= set(ranks[1].running))
        svc.call(lambda: svc.return_to_rollout(3))
        svc.call(lambda: svc.send_weights(type("M", (), {"version": 1})))
        ranks[3].start()
        _until("rank 3 in service", lambda: svc.call(lambda: 3 in svc.quarantine.serving))
        time.sleep(0.2)  # a heartbeat of rank 1 shows the carried tasks running, then it hangs
        ranks[1].frozen.set()
        batch, _, _ = wait_batch(svc)
        assert batch.num_trajectories == 2 * G and svc.call(svc.quarantine_counts)["quarantines"] == 1
        time.sleep(0.3)
        led = svc.call(svc.ledger_snapshot)
        # rank 1's own tokens of them (written off) and rank 2's carried ones, each booked once
        assert led["lost"] == 0 and led["failed"] == 5 * 2 * len(on_2)
        assert led["generated"] == sum(r.generated for r in ranks.values())
    finally:
        svc.stop()
        for r in ranks.values():
            r.stop.set()


def test_a_move_needs_a_rank_in_service(store):
    svc = make_service(store, ranks=(1,))
    try:
        with pytest.raises(ValueError, match="rank 5 is not a rollout rank in service"):
            svc.call(lambda: svc.move_to_trainer(5, "ERS"))
    finally:
        svc.stop()


def test_the_run_stops_when_no_rollout_rank_is_left(store):
    with serving(store, dict(delay_s=100.0), mode="sync", heartbeat_timeout_s=0.5) as (svc, rank):
        _until("the rank", lambda: svc.call(lambda: len(svc.engines)) == 1)
        rank.frozen.set()
        svc.call(lambda: svc.request_groups(1))
        with pytest.raises(RunError, match=r"rollout rank 1 sent nothing.*0 rollout rank\(s\) left in service"):
            wait_batch(svc, timeout=20)


def test_the_kv_use_and_tasks_ers_reads_are_time_weighted_and_sampled_at_most_every_tenth_of_a_second(store):
    mailbox = Mailbox(store, 0)
    health = RolloutHealth([], 0.0, heartbeat_timeout_s=30.0, stall_timeout_s=30.0)
    shares = iter([0.5, 0.9, 0.2, 0.0])
    tasks = iter([2, 5, 3, 0])
    placement = RequestPlacement(mailbox, [1], 8)
    placement.kv_usage = lambda ranks: next(shares)
    placement.running = lambda: next(tasks)
    svc = RolloutService(mailbox=mailbox, buffer=GlobalBuffer(BufferConfig(group_size=G, b_min=G, b_ideal=G)),
                         placement=placement, mode=mode_policy("tide"), rollout_ranks=[1], tasks=TASKS, group_size=G,
                         groups_per_step=1, max_staleness=1, max_task_retries=1, max_failed_groups=3, seed=0,
                         start_version=0, health=health)  # not started: this test is its only thread
    svc.meter.sample(100.0)  # 0.5 and 2 tasks from here
    svc.meter.sample(100.05)  # too soon: no sample
    svc.meter.sample(101.0)  # 0.9 and 5 tasks from here
    window = svc.ers_window(now=104.0)  # (0.5 x 1 s + 0.9 x 3 s) / 4 s; samples 0.2 and 3 from here
    assert window["kv_used_fraction"] == pytest.approx(0.8)
    assert window["tasks_in_flight_s"] == pytest.approx(2 * 1.0 + 5 * 3.0)
    window = svc.ers_window(now=105.0)
    assert window["kv_used_fraction"] == pytest.approx(0.2) and window["tasks_in_flight_s"] == pytest.approx(3.0)


@pytest.mark.parametrize("tasks_per_rank", [8, G])
def test_ers_counts_delivery_only_while_admission_is_open(store, tasks_per_rank):
    """With room for every group the window allows (8 tasks), all are admitted at once: the
    slots stay full and the groups completing then are what the throttle allowed, not what
    Rollout can, so ERS's window counts none of them. With room for one group at a time
    (G tasks), the next group waits for the rank: admission is open, and what completes counts."""
    with serving(store, dict(delay_s=0.2), mode="tide", groups_per_step=1,
                 tasks_per_rank=tasks_per_rank) as (svc, _):
        _until("a group ready", lambda: svc.call(lambda: len(svc.buffer.ready_groups())) >= 1)
        window = svc.call(svc.ers_window)
        if tasks_per_rank == 8:
            assert window["fresh_tokens"] == 0 and window["slots_full_s"] > 0
        else:
            assert window["fresh_tokens"] >= G * (3 + 5)  # the slots fill once the second group is on the rank


def _decode_turn(iterations, seconds, seq_s, floor_n=0, floor_s=0.0, pid=100, batch_s=None):
    """A finished turn's plugin report with the engine's cumulative decode counters (its busy
    time `batch_s` twice its decode time unless given)."""
    return TurnEvent("g0/0", "finished", 10, report={
        "pid": pid, "decode_iterations": iterations, "decode_s": seconds, "decode_seqs": 0, "decode_seq_s": seq_s,
        "decode_floor_iterations": floor_n, "decode_floor_s": floor_s,
        "batch_s": 2 * seconds if batch_s is None else batch_s})


def _window_after(svc, store, *turns):
    """Post (rank, turn report) in order, let the service read them, and take ERS's window."""
    for rank, turn in turns:
        Mailbox(store, rank).post(0, turn)
    svc._pump()
    return svc.ers_window()


def test_ers_window_takes_differences_of_the_ranks_cumulative_decode_counters(store):
    """Driven by hand (the service thread is not started): turn reports in, `_pump`, `ers_window`."""
    svc = make_service(store, ranks=(1, 2), start=False)
    # Nothing decoded, no batch of one: unmeasured (0), so ERS reads decode as unslowed.
    w = _window_after(svc, store, (1, _decode_turn(0, 0.0, 0.0)))
    assert (w["decode_iteration_s"], w["decode_floor_s"], w["mean_decode_batch"]) == (0.0, 0.0, 0.0)
    # Rank 1's first counters count whole; rank 2 ran 10 iterations of 4 sequences at 0.05 s.
    w = _window_after(svc, store, (1, _decode_turn(10, 0.2, 0.2, floor_n=10, floor_s=0.2)),
                      (2, _decode_turn(10, 0.5, 2.0, pid=200)))
    assert w["decode_iteration_s"] == pytest.approx(0.7 / 20)
    assert w["mean_decode_batch"] == pytest.approx(2.2 / 0.7) and w["decode_seq_s"] == pytest.approx(2.2)
    assert w["decode_floor_s"] == pytest.approx(0.02) and w["rollout_busy_s"] == pytest.approx(1.4)
    # Next window: rank 1 ran 10 more (batch 8, 0.1 s each), then an older report of its
    # scheduler arrives late (skipped); rank 2's engine restarted (a new scheduler process):
    # its new values are the difference.
    w = _window_after(svc, store, (1, _decode_turn(20, 1.2, 8.2, floor_n=10, floor_s=0.2)),
                      (1, _decode_turn(15, 0.7, 4.2, floor_n=10, floor_s=0.2)), (2, _decode_turn(5, 0.5, 1.0, pid=201)))
    assert w["decode_iteration_s"] == pytest.approx(1.5 / 15) and w["rollout_busy_s"] == pytest.approx(3.0)
    assert w["mean_decode_batch"] == pytest.approx(9.0 / 1.5)
    assert w["decode_floor_s"] == pytest.approx(0.02)  # the run's floor, not this window's
    # A new scheduler whose counters already exceed the old ones is still a restart (its pid).
    w = _window_after(svc, store, (2, _decode_turn(30, 0.6, 0.6, floor_n=30, floor_s=0.6, pid=300)))
    assert w["decode_iteration_s"] == pytest.approx(0.02)
    assert w["decode_floor_s"] == pytest.approx(0.8 / 40)


def test_a_rank_out_of_service_books_no_decode_and_resumes_from_its_last_counters(store):
    svc = make_service(store, ranks=(1, 2), start=False)
    _window_after(svc, store, (1, _decode_turn(10, 0.5, 0.5)))
    svc.quarantine.put_out(1, "test", time.monotonic(), kind="trainer")
    assert _window_after(svc, store, (1, _decode_turn(30, 1.5, 1.5)))["decode_iteration_s"] == 0.0
    del svc.quarantine.out[1]  # back in service
    assert _window_after(svc, store, (1, _decode_turn(40, 2.5, 2.5)))["decode_iteration_s"] == pytest.approx(0.1)


def test_an_engine_restarted_without_the_weights_it_confirmed_takes_its_rank_out_until_the_next_sync(store):
    """The broadcast path keeps no host copy on a receiver: a rank whose engine restarted
    reports the version the new engine holds; behind what it confirmed, it is quarantined (its
    tasks go elsewhere) and rejoins with the next weights."""
    ranks = {r: FakeRank(store, r) for r in (1, 2)}
    for r in ranks.values():
        r.start()
    svc = make_service(store, mode="stream", ranks=(1, 2))
    try:
        _until("both ranks", lambda: svc.call(lambda: len(svc.engines)) == 2)
        svc.call(lambda: svc.send_weights(type("M", (), {"version": 1})))
        _until("the confirmations", lambda: svc.call(lambda: svc.weights_settled(1)))
        ranks[1].mb.post(0, RankReady(engine=EngineFacts(max_running_requests=8, restarts=1, weight_version=1)))
        ranks[2].mb.post(0, RankReady(engine=EngineFacts(max_running_requests=8, restarts=1, weight_version=0)))
        _until("the quarantine", lambda: svc.call(lambda: svc.quarantine.is_out(2)))
        assert not svc.call(lambda: svc.quarantine.is_out(1))  # its engine reloaded what it had
        assert "restarted with the weights of version 0" in svc.call(lambda: svc.quarantine.out[2].reason)
        _until("the drain and a heartbeat", lambda: svc.call(lambda: svc.weight_receivers())[0] == [1, 2])
        assert svc.call(lambda: svc.weight_receivers())[1] == [1]  # it rejoins by the host path
    finally:
        svc.stop()
        for r in ranks.values():
            r.stop.set()


def test_an_idle_service_backs_off_its_mailbox_reads_and_still_serves_requests_at_once(store):
    """An idle pass costs rank 0 CPU per wall second: with nothing arriving the service waits up
    to IDLE_POLL_MAX_S between passes, not its busy interval; a request ends the wait."""
    from tide_megatron.controller.rollout_service import IDLE_POLL_MAX_S

    svc = make_service(store, poll_s=0.005)  # its rank never starts: nothing arrives
    try:
        time.sleep(0.2)  # the wait has grown to its bound
        before, t0 = svc.loops, time.monotonic()
        time.sleep(1.0)
        passes, idle_s = svc.loops - before, time.monotonic() - t0
        assert passes <= idle_s / IDLE_POLL_MAX_S + 2 < idle_s / svc.poll_s / 4
        assert svc.wait(svc.submit(lambda: 7), 10.0, "a request") == 7
    finally:
        svc.stop()
