"""Stand-ins for the CTB tests: a carrier that records decisions, and a fake SGLang engine, env
and chat format so the real `CTBTaskRunner` and `LocalCarrier` run without SGLang.

`RowModelEngine` models what `benchmarks/ctb_rows.py` measured on SGLang 0.5.23: it has
`max_running_requests` request rows; a streaming session takes a row at its first turn and
keeps it until closed (a close waits for an in-flight turn); a plain request holds a row while
it runs; and ANY request starts only while at least one row is free, even a session turn that
borrows its own row. With as many open sessions as rows, every turn waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from tide_megatron.rollout.engine import Generation


class Recorder:
    """A carrier that records every decision; optionally confirms releases at once."""

    def __init__(self, can_move_tasks: bool = True, auto_release: bool = True):
        self.can_move_tasks = can_move_tasks
        self.auto_release = auto_release
        self.dispatcher = None
        self.calls: list[tuple] = []
        self.where: dict[str, Optional[int]] = {}
        """Where each task may run now (None: paused or never admitted)."""

    def admit(self, rank, assignment, tag):
        self.calls.append(("admit", rank, assignment.trajectory_id))
        self.where[assignment.trajectory_id] = rank

    def pause(self, rank, task_id):
        self.calls.append(("pause", rank, task_id))
        self.where[task_id] = None
        if self.auto_release:
            self.dispatcher.task_released(rank, task_id)

    def resume(self, rank, task_id, tag):
        self.calls.append(("resume", rank, task_id))
        self.where[task_id] = rank

    def cancel(self, rank, task_id):
        self.calls.append(("cancel", rank, task_id))
        self.where[task_id] = None
        if self.auto_release:
            self.dispatcher.task_released(rank, task_id)

    def of(self, kind):
        return [c[2] for c in self.calls if c[0] == kind]


class RowModelEngine:
    """A fake engine with SGLang's request-row admission rule (module docstring)."""

    def __init__(self, kv_tokens: int, rows: int, new_tokens: int = 4):
        self.cfg = SimpleNamespace(max_total_tokens=kv_tokens, max_running_requests=rows)
        self.weight_version = 0
        self.weight_epoch = 0
        self.rows = rows
        self.new_tokens = new_tokens
        self.session_rows: set[str] = set()
        self.inflight: dict[str, int] = {}
        self.closing: set[str] = set()
        self.closed: list[str] = []
        self.plain_rows = 0
        self.context: dict[str, int] = {}
        """Tokens of each session's context (a session turn sends only the new ones)."""
        self.peak_rows = 0
        self._ids = itertools.count()
        self._changed = asyncio.Condition()

    @property
    def rows_used(self) -> int:
        return len(self.session_rows) + self.plain_rows

    @contextlib.asynccontextmanager
    async def turn(self):
        """No weight updates here: a turn needs no guard."""
        yield

    async def open_session(self, capacity_tokens: int) -> str:
        return f"s{next(self._ids)}"

    async def close_session(self, session_id: Optional[str]) -> None:
        if session_id is None:
            return
        async with self._changed:
            self.closing.add(session_id)
            await self._changed.wait_for(lambda: not self.inflight.get(session_id))
            self.closing.discard(session_id)
            self.session_rows.discard(session_id)
            self.closed.append(session_id)
            self._changed.notify_all()

    async def generate(self, input_ids, sampling_params, session_id=None, previous_rid=None, rid=None) -> Generation:
        async with self._changed:
            if session_id is not None:  # a close now waits for this turn, even while it queues
                self.inflight[session_id] = self.inflight.get(session_id, 0) + 1
            await self._changed.wait_for(lambda: self.rows_used < self.rows)  # one row must be free
            if session_id is None:
                self.plain_rows += 1
            else:
                self.session_rows.add(session_id)
            self.peak_rows = max(self.peak_rows, self.rows_used)
        await asyncio.sleep(0)
        async with self._changed:
            if session_id is None:
                self.plain_rows -= 1
            else:
                self.inflight[session_id] -= 1
            self._changed.notify_all()
            context = len(input_ids) + (self.context.get(session_id, 0) if previous_rid is not None else 0)
            if session_id is not None:
                self.context[session_id] = context + self.new_tokens
            report = None
            if rid is not None and rid.startswith("tide-ctb:"):
                report = {"plugin": "tide_ctb", "context_tokens": context + self.new_tokens,
                          "kv_total": self.cfg.max_total_tokens, "rows_total": self.rows,
                          "rows_free": self.rows - self.rows_used}
        out = list(range(100, 100 + self.new_tokens))
        return Generation(output_ids=out, logprobs=[-1.0] * len(out), finish_reason="length",
                          prompt_tokens=len(input_ids), cached_tokens=0, rid=rid or f"r{next(self._ids)}",
                          ctb_report=report)


