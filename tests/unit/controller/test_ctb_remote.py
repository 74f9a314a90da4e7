"""Rank 0's interim CTB over remote ranks: the unified dispatcher's decisions become mailbox messages."""

from __future__ import annotations

import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.controller.ctb_remote import RemoteCTB
from tide_megatron.core.ctb import CTBConfig
from tide_megatron.rollout.ctb_config import CTBDispatchConfig
from tide_megatron.rollout.ctb_dispatcher import RankResources
from tide_megatron.rollout.task_runner import TaskAssignment


def _group(gid: str, n: int = 2, is_eval: bool = False):
    task = {"env": "door_game", "task_id": f"train/{gid}", "task_type": "door_game/rooms2", "split": "train"}
    return [TaskAssignment(task=task, group_id=gid, index=i, is_eval=is_eval) for i in range(n)]


def _remote(kv_tokens: int = 5000):
    store = dist.HashStore()
    cfg = CTBDispatchConfig(prompt_tokens_estimate=100, policy=CTBConfig(probe_turn_reserve_tokens=64))
    resources = RankResources(kv_tokens, 32)
    return RemoteCTB(cfg, Mailbox(store, 0), {1: resources, 2: resources}), {r: Mailbox(store, r) for r in (1, 2)}


def test_admits_probe_first_then_group_after_its_first_turn():
    ctb, ranks = _remote()
    ctb.submit(_group("g0"))
    ctb.schedule(0.0, unconsumed_trajectories=0)
    sent = [(r, m) for r, box in ranks.items() for m in box.poll()]
    assert [m["kind"] for _r, m in sent] == ["task"]  # only the group's probe until it measured a turn
    rank, probe = sent[0]
    assert {"priority", "footprint_tokens", "turn_reserve_tokens"} <= set(probe["ctb"])
    tid = f"{probe['assignment']['group_id']}/{probe['assignment']['index']}"
    ctb.on_turn({"src": rank, "task_id": tid, "phase": "started", "context_tokens": 120})
    ctb.on_turn({"src": rank, "task_id": tid, "phase": "finished", "context_tokens": 130,
                 "report": {"plugin": "tide_ctb", "context_tokens": 131}})
    ctb.schedule(0.1, unconsumed_trajectories=0)
    assert [m["kind"] for r in ranks.values() for m in r.poll()] == ["task"]  # the rest of the group
    ctb.on_finished(tid, 140)
    assert ctb.dispatcher.policy.counts()["finished"] == 1


def test_eval_tasks_are_admitted_first():
    ctb, ranks = _remote()
    ctb.submit(_group("train0"))
    ctb.submit(_group("eval0", is_eval=True))
    ctb.schedule(0.0, unconsumed_trajectories=0)
    first = [m for r in ranks.values() for m in r.poll()]
    assert first and first[0]["assignment"]["is_eval"]
