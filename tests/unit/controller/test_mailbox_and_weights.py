"""Control messages through a key-value store; the packing of weights and their point-to-point
transfer, where a receiver that never receives holds up no one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import (CancelTask, EngineFacts, Heartbeat, LoadWeights, OpenRefStep, PushWeights, RankReady,
                                         RefMicroBatch, RunTask, SaveCheckpoint, SetRoles, TaskAssignment,
                                         TrainMicroBatch, TrajectoryDone, TurnEvent, WeightsLoaded)
from tide_megatron.comm.weight_sync import (
    bucket_ranges,
    WeightManifest,
    WeightSender,
    WeightSet,
    bucket_handles,
    buckets,
    pack,
    receive_flat,
    route,
    share_named,
    unpack,
)
from tide_megatron.core.trajectory import Segment, Trajectory


def test_messages_arrive_in_order_once():
    store = dist.HashStore()
    rank0, rank1 = Mailbox(store, 0), Mailbox(store, 1)
    for i in range(5):
        rank0.post(1, PushWeights(i))
    rank1.post(0, SaveCheckpoint())
    got = rank1.poll()
    assert [m.version for m in got] == list(range(5)) and all(m.src == 0 for m in got)
    assert rank1.poll() == []
    (saved,) = rank0.poll()
    assert isinstance(saved, SaveCheckpoint) and saved.src == 1


def test_typed_messages_round_trip_with_their_sender():
    store = dist.HashStore()
    rank0, rank1 = Mailbox(store, 0), Mailbox(store, 1)
    a = TaskAssignment({"env": "door_game", "task_id": "t1"}, "g0v0", 2, attempt=1)
    rank0.post(1, RunTask(a, {"priority": 1.5}))
    traj = Trajectory("g0v0", 2, "t1", 3, 5, 4, 1.0, token_ids=list(range(9)), loss_mask=[0] * 5 + [1] * 4,
                      logprobs=[0.0] * 5 + [-0.5] * 4, segments=[Segment(5, 7, 3), Segment(7, 9, 4)])
    rank1.post(0, TrajectoryDone(traj))
    rank1.post(0, Heartbeat(generated_tokens=4, running_tokens=0, running_tasks=0, env_steps=2))
    (run,) = rank1.poll()
    assert isinstance(run, RunTask) and run.assignment == a and run.tag == {"priority": 1.5} and run.src == 0
    done, beat = rank0.poll()
    assert done.trajectory == traj and done.trajectory.versions == [3, 4] and done.src == 1
    assert beat.env_steps == 2 and beat.src == 1


def test_only_typed_messages_can_be_posted():
    with pytest.raises(TypeError, match="typed message"):
        Mailbox(dist.HashStore(), 0).post(1, "task")


def test_trainer_messages_round_trip_with_typed_fields():
    store = dist.HashStore()
    rank0, rank1 = Mailbox(store, 0), Mailbox(store, 1)
    traj = Trajectory.from_tokens([5, 6, 7], [0, 1, 1], [0.0, -0.1, -0.2], advantage=0.5, group_id="g1", index=3)
    rank0.post(1, OpenRefStep({0: 2, 3: 1}))
    rank0.post(1, RefMicroBatch(3, [traj]))
    rank0.post(1, TrainMicroBatch([traj, traj]))
    rank0.post(1, SetRoles(2, [4, 5], False, 3, [], True))
    opened, ref_mb, mb, roles = rank1.poll()
    assert opened.num_micro_batches == {0: 2, 3: 1}  # int keys again after JSON's strings
    assert ref_mb.dp == 3 and ref_mb.trajectories == [traj] and mb.trajectories == [traj, traj]
    assert mb.trajectories[0].advantage == 0.5 and mb.trajectories[0].trajectory_id == "g1/3"
    assert roles == SetRoles(2, [4, 5], False, 3, [], True) and roles.src == 0
    rank1.post(0, RankReady(EngineFacts(kv_tokens=1024, request_rows=8, use_sessions=True), pid=7))
    (ready,) = rank0.poll()
    assert ready.engine == EngineFacts(kv_tokens=1024, request_rows=8, use_sessions=True) and ready.pid == 7


def test_concurrent_senders_lose_nothing():
    store = dist.HashStore()
    inbox = Mailbox(store, 0)
    senders = [Mailbox(store, r) for r in (1, 2, 3)]

    def send(mb):
        for i in range(50):
            mb.post(0, PushWeights(i))

    threads = [threading.Thread(target=send, args=(s,)) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = inbox.poll()
    assert len(got) == 150
    for src in (1, 2, 3):
        assert [m.version for m in got if m.src == src] == list(range(50))  # per-sender order


def test_poll_limit_keeps_the_rest():
    store = dist.HashStore()
    a, b = Mailbox(store, 0), Mailbox(store, 1)
    for i in range(4):
        a.post(1, PushWeights(i))
    assert [m.version for m in b.poll(limit=3)] == [0, 1, 2]
    assert [m.version for m in b.poll()] == [3]


def test_pack_unpack_round_trip():
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(4)), ("c", torch.randn(2, 2, 2))]
    manifest, flat = pack(named, version=7)
    assert flat.numel() == manifest.numel == 12 + 4 + 8
    again = WeightManifest.from_json(manifest.to_json())
    for (name, t), (name2, t2) in zip(named, unpack(again, flat.clone())):
        assert name == name2 and torch.equal(t, t2)
    assert again.version == 7


def test_pack_refuses_mixed_dtypes():
    import pytest

    with pytest.raises(ValueError, match="expected every tensor"):
        pack([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))], 0)


def test_buckets_keep_order_and_cut_at_the_byte_limit():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 100])]  # fp32: 4 bytes each
    cut = buckets(named, bucket_bytes=80)
    assert [[n for n, _ in b] for b in cut] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert [n for b in cut for n, _ in b] == [n for n, _ in named]


@pytest.mark.parametrize("receivers,nodes,local,relays", [
    ([1, 2, 3], {0: 0, 1: 0, 2: 0, 3: 0}, [1, 2, 3], {}),               # one node: every engine maps the buckets
    ([4, 5, 6, 7, 9], {r: r // 4 for r in range(12)}, [], {4: [5, 6, 7], 9: []}),  # one relay per other node
    ([3, 4], {r: r // 4 for r in range(8)}, [3], {4: []}),
])
def test_route_shares_on_the_senders_node_and_relays_one_copy_per_other_node(receivers, nodes, local, relays):
    assert route(receivers, nodes.__getitem__, sender_node=0) == (local, relays)


def test_shared_buckets_reach_an_unrelated_process_by_handle_not_by_copy(tmp_path):
    """What an engine's scheduler gets: a few hundred bytes per bucket naming a /dev/shm file,
    which a process of the node maps to the very tensors the sender wrote."""
    named = [("big.weight", torch.randn(512, 512)), ("small.bias", torch.randn(7)), ("last", torch.arange(6.0))]
    manifest, flat = share_named(named, version=3, bucket_bytes=1 << 20)
    handles = bucket_handles(manifest, flat)
    assert flat.is_shared() and len(handles) == 2  # the 1 MiB matrix alone, then the two small ones
    assert all(len(h) < 4096 for h in handles)  # handles, not data (the matrix alone is 1 MiB)
    script = (
        "import base64, pickle, sys, torch\n"
        "out = []\n"
        "for h in sys.stdin.read().split():\n"
        "    for name, t in pickle.loads(base64.b64decode(h)):\n"
        "        out.append((name, float(t.double().sum()), list(t.shape)))\n"
        "print(out)\n")
    proc = subprocess.run([sys.executable, "-c", script], input="\n".join(handles), capture_output=True, text=True,
                          timeout=120, start_new_session=True)  # its own session: no inherited descriptors
    assert proc.returncode == 0, proc.stderr
    got = eval(proc.stdout)
    assert got == [(n, float(t.double().sum()), list(t.shape)) for n, t in named]
    # Each opening takes one reference: a second process with handles of its own still finds the
    # buffer (one set of handles opened twice would drop the buffer's last reference early).
    again = subprocess.run([sys.executable, "-c", script], input="\n".join(bucket_handles(manifest, flat)),
                           capture_output=True, text=True, timeout=120, start_new_session=True)
    assert again.returncode == 0 and eval(again.stdout) == got, again.stderr
    assert WeightManifest.from_json(manifest.to_json()).bucket_bytes == 1 << 20


def test_no_shared_buffer_outlives_its_creator_even_when_a_reader_was_killed(tmp_path):
    """A process that mapped a buffer and was SIGKILLed (an SGLang scheduler) never drops its
    reference, and SGLang's engine shutdown kills torch's shared-memory manager (a child of the
    process) that would clean up after it; the buffer's file is still unlinked when the process
    that made it exits."""
    script = (
        "import signal, subprocess, sys, time, torch\n"
        "from tide_megatron.comm import weight_sync as w\n"
        "m, flat = w.share_named([('a', torch.ones(1000))], 1, 1 << 20)\n"
        "print(w._CREATED[-1], flush=True)\n"
        "reader = subprocess.Popen([sys.executable, '-c', 'import base64, pickle, sys, time, torch; '\n"
        "    'x = pickle.loads(base64.b64decode(sys.stdin.readline())); print(1, flush=True); time.sleep(60)'],\n"
        "    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "reader.stdin.write(w.bucket_handles(m, flat)[0] + '\\n'); reader.stdin.flush()\n"
        "assert reader.stdout.readline().strip() == '1'\n"
        "reader.send_signal(signal.SIGKILL); reader.wait()\n"
        "import psutil\n"  # as SGLang's engine shutdown does: every child goes, torch's shm manager too
        "children = psutil.Process().children(recursive=True)\n"
        "for child in children: child.kill()\n"
        "psutil.wait_procs(children, timeout=30)\n")
    # `flat` stays alive to the end: torch aborts a process that frees a managed buffer after its
    # shm manager died (libshm's deallocation message fails with EPIPE inside a destructor).
    # This test used to `del flat` here and passed only while the kill had not yet taken effect.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.split()[0]
    assert not os.path.exists(os.path.join("/dev/shm", name.lstrip("/")))


def test_polling_a_queue_nobody_wrote_returns_at_once():
    """A `get` of a key nobody has set waits for the store's timeout; a poll must not."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    t0 = time.monotonic()
    assert Mailbox(store, 0).poll() == []
    assert time.monotonic() - t0 < 1


