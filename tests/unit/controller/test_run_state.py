"""The controller's run state: capture on a live rollout service, a JSON round trip, and a
restore into a fresh controller that then continues exactly where the first one was."""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.controller import run_state
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import mode_policy
from tide_megatron.controller.placement import RequestPlacement
from tide_megatron.controller.rollout_service import RolloutService
from tide_megatron.controller.run_state import RunState
from tide_megatron.core.buffer import BufferConfig, GlobalBuffer
from tide_megatron.core.trajectory import Segment, Trajectory

TASKS = [{"env": "door_game", "task_id": f"t{i}"} for i in range(7)]
G = 2


def make_controller(step: int, seed: int = 0) -> SimpleNamespace:
    store = dist.HashStore()
    mailbox = Mailbox(store, 0)
    buffer = GlobalBuffer(BufferConfig(group_size=G, b_min=G, b_ideal=4 * G, max_staleness=2))
    health = RolloutHealth([], time.monotonic(), heartbeat_timeout_s=30, stall_timeout_s=30)
    service = RolloutService(mailbox=mailbox, buffer=buffer, placement=RequestPlacement(mailbox, [1], 8),
                             mode=mode_policy("async_static"), rollout_ranks=[1], tasks=TASKS, group_size=G,
                             groups_per_step=2, max_staleness=2, max_task_retries=1, max_failed_groups=3, seed=seed,
                             start_version=step, health=health)
    return SimpleNamespace(step=step, version=step, rollout=service, log=SimpleNamespace(_generated_before=0))


def finish(buffer: GlobalBuffer, gid: str, index: int, version: int, gen: int, reward: float) -> None:
    buffer.add_trajectory(Trajectory(gid, index, "t", version, 3, gen, reward, token_ids=[1] * (3 + gen),
                                     loss_mask=[0] * 3 + [1] * gen, logprobs=[-0.5] * (3 + gen),
                                     segments=[Segment(3, 3 + gen, version)]), time.monotonic(), consumer_version=3)


def history(ctrl) -> None:
    """Five groups drawn: one consumed, two ready, one half done, one not started on a rank."""
    svc = ctrl.rollout
    gids = [svc.groups.start() for _ in range(5)]
    for i, gid in enumerate(gids[:3]):
        for index in range(G):
            finish(svc.buffer, gid, index, version=2 + (i > 0), gen=5 + i + index, reward=float(index + i))
    svc.buffer.fetch(3, time.monotonic(), G)  # the trainer took the oldest group
    finish(svc.buffer, gids[3], 0, version=3, gen=4, reward=1.0)  # half a group: in flight
    svc.counters["retries"] += 2


@pytest.fixture
def captured():
    ctrl = make_controller(step=3)
    history(ctrl)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    ctrl.rollout.start()
    try:
        state = run_state.capture(ctrl)
    finally:
        ctrl.rollout.stop()
        ctrl.rollout.join(timeout=5)
    return ctrl, state


def test_capture_holds_sampler_ledger_and_ready_groups(captured):
    ctrl, state = captured
    svc = ctrl.rollout
    assert (state.step, state.version) == (3, 3)
    assert state.sampler["groups_started"] == 5 and state.sampler["num_tasks"] == len(TASKS)
    assert state.sampler["tasks_drawn"] == 5
    assert state.counters["groups_started"] == 5 and state.counters["retries"] == 2
    assert state.ledger["in_flight"] == 4 and state.ledger["consumed"] == 5 + 6
    assert [g["group_id"] for g in state.ready_groups] == [g.group_id for g in svc.buffer.ready_groups()]
    assert state.ledger["ready"] == sum(t["generated_tokens"] for g in state.ready_groups for t in g["trajectories"])


