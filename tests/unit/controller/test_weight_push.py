"""Rank 0's weight sync: which receivers take which path (`controller/weight_push.py`), and
when the update group is re-formed (`comm/update_group.py`). The transfer itself, through real
SGLang engines, is `tests/integration/rollout/test_weight_sync.py`."""

from __future__ import annotations

import pytest
import torch

from tide_megatron.comm import update_group
from tide_megatron.comm.update_group import GroupChange, UpdateGroupSender
from tide_megatron.controller.weight_push import WeightPush


def _sender(ports=iter(range(40000, 40100))) -> UpdateGroupSender:
    return UpdateGroupSender(backend="gloo", device="cpu", engine_tp=2, timeout_s=5.0, address="10.0.0.1",
                             port_fn=lambda: next(ports))


def test_the_group_is_re_formed_only_when_its_members_change_and_members_leave_their_old_group(monkeypatch):
    monkeypatch.setattr(update_group, "new_update_group", lambda *a, **k: object())
    monkeypatch.setattr(update_group.dist, "destroy_process_group", lambda pg: None)
    sender = _sender()
    first = sender.change_for([3, 1])
    assert first.members == (1, 3) and first.world_size == 1 + 2 * 2  # rank 0 + two engines of TP 2
    assert [(j.rank_offset, j.leave, j.address, j.port) for j in first.joins.values()] == \
        [(1, "", "10.0.0.1", first.port), (3, "", "10.0.0.1", first.port)]
    assert sender.change_for([1, 3]) is not None  # not formed yet (connect not called): asked again
    sender.connect(first)
    assert sender.change_for([3, 1]) is None and sender.members == (1, 3)
    second = sender.change_for([1, 2])  # an ERS move: 3 out, 2 in
    assert second.name != first.name and second.port != first.port and sender.members == ()
    assert {r: j.leave for r, j in second.joins.items()} == {1: first.name, 2: ""}
    assert sender.change_for([]) is None


class _Rollout:
    def __init__(self, receivers, steady):
        self.receivers, self.steady = receivers, steady
        self.host_sends, self.broadcasts = [], []

    def call(self, fn):
        return fn()

    def weight_receivers(self):
        return self.receivers, self.steady

    def send_weights(self, weights, receivers=None):
        receivers = list(receivers if receivers is not None else self.receivers)
        self.host_sends.append((weights.version, receivers, [n for n, _ in weights.named]))
        return receivers

    def sent_broadcast(self, loads, version):
        self.broadcasts.append((version, sorted(loads)))


class _Group:
    """An update group's rank-0 end, without the process group."""

    timeout_s = 1.0

    def __init__(self, fail_connect=False, fail_broadcast=False):
        self.members, self.name = (), ""
        self.fail_connect, self.fail_broadcast = fail_connect, fail_broadcast
        self.joined, self.sent = [], []

    def change_for(self, members):
        members = tuple(sorted(members))
        if members == self.members:
            return None
        return GroupChange(members, {r: f"join-{r}" for r in members}, 1, 1 + len(members), "g")

    def connect(self, change):
        if self.fail_connect:
            raise RuntimeError("a member did not join")
        self.members, self.name = change.members, change.name
        return 0.25

    def loads(self, manifest):
        return {r: manifest.version for r in self.members}

    def broadcast(self, named, manifest):
        self.sent.append((manifest.version, type(named).__name__))
        if self.fail_broadcast:
            next(iter(named))
            raise RuntimeError("timed out")
        for _ in named:
            pass
        return update_group.BroadcastStats(nbytes=1000, buckets=1, seconds=0.5)

    def close(self):
        self.members = ()


class _Posts:
    def __init__(self):
        self.posted = []

    def post(self, dest, msg):
        self.posted.append((dest, msg))


NAMES = ["a", "b", "c"]


def _gather(consumed: list):
    """A lazy gather of three tensors; `consumed` counts what was taken (the TP peers' part)."""
    for name in NAMES:
        consumed.append(name)
        yield name, torch.ones(4)


def _push(rollout, group, path="broadcast"):
    push = WeightPush(path=path, rollout=rollout, mailbox=_Posts(), bucket_bytes=1 << 20)
    if group is not None:
        push.group = group
    return push


def test_steady_ranks_take_the_broadcast_and_the_rest_the_host_copy_made_only_then():
    rollout, group = _Rollout([1, 2, 3], steady=[1, 2]), _Group()
    push = _push(rollout, group)
    push.send(_gather([]), version=1)
    assert [dest for dest, _ in push.mailbox.posted] == [1, 2]  # joins, before the broadcast
    assert rollout.host_sends == [(1, [3], NAMES)] and rollout.broadcasts == [(1, [1, 2])]
    assert push.metrics() == {"weights/host_ranks": 1.0, "weights/broadcast_ranks": 2.0,
                              "weights/group_rebuild_s": 0.25, "weights/broadcast_s": 0.5,
                              "weights/broadcast_gb_per_s": 1000 / 0.5 / 1e9}
    rollout.receivers = rollout.steady = [1, 2, 3]  # 3 confirmed: the group is re-formed with it
    consumed = []
    push.send(_gather(consumed), version=2)
    assert group.members == (1, 2, 3) and rollout.host_sends[1:] == [] and consumed == NAMES
    assert group.sent[-1] == (2, "generator")  # streamed as gathered: no host copy of the model
    push.send(_gather([]), version=3)
    assert push.metrics()["weights/group_rebuild_s"] == 0.0  # the same members: the group stands


def test_a_group_that_does_not_form_sends_everyone_by_the_host_path():
    rollout = _Rollout([1, 2], steady=[1, 2])
    push = _push(rollout, _Group(fail_connect=True))
    push.send(_gather([]), version=1)
    assert rollout.host_sends == [(1, [1, 2], NAMES)] and rollout.broadcasts == []


def test_a_failed_broadcast_is_not_the_runs_end_and_every_tensor_is_still_gathered():
    """Its members do not confirm and are quarantined by the rollout service; rank 0 goes on,
    after taking part in every remaining TP gather (its peers are in them)."""
    rollout, group = _Rollout([1, 2], steady=[1, 2]), _Group(fail_broadcast=True)
    push = _push(rollout, group)
    push.send(_gather([]), version=1)  # the first sync materializes the manifest
    consumed = []
    push.send(_gather(consumed), version=2)
    assert consumed == NAMES and rollout.broadcasts == [(1, [1, 2]), (2, [1, 2])]
    assert "weights/broadcast_s" not in push.metrics()


def test_the_host_path_sends_every_receiver_one_copy():
    rollout = _Rollout([1, 2], steady=[1, 2])
    push = _push(rollout, None, path="host")
    push.send(_gather([]), version=4)
    assert rollout.host_sends == [(4, [1, 2], NAMES)] and push.metrics() == {"weights/host_ranks": 2.0}


def test_an_unknown_path_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="scheduler.weight_sync_path"):
        WeightPush(path="nccl", rollout=None, mailbox=None, bucket_bytes=1)