def test_large_messages_go_by_their_own_keys_in_pieces_and_keep_their_place(monkeypatch):
    from tide_megatron.comm import mailbox

    monkeypatch.setattr(mailbox, "PIECE_BYTES", 1000)  # a large message in several pieces
    store = dist.HashStore()
    sender, owner = Mailbox(store, 1), Mailbox(store, 0)
    keys_before = store.num_keys()
    big = {"text": "x" * (mailbox.INLINE_BYTES + 2500)}
    sender.post(0, PushWeights(0))
    sender.post(0, TurnEvent("g0v0/1", "finished", 7, big))
    sender.post(0, PushWeights(1))
    queued = store.get(f"tide/mb/q/0/{sender._name}.0/1")
    assert len(queued) < 1000 and queued.count(b'{"ref":') == 1  # the slot holds a reference only
    first, turn, last = owner.poll()
    assert (first.version, last.version) == (0, 1) and turn.report == big and turn.src == 1
    # the pieces are deleted; the bell, the wake key, 3 emptied slots and the read record stay
    assert store.num_keys() == keys_before + 6


def test_a_queue_past_the_stores_8_mib_request_limit_is_read_whole():
    """torch's libuv store closes the connection of a request over 8 MiB, and the owner's clear
    sends back the whole queue it read: 12 MB of queued turn reports once killed rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    sender, owner = Mailbox(store, 1), Mailbox(store, 0)
    report = {"text": "y" * 300_000}
    for i in range(40):
        sender.post(0, TurnEvent(f"g{i}", "finished", i, report))
    got = owner.poll()
    assert [m.context_tokens for m in got] == list(range(40)) and all(m.report == report for m in got)


def test_small_messages_of_many_senders_past_the_8_mib_limit_are_read_whole():
    """At 64 ranks rank 0 fell behind and its one queue of small turn reports (each well under
    `INLINE_BYTES`) passed 8 MiB: the clear that sent it back closed rank 0's store connection."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    owner = Mailbox(store, 0)
    senders = [Mailbox(store, r) for r in range(1, 5)]
    report = {"text": "z" * 2000}
    for i in range(1500):  # 4 x 1,500 x ~2.1 KB: 12.6 MB queued for rank 0
        for s in senders:
            s.post(0, TurnEvent(f"g{i}", "finished", i, report))
    got = owner.poll()
    assert len(got) == 6000 and all(m.report == report for m in got)
    assert [(m.src, m.context_tokens) for m in got] == [(r, i) for i in range(1500) for r in range(1, 5)]  # posting order


