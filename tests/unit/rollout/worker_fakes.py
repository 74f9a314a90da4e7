"""Fakes of a rollout rank's mailbox and engine (no SGLang) for the worker's lifecycle tests."""

from __future__ import annotations

import asyncio
import threading
import types

from tide_megatron.comm.messages import Stop


class FakeMailbox:
    def __init__(self):
        self.inbox, self.sent, self._lock = [], [], threading.Lock()

    def post(self, dest, message, **payload):
        self.sent.append(message)

    def poll(self, limit=1 << 30):
        with self._lock:
            out, self.inbox = self.inbox, []
        return out


class FakeEngine:
    def __init__(self):
        self.cfg = types.SimpleNamespace(max_total_tokens=1000, max_running_requests=8, use_sessions=True)
        self.kv_tokens, self.request_rows = 1000, 8  # what SGLang allocated
        self.loop = asyncio.new_event_loop()
        self.died = False
        self.weight_version = 0
        self.closed_sessions = []

    async def close_session(self, session):
        self.closed_sessions.append(session)

    def check_alive(self):
        return not self.died

    def shutdown(self):
        self.loop.close()


class WaitsForResume:
    """A task that CTB paused: it waits for a placement that never comes."""

    def __init__(self):
        self.started = 0

    async def run(self, assignment, handle, listener, carry=None):
        self.started += 1
        await asyncio.Event().wait()


def run_until_a_task_started(worker, mailbox: FakeMailbox, runner: WaitsForResume, timeout_s: float = 20.0) -> bool:
    """Run `worker` on a thread; once `runner` started a task, send it Stop. Returns whether the
    worker returned within `timeout_s`."""
    def stop_when_started():
        while runner.started == 0:
            threading.Event().wait(0.01)
        mailbox.inbox.append(Stop())

    threading.Thread(target=stop_when_started, daemon=True).start()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.run(), done.set()), daemon=True).start()
    return done.wait(timeout_s)
