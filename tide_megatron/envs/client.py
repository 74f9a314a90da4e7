"""Asyncio client of the env server, used by the rollout task runner.

One `EnvClient` holds one TCP connection and multiplexes every call over it (calls are
matched to replies by id), so a rollout rank with hundreds of live tasks needs one client.
It connects lazily on the first call (presenting the shared token in `hello` when there is
one) and reconnects when the connection is lost.

    async with EnvClient(EnvClientConfig(port=port)) as client:
        tasks = await client.list_tasks("door_game", split="train", limit=64)
        first = await client.reset("door_game", tasks[0].task_id, trajectory_id="g0-t3")
        while True:
            res = await client.step(first.session_id, action_text)
            if res.done:
                break
        await client.close_session(first.session_id)

Reconnection: a call that cannot reach the server, or loses the connection before its reply,
is retried on a new connection after an exponential backoff (`max_retries`,
`backoff_initial_s`, `backoff_max_s`) when that is safe: `reset`, `tasks`, `ping`, `envs`,
`stats`. Sessions live and die with the connection that owns them (the server closes them
when it drops), so a `step` on a session of a lost connection raises `EnvSessionLost` at
once, and closing one is a no-op.

Handoff: a session can move to another connection (another rank's client) without restarting
its episode. The owner calls `claim = await a.detach(session_id)` (the session then belongs
to no connection and survives `a`'s; it does not wait for a step in flight, whose result `a`
still receives); another client calls `await b.attach(claim)`, which waits for that step and
returns an `AttachResult` (turn count, whether done, and the latest result, images read
back unless `images=False`). A claim is single use and never retried; a detached session
nobody attaches is closed by the server after its idle timeout. A call that still fails after the retries raises
`EnvServerDown` naming the server address, the call and the attempts made.

Image observations: a reset or step result carries `images` (references into the server's
image store); with `resolve_images` (the default) the client reads each one, from the file
when it is on this node or through the `image` call otherwise, validates it, checks it is the
image referenced, and fills the result's `image_data` (encoded bytes, aligned with `images`;
`images.decode_image` turns one into a PIL image).

Failures raise the typed errors of `tide_megatron.envs.errors`: `EnvServerDown` (cannot
connect, connection lost, retries spent), `EnvSessionLost` (the session died with its
connection), `EnvTimeout` (no reply within the call's timeout; not retried), `EnvProtocolError`
(malformed data, or a reply holding NaN or infinity: only that call fails),
`EnvRemoteError` (the server refused the call; `.kind` says why), `EnvImageError` (a bad
image observation; it names the env and the task).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import logging
import os
import random
import time
from typing import Any, AsyncIterator

from tide_megatron.envs.config import TOKEN_ENV_VAR, EnvClientConfig
from tide_megatron.envs.errors import (
    EnvImageError, EnvProtocolError, EnvRemoteError, EnvServerDown, EnvSessionLost, EnvTimeout,
)
from tide_megatron.envs.images import ImageError, check_against_ref, read_image_file
from tide_megatron.envs.protocol import AttachResult, ImageRef, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.wire import PROTOCOL_VERSION, Request, Response, WireError, decode_response, encode_request

logger = logging.getLogger(__name__)


class EnvClient:
    def __init__(self, cfg: EnvClientConfig):
        if cfg.image_transport not in ("auto", "file", "wire"):
            raise ValueError(f"image_transport must be auto, file or wire, got {cfg.image_transport!r}")
        self.cfg = cfg
        self.address = f"{cfg.host}:{cfg.port}"
        self.token = cfg.auth_token or os.environ.get(TOKEN_ENV_VAR, "")
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._epoch = 0  # counts connections; a session is valid only on the one that opened it
        self._sessions: dict[str, tuple[str, str, int]] = {}  # session id -> (env, task id, epoch)
        self._server_said = ""  # the last error the server sent outside any call (e.g. too busy)

    # Connection ----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        """Open the connection if there is none (one attempt; calls retry on their own)."""
        async with self._connect_lock:
            if self.connected:
                return
            try:
                self._reader, self._writer = await asyncio.wait_for(
                    asyncio.open_connection(self.cfg.host, self.cfg.port, limit=self.cfg.max_message_bytes),
                    timeout=self.cfg.connect_timeout_s,
                )
            except asyncio.TimeoutError:
                raise EnvServerDown(self.address, "connect", f"no connection within {self.cfg.connect_timeout_s:g} s") from None
            except OSError as e:
                raise EnvServerDown(self.address, "connect", f"cannot connect: {e}") from None
            self._epoch += 1
            self._server_said = ""
            self._reader_task = asyncio.create_task(self._read_replies(self._reader))
            if self.token:
                try:
                    await self._call_once("hello", {"token": self.token, "version": PROTOCOL_VERSION}, "hello",
                                          self.cfg.connect_timeout_s)
                except BaseException:
                    self._drop(EnvServerDown(self.address, "hello", "hello refused"))
                    raise

    async def close(self) -> None:
        """Drop the connection (the server then closes this client's sessions)."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
            self._reader_task = None
        self._drop(EnvServerDown(self.address, "close", "client closed"))

    async def __aenter__(self) -> EnvClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _drop(self, error: Exception) -> None:
        """Forget the connection and fail every call in flight with `error`."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        error: Exception
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    error = EnvProtocolError(self.address, "read", f"reply line over {self.cfg.max_message_bytes} bytes")
                    break
                if not line or not line.endswith(b"\n"):
                    said = f" (it said {self._server_said})" if self._server_said else ""
                    error = EnvServerDown(self.address, "read", f"connection closed by the server{said}")
                    break
                try:
                    resp = decode_response(line)
                except WireError as e:
                    fut = self._pending.pop(e.request_id, None) if e.request_id is not None else None
                    if fut is None:  # cannot tell which call it answers: the stream is not to be trusted
                        error = EnvProtocolError(self.address, "read", str(e))
                        break
                    if not fut.done():  # a well-framed reply with bad content fails only its call
                        fut.set_exception(EnvProtocolError(self.address, "read", str(e)))
                    continue
                fut = self._pending.pop(resp.id, None)
                if fut is None:
                    # A reply to a call that timed out, or an error about no call in particular.
                    if not resp.ok:
                        self._server_said = f"{resp.error_type}: {resp.error_message}"
                        logger.warning("env server %s: %s", self.address, self._server_said)
                    continue
                if not fut.done():
                    fut.set_result(resp)
        except ConnectionError as e:
            error = EnvServerDown(self.address, "read", f"connection lost: {e}")
        except asyncio.CancelledError:
            raise
        # Only drop the connection this reader belongs to (a reconnect may have replaced it).
        if reader is self._reader:
            self._drop(error)

    # Calls ---------------------------------------------------------------------------------

    async def call(self, op: str, args: dict[str, Any], call_name: str, timeout_s: float | None = None,
                   retry: bool = True) -> dict[str, Any]:
        """One call; returns the result object. With `retry`, a lost or refused connection is
        retried with backoff (only for calls that are safe to repeat on a new connection)."""
        timeout = self.cfg.call_timeout_s if timeout_s is None else timeout_s
        started, attempt = time.monotonic(), 0
        while True:
            try:
                await self.connect()
                return await self._call_once(op, args, call_name, timeout)
            except EnvServerDown as e:
                if not retry or attempt >= self.cfg.max_retries:
                    tries = f"; gave up after {attempt + 1} attempts over {time.monotonic() - started:.1f} s" if retry else ""
                    raise EnvServerDown(self.address, call_name, f"{e.detail}{tries}") from None
                delay = min(self.cfg.backoff_max_s, self.cfg.backoff_initial_s * 2**attempt) * random.uniform(0.5, 1.0)
                attempt += 1
                logger.warning("env server %s: %s failed (%s); retry %d/%d in %.1f s", self.address, call_name,
                               e.detail, attempt, self.cfg.max_retries, delay)
                await asyncio.sleep(delay)

    async def _call_once(self, op: str, args: dict[str, Any], call_name: str, timeout: float) -> dict[str, Any]:
        req_id = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            try:
                async with self._write_lock:
                    if self._writer is None:
                        raise ConnectionError("not connected")
                    self._writer.write(encode_request(Request(req_id, op, args)))
                    await self._writer.drain()
            except ConnectionError as e:
                self._drop(EnvServerDown(self.address, call_name, f"connection lost: {e}"))
                raise EnvServerDown(self.address, call_name, f"connection lost while sending: {e}") from None
            try:
                resp: Response = await asyncio.wait_for(fut, timeout=timeout)
            except asyncio.TimeoutError:
                raise EnvTimeout(self.address, call_name, timeout) from None
        except EnvServerDown as e:
            # Re-raise under this call's name: the reader only knows the connection died.
            raise EnvServerDown(self.address, call_name, e.detail) from None
        except EnvProtocolError as e:
            raise EnvProtocolError(self.address, call_name, e.detail) from None
        finally:
            self._pending.pop(req_id, None)
        if not resp.ok:
            raise EnvRemoteError(self.address, call_name, resp.error_type, resp.error_message)
        assert resp.result is not None
        return resp.result

    async def ping(self, timeout_s: float | None = None) -> dict[str, Any]:
        return await self.call("ping", {}, "ping", timeout_s)

    async def envs(self) -> list[str]:
        result = await self.call("envs", {}, "envs")
        return self._parse("envs", lambda: _str_list(result["envs"]))

    async def stats(self) -> dict[str, Any]:
        return await self.call("stats", {}, "stats")

    async def list_tasks(self, env: str, split: str = "train", offset: int = 0, limit: int = 1 << 30) -> list[TaskSpec]:
        """Up to `limit` tasks from `offset` on, fetched page by page (the server bounds a page)."""
        name = f"tasks(env={env}, split={split})"
        tasks: list[TaskSpec] = []
        while len(tasks) < limit:
            result = await self.call("tasks", {"env": env, "split": split, "offset": offset,
                                               "limit": limit - len(tasks)}, name)
            page = self._parse(name, lambda: [TaskSpec.from_json(t) for t in result["tasks"]])
            tasks.extend(page[: limit - len(tasks)])
            nxt = result.get("next_offset")  # absent from servers that answer everything at once
            if nxt is None or not page:
                break
            if isinstance(nxt, bool) or not isinstance(nxt, int) or nxt <= offset:
                raise EnvProtocolError(self.address, name, f"next_offset {nxt!r} does not advance from {offset}")
            offset = nxt
        return tasks

    async def reset(self, env: str, task_id: str, trajectory_id: str, timeout_s: float | None = None) -> ResetResult:
        """Open a session on `task_id`; the result carries its `session_id`."""
        name = f"reset(env={env}, task={task_id}, trajectory={trajectory_id})"
        if timeout_s is None and self.cfg.reset_timeout_s > 0:
            timeout_s = self.cfg.reset_timeout_s
        result = await self._image_call("reset", {"env": env, "task_id": task_id, "trajectory_id": trajectory_id},
                                        name, timeout_s, env, task_id)
        res = self._parse(name, lambda: ResetResult.from_json(result))
        if not res.session_id:
            raise EnvProtocolError(self.address, name, "reset reply carries no session_id")
        self._sessions[res.session_id] = (env, task_id, self._epoch)
        try:
            res.image_data = await self._resolve_images(res.session_id, res.images, name, timeout_s)
        except EnvImageError:
            await self.close_quietly(res.session_id)
            raise
        return res

    async def step(self, session_id: str, action: str, timeout_s: float | None = None) -> StepResult:
        name = self._call_name("step", session_id)
        env, task_id = self._live_session(session_id, name)
        result = await self._image_call("step", {"session_id": session_id, "action": action}, name, timeout_s,
                                        env, task_id)
        res = self._parse(name, lambda: StepResult.from_json(result))
        res.image_data = await self._resolve_images(session_id, res.images, name, timeout_s)
        return res

    async def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        """Close a session. A session of a lost connection is already gone: nothing to do."""
        name = self._call_name("close", session_id)
        info = self._sessions.pop(session_id, None)
        if info is not None and info[2] != self._epoch:
            return
        try:
            await self.call("close", {"session_id": session_id}, name, timeout_s, retry=False)
        except EnvServerDown:
            pass  # the connection, and the session with it, is gone

    async def detach(self, session_id: str, timeout_s: float | None = None) -> str:
        """Hand a session of this client to no connection; returns the claim another client
        passes to `attach`. This client forgets the session. A step in flight still gets its
        reply here; the attacher sees its result. Never retried (EnvSessionLost when the
        connection is lost: the session went with it, or is detached with its claim lost and
        will be closed when idle)."""
        name = self._call_name("detach", session_id)
        self._live_session(session_id, name)
        try:
            result = await self.call("detach", {"session_id": session_id}, name, timeout_s, retry=False)
        except EnvServerDown as e:
            self._sessions.pop(session_id, None)
            raise EnvSessionLost(self.address, name, f"{e.detail}; the session was lost with its connection") from None
        claim = self._parse(name, lambda: _str_field(result, "claim"))
        self._sessions.pop(session_id, None)
        return claim

    async def attach(self, claim: str, timeout_s: float | None = None, *, images: bool = True) -> AttachResult:
        """Take over the session another client detached. Waits for a step in flight on it;
        the result carries the session's turn count and latest result (images resolved, unless
        `images=False`: a caller that only closes the session skips reading them). The
        claim is single use, so the call is never retried; a refusal for this connection's
        session cap (`ServerBusy`) leaves the claim usable."""
        name = "attach"
        result = await self.call("attach", {"claim": claim}, name, timeout_s, retry=False)
        res = self._parse(name, lambda: AttachResult.from_json(result))
        self._sessions[res.session_id] = (res.env, res.task_id, self._epoch)
        if not images:
            return res
        name = self._call_name("attach", res.session_id)
        try:
            res.last.image_data = await self._resolve_images(res.session_id, res.last.images, name, timeout_s)
        except EnvImageError:
            await self.close_quietly(res.session_id)
            raise
        return res

    def _live_session(self, session_id: str, name: str) -> tuple[str, str]:
        """(env, task id) of a session this client opened; EnvSessionLost when it was opened
        on a connection that has since been lost."""
        env, task_id, epoch = self._sessions.get(session_id, ("?", "?", self._epoch))
        if epoch != self._epoch or (session_id in self._sessions and not self.connected):
            self._sessions.pop(session_id, None)
            raise EnvSessionLost(self.address, name, "the session was lost with its connection (the server died, "
                                                     "restarted or dropped it); reset a new one")
        return env, task_id

    def _call_name(self, op: str, session_id: str) -> str:
        """`op(env=.., task=.., session=..)` for a session this client opened, else `op(session=..)`."""
        if session_id in self._sessions:
            env, task_id, _ = self._sessions[session_id]
            return f"{op}(env={env}, task={task_id}, session={session_id})"
        return f"{op}(session={session_id})"

    async def close_quietly(self, session_id: str) -> None:
        """`close_session`, ignoring every env error (the session is done with either way)."""
        with contextlib.suppress(EnvServerDown, EnvTimeout, EnvRemoteError, EnvProtocolError):
            await self.close_session(session_id)

    async def _image_call(self, op: str, args: dict[str, Any], name: str, timeout_s: float | None,
                          env: str, task_id: str) -> dict[str, Any]:
        """A reset or step. A step is never retried (its session dies with the connection);
        the server's refusal of the env's image becomes EnvImageError."""
        try:
            return await self.call(op, args, name, timeout_s, retry=op == "reset")
        except EnvSessionLost:
            raise
        except EnvServerDown as e:
            if op == "step":
                self._sessions.pop(args["session_id"], None)
                raise EnvSessionLost(self.address, name, f"{e.detail}; the session was lost with its connection") from None
            raise
        except EnvRemoteError as e:
            if e.kind == "BadImage":
                raise EnvImageError(self.address, name, env, task_id, e.message) from None
            raise

    async def _resolve_images(self, session_id: str, refs: list[ImageRef], name: str,
                              timeout_s: float | None) -> list[bytes]:
        """Read and check every referenced image (empty when `resolve_images` is off)."""
        if not refs or not self.cfg.resolve_images:
            return []
        env, task_id, _ = self._sessions.get(session_id, ("?", "?", 0))
        out = []
        for ref in refs:
            try:
                if self.cfg.image_transport == "wire" or (
                        self.cfg.image_transport == "auto" and not os.access(ref.path, os.R_OK)):
                    data = await self._fetch_image(session_id, ref, name, timeout_s)
                else:
                    data = await asyncio.to_thread(read_image_file, ref, self.cfg.images)
            except ImageError as e:
                raise EnvImageError(self.address, name, env, task_id, str(e)) from None
            out.append(data)
        return out

    async def _fetch_image(self, session_id: str, ref: ImageRef, name: str, timeout_s: float | None) -> bytes:
        result = await self.call("image", {"session_id": session_id, "image_id": ref.id}, f"image({name})",
                                 timeout_s, retry=False)
        payload = result.get("data_b64")
        if not isinstance(payload, str):
            raise ImageError(f"image {ref.id}: the image reply carries no data_b64 string")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"image {ref.id}: data_b64 is not base64 ({e})") from None
        await asyncio.to_thread(check_against_ref, data, ref, self.cfg.images)
        return data

    @contextlib.asynccontextmanager
    async def session(self, env: str, task_id: str, trajectory_id: str) -> AsyncIterator[ResetResult]:
        """Reset on entry, close on exit (best effort: a dead server already dropped it)."""
        first = await self.reset(env, task_id, trajectory_id)
        try:
            yield first
        finally:
            await self.close_quietly(first.session_id)

    def _parse(self, call_name: str, build):
        try:
            return build()
        except (KeyError, TypeError, ValueError) as e:
            raise EnvProtocolError(self.address, call_name, f"malformed result: {e}") from None


def _str_field(result: dict[str, Any], key: str) -> str:
    value = result[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _str_list(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {value!r}")
    return value