def test_a_sender_whose_slots_are_unread_moves_to_new_ones_and_reuses_read_ones(monkeypatch):
    from tide_megatron.comm import mailbox

    monkeypatch.setattr(mailbox, "SLOTS", 4)
    store = dist.HashStore()
    sender, owner = Mailbox(store, 1), Mailbox(store, 0)
    for i in range(10):  # the owner reads nothing: 4 slots, 4 more, then 2 of a third generation
        sender.post(0, PushWeights(i))
    generation = [f"tide/mb/q/0/{sender._name}.{g}/0" for g in range(4)]
    assert store.check(generation[:3]) and not store.check(generation[3:])
    assert [m.version for m in owner.poll()] == list(range(10))
    keys = store.num_keys()
    for i in range(10, 14):  # two new slots of the third generation, then its two emptied ones
        sender.post(0, PushWeights(i))
    assert not store.check(generation[3:]) and store.num_keys() == keys + 2  # 2 of its slots were new
    assert [m.version for m in owner.poll()] == list(range(10, 14)) and owner.received == 14


class _PostsAfterTheBell:
    """A store on which, right after the owner has taken its bell, rank 2 posts X and rank 1 then
    posts Z (as a reply to X would come), before the owner fetches rank 1's older message."""

    def __init__(self, store, first: Mailbox, second: Mailbox):
        self.store, self.first, self.second, self.armed = store, first, second, True

    def __getattr__(self, name):
        return getattr(self.store, name)

    def compare_set(self, key, expected, desired):
        out = self.store.compare_set(key, expected, desired)
        if key.endswith("/bell") and desired == b"" and not out and self.armed:
            self.armed = False
            self.first.post(0, PushWeights(1))  # X
            self.second.post(0, PushWeights(2))  # Z, caused by X
        return out


