"""The env server: many concurrent env sessions behind one asyncio TCP port.

Run it as its own process (`python -m tide_megatron.envs.server --config-json '{...}'`, or
`EnvServerProcess` from Python). It binds loopback unless told otherwise, speaks the
newline-delimited JSON of `tide_megatron.envs.wire`, and computes rewards next to the env.

Concurrency model:
- every request runs in its own task, so one slow env step never holds up another session
  on the same connection; calls of one session are serialised by a per-session lock;
- blocking work (envs marked `blocking`, long actions, image checks, task lists, large
  replies) runs on `FairExecutor` threads, connections taking turns; emulated latency is an
  `asyncio.sleep`, costing no thread;
- image observations are validated (`images.py`) and written to the node-local image store;
  replies carry references, and a session's images go when it closes.

Security and limits (all in `EnvServerConfig` / `EnvServerLimits`, per connection in
`server_connection.py`):
- loopback by default; binding any other address requires a shared token (`auth_token` or
  the TIDE_ENV_TOKEN variable), which every connection must present in `hello` first;
- caps on connections (past it: one `ServerBusy` line and a clean close, never a reset: see
  `_refuse_busy`; the listen backlog is `accept_backlog`; the process's file descriptor limit
  is checked and raised at start), on sessions (server-wide and per connection), on message
  sizes, nesting and numbers; read, idle and write timeouts;
- malformed arguments (a task id of 5,000 digits, an index written "²") are `BadRequest`
  naming the argument, never an `EnvFailure`;
- sessions belong to the connection that opened them, under unguessable ids: no other
  connection can step, close or read the images of one; they close when it drops (a crashed
  rollout rank leaks nothing), or after `session_idle_timeout_s` without a call;
- handoff: the owner may `detach` a session, which then belongs to no connection (it survives
  its old connection dropping, still counts against `max_sessions`, and is closed by the idle
  reaper if nobody takes it) and gets a claim (`secrets.token_urlsafe(24)`, unguessable,
  single use); any connection presenting the claim in `attach` becomes its owner. An attach
  over the connection's `max_sessions_per_connection` is refused before the claim is used,
  so it can be retried elsewhere; an accepted one consumes the claim at once, waits for a step
  in flight to finish, and answers the session's turn count and latest result;
- rewards and replies holding NaN or infinity are refused with an error naming the env and
  the task, never sent and never a dead reply;
- `tasks` is paginated by count and bytes; warnings are rate-limited (`log_interval_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib
import ipaddress
import itertools
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tide_megatron.envs.config import TOKEN_ENV_VAR, EnvConfig, EnvServerConfig, config_from_dict
from tide_megatron.envs.fair_executor import FairExecutor
from tide_megatron.envs.image_store import ImageStore
from tide_megatron.envs.images import ImageError, validate_image
from tide_megatron.envs.protocol import Env, ResetResult, StepResult
from tide_megatron.envs.registry import build_env
from tide_megatron.envs.task_ids import MalformedTaskId
from tide_megatron.envs.server_connection import CallError, Connection, RateLimitedLog
from tide_megatron.envs.wire import PROTOCOL_VERSION, SERVER_NAME, Request, Response, encode_response, non_finite_path

logger = logging.getLogger(__name__)

READY_PREFIX = "TIDE_ENV_SERVER_READY "
"""First line the server prints on stdout once it listens, followed by {"host":..,"port":..}."""

INLINE_ACTION_CHARS = 4096
"""Steps with a longer action run on a worker thread even for a non-blocking env."""
_FD_RESERVE = 256  # descriptors kept for sessions' files, the image store, logs, the executor
_REFUSAL_DRAIN_BYTES = 1024 * 1024  # most bytes read (and dropped) from a refused connection


@dataclass
class Session:
    session_id: str
    env_key: str
    task_id: str
    trajectory_id: str
    env: Env
    owner: int
    """Id of the connection that owns it (opened or attached it): the only one that may use it;
    0 while detached (connection ids start at 1)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    done: bool = False
    turns: int = 0
    claim: str = ""
    """The claim of a detached session not yet attached, else empty."""
    last: dict[str, Any] | None = None
    """The JSON result of the latest successful reset or step, as it was returned."""
    last_turn: int = 0
    """The turn `last` answers (0: the reset); below `turns` only when a later step was
    applied by the env but its result refused (a NaN reward, a bad image)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EnvServer:
    """Serves the envs of an `EnvServerConfig`."""

    def __init__(self, cfg: EnvServerConfig):
        self.token = cfg.auth_token or os.environ.get(TOKEN_ENV_VAR, "")
        if not is_loopback(cfg.host) and not self.token:
            raise ValueError(f"refusing to bind {cfg.host!r} without a shared token: set auth_token (or the "
                             f"{TOKEN_ENV_VAR} environment variable) on the server and its clients, or bind loopback")
        if self.token and len(self.token) < 16:
            raise ValueError("auth_token must be at least 16 characters (e.g. secrets.token_urlsafe(24))")
        if cfg.accept_backlog < 1:
            raise ValueError(f"accept_backlog must be at least 1, got {cfg.accept_backlog}")
        for module in cfg.plugins:
            importlib.import_module(module)
        keys = [e.key for e in cfg.envs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate served env names: {keys}")
        self.cfg = cfg
        self.log = RateLimitedLog(cfg.limits.log_interval_s)
        self.executor = FairExecutor(cfg.num_workers)
        self.counts = {"resets": 0, "steps": 0, "errors": 0, "refused_connections": 0}
        self._env_cfgs: dict[str, EnvConfig] = {e.key: e for e in cfg.envs}
        # One instance per env answers catalogue queries; sessions get their own instances.
        self._catalog: dict[str, Env] = {k: build_env(c) for k, c in self._env_cfgs.items()}
        self._task_pages: dict[tuple[str, str], asyncio.Future] = {}
        self._sessions: dict[str, Session] = {}
        self._claims: dict[str, str] = {}  # claim -> id of the detached session it hands over
        self._connections: dict[int, Connection] = {}
        self._connection_ids = itertools.count(1)
        self._handlers: set[asyncio.Task] = set()
        self._images: ImageStore | None = None
        self._server: asyncio.base_events.Server | None = None
        self._reaper: asyncio.Task | None = None
        self._previous_handler = None
        self._max_connections = cfg.limits.max_connections
        self._max_lingering = cfg.limits.max_lingering_refusals
        self._lingering = 0  # refused connections now waiting for their client to close
        self._started = time.monotonic()
        self.host = cfg.host
        self.port = cfg.port

    # Lifecycle -----------------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        self._max_connections, self._max_lingering = _fit_descriptor_limit(
            self.cfg.limits.max_connections, self.cfg.limits.max_lingering_refusals)
        loop = asyncio.get_running_loop()
        self._previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(self._loop_exception)
        self._images = ImageStore(self.cfg.image_store_dir, self.cfg.images_kept_per_session)
        # The backlog holds connections the kernel completed but the loop has not accepted yet;
        # asyncio's default (100) overflows in a burst of clients, which then wait seconds for
        # SYN retransmits (or are reset, with net.ipv4.tcp_abort_on_overflow=1).
        self._server = await asyncio.start_server(self._accept, self.cfg.host, self.cfg.port,
                                                  backlog=self.cfg.accept_backlog)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        self._reaper = asyncio.create_task(self._reap_idle_sessions())
        logger.info("env server on %s:%d serving %s%s", self.host, self.port, sorted(self._env_cfgs),
                    " (token required)" if self.token else "")
        return self.host, self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for session in list(self._sessions.values()):
            await self._close_session(session)
        for env in self._catalog.values():
            env.close()
        self.executor.shutdown()
        if self._images is not None:
            self._images.close()
        asyncio.get_running_loop().set_exception_handler(self._previous_handler)

    async def __aenter__(self) -> EnvServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # asyncio reports accept() failures (out of descriptors) here, once per retry: keep
        # them to a line per interval instead of a traceback per event.
        message = context.get("message", "unhandled error in the event loop")
        exc = context.get("exception")
        self.log.warning(f"loop:{message}", f"env server: {message}" + (f": {exc!r}" if exc else ""))

    # Connections ---------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            if len(self._connections) >= self._max_connections:
                await self._refuse_busy(reader, writer)
                return
            conn = Connection(self, reader, writer, next(self._connection_ids))
            self._connections[conn.id] = conn
            await conn.serve()
        finally:
            self._handlers.discard(task)

    async def _refuse_busy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One `ServerBusy` line, then a close the client sees as the end of the stream.

        Closing a socket whose client's request is still unread makes the kernel send RST
        instead of FIN, and a client that had not read the line yet loses it to a
        `ConnectionResetError` (217 of 500 clients of a burst did). So: the line, then FIN
        (`write_eof`), then the client's bytes are read and dropped until it closes, for at
        most `refusal_linger_s` and `_REFUSAL_DRAIN_BYTES`. At most `max_lingering_refusals`
        wait at once (each holds a descriptor); past that the close is at once, still after
        the FIN, so a client that sent nothing more still reads the line and an end of stream."""
        self.counts["refused_connections"] += 1
        self.log.warning("refused", f"env server: refusing a connection: {len(self._connections)} open "
                                    f"(max_connections={self._max_connections})")
        lingering = self._lingering < self._max_lingering
        self._lingering += lingering
        try:
            writer.write(encode_response(Response(-1, False, error_type="ServerBusy", error_message=(
                f"too many connections ({self._max_connections} open); try again later"))))
            if writer.can_write_eof():
                writer.write_eof()
            if lingering:
                await asyncio.wait_for(_drain_to_eof(reader), self.cfg.limits.refusal_linger_s)
        except (OSError, asyncio.TimeoutError):
            pass  # the client reset, or kept its side open too long: close anyway
        finally:
            self._lingering -= lingering
            writer.close()

    async def connection_closed(self, conn: Connection) -> None:
        """Called by a connection as it ends: its sessions go with it."""
        self._connections.pop(conn.id, None)
        for session_id in list(conn.sessions):
            session = self._sessions.get(session_id)
            if session is not None:
                await self._close_session(session)

    # Calls ---------------------------------------------------------------------------------

    async def dispatch(self, req: Request, conn: Connection) -> dict[str, Any]:
        a = req.args
        if req.op in ("ping", "hello"):
            return {"server": SERVER_NAME, "version": PROTOCOL_VERSION}
        if req.op == "envs":
            return {"envs": sorted(self._env_cfgs)}
        if req.op == "stats":
            return self._stats()
        if req.op == "tasks":
            split, offset, limit = a.get("split", "train"), a.get("offset", 0), a.get("limit", 1 << 30)
            if not isinstance(split, str) or not _is_int(offset) or not _is_int(limit) or offset < 0 or limit < 0:
                raise CallError("BadRequest", "tasks: split must be a string, offset and limit integers >= 0")
            return await self._tasks_page(_arg(a, "env", str), split, offset, limit, conn)
        if req.op == "reset":
            return await self._reset(_arg(a, "env", str), _arg(a, "task_id", str), _arg(a, "trajectory_id", str), conn)
        if req.op == "step":
            return await self._step(self._owned(_arg(a, "session_id", str), conn), _arg(a, "action", str), conn)
        if req.op == "close":
            session = self._sessions.get(_arg(a, "session_id", str))
            if session is not None and session.owner == conn.id:
                await self._close_session(session)
            return {}
        if req.op == "detach":
            return self._detach(self._owned(_arg(a, "session_id", str), conn), conn)
        if req.op == "attach":
            return await self._attach(_arg(a, "claim", str), conn)
        if req.op == "image":
            return await self._image(self._owned(_arg(a, "session_id", str), conn), _arg(a, "image_id", str), conn)
        raise CallError("UnknownOp", f"unknown op {req.op!r}")

    def _owned(self, session_id: str, conn: Connection) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != conn.id:
            # The same answer whether it never existed or is another connection's: ids leak nothing.
            raise CallError("UnknownSession", f"no session {session_id!r} on this connection (closed, timed out, "
                                              "or never opened here)")
        return session

    def _detach(self, session: Session, conn: Connection) -> dict[str, Any]:
        """Hand the session to no connection, against a claim. Does not wait for a step in
        flight: that step still answers its caller, and its result is what `attach` returns."""
        claim = secrets.token_urlsafe(24)
        session.owner = 0
        session.claim = claim
        self._claims[claim] = session.session_id
        conn.sessions.discard(session.session_id)
        session.last_active = time.monotonic()
        return {"claim": claim}

    async def _attach(self, claim: str, conn: Connection) -> dict[str, Any]:
        """Make `conn` the owner of the detached session of `claim`. The cap is checked before
        the claim is used (a refused attach may be retried, here or elsewhere); an accepted one
        consumes the claim at once, then waits for a step in flight."""
        session_id = self._claims.get(claim)
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is None:
            # The same answer for a claim never issued, used, or whose session is gone.
            raise CallError("UnknownSession", "no detached session for this claim (already attached, closed, "
                                              "timed out, or never issued)")
        if len(conn.sessions) >= self.cfg.limits.max_sessions_per_connection:
            raise CallError("ServerBusy", f"this connection holds {len(conn.sessions)} sessions "
                                          f"(max_sessions_per_connection={self.cfg.limits.max_sessions_per_connection})")
        del self._claims[claim]
        session.claim = ""
        # Counted against this connection's cap while it waits; closed with it if it drops.
        conn.sessions.add(session.session_id)
        async with session.lock:  # a step in flight finishes first
            if self._sessions.get(session.session_id) is not session:
                conn.sessions.discard(session.session_id)
                raise CallError("UnknownSession", "the detached session closed before it could be attached")
            if self._connections.get(conn.id) is not conn:
                await self._close_session(session)
                raise CallError("UnknownSession", "the attaching connection is gone; session closed")
            session.owner = conn.id
            session.last_active = time.monotonic()
            return {"session_id": session.session_id, "env": session.env_key, "task_id": session.task_id,
                    "trajectory_id": session.trajectory_id, "turns": session.turns, "done": session.done,
                    "last": session.last, "last_turn": session.last_turn}

    async def _tasks_page(self, env_key: str, split: str, offset: int, limit: int, conn: Connection) -> dict[str, Any]:
        entries = await self._task_entries(env_key, split, conn)
        lim = self.cfg.limits
        page: list[dict[str, Any]] = []
        size, i = 0, offset
        while i < len(entries) and len(page) < min(limit, lim.max_tasks_page):
            task, nbytes = entries[i]
            if page and size + nbytes > lim.max_page_bytes:
                break
            page.append(task)
            size, i = size + nbytes, i + 1
        return {"tasks": page, "total": len(entries), "next_offset": i if i < len(entries) else None}

    async def _task_entries(self, env_key: str, split: str, conn: Connection) -> list[tuple[dict[str, Any], int]]:
        """Every task of (env, split) as JSON with its encoded size; built once, off the loop."""
        env = self._env(env_key)
        key = (env_key, split)
        if key not in self._task_pages:
            def build() -> list[tuple[dict[str, Any], int]]:
                specs = [t.to_json() for t in env.list_tasks(split)]
                return [(t, len(json.dumps(t, separators=(",", ":"))) + 1) for t in specs]

            self._task_pages[key] = asyncio.ensure_future(self.executor.run(conn.id, build))
        try:
            return await asyncio.shield(self._task_pages[key])
        except Exception as e:
            failed = self._task_pages.get(key)
            if failed is not None and failed.done():  # a failed build is not cached
                self._task_pages.pop(key, None)
            if isinstance(e, KeyError):
                raise CallError("BadRequest", str(e.args[0] if e.args else e)) from None
            raise

    async def _reset(self, env_key: str, task_id: str, trajectory_id: str, conn: Connection) -> dict[str, Any]:
        cfg = self._env_cfgs.get(env_key)
        if cfg is None:
            raise CallError("UnknownEnv", f"unknown env {env_key!r}; served: {sorted(self._env_cfgs)}")
        if len(self._sessions) >= self.cfg.max_sessions:
            raise CallError("ServerBusy", f"{len(self._sessions)} sessions open (max_sessions={self.cfg.max_sessions})")
        if len(conn.sessions) >= self.cfg.limits.max_sessions_per_connection:
            raise CallError("ServerBusy", f"this connection holds {len(conn.sessions)} sessions "
                                          f"(max_sessions_per_connection={self.cfg.limits.max_sessions_per_connection})")
        try:
            self._env(env_key).task(task_id)
        except MalformedTaskId as e:
            raise CallError("BadRequest", f"argument 'task_id': {e.args[0] if e.args else e}") from None
        except KeyError as e:
            raise CallError("UnknownTask", str(e.args[0] if e.args else e)) from None
        except ValueError as e:
            # `task` only looks the id up: a ValueError there (a plugin env's int() of a
            # 5,000-digit or "²" index) is about the id the client sent, not an env failure.
            raise CallError("BadRequest", f"argument 'task_id' {_clip(task_id)} is malformed for env {env_key!r}: "
                                          f"{type(e).__name__}: {_clip(str(e), 200)}") from None
        env = build_env(cfg)
        session = Session(f"s-{secrets.token_urlsafe(18)}", env_key, task_id, trajectory_id, env, conn.id)
        conn.sessions.add(session.session_id)  # counted against the cap while the reset runs
        try:
            result = await self._call(env, env.reset, (task_id, trajectory_id), conn, env.blocking)
            await self._publish_images(session, result, conn)
            out = self._checked(session, result)
        except BaseException:
            conn.sessions.discard(session.session_id)
            self._images.release(session.session_id)
            await self._call(env, env.close, (), conn, env.blocking)
            raise
        self._sessions[session.session_id] = session
        self.counts["resets"] += 1
        out["session_id"] = session.session_id
        session.last, session.last_turn = out, 0
        if result.latency_s > 0:
            await asyncio.sleep(result.latency_s)
        return out

    async def _step(self, session: Session, action: str, conn: Connection) -> dict[str, Any]:
        # The step runs in a task of its own: when its connection drops mid-step after handing
        # the session off (`detach`), the step still finishes, for whoever attaches.
        task = asyncio.ensure_future(self._step_locked(session, action, conn))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if session.owner == conn.id or self._sessions.get(session.session_id) is not session:
                task.cancel()  # the session goes with its connection: stop the step
            else:
                task.add_done_callback(_retrieve)
            raise

    async def _step_locked(self, session: Session, action: str, conn: Connection) -> dict[str, Any]:
        async with session.lock:
            if session.done:
                raise CallError("EpisodeDone", f"session {session.session_id} is done; reset a new one")
            session.last_active = time.monotonic()
            heavy = session.env.blocking or len(action) > INLINE_ACTION_CHARS
            result = await self._call(session.env, session.env.step, (action,), conn, heavy)
            if self._sessions.get(session.session_id) is not session:
                raise CallError("UnknownSession", f"session {session.session_id} closed during the step")
            session.turns += 1
            session.done = result.done
            self.counts["steps"] += 1
            await self._publish_images(session, result, conn)
            out = self._checked(session, result)
            session.last, session.last_turn = out, session.turns
            if result.latency_s > 0:
                await asyncio.sleep(result.latency_s)
            session.last_active = time.monotonic()
        return out

    def _checked(self, session: Session, result: ResetResult | StepResult) -> dict[str, Any]:
        """The result as JSON, refused when it holds NaN or infinity (a reward above all)."""
        what = f"env {session.env_key!r} task {session.task_id!r} (turn {session.turns})"
        reward = getattr(result, "reward", 0.0)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            session.done = True
            raise CallError("EnvFailure", f"{what} returned the reward {reward!r}, not a finite number; refused")
        out = result.to_json()
        where = non_finite_path(out, "result")
        if where is not None:
            session.done = True
            raise CallError("EnvFailure", f"{what} returned NaN or infinity at {where}; refused")
        return out

    async def _call(self, env: Env, fn: Callable, args: tuple, conn: Connection, heavy: bool) -> Any:
        if heavy:
            return await self.executor.run(conn.id, fn, *args)
        return fn(*args)

    async def _publish_images(self, session: Session, result: ResetResult | StepResult, conn: Connection) -> None:
        """Validate and store the env's image bytes; the reply then carries references."""
        if not result.image_data:
            return
        data, result.image_data = result.image_data, []

        def publish() -> list:
            refs = []
            for i, raw in enumerate(data):
                try:
                    info = validate_image(raw, self.cfg.images)
                except ImageError as e:
                    raise CallError("BadImage", f"env {session.env_key!r} task {session.task_id!r} turn "
                                                f"{session.turns}: image {i}: {e}") from None
                refs.append(self._images.put(session.session_id, raw, info))
            return refs

        result.images = await self.executor.run(conn.id, publish)

    async def _image(self, session: Session, image_id: str, conn: Connection) -> dict[str, Any]:
        try:
            ref, data = await self.executor.run(conn.id, self._images.read, session.session_id, image_id)
        except (KeyError, OSError):
            raise CallError("BadRequest", f"session {session.session_id} holds no image {image_id!r} (only the newest "
                                          f"{self.cfg.images_kept_per_session} are kept)") from None
        session.last_active = time.monotonic()
        return {**ref.to_json(), "data_b64": base64.b64encode(data).decode("ascii")}

    async def _close_session(self, session: Session) -> None:
        if self._sessions.pop(session.session_id, None) is None:
            return
        if session.claim:
            self._claims.pop(session.claim, None)
            session.claim = ""
        conn = self._connections.get(session.owner)
        if conn is not None:
            conn.sessions.discard(session.session_id)
        self._images.release(session.session_id)
        try:
            if session.env.blocking and not self.executor.closed:
                await self.executor.run(session.owner, session.env.close)
            else:
                session.env.close()
        except Exception:
            logger.exception("closing session %s failed", session.session_id)

    def _env(self, env_key: str) -> Env:
        env = self._catalog.get(env_key)
        if env is None:
            raise CallError("UnknownEnv", f"unknown env {env_key!r}; served: {sorted(self._env_cfgs)}")
        return env

    def _stats(self) -> dict[str, Any]:
        per_env: dict[str, int] = {k: 0 for k in self._env_cfgs}
        for s in self._sessions.values():
            per_env[s.env_key] += 1
        return {
            "sessions": len(self._sessions), "max_sessions": self.cfg.max_sessions, "sessions_per_env": per_env,
            "detached": len(self._claims), "connections": len(self._connections), "max_connections": self._max_connections,
            "max_sessions_per_connection": self.cfg.limits.max_sessions_per_connection,
            "images": self._images.count() if self._images is not None else 0,
            "queued_jobs": self.executor.queued(), "uptime_s": time.monotonic() - self._started, **self.counts,
        }

    async def _reap_idle_sessions(self) -> None:
        period = max(0.05, min(30.0, self.cfg.session_idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            cutoff = time.monotonic() - self.cfg.session_idle_timeout_s
            for session in [s for s in self._sessions.values() if s.last_active < cutoff and not s.lock.locked()]:
                logger.info("closing idle session %s", session.session_id)
                await self._close_session(session)


def _fit_descriptor_limit(max_connections: int, max_lingering: int = 0) -> tuple[int, int]:
    """(`max_connections`, `max_lingering`), or fewer when the process cannot have that many
    descriptors open (the soft limit is raised towards the hard one first; lingering refusals
    give way before connections do). Past the limit accept() fails in a loop; refusing
    politely below it is the cure."""
    try:
        import resource
    except ImportError:  # not POSIX
        return max_connections, max_lingering
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + max_lingering + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(1, min(max_connections, soft - _FD_RESERVE))
        lingering = max(0, min(max_lingering, soft - _FD_RESERVE - fitted))
        logger.warning("file descriptor limit %d: serving at most %d connections (max_connections=%d) and "
                       "%d lingering refusals (max_lingering_refusals=%d)", soft, fitted, max_connections,
                       lingering, max_lingering)
        return fitted, lingering
    return max_connections, max_lingering


async def _drain_to_eof(reader: asyncio.StreamReader) -> None:
    """Read and drop what a refused client sends, until it closes or `_REFUSAL_DRAIN_BYTES`."""
    total = 0
    while total < _REFUSAL_DRAIN_BYTES:
        chunk = await reader.read(64 * 1024)
        if not chunk:
            return
        total += len(chunk)


def _retrieve(task: asyncio.Task) -> None:
    """Done callback of a step nobody awaits any more: consume its outcome (no loop warning)."""
    if not task.cancelled():
        task.exception()


def _arg(args: dict[str, Any], name: str, tp: type) -> Any:
    value = args.get(name)
    if not isinstance(value, tp):
        raise CallError("BadRequest", f"argument {name!r} must be {tp.__name__}, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _clip(text: str, n: int = 64) -> str:
    """`text` quoted for an error message, cut to `n` characters (it came from a client)."""
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"


async def serve(cfg: EnvServerConfig, ready: Callable[[str, int], None] | None = None, exit_with_parent: bool = False) -> None:
    """Run a server until SIGTERM or SIGINT (or, with `exit_with_parent`, until the process
    that started it is gone), then close every session."""
    server = EnvServer(cfg)
    host, port = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_watch_parent(stop)) if exit_with_parent else None
    if ready is not None:
        ready(host, port)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await server.stop()


async def _watch_parent(stop: asyncio.Event) -> None:
    # A launcher killed with SIGKILL cannot stop its embedded server; reparenting tells us.
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    logger.warning("parent process %d is gone; stopping", parent)
    stop.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="tide-megatron env server")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config-json", help="EnvServerConfig as a JSON object")
    src.add_argument("--config-file", help="path of a JSON file holding an EnvServerConfig")
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")
    args = parser.parse_args(argv)
    data: dict[str, Any] = {}
    if args.config_json:
        data = json.loads(args.config_json)
    elif args.config_file:
        with open(args.config_file) as f:
            data = json.load(f)
    cfg = config_from_dict(EnvServerConfig, data)
    if args.host is not None:
        cfg.host = args.host
    if args.port is not None:
        cfg.port = args.port
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s env-server %(levelname)s %(message)s")

    def ready(host: str, port: int) -> None:
        print(READY_PREFIX + json.dumps({"host": host, "port": port}), flush=True)

    asyncio.run(serve(cfg, ready, exit_with_parent=args.exit_with_parent))


if __name__ == "__main__":
    main()
