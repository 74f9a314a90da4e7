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
    DoorGameConfig, EnvConfig, GuiDesktopConfig, LatencyConfig, OSWorldConfig, TextWorldConfig, default_cache_dir,
)

__all__ = [
    "DoorGameConfig", "EnvClientConfig", "EnvConfig", "EnvServerConfig", "EnvServerProcessConfig", "GuiDesktopConfig",
    "ImageLimits", "LatencyConfig", "OSWorldConfig", "TextWorldConfig", "config_from_dict", "config_to_dict", "default_cache_dir",
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


@dataclass
class EnvServerConfig:
    """The env server process."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; anything else needs `allow_remote`."""

    port: int = 0
    """TCP port; 0 lets the OS pick a free one (the server reports it when ready)."""

    allow_remote: bool = False
    """Allow binding a non-loopback address. The protocol has no authentication: only turn
    this on inside a trusted network (an env fleet next to the trainer)."""

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
    """Threads for envs whose calls block (TextWorld); pure-Python ones run on the event loop."""

    max_message_bytes: int = 16 * 1024 * 1024
    """Longest accepted request or response line, in bytes."""

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

    max_message_bytes: int = 16 * 1024 * 1024
    """Longest accepted response line, in bytes."""

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