def test_a_message_never_comes_out_before_one_posted_before_it_by_another_rank():
    store = dist.HashStore()
    one, two = Mailbox(store, 1), Mailbox(store, 2)
    owner = Mailbox(_PostsAfterTheBell(store, two, one), 0)
    one.post(0, PushWeights(0))
    assert [m.version for m in owner.poll()] == [0]  # not Z, which the bell the owner read did not name
    assert [(m.src, m.version) for m in owner.poll()] == [(2, 1), (1, 2)]  # X, then Z
    assert owner.poll() == [] and owner.received == 3


def test_wait_returns_at_a_post_and_holds_no_connection_the_others_need():
    """The trainer rank's reader waits for its next message instead of polling; its main thread
    posts over the same mailbox meanwhile (a TCP store connection blocks while it waits)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    owner, sender = Mailbox(store, 1), Mailbox(store, 0)
    woke = []
    reader = threading.Thread(target=lambda: woke.append((owner.wait(20), time.monotonic())))
    reader.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    owner.post(0, PushWeights(7))  # the owner posts while its reader waits
    assert time.monotonic() - t0 < 1 and [m.version for m in sender.poll()] == [7]
    sender.post(1, PushWeights(8))
    reader.join(timeout=10)
    assert woke and woke[0][0] and woke[0][1] - t0 < 5
    assert [m.version for m in owner.poll()] == [8]


def test_wait_misses_no_message_posted_around_it():
    store = dist.HashStore()
    owner, sender = Mailbox(store, 1), Mailbox(store, 0)
    sender.post(1, PushWeights(0))  # before the wait: it returns at once
    assert owner.wait(5) and [m.version for m in owner.poll()] == [0]
    assert not owner.wait(0.2)  # nothing since
    sender.post(1, PushWeights(1))
    sender.post(1, PushWeights(2))
    assert owner.wait(5) and [m.version for m in owner.poll(limit=1)] == [1]
    assert owner.wait(0.2)  # one message read, not returned yet
    assert [m.version for m in owner.poll()] == [2] and not owner.wait(0.2)
    owner.wake()
    assert owner.wait(5) and owner.poll() == []


class _AppendsDuringClear:
    """A store on which another sender posts between the owner's read and its clear, `times` times."""

    def __init__(self, store, sender: Mailbox, times: int):
        self.store, self.sender, self.times = store, sender, times

    def __getattr__(self, name):
        return getattr(self.store, name)

    def compare_set(self, key, expected, desired):
        if desired == b"" and self.times:  # the clear
            self.times -= 1
            self.sender.post(0, PushWeights(100 + self.times))
        return self.store.compare_set(key, expected, desired)


def test_a_message_posted_between_the_read_and_the_clear_is_neither_lost_nor_read_twice():
    store = dist.HashStore()
    sender = Mailbox(store, 1)
    owner = Mailbox(_AppendsDuringClear(store, sender, times=2), 0)
    sender.post(0, PushWeights(0))
    assert [m.version for m in owner.poll()] == [0, 101, 100]
    assert owner.poll() == [] and owner.received == 3
    sender.post(0, PushWeights(1))
    assert [m.version for m in owner.poll()] == [1]


def test_an_unreadable_message_is_named_and_the_others_still_come_out():
    store = dist.HashStore()
    sender = Mailbox(store, 1)
    sender.post(0, PushWeights(0))
    store.set("tide/mb/q/0/9-foreign.0/0", '0 {"kind":"no_such_kind","src":9}')  # a sender of another version
    store.append("tide/mb/q/0/bell", "9-foreign.0/0\n")
    sender.post(0, PushWeights(1))
    owner = Mailbox(store, 0)
    with pytest.raises(ValueError, match="rank 0: 1 unreadable control message.*no_such_kind"):
        owner.poll()
    assert [m.version for m in owner.poll()] == [0, 1] and owner.received == 2


