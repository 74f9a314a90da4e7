"""A rollout rank: one SGLang engine, many concurrent multi-turn tasks.

The worker runs on the engine's event loop. It takes task assignments and commands from
its mailbox, runs each task as an asyncio task, and posts every finished trajectory to
the controller as soon as it is done. A task sent with CTB tag fields runs pausable
(`CTBTaskRunner`): its requests carry the task tag to the `tide_ctb` SGLang plugin, every
turn is reported to the controller, and `pause` / `resume` commands stop it before its
next turn (releasing its SGLang session) and let it go on. On a `weights` command it joins the world
broadcast (in a thread, so running tasks keep going) and loads the new weights into
its engine, which also drops every cached prefix of the old policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any

from tide_megatron.comm import weight_sync
from tide_megatron.comm.mailbox import CONTROLLER, Mailbox
from sglang_patches.task_tag import TaskTag
from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner, TaskHandle
from tide_megatron.rollout.engine import RolloutEngine
from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunner

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.02


class RolloutWorker:
    def __init__(self, rank: int, engine: RolloutEngine, runner: TaskRunner, mailbox: Mailbox, job_group):
        self.rank = rank
        self.job_group = job_group
        self.engine = engine
        self.runner = runner
        self.mailbox = mailbox
        self._running: set[asyncio.Task] = set()
        self._stopping = False
        self._busy_s = 0.0  # wall time with at least one task running
        self._busy_since: float | None = None
        self._engines = {rank: engine}
        self._ctb_runner = CTBTaskRunner(runner.cfg, self._engines, runner.chat, runner.env, use_sessions=True)
        self._handles: dict[str, TaskHandle] = {}
        self._tags: dict[str, dict[str, Any]] = {}  # task id -> latest CTB tag fields from rank 0

    def run(self) -> None:
        self.engine.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._started = time.monotonic()
        self.mailbox.post(CONTROLLER, "ready")
        while not self._stopping:
            for msg in self.mailbox.poll():
                await self._handle(msg)
            await asyncio.sleep(POLL_INTERVAL_S)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["kind"]
        if kind == "task":
            assignment = TaskAssignment(**msg["assignment"])
            if msg.get("ctb") is not None:
                self._tags[assignment.trajectory_id] = msg["ctb"]
            task = asyncio.get_running_loop().create_task(self._run_task(assignment))
            self._running.add(task)
            self._mark_busy()
            task.add_done_callback(self._task_done)
        elif kind == "pause":
            handle = self._handles.get(msg["task_id"])
            if handle is not None and handle.rank is not None:
                handle.pause(self._engines)
        elif kind == "resume":
            self._tags[msg["task_id"]] = msg["ctb"]
            handle = self._handles.get(msg["task_id"])
            if handle is not None:
                handle.place(self.rank)
        elif kind == "weights":
            await self._load_weights(weight_sync.WeightManifest.from_json(msg["manifest"]))
        elif kind == "stop":
            self._stopping = True
        else:
            raise ValueError(f"rollout rank {self.rank}: unknown message kind {kind!r}")

    async def _run_task(self, assignment: TaskAssignment) -> None:
        tid = assignment.trajectory_id
        try:
            if tid in self._tags:
                handle = self._handles[tid] = TaskHandle(tid)
                handle.place(self.rank)
                trajectory = await self._ctb_runner.run(assignment, handle, _MailboxTurns(self, assignment))
            else:
                trajectory = await self.runner.run(assignment)
        except Exception as exc:  # report, never lose the task silently
            logger.error("task %s failed on rank %d: %s", assignment.trajectory_id, self.rank, exc)
            self.mailbox.post(
                CONTROLLER, "task_failed", assignment=assignment.__dict__, error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=5),
            )
            return
        finally:
            self._handles.pop(tid, None)
            self._tags.pop(tid, None)
        self.mailbox.post(CONTROLLER, "trajectory", trajectory=trajectory.to_json())

    def _mark_busy(self) -> None:
        if self._busy_since is None:
            self._busy_since = time.monotonic()

    def _task_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not self._running and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    async def _load_weights(self, manifest: weight_sync.WeightManifest) -> None:
        loop = asyncio.get_running_loop()
        flat, comm_s = await loop.run_in_executor(None, weight_sync.broadcast_flat, self.job_group, None, manifest)
        t0 = time.perf_counter()
        await self.engine.update_weights(weight_sync.unpack(manifest, flat), manifest.version)
        now = time.monotonic()
        busy = self._busy_s + (now - self._busy_since if self._busy_since else 0.0)
        self.mailbox.post(
            CONTROLLER, "weights_loaded", version=manifest.version, broadcast_s=comm_s,
            load_s=time.perf_counter() - t0, busy_s=busy, idle_s=now - self._started - busy,
        )


class _MailboxTurns:
    """A CTB task's turn events, to rank 0; its requests' tags, from rank 0's latest fields."""

    def __init__(self, worker: RolloutWorker, assignment: TaskAssignment):
        self.worker = worker
        self.assignment = assignment

    def turn_started(self, task_id: str, context_tokens: int, kind: str) -> TaskTag:
        self.worker.mailbox.post(CONTROLLER, "turn", task_id=task_id, phase="started", context_tokens=context_tokens)
        fields = self.worker._tags[task_id]
        return TaskTag(kind=kind, task_id=task_id, group_id=self.assignment.group_id, is_eval=self.assignment.is_eval,
                       priority=float(fields["priority"]),
                       footprint_tokens=max(int(fields["footprint_tokens"]), context_tokens),
                       turn_reserve_tokens=int(fields["turn_reserve_tokens"]))

    def turn_finished(self, task_id: str, context_tokens: int, report: dict[str, Any] | None) -> None:
        self.worker.mailbox.post(CONTROLLER, "turn", task_id=task_id, phase="finished",
                                 context_tokens=context_tokens, report=report)


def build_chat(model_path: str, system_prompt: str | None) -> ChatFormat:
    from transformers import AutoTokenizer

    from tide_megatron.rollout.multimodal import ImagePrompts

    return ChatFormat(AutoTokenizer.from_pretrained(model_path), system_prompt,
                      images=ImagePrompts.for_checkpoint(model_path))
