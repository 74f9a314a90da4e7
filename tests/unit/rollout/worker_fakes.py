"""Fakes of a rollout rank's mailbox and engine (no SGLang) for the worker's lifecycle tests."""

from __future__ import annotations

import asyncio
import threading
import types


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