def test_round_trip_continues_where_the_run_was(captured):
    old, state = captured
    state = RunState.from_json(json.loads(json.dumps(state.to_json())))  # what a checkpoint holds
    expected_tasks = [old.rollout._rng.choice(TASKS)["task_id"] for _ in range(6)]
    expected_python, expected_numpy, expected_torch = random.random(), np.random.rand(), torch.rand(1).item()
    old_ready = {g.group_id: [(t.index, t.advantage, t.generated_tokens) for t in g.trajectories]
                 for g in old.rollout.buffer.ready_groups()}

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    new = make_controller(step=3)  # a fresh process: the sampler would start from its seed
    notes = run_state.restore(new, state)
    svc = new.rollout

    assert [svc._rng.choice(TASKS)["task_id"] for _ in range(6)] == expected_tasks
    assert svc.groups.start() == "g5v3"  # group ids keep counting after the 5 drawn before the save
    assert svc.groups.drawn == 6  # so does a sequential order's position
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == (expected_python, expected_numpy,
                                                                          expected_torch)
    assert dict(svc.counters) == {**state.counters, "groups_started": state.counters["groups_started"] + 1}
    ledger = svc.buffer.ledger
    assert ledger.balanced and svc.buffer.audit() == []
    # The half-finished group died with the job: its tokens are failed, nothing else moved.
    assert (ledger.in_flight, ledger.failed, ledger.consumed) == (0, state.ledger["failed"] + 4,
                                                                  state.ledger["consumed"])
    assert ledger.generated == state.ledger["generated"]
    assert {g.group_id: [(t.index, t.advantage, t.generated_tokens) for t in g.trajectories]
            for g in svc.buffer.ready_groups()} == old_ready
    assert new.log._generated_before == ledger.generated and svc.lost_before == 0
    assert notes == ["4 tokens of groups still running at the checkpoint are booked as failed"]
    # The restored groups are trainable: a fetch takes them, oldest version first.
    taken = svc.buffer.fetch(3, time.monotonic(), 4 * G)
    assert [g.group_id for g in taken] == list(old_ready)


def test_restore_says_when_the_task_list_changed(captured):
    _, state = captured
    new = make_controller(step=3)
    new.rollout.tasks = TASKS[:3]
    notes = run_state.restore(new, state)
    assert any("the env offers 3 training tasks, the checkpoint's sampler drew from 7" in n for n in notes)


def test_restore_refuses_another_step_or_a_running_service(captured):
    _, state = captured
    with pytest.raises(ValueError, match="run state of step 3 .* does not match the checkpoint's step 4"):
        run_state.restore(make_controller(step=4), state)
    running = make_controller(step=3)
    running.rollout.start()
    try:
        with pytest.raises(RuntimeError, match="before the rollout service thread starts"):
            run_state.restore(running, state)
    finally:
        running.rollout.stop()
        running.rollout.join(timeout=5)


def test_a_run_state_of_an_earlier_version_has_drawn_no_task_in_order(captured):
    data = json.loads(json.dumps(captured[1].to_json()))
    del data["sampler"]["tasks_drawn"]
    assert RunState.from_json(data).sampler["tasks_drawn"] == 0


@pytest.mark.parametrize("damage,field", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d["sampler"].update(rng=[3, "x", None]), "sampler.rng"),
    (lambda d: d["sampler"].pop("groups_started"), "sampler.groups_started"),
    (lambda d: d["sampler"].update(tasks_drawn=-2), "sampler.tasks_drawn"),
    (lambda d: d["counters"].update(retries="two"), "counters.retries"),
    (lambda d: d["ledger"].update(lost=5), "ledger: buckets do not add up"),
    (lambda d: d["ready_groups"][0]["trajectories"][0].update(loss_mask=[1]), "ready_groups[0]: bad trajectory"),
    (lambda d: d["ready_groups"].pop(), "ready_groups hold"),
])
def test_bad_run_states_name_the_field(captured, damage, field):
    data = json.loads(json.dumps(captured[1].to_json()))
    damage(data)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        RunState.from_json(data)