@dataclass
class _Step:
    observation: str
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class FakeEnv:
    """Episodes of a fixed number of steps; `fail` task ids raise on their first step."""

    def __init__(self, steps: int = 3, seed: int = 0, fail: Optional[dict[str, int]] = None):
        self.steps = steps
        self.rng = random.Random(seed)
        self.fail = dict(fail or {})
        """Trajectory id -> how many of its attempts fail."""
        self._left: dict[str, int] = {}
        self._traj: dict[str, str] = {}

    async def reset(self, env: str, task_id: str, trajectory_id: str):
        sid = f"env-{trajectory_id}-{self.rng.random()}"
        self._left[sid] = self.steps
        self._traj[sid] = trajectory_id
        await asyncio.sleep(0)
        return SimpleNamespace(observation="start", session_id=sid)

    async def close_quietly(self, session_id: str) -> None:
        self._left.pop(session_id, None)

    async def step(self, session_id: str, action: str) -> _Step:
        await asyncio.sleep(self.rng.random() * 0.002)
        traj = self._traj[session_id]
        if self.fail.get(traj, 0) > 0:
            self.fail[traj] -= 1
            raise ConnectionError(f"env lost {traj}")
        self._left[session_id] -= 1
        return _Step("obs", 1.0, self._left[session_id] <= 0)


class FakeChat:
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "act")

    def prompt_ids(self, observation: Any) -> list[int]:
        return list(range(20))

    def user_turn_ids(self, observation: Any, previous_output: list[int]) -> list[int]:
        return list(range(6))


class HandoffEnv(FakeEnv):
    """`FakeEnv` whose sessions can move between clients (`detach` / `attach`, as the env server
    does): like the server, it finishes a step its caller stopped waiting for, counts each
    session's steps and keeps the latest result. `step_s`: how long a step takes."""

    def __init__(self, steps: int = 3, step_s: float = 0.0):
        super().__init__(steps=steps)
        self.step_s = step_s
        self.resets = 0
        self.turns: dict[str, int] = {}
        self.last: dict[str, Any] = {}
        self.stepping: set[str] = set()
        self.detached: set[str] = set()

    async def reset(self, env: str, task_id: str, trajectory_id: str):
        self.resets += 1
        first = await super().reset(env, task_id, trajectory_id)
        self.turns[first.session_id] = 0
        return first

    async def step(self, session_id: str, action: str) -> _Step:
        if session_id in self.detached:
            raise KeyError(f"no session {session_id} on this connection")
        return await asyncio.shield(asyncio.ensure_future(self._step(session_id, action)))

    async def _step(self, session_id: str, action: str) -> _Step:
        self.stepping.add(session_id)
        await asyncio.sleep(self.step_s)
        self._left[session_id] -= 1
        self.turns[session_id] += 1
        self.last[session_id] = _Step(f"obs {self.turns[session_id]}", 1.0, self._left[session_id] <= 0)
        self.stepping.discard(session_id)
        return self.last[session_id]

    async def detach(self, session_id: str) -> str:
        self.detached.add(session_id)
        return f"claim-{session_id}"

    async def attach(self, claim: str, images: bool = True):
        sid = claim.removeprefix("claim-")
        self.detached.remove(sid)
        while sid in self.stepping:  # the server's attach waits for a step in flight
            await asyncio.sleep(0.001)
        return SimpleNamespace(session_id=sid, turns=self.turns[sid], last_turn=self.turns[sid], done=self._left[sid] <= 0,
                               last=self.last.get(sid))
