"""Weights go point to point to the ranks named, and a receiver that never receives holds up
no one: rank 0 does not wait on it, the others get their weights (again at the next version),
and when it does receive later it gets exactly what was sent to it. Three gloo ranks, one
thread each, on loopback."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import LoadWeights, WeightsLoaded
from tide_megatron.comm.weight_sync import WeightManifest, WeightSender, pack, receive_flat, unpack

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
            manifest = WeightManifest.from_json(msg.manifest)
            flat, _ = receive_flat(groups[rank], manifest, msg.sender, timeout_s=30)
            got[rank].append((manifest.version, unpack(manifest, flat)))
            mailbox.post(0, WeightsLoaded(manifest.version))

    threads = [threading.Thread(target=receiver, args=(1, 2)), threading.Thread(target=receiver, args=(2, 1))]
    for t in threads:
        t.start()
    sender, inbox = WeightSender(groups[0], Mailbox(store, 0)), Mailbox(store, 0)
    t0 = time.monotonic()
    sends = sender.send(*pack(_named(1), 1), receivers=[1, 2])
    assert time.monotonic() - t0 < 5  # nothing waits for rank 2
    assert [(s.rank, s.version) for s in sends] == [(1, 1), (2, 1)]
    assert _take(inbox, WeightsLoaded, 30).src == 1
    # rank 2 stays silent; the next version goes to rank 1 alone, over the same group
    later = sender.send(*pack(_named(2), 2), receivers=[1])  # kept: a dropped Send may abort its transfer
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
