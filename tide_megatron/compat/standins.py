"""Stand-ins for GPU-only packages that SGLang imports but never calls on the CPU path.

- `triton`: imported at module level by many SGLang files for `@triton.jit` kernels that the
  torch_native path never launches. Decorators pass functions through unchanged.
- `torchvision`: PyPI's build cannot load beside torch 2.13.0+cpu, yet SGLang's multimodal
  utilities import it at module level. The stand-in has no `__file__` and no version, which
  transformers' availability check reads as "not installed", so no HF code path uses it.
- `vllm`: `RotaryEmbedding.__init__` imports `vllm._custom_ops` on non-CUDA platforms and
  keeps the (unused) function.

A finder serves a package only when no real one is installed (see `StandinFinder.for_missing`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

VERSION = "3.0.0"  # a parseable version: callers compare it with packaging


class _StandinBase:
    """Any class name looked up on the stand-in is a subclassable class."""


class StandinModule(types.ModuleType):
    """A module whose unknown attributes are child stand-ins, callable as decorators."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__package__ = name
        self.__spec__ = importlib.machinery.ModuleSpec(name, StandinFinder, is_package=True)
        self.__tide_standin__ = True

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        if name[:1].isupper():
            value = type(name, (_StandinBase,), {"__module__": self.__name__})
        else:
            value = _module(full)
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return lambda fn: fn  # @triton.jit(...) / @triton.autotune(...)

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __repr__(self):
        return f"<stand-in module {self.__name__!r}>"


def _module(name: str) -> StandinModule:
    mod = StandinModule(name)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


class _Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **extra):
        self.kwargs = kwargs or {}
        self.num_warps = num_warps
        self.num_stages = num_stages


class _Constexpr:
    def __init__(self, value=None):
        self.value = value


STANDIN_PACKAGES = ("triton", "torchvision", "vllm")
# Packages whose stand-in must not look installed to `importlib.util.find_spec` probes
# (transformers would otherwise build torchvision-backed image processors).
INVISIBLE_TO_PROBES = frozenset({"torchvision"})


def _called_from_probe() -> bool:
    """True when the lookup comes from `importlib.util.find_spec`, not an import statement."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code is importlib.util.find_spec.__code__:
            return True
        frame = frame.f_back
    return False


class StandinFinder:
    """Meta-path finder that answers imports of the missing packages with stand-ins."""

    packages: tuple[str, ...] = ()

    @classmethod
    def for_missing(cls, candidates=STANDIN_PACKAGES) -> tuple[str, ...]:
        """Serve only those candidates that no real installation provides."""
        cls.packages = tuple(p for p in candidates if importlib.machinery.PathFinder.find_spec(p) is None)
        return cls.packages

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        root = fullname.partition(".")[0]
        if root not in cls.packages:
            return None
        if root in INVISIBLE_TO_PROBES and _called_from_probe():
            return None
        if fullname not in sys.modules:
            _BUILDERS.get(fullname, _module)(fullname)
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @staticmethod
    def create_module(spec):
        return sys.modules[spec.name]

    @staticmethod
    def exec_module(module):
        pass


def _build_triton(name: str = "triton") -> StandinModule:
    """The stand-in `triton`, with the few concrete values callers read at import time."""
    triton = _module(name)
    triton.__version__ = VERSION
    triton.cdiv = lambda a, b: -(a // -b)
    triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1
    triton.Config = _Config
    tl = _module("triton.language")
    tl.constexpr = _Constexpr
    runtime = _module("triton.runtime")
    jit = _module("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {})
    jit.KernelInterface = type("KernelInterface", (_StandinBase,), {})
    runtime.jit = jit
    autotuner = _module("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})
    cache = _module("triton.runtime.cache")
    cache.triton_key = lambda: "triton-standin"
    compiler = _module("triton.compiler.compiler")
    compiler.triton_key = cache.triton_key
    return triton


_BUILDERS = {"triton": _build_triton}
