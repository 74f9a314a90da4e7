"""A rollout rank whose engine dies while it handles one message of a poll still handles the
messages read with it, on the replacement engine (issue 39). They used to be dropped: a
`RunTask` that followed a `LoadWeights` during which the engine died never ran, was never
answered, and stayed resident in rank 0's CTB placement until the run stalled."""

from __future__ import annotations

import os
import sys
import types

from tide_megatron.comm.messages import LoadWeights, RunTask, TaskAssignment, TaskCancelled
from tide_megatron.rollout import worker as worker_mod
from tide_megatron.rollout.task_runner import TaskRunnerConfig

sys.path.insert(0, os.path.dirname(__file__))
from worker_fakes import FakeEngine, FakeMailbox, WaitsForResume, run_until_a_task_started  # noqa: E402


def test_messages_read_with_the_one_the_engine_died_in_are_handled_after_the_restart(monkeypatch):
    monkeypatch.setattr(worker_mod, "STOP_GRACE_S", 5.0)
    mailbox = FakeMailbox()
    worker = worker_mod.RolloutWorker(1, FakeEngine(), TaskRunnerConfig(), types.SimpleNamespace(), env=None,
                                      mailbox=mailbox, job_group=None, heartbeat_interval_s=0.05,
                                      engine_factory=FakeEngine)
    runner = worker._runner = WaitsForResume()

    async def load_and_die(msg):  # the engine dies during the weight load
        worker.engine.died = True

    worker._load_weights = load_and_die
    assignment = TaskAssignment(task={"task_id": "t0"}, group_id="g0", index=0)
    mailbox.inbox = [LoadWeights({}, sender=0), RunTask(assignment)]  # one poll

    assert run_until_a_task_started(worker, mailbox, runner), "the task that came with the fatal message never ran"
    assert worker.engine_restarts == 1 and runner.started == 1
    cancelled = [m for m in mailbox.sent if isinstance(m, TaskCancelled)]  # at Stop: answered once
    assert [m.task_id for m in cancelled] == [assignment.trajectory_id]