def test_a_message_with_newlines_in_its_text_is_one_message():
    store = dist.HashStore()
    Mailbox(store, 1).post(0, CancelTask("g0v0/1", reason="line one\nline two"))
    (msg,) = Mailbox(store, 0).poll()
    assert msg.reason == "line one\nline two"


# -- point-to-point weights: three gloo ranks, one thread each, on loopback ----------------------
WORLD = 3


def _named(version: int) -> list[tuple[str, torch.Tensor]]:
    return [("a.weight", torch.full((64, 32), float(version))), ("b.bias", torch.arange(32.0) + version)]


def _group(store, rank: int):
    return dist.ProcessGroupGloo(dist.PrefixStore("pg", store), rank, WORLD, timedelta(seconds=30))


def _take(mailbox: Mailbox, kind: type, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for msg in mailbox.poll():
            if isinstance(msg, kind):
                return msg
        time.sleep(0.01)
    raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")


def test_a_receiver_that_never_receives_blocks_no_one():
    store = dist.HashStore()
    groups: dict[int, object] = {}
    made = [threading.Thread(target=lambda r=r: groups.__setitem__(r, _group(store, r))) for r in range(WORLD)]
    for t in made:
        t.start()
    for t in made:
        t.join(timeout=30)
    assert len(groups) == WORLD
    got: dict[int, list] = {1: [], 2: []}
    wake_rank2 = threading.Event()

    def receiver(rank: int, versions: int) -> None:
        mailbox = Mailbox(store, rank)
        for _ in range(versions):
            if rank == 2:
                assert wake_rank2.wait(timeout=30)  # hung until rank 0 is done with the others
            msg = _take(mailbox, LoadWeights, 30)
            assert msg.relay_to == [] and msg.shared == []  # each rank its own node's relay: point to point
            manifest = WeightManifest.from_json(msg.manifest)
            flat, _ = receive_flat(groups[rank], manifest, msg.sender, timeout_s=30)
            got[rank].append((manifest.version, unpack(manifest, flat)))
            mailbox.post(0, WeightsLoaded(manifest.version))

    threads = [threading.Thread(target=receiver, args=(1, 2)), threading.Thread(target=receiver, args=(2, 1))]
    for t in threads:
        t.start()
    # Every rank on a node of its own: the weights cross the network, point to point.
    sender, inbox = WeightSender(groups[0], Mailbox(store, 0), node_of=lambda rank: rank), Mailbox(store, 0)
    t0 = time.monotonic()
    sends = sender.send(WeightSet(_named(1), 1), receivers=[1, 2])
    assert time.monotonic() - t0 < 5  # nothing waits for rank 2
    assert [(s.rank, s.version) for s in sends] == [(1, 1), (2, 1)]
    assert _take(inbox, WeightsLoaded, 30).src == 1
    # rank 2 stays silent; the next version goes to rank 1 alone, over the same group
    later = sender.send(WeightSet(_named(2), 2), receivers=[1])  # kept: a dropped Send may abort its transfer
    assert _take(inbox, WeightsLoaded, 30).src == 1
    assert time.monotonic() - t0 < 20
    assert [v for v, _ in got[1]] == [1, 2] and got[2] == []
    for version, tensors in got[1]:
        for (name, t), (name2, t2) in zip(_named(version), tensors):
            assert name == name2 and torch.equal(t, t2)
    wake_rank2.set()  # it wakes: its pending send (version 1) completes
    loaded = _take(inbox, WeightsLoaded, 30)
    assert (loaded.src, loaded.version) == (2, 1)
    for t in threads:
        t.join(timeout=30)
    assert [v for v, _ in got[2]] == [1] and torch.equal(got[2][0][1][0][1], _named(1)[0][1])
    del sends, later  # confirmed: their buffers may go
    for group in groups.values():
        group.shutdown()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(1, 8000))
def test_buckets_cover_every_tensor_in_order_and_close_only_when_the_next_would_overflow(nbytes, bucket_bytes):
    ranges = bucket_ranges(nbytes, bucket_bytes)
    assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(len(nbytes)))
    for (lo, hi), nxt in zip(ranges, ranges[1:] + [None]):
        size = sum(nbytes[lo:hi])
        assert hi > lo and (size <= bucket_bytes or hi - lo == 1)
        if nxt is not None:
            assert size + nbytes[hi] > bucket_bytes
