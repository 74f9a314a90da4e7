"""One client connection of the env server: framing, limits, authentication, replies.

Everything a single client can do to the server is bounded here (the limits are
`EnvServerLimits`; a server-wide view is in `server.py`):

- framing: lines are read into a bounded buffer. A line over `max_request_bytes` is answered
  `TooLarge` (with its id when the line starts with one) and skipped to its end; the
  connection goes on. A line must arrive whole within `read_timeout_s` of its first byte, or
  the connection is closed (half-sent messages cannot pin memory or a slot for ever).
- idleness: a connection with no session, no call in flight and no byte for
  `idle_timeout_s` is closed.
- parsing: nesting, number size and NaN are refused by `wire.decode_request` with an error
  reply; long lines are decoded on a worker thread, not on the event loop.
- authentication: with a shared token, the first call must be `hello` with that token
  (compared in constant time); anything else gets `Unauthorized` and the connection closes.
- backpressure: at most `max_inflight_per_connection` calls are served at once; past that the
  connection is not read until one finishes, so a pipelining client waits on its own socket.
- replies: one writer at a time; a reply that does not drain within `write_timeout_s` drops
  the connection (a client that never reads cannot make the server buffer for ever); a reply
  over `max_reply_bytes`, or one holding NaN, is replaced by an error reply, never dropped.

Repeated warnings go through `RateLimitedLog`, so a flood of bad clients costs a log line per
interval, not one per event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from tide_megatron.envs.wire import (
    PROTOCOL_VERSION, SERVER_NAME, Request, Response, WireError, decode_request, encode_response, leading_id,
    non_finite_path,
)

if TYPE_CHECKING:
    from tide_megatron.envs.server import EnvServer

logger = logging.getLogger("tide_megatron.envs.server")

INLINE_BYTES = 64 * 1024
"""Requests and replies larger than this are decoded or encoded on a worker thread."""
_READ_CHUNK = 64 * 1024


class RateLimitedLog:
    """At most one warning per key per interval; the next one says how many were dropped."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        dropped = self._suppressed.pop(key, 0)
        logger.warning("%s%s", message, f" ({dropped} more like it in the last {self.interval_s:g} s)" if dropped else "")


