"""The env server: many concurrent env sessions behind one asyncio TCP port.

Run it as its own process (`python -m tide_megatron.envs.server --config-json '{...}'`, or
`EnvServerProcess` from Python). It binds loopback unless told otherwise, speaks the
newline-delimited JSON of `tide_megatron.envs.wire`, and computes rewards next to the env.

Concurrency model:
- every request runs in its own task, so one slow env step never holds up another session
  on the same connection;
- calls of one session are serialised by a per-session lock;
- envs marked `blocking` (TextWorld) run on a thread pool, pure-Python ones on the loop;
- emulated latency is an `asyncio.sleep`, costing no thread;
- sessions belong to the connection that opened them and close when it drops (a crashed
  rollout rank leaks nothing), or after `session_idle_timeout_s` without a call;
- image observations are validated (`images.py`) and written to the node-local image store
  off the event loop; replies carry references, and a session's images go when it closes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import importlib
import ipaddress
import itertools
import json
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tide_megatron.envs.config import EnvConfig, EnvServerConfig, config_from_dict
from tide_megatron.envs.image_store import ImageStore
from tide_megatron.envs.images import ImageError, validate_image
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.registry import build_env
from tide_megatron.envs.wire import (
    PROTOCOL_VERSION, SERVER_NAME, Request, Response, WireError, decode_request, encode_response,
)

logger = logging.getLogger(__name__)

READY_PREFIX = "TIDE_ENV_SERVER_READY "
"""First line the server prints on stdout once it listens, followed by {"host":..,"port":..}."""


class CallError(Exception):
    """A call the server refuses; becomes an error response of type `kind`."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass
