"""A rollout rank's lifecycle with fakes (no SGLang): told to stop, it ends every task it holds,
including one paused by CTB that waits for a resume which will never come (a CI run hung there
after its last step); while it replaces a dead engine it keeps sending heartbeats (a slow
restart on a loaded machine once looked like a silent rank); told to, it closes the env session
of a hand-over rank 0 dropped, before it returns."""

from __future__ import annotations

import os
import sys
import asyncio
import threading
import types

from tide_megatron.comm.messages import Heartbeat, ReleaseCarry, RunTask, Stop, TaskAssignment, TaskCancelled
from tide_megatron.rollout import worker as worker_mod
from tide_megatron.rollout.task_runner import TaskRunnerConfig

sys.path.insert(0, os.path.dirname(__file__))
from worker_fakes import FakeEngine, FakeMailbox, WaitsForResume, run_until_a_task_started  # noqa: E402


def test_stop_ends_a_paused_task_and_returns(monkeypatch):
    monkeypatch.setattr(worker_mod, "STOP_GRACE_S", 5.0)
    mailbox, engine = FakeMailbox(), FakeEngine()
    chat = types.SimpleNamespace()
    worker = worker_mod.RolloutWorker(1, engine, TaskRunnerConfig(), chat, env=None, mailbox=mailbox,
                                      job_group=None, heartbeat_interval_s=0.05)
    runner = worker._runner = WaitsForResume()
    assignment = TaskAssignment(task={"task_id": "t0"}, group_id="g0", index=0)
    mailbox.inbox = [RunTask(assignment)]

    assert run_until_a_task_started(worker, mailbox, runner), "the worker did not return after Stop"
    cancelled = [m for m in mailbox.sent if isinstance(m, TaskCancelled)]
    assert [m.task_id for m in cancelled] == [assignment.trajectory_id]
    assert worker._tasks == {}


def test_heartbeats_go_on_while_a_dead_engine_is_replaced():
    mailbox = FakeMailbox()

    def slow_factory():
        threading.Event().wait(0.6)  # an engine start, much shortened
        return FakeEngine()

    worker = worker_mod.RolloutWorker(1, FakeEngine(), TaskRunnerConfig(), types.SimpleNamespace(), env=None,
                                      mailbox=mailbox, job_group=None, heartbeat_interval_s=0.05,
                                      engine_factory=slow_factory)
    worker._restart_engine()
    beats = [m for m in mailbox.sent if isinstance(m, Heartbeat)]
    assert len(beats) >= 5, f"{len(beats)} heartbeats during a 0.6 s restart at a 0.05 s interval"
    assert worker.engine_restarts == 1
    sent = len(mailbox.sent)
    threading.Event().wait(0.2)
    assert len(mailbox.sent) == sent  # the heartbeat thread ended with the restart


def test_cancel_all_answers_for_tasks_that_never_started():
    """Stale `RunTask`s ahead of a `CancelAll` in one poll (a rank woken after its quarantine):
    their jobs are cancelled before their first step, so `_run_task` never runs; each is still
    answered, and then `AllCancelled`."""
    from tide_megatron.comm.messages import AllCancelled, CancelAll

    mailbox, engine = FakeMailbox(), FakeEngine()
    worker = worker_mod.RolloutWorker(1, engine, TaskRunnerConfig(), types.SimpleNamespace(), env=None,
                                      mailbox=mailbox, job_group=None, heartbeat_interval_s=0.05)
    worker._runner = WaitsForResume()
    stale = [TaskAssignment(task={"task_id": "t0"}, group_id="g0", index=i) for i in range(2)]
    mailbox.inbox = [RunTask(a) for a in stale] + [CancelAll(epoch=3, reason="silent")]

    def stop_when_answered():
        while not any(isinstance(m, AllCancelled) for m in mailbox.sent):
            threading.Event().wait(0.01)
        mailbox.inbox.append(Stop())

    threading.Thread(target=stop_when_answered, daemon=True).start()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.run(), done.set()), daemon=True).start()
    assert done.wait(20), "no AllCancelled: a task cancelled before it started was never answered"
    answers = [m for m in mailbox.sent if isinstance(m, (TaskCancelled, AllCancelled))]
    assert [type(m).__name__ for m in answers] == ["TaskCancelled", "TaskCancelled", "AllCancelled"]
    assert {m.task_id for m in answers[:2]} == {a.trajectory_id for a in stale} and answers[2].epoch == 3
    assert worker._tasks == {}


class FakeEnv:
    def __init__(self):
        self.calls = []

    async def attach(self, claim, images=True):
        await asyncio.sleep(0.05)  # still attaching when Stop is read
        self.calls.append(("attach", claim))
        return types.SimpleNamespace(session_id=f"s-{claim}")

    async def close_quietly(self, session_id):
        self.calls.append(("close", session_id))


def test_a_dropped_hand_over_s_env_session_is_closed_even_when_stop_follows():
    mailbox, engine, env = FakeMailbox(), FakeEngine(), FakeEnv()
    worker = worker_mod.RolloutWorker(1, engine, TaskRunnerConfig(), types.SimpleNamespace(), env=env,
                                      mailbox=mailbox, job_group=None, heartbeat_interval_s=0.05)
    mailbox.inbox = [ReleaseCarry("c0"), Stop()]
    assert worker.run() is None
    assert env.calls == [("attach", "c0"), ("close", "s-c0")] and not worker._releases
