"""A package's public names, imported from their modules on first use (PEP 562).

Importing any submodule runs its package's `__init__` first; a package whose config module must
import without torch, Megatron or SGLang (`trainer.config`, `models.config`, `envs.config`)
therefore names its other exports here instead of importing them.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable, list[str]]:
    """(`__getattr__`, `__dir__`, `__all__`) for `package`, whose submodule `m` exports
    `modules[m]`. Assign them in the package's `__init__`."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__, sorted(exports)