class Session:
    session_id: str
    env_key: str
    task_id: str
    trajectory_id: str
    env: Env
    connection_id: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    done: bool = False
    turns: int = 0


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
        if not is_loopback(cfg.host) and not cfg.allow_remote:
            raise ValueError(
                f"refusing to bind {cfg.host!r}: the env protocol has no authentication; "
                "bind loopback or set allow_remote=True inside a trusted network"
            )
        for module in cfg.plugins:
            importlib.import_module(module)
        keys = [e.key for e in cfg.envs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate served env names: {keys}")
        self.cfg = cfg
        self._env_cfgs: dict[str, EnvConfig] = {e.key: e for e in cfg.envs}
        # One instance per env answers catalogue queries; sessions get their own instances.
        self._catalog: dict[str, Env] = {k: build_env(c) for k, c in self._env_cfgs.items()}
        self._task_lists: dict[tuple[str, str], list[TaskSpec]] = {}
        self._sessions: dict[str, Session] = {}
        self._images: ImageStore | None = None
        self._connection_ids = itertools.count(1)
        self._connections: set[asyncio.Task] = set()
        self._executor = concurrent.futures.ThreadPoolExecutor(cfg.num_workers, thread_name_prefix="env-worker")
        self._server: asyncio.base_events.Server | None = None
        self._reaper: asyncio.Task | None = None
        self._started = time.monotonic()
        self._counts = {"resets": 0, "steps": 0, "errors": 0}
        self.host = cfg.host
        self.port = cfg.port

    # Lifecycle -----------------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        self._images = ImageStore(self.cfg.image_store_dir, self.cfg.images_kept_per_session)
        self._server = await asyncio.start_server(
            self._serve_connection, self.cfg.host, self.cfg.port, limit=self.cfg.max_message_bytes
        )
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        self._reaper = asyncio.create_task(self._reap_idle_sessions())
        logger.info("env server on %s:%d serving %s", self.host, self.port, sorted(self._env_cfgs))
        return self.host, self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for session in list(self._sessions.values()):
            await self._close_session(session)
        for env in self._catalog.values():
            env.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._images is not None:
            self._images.close()

    async def __aenter__(self) -> EnvServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # Connections ---------------------------------------------------------------------------

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = next(self._connection_ids)
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        write_lock = asyncio.Lock()
        inflight: set[asyncio.Task] = set()

        async def send(resp: Response) -> None:
            async with write_lock:
                writer.write(encode_response(resp))
                await writer.drain()

        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    await send(Response(-1, False, error_type="BadRequest",
                                        error_message=f"line over {self.cfg.max_message_bytes} bytes; closing"))
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    req = decode_request(line)
                except WireError as e:
                    await send(Response(-1, False, error_type="BadRequest", error_message=str(e)))
                    continue
                t = asyncio.create_task(self._answer(req, conn_id, send))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for t in inflight:
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            for session in [s for s in self._sessions.values() if s.connection_id == conn_id]:
                await self._close_session(session)
            writer.close()
            self._connections.discard(task)

    async def _answer(self, req: Request, conn_id: int, send: Callable) -> None:
        try:
            result = await self._dispatch(req, conn_id)
            resp = Response(req.id, True, result=result)
        except CallError as e:
            self._counts["errors"] += 1
            resp = Response(req.id, False, error_type=e.kind, error_message=e.message)
        except Exception as e:  # an env bug must not kill the server; report it to the caller
            logger.exception("env call %s failed", req.op)
            self._counts["errors"] += 1
            resp = Response(req.id, False, error_type="EnvFailure", error_message=f"{type(e).__name__}: {e}")
        try:
            await send(resp)
        except (ConnectionError, RuntimeError):
            pass  # the client went away; its sessions are closed by the connection handler

    # Calls ---------------------------------------------------------------------------------

    async def _dispatch(self, req: Request, conn_id: int) -> dict[str, Any]:
        a = req.args
        if req.op == "ping":
            return {"server": SERVER_NAME, "version": PROTOCOL_VERSION}
        if req.op == "envs":
            return {"envs": sorted(self._env_cfgs)}
        if req.op == "stats":
            return self._stats()
        if req.op == "tasks":
            env_key = _arg(a, "env", str)
            split = a.get("split", "train")
            offset, limit = a.get("offset", 0), a.get("limit", 1 << 30)
            if not isinstance(split, str) or not _is_int(offset) or not _is_int(limit):
                raise CallError("BadRequest", "tasks: split must be a string, offset and limit integers")
            tasks = await self._task_list(env_key, split)
            return {"tasks": [t.to_json() for t in tasks[offset : offset + limit]], "total": len(tasks)}
        if req.op == "reset":
            return await self._reset(_arg(a, "env", str), _arg(a, "task_id", str), _arg(a, "trajectory_id", str), conn_id)
        if req.op == "step":
            return await self._step(_arg(a, "session_id", str), _arg(a, "action", str))
        if req.op == "close":
            session = self._sessions.get(_arg(a, "session_id", str))
            if session is not None:
                await self._close_session(session)
            return {}
        if req.op == "image":
            return await self._image(_arg(a, "session_id", str), _arg(a, "image_id", str))
        raise CallError("UnknownOp", f"unknown op {req.op!r}")

    async def _task_list(self, env_key: str, split: str) -> list[TaskSpec]:
        env = self._env(env_key)
        key = (env_key, split)
        if key not in self._task_lists:
            try:
                self._task_lists[key] = await asyncio.get_running_loop().run_in_executor(
                    self._executor, env.list_tasks, split
                )
            except KeyError as e:
                raise CallError("BadRequest", str(e.args[0] if e.args else e)) from None
        return self._task_lists[key]

    async def _reset(self, env_key: str, task_id: str, trajectory_id: str, conn_id: int) -> dict[str, Any]:
        cfg = self._env_cfgs.get(env_key)
        if cfg is None:
            raise CallError("UnknownEnv", f"unknown env {env_key!r}; served: {sorted(self._env_cfgs)}")
        if len(self._sessions) >= self.cfg.max_sessions:
            raise CallError("ServerBusy", f"{len(self._sessions)} sessions open (max_sessions={self.cfg.max_sessions})")
        try:
            self._env(env_key).task(task_id)
        except KeyError as e:
            raise CallError("UnknownTask", str(e.args[0] if e.args else e)) from None
        env = build_env(cfg)
        session = Session(f"s-{secrets.token_urlsafe(16)}", env_key, task_id, trajectory_id, env, conn_id)
        try:
            result = await self._call(env, env.reset, task_id, trajectory_id)
            await self._publish_images(session, result)
        except BaseException:
            self._images.release(session.session_id)
            await self._call(env, env.close)
            raise
        self._sessions[session.session_id] = session
        self._counts["resets"] += 1
        result.session_id = session.session_id
        if result.latency_s > 0:
            await asyncio.sleep(result.latency_s)
        return result.to_json()

    async def _step(self, session_id: str, action: str) -> dict[str, Any]:
        session = self._sessions.get(session_id)
        if session is None:
            raise CallError("UnknownSession", f"no session {session_id!r} (closed, timed out, or never opened)")
        async with session.lock:
            if session.done:
                raise CallError("EpisodeDone", f"session {session_id} is done; reset a new one")
            session.last_active = time.monotonic()
            result = await self._call(session.env, session.env.step, action)
            session.turns += 1
            await self._publish_images(session, result)
            session.done = result.done
            self._counts["steps"] += 1
            if result.latency_s > 0:
                await asyncio.sleep(result.latency_s)
            session.last_active = time.monotonic()
        return result.to_json()

    async def _publish_images(self, session: Session, result: ResetResult | StepResult) -> None:
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
                    raise CallError("BadImage", f"env {session.env_key!r} task {session.task_id!r} turn {session.turns}: "
                                                f"image {i}: {e}") from None
                refs.append(self._images.put(session.session_id, raw, info))
            return refs

        result.images = await asyncio.get_running_loop().run_in_executor(self._executor, publish)

    async def _image(self, session_id: str, image_id: str) -> dict[str, Any]:
        session = self._sessions.get(session_id)
        if session is None:
            raise CallError("UnknownSession", f"no session {session_id!r} (closed, timed out, or never opened)")
        try:
            ref, data = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._images.read, session_id, image_id)
        except (KeyError, OSError):
            raise CallError("BadRequest", f"session {session_id} holds no image {image_id!r} (only the newest "
                                          f"{self.cfg.images_kept_per_session} are kept)") from None
        session.last_active = time.monotonic()
        return {**ref.to_json(), "data_b64": base64.b64encode(data).decode("ascii")}

    async def _call(self, env: Env, fn: Callable, *args: Any) -> Any:
        if env.blocking:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        return fn(*args)

    async def _close_session(self, session: Session) -> None:
        if self._sessions.pop(session.session_id, None) is None:
            return
        self._images.release(session.session_id)
        try:
            await self._call(session.env, session.env.close)
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
            "images": self._images.count() if self._images is not None else 0,
            "uptime_s": time.monotonic() - self._started, **self._counts,
        }

    async def _reap_idle_sessions(self) -> None:
        period = max(0.05, min(30.0, self.cfg.session_idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            cutoff = time.monotonic() - self.cfg.session_idle_timeout_s
            for session in [s for s in self._sessions.values() if s.last_active < cutoff and not s.lock.locked()]:
                logger.info("closing idle session %s", session.session_id)
                await self._close_session(session)


def _arg(args: dict[str, Any], name: str, tp: type) -> Any:
    value = args.get(name)
    if not isinstance(value, tp):
        raise CallError("BadRequest", f"argument {name!r} must be {tp.__name__}, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
