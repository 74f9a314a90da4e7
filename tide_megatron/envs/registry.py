"""Env registry: names to factories, and `build_env` that applies the latency wrapper.

Built-in names: `door_game` and `gui_desktop` (always available), `textworld` (needs the
textworld package from requirements/envs.lock; imported only when a textworld env is built),
`osworld` (the adapter to OSWorld's VM servers) and `workload` (the simulator's task stream,
replayed for emulated runs).
"""

from __future__ import annotations

from typing import Callable

from tide_megatron.envs.config import EnvConfig
from tide_megatron.envs.latency import LatencyEnv
from tide_megatron.envs.protocol import Env

EnvFactory = Callable[[EnvConfig], Env]

_REGISTRY: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory) -> None:
    """Make `name` buildable. Re-registering a name replaces it (tests use this)."""
    _REGISTRY[name] = factory


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)


def build_env(cfg: EnvConfig) -> Env:
    """A fresh env instance (one per server session), wrapped in latency emulation if enabled."""
    try:
        factory = _REGISTRY[cfg.name]
    except KeyError:
        raise KeyError(f"unknown env {cfg.name!r}; registered: {registered_envs()}") from None
    env = factory(cfg)
    if cfg.latency.enabled:
        env = LatencyEnv(env, cfg.latency, namespace=cfg.key)
    return env


def _door_game(cfg: EnvConfig) -> Env:
    from tide_megatron.envs.door_game import DoorGameEnv

    return DoorGameEnv(cfg)


def _gui_desktop(cfg: EnvConfig) -> Env:
    from tide_megatron.envs.gui_desktop import GuiDesktopEnv

    return GuiDesktopEnv(cfg)


def _osworld(cfg: EnvConfig) -> Env:
    from tide_megatron.envs.osworld import OSWorldEnv

    return OSWorldEnv(cfg)


def _textworld(cfg: EnvConfig) -> Env:
    from tide_megatron.envs.textworld_env import TextWorldEnv

    return TextWorldEnv(cfg)


def _workload(cfg: EnvConfig) -> Env:
    from tide_megatron.envs.workload_env import WorkloadEnv

    return WorkloadEnv(cfg)


register_env("door_game", _door_game)
register_env("workload", _workload)
register_env("textworld", _textworld)
register_env("gui_desktop", _gui_desktop)
register_env("osworld", _osworld)