class CallError(Exception):
    """A call the server refuses; becomes an error reply of type `kind`."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Connection:
    def __init__(self, server: EnvServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn_id: int):
        self.server = server
        self.limits = server.cfg.limits
        self.reader = reader
        self.writer = writer
        self.id = conn_id
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.sessions: set[str] = set()
        self.authenticated = not server.token
        self.image_slots = asyncio.Semaphore(2)  # `image` replies are the large ones: two at a time
        self._inflight = asyncio.Semaphore(self.limits.max_inflight_per_connection)
        self._tasks: set[asyncio.Task] = set()
        self._write_lock = asyncio.Lock()
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no newline
        self._line_started = 0.0
        self._discarding = False
        self._closing = False

    # Reading -------------------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            while not self._closing:
                line = await self._read_line()
                if line is None:
                    break
                if not line.strip():
                    continue
                if not self.authenticated:
                    await self._authenticate(line)
                    continue
                await self._inflight.acquire()
                task = asyncio.create_task(self._handle(line))
                self._tasks.add(task)
                task.add_done_callback(self._call_done)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._closing = True
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.server.connection_closed(self)
            self.writer.close()

    def _call_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._inflight.release()

    async def _read_line(self) -> bytes | None:
        """The next whole line, or None when the connection is to end."""
        lim = self.limits
        while True:
            nl = self._buf.find(b"\n", self._scanned)
            if nl >= 0:
                line = bytes(self._buf[: nl + 1])
                del self._buf[: nl + 1]
                self._scanned = 0
                if self._buf:
                    self._line_started = time.monotonic()
                if self._discarding:  # the tail of an oversized line
                    self._discarding = False
                    continue
                if len(line) > lim.max_request_bytes:
                    await self._refuse_oversized(line)
                    continue
                return line
            self._scanned = len(self._buf)
            if len(self._buf) > lim.max_request_bytes:
                if not self._discarding:
                    await self._refuse_oversized(bytes(self._buf[:64]))
                    self._discarding = True
                del self._buf[:]
                self._scanned = 0
            if self._buf or self._discarding:
                timeout = self._line_started + lim.read_timeout_s - time.monotonic()
            else:
                timeout = lim.idle_timeout_s
            try:
                chunk = await asyncio.wait_for(self.reader.read(_READ_CHUNK), max(timeout, 0.0))
            except asyncio.TimeoutError:
                if self._buf or self._discarding:
                    self.server.log.warning("half-sent", f"env server: {self.peer} sent part of a request and "
                                                         f"nothing more for read_timeout_s={lim.read_timeout_s:g}; "
                                                         "closing")
                    return None
                if self.sessions or self._tasks:
                    continue  # quiet, but holding sessions or awaiting replies: not idle
                self.server.log.warning("idle", f"env server: closing {self.peer}, idle for {lim.idle_timeout_s:g} s")
                return None
            if not chunk:
                return None
            if not self._buf and not self._discarding:
                self._line_started = time.monotonic()
            self._buf += chunk

    async def _refuse_oversized(self, head: bytes) -> None:
        lim = self.limits
        self.server.log.warning("too-large", f"env server: request over {lim.max_request_bytes} bytes from {self.peer}; "
                                             "skipped")
        req_id = leading_id(head)
        await self._send(Response(-1 if req_id is None else req_id, False, error_type="TooLarge",
                                  error_message=f"request line over max_request_bytes={lim.max_request_bytes}; skipped"))

    async def _authenticate(self, line: bytes) -> None:
        """Before `hello` with the right token, the only call answered is `hello`."""
        try:
            req = decode_request(line, self.limits.max_json_depth, self.limits.max_number_digits)
        except WireError as e:
            req = Request(e.request_id if e.request_id is not None else -1, "", {})
        token = req.args.get("token") if req.op == "hello" else None
        if isinstance(token, str) and hmac.compare_digest(token.encode(), self.server.token.encode()):
            self.authenticated = True
            await self._send(Response(req.id, True, result={"server": SERVER_NAME, "version": PROTOCOL_VERSION}))
            return
        why = "wrong token" if req.op == "hello" else f"{req.op or 'an unparseable request'} before hello"
        self.server.log.warning("unauthorized", f"env server: refused {self.peer}: {why}")
        await self._send(Response(req.id, False, error_type="Unauthorized",
                                  error_message=f"this server needs its shared token in a hello call first ({why}); "
                                                "closing"))
        self._closing = True

    # Calls ---------------------------------------------------------------------------------

    async def _handle(self, line: bytes) -> None:
        try:
            await self._answer(line)
        except ConnectionError:
            pass  # the client went away or stopped reading; its sessions close with the connection

    async def _answer(self, line: bytes) -> None:
        lim = self.limits
        try:
            if len(line) > INLINE_BYTES:
                req = await self.server.executor.run(self.id, decode_request, line, lim.max_json_depth,
                                                     lim.max_number_digits)
            else:
                req = decode_request(line, lim.max_json_depth, lim.max_number_digits)
        except WireError as e:
            await self._send(Response(e.request_id if e.request_id is not None else -1, False,
                                      error_type="BadRequest", error_message=str(e)))
            return
        try:
            if req.op == "image":
                async with self.image_slots:
                    await self._reply(req, await self.server.dispatch(req, self))
            else:
                await self._reply(req, await self.server.dispatch(req, self))
        except CallError as e:
            self.server.counts["errors"] += 1
            await self._send(Response(req.id, False, error_type=e.kind, error_message=e.message))
        except ConnectionError:
            raise
        except Exception as e:  # an env bug must not kill the server; report it to the caller
            logger.exception("env call %s failed", req.op)
            self.server.counts["errors"] += 1
            await self._send(Response(req.id, False, error_type="EnvFailure", error_message=f"{type(e).__name__}: {e}"))

    async def _reply(self, req: Request, result: dict[str, Any]) -> None:
        resp = Response(req.id, True, result=result)
        try:
            if req.op in ("tasks", "image"):  # the large replies
                line = await self.server.executor.run(self.id, encode_response, resp)
            else:
                line = encode_response(resp)
        except ValueError:
            where = non_finite_path(result, "result") or "the result"
            raise CallError("EnvFailure", f"the reply to {req.op} holds NaN or infinity at {where}; refused") from None
        if len(line) > self.limits.max_reply_bytes:
            raise CallError("TooLarge", f"the reply to {req.op} is {len(line)} bytes, over max_reply_bytes="
                                        f"{self.limits.max_reply_bytes}")
        await self._write(line)

    async def _send(self, resp: Response) -> None:
        await self._write(encode_response(resp))

    async def _write(self, line: bytes) -> None:
        async with self._write_lock:
            if self.writer.is_closing():
                raise ConnectionError("connection closed")
            self.writer.write(line)
            try:
                await asyncio.wait_for(self.writer.drain(), self.limits.write_timeout_s)
            except asyncio.TimeoutError:
                self.server.log.warning("slow-reader", f"env server: {self.peer} did not read its replies for "
                                                       f"write_timeout_s={self.limits.write_timeout_s:g}; dropping it")
                self.abort()
                raise ConnectionError("client not reading") from None

    def abort(self) -> None:
        self._closing = True
        self.writer.transport.abort()
