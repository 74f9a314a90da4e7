"""Typed errors of the env client. Each names the server address and the call that failed,
so a log line alone says which env fleet member misbehaved and during what."""

from __future__ import annotations


class EnvError(RuntimeError):
    """Base of every env client error."""

    def __init__(self, address: str, call: str, detail: str):
        self.address = address
        self.call = call
        self.detail = detail
        super().__init__(f"env server {address}: {call}: {detail}")


class EnvServerDown(EnvError):
    """The server could not be reached, or the connection dropped with the call in flight.
    Sessions on that server are to be presumed lost; re-run the task."""


class EnvSessionLost(EnvServerDown):
    """The session's connection dropped (the server died, restarted, or cut the connection),
    and the session with it: the episode cannot go on. The client reconnects by itself for
    the next reset; the task is to be re-run."""


class EnvTimeout(EnvError):
    """The call did not complete within its timeout. The session may still be live server-side
    (the env was merely slow); the caller decides whether to retry, close or abandon it."""

    def __init__(self, address: str, call: str, timeout_s: float):
        self.timeout_s = timeout_s
        super().__init__(address, call, f"no reply within {timeout_s:g} s")


class EnvProtocolError(EnvError):
    """The server sent something that is not a valid message of the protocol (not JSON, a
    missing or mistyped field, a line over the size limit). The connection is dropped."""


class EnvRemoteError(EnvError):
    """The server understood the call and refused it (unknown env/task/session, episode
    already done, server busy, the env raised). `kind` is the server's error type."""

    def __init__(self, address: str, call: str, kind: str, message: str):
        self.kind = kind
        self.message = message
        super().__init__(address, call, f"{kind}: {message}")


class EnvImageError(EnvError):
    """An image observation that cannot be used: the env produced a bad image (the server
    refused it), or what the client read back is missing, truncated, not the referenced
    image, or outside the image limits. The episode cannot go on with a lost observation, so
    the task fails; it is a task failure to retry, never a crash of the rollout."""

    def __init__(self, address: str, call: str, env: str, task_id: str, detail: str):
        self.env = env
        self.task_id = task_id
        super().__init__(address, call, f"bad image observation of env {env!r}, task {task_id!r}: {detail}")
