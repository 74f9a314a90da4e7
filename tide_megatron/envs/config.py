"""Typed configs of the env server, its client and the embedded server process.

Plain dataclasses (Hydra registers them in its ConfigStore; the library only ever sees these
objects). Every field carries an attribute docstring. The per-env configs live in
`env_config.py` and are re-exported here, so this module is the one import for every env
config. `config_from_dict` rebuilds a config from JSON-able data, which is how the server
subprocess receives its config on the command line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tide_megatron.envs.env_config import (
    DoorGameConfig, EnvConfig, GuiDesktopConfig, LatencyConfig, OSWorldConfig, TextWorldConfig, WorkloadEnvConfig,
    default_cache_dir,
)

__all__ = [
    "DoorGameConfig", "EnvClientConfig", "EnvConfig", "EnvServerConfig", "EnvServerLimits", "EnvServerProcessConfig",
    "GuiDesktopConfig", "ImageLimits", "LatencyConfig", "OSWorldConfig", "TOKEN_ENV_VAR", "TextWorldConfig",
    "WorkloadEnvConfig", "config_from_dict", "config_to_dict", "default_cache_dir",
]

T = TypeVar("T")


@dataclass
class ImageLimits:
    """What an image observation (a screenshot) may be. Checked by the env server before it
    stores an env's image, and again by the client when it reads one back.

    Defaults: a 4K screen (3840x2160) is the largest common desktop; 4096 a side and 4096x2304
    pixels admit it with a margin. Its raw RGB is 24.9 MB and a desktop screenshot's PNG
    compresses at least 3x, so 16 MiB bounds any real screenshot while refusing absurd ones.
    """

    formats: list[str] = field(default_factory=lambda: ["png", "jpeg"])
    """Accepted formats (of `png`, `jpeg`), recognised by magic bytes, never by a name."""

    max_bytes: int = 16 * 1024 * 1024
    """Largest encoded image, in bytes."""

    max_width: int = 4096
    """Widest decoded image, in pixels."""

    max_height: int = 4096
    """Tallest decoded image, in pixels."""

    max_pixels: int = 4096 * 2304
    """Most decoded pixels (width x height), checked from the header before any pixel is
    decoded, so a decompression bomb is refused without being expanded."""


TOKEN_ENV_VAR = "TIDE_ENV_TOKEN"
"""Environment variable holding the shared token when the config's `auth_token` is empty
(keeps the token out of config files and command lines)."""


@dataclass
class EnvServerLimits:
    """What one client can take from the env server. Defaults are sized from the workloads:
    a rollout rank holds one connection with at most `max_tasks_per_rank` live tasks (16 to 32
    in the recipes), one call in flight per task; actions are at most a few thousand tokens."""

    max_connections: int = 256
    """Open connections at most (one per rollout rank and a few tools). A connection past the
    cap gets one `ServerBusy` error line and is closed cleanly (see `refusal_linger_s`); the cap
    also keeps file descriptors below the process limit (checked, and raised to the hard limit
    if need be, at start)."""

    refusal_linger_s: float = 2.0
    """After its `ServerBusy` line and end of stream, a refused connection stays open this
    long at most, its client's bytes read and dropped, so that the client closes first. Closed
    with its request unread, the kernel would send a reset, and a client that had not read the
    line yet would see only `ConnectionResetError`. A client closes as soon as it reads the
    line (well under a millisecond on loopback, a round trip elsewhere); 2 s covers a loaded
    node."""

    max_lingering_refusals: int = 1024
    """Refused connections lingering (`refusal_linger_s`) at once, each holding a descriptor
    (counted in the descriptor check at start). Past it a refused connection is closed at once,
    still after its line and end of stream. 1024: a burst of several times `max_connections`
    clients, for a few MB of kernel buffers at most."""

    max_sessions_per_connection: int = 256
    """Live sessions one connection may hold: 8x the largest recipe's tasks per rank, and a
    sixteenth of the default `max_sessions`, so no one client can take every session."""

    max_inflight_per_connection: int = 64
    """Calls of one connection being served at once; past it the server stops reading that
    connection (TCP backpressure) until one finishes, so a pipelining client queues at home."""

    max_request_bytes: int = 1024 * 1024
    """Longest request line. A 4,096-token action is about 16 KB of text and at most 6x that
    once JSON-escaped; 1 MiB leaves a wide margin. A longer line is answered `TooLarge` and
    skipped, the connection goes on."""

    max_reply_bytes: int = 24 * 1024 * 1024
    """Longest reply line; a larger result is answered `TooLarge`. Fits an `image` reply of an
    image at `ImageLimits.max_bytes` (16 MiB) in base64 (4/3 of it)."""

    max_json_depth: int = 32
    """Deepest nesting of a request (ours nest 3-6 deep); deeper is answered `BadRequest`."""

    max_number_digits: int = 32
    """Longest number in a request, in characters (an int64 has 20, a double's repr 24)."""

    read_timeout_s: float = 30.0
    """A request line must arrive whole within this of its first byte (1 MiB at a slow
    1 Mbit/s takes 8 s); a half-sent one past it closes the connection."""

    idle_timeout_s: float = 120.0
    """A connection with no session, no call in flight and no byte for this long is closed
    (the client reconnects on its next call). Connections holding sessions are never idled
    out; their sessions are, after `session_idle_timeout_s`."""

    write_timeout_s: float = 60.0
    """A reply must drain to the client within this; a client that stops reading is dropped."""

    max_tasks_page: int = 1000
    """Most tasks in one `tasks` reply."""

    max_page_bytes: int = 1024 * 1024
    """Most bytes of tasks in one `tasks` reply; a page ends before it would pass this."""

    log_interval_s: float = 10.0
    """Repeated warnings (accept errors, refused connections, timeouts, bad tokens) are logged
    at most once per this interval each, with a count of those suppressed."""


@dataclass
class EnvServerConfig:
    """The env server process."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; any other address requires `auth_token`."""

    port: int = 0
    """TCP port; 0 lets the OS pick a free one (the server reports it when ready)."""

    accept_backlog: int = 1024
    """Listen backlog: connections the kernel has completed but the server not yet accepted.
    asyncio's default of 100 overflows when hundreds of rollout ranks connect at once; the
    overflow waits seconds for SYN retransmits (or is reset where net.ipv4.tcp_abort_on_overflow
    is 1). The kernel caps it at net.core.somaxconn (4096 on Linux 5.4 and later)."""

    auth_token: str = ""
    """Shared secret a client must present (`hello`) before any other call; empty: none, or
    the `TIDE_ENV_TOKEN` environment variable when set. Required off loopback; at least 16
    characters. It authenticates, it does not encrypt: keep the fleet on a trusted network."""

    envs: list[EnvConfig] = field(default_factory=lambda: [EnvConfig()])
    """The environments this server offers, by `EnvConfig.key`."""

    plugins: list[str] = field(default_factory=list)
    """Modules imported before the envs are built; each registers its envs with
    `register_env` (how a benchmark adapter joins without changing this package)."""

    max_sessions: int = 4096
    """Most live sessions; a reset past this fails with `ServerBusy` (env concurrency bound)."""

    session_idle_timeout_s: float = 900.0
    """A session that sees no call for this long is closed (its client is presumed gone)."""

    num_workers: int = 4
    """Threads for blocking work: envs whose calls block (TextWorld, gui_desktop, osworld),
    image checks, task lists, long requests and large replies. Connections take turns on them."""

    limits: EnvServerLimits = field(default_factory=EnvServerLimits)
    """Per-connection and per-message limits."""

    images: ImageLimits = field(default_factory=ImageLimits)
    """What an env's image observation may be; a bad one fails the call with `BadImage`."""

    image_store_dir: str = ""
    """Directory under which the server keeps image observations (a private subdirectory per
    server, removed at stop). Empty: /dev/shm when it is writable (memory, no disk I/O), else
    the system temp directory. It must be node-local and readable by the clients on the node."""

    images_kept_per_session: int = 4
    """Newest images kept per session; older ones are deleted as new ones arrive, and all of a
    session's images when it closes. The client reads an observation's images as soon as the
    reply arrives, so a few suffice; this bounds the store at sessions x this x max_bytes."""


@dataclass
class EnvClientConfig:
    """The asyncio client the rollout task runner uses."""

    host: str = "127.0.0.1"
    """Env server address."""

    port: int = 0
    """Env server port (the embedded server's port is filled in once it is up)."""

    connect_timeout_s: float = 10.0
    """Time allowed to open the TCP connection."""

    call_timeout_s: float = 60.0
    """Default time allowed for one call (reset, step, ...), waiting for the env included.
    Emulated or real env latency counts against it, so set it above the slowest expected step."""

    reset_timeout_s: float = 0.0
    """Time allowed for a reset; 0 means `call_timeout_s`. Resets of generated games (TextWorld's
    first use of a seed compiles a game) take seconds."""

    max_message_bytes: int = 32 * 1024 * 1024
    """Longest accepted response line, in bytes (at least the server's `max_reply_bytes`)."""

    auth_token: str = ""
    """The server's shared token, sent in `hello` on every new connection; empty: the
    `TIDE_ENV_TOKEN` environment variable when set, else none."""

    max_retries: int = 5
    """Reconnection attempts, after the first try, of a call that lost its connection or could
    not open one (reset, tasks, ping, envs, stats; a step's session dies with its connection,
    so a step is never retried). With the default backoff they span about 10 to 16 s."""

    backoff_initial_s: float = 0.5
    """Wait before the first reconnection attempt; it doubles per attempt, times a random
    factor in [0.5, 1] so that many rollout ranks do not reconnect in lockstep."""

    backoff_max_s: float = 10.0
    """Longest wait between two attempts."""

    resolve_images: bool = True
    """Read and validate every image of a reset or step result before returning it, filling
    the result's `image_data`. Off: only the references (`images`) are returned."""

    image_transport: str = "auto"
    """How images are read: `file` from the server's node-local store (same node only),
    `wire` through the server's `image` call (any node), `auto` the file when it is readable
    here, else the wire."""

    images: ImageLimits = field(default_factory=ImageLimits)
    """What an image read back may be; a bad one raises `EnvImageError`."""


@dataclass
class EnvServerProcessConfig:
    """How `EnvServerProcess` starts the server subprocess."""

    ready_timeout_s: float = 60.0
    """Time allowed for the subprocess to bind and answer a ping."""

    stop_timeout_s: float = 10.0
    """Time allowed for a graceful stop (SIGTERM) before the process is killed."""

    log_path: str = ""
    """File for the server's stderr; empty sends it to this process's stderr."""

    supervise_interval_s: float = 5.0
    """How often a supervisor thread checks that the server still runs and restarts it on the
    same address if not; 0: no thread (the launcher may call `ensure_running()` itself)."""

    max_restarts: int = 5
    """Restarts allowed in the process's life; a server that dies more often needs a person,
    so supervision then stops and the next env calls fail with `EnvServerDown`."""


def config_from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass `cls` from plain data (nested dataclasses and lists of them included).

    Unknown keys are an error, so a typo in a recipe fails loudly instead of being ignored.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    kwargs = {name: _convert(hints[name], value) for name, value in data.items()}
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return config_from_dict(tp, value)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return [_convert(inner, v) for v in value]
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return config_from_dict(arg, value)
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
