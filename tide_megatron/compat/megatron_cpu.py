"""Megatron-core on a machine without CUDA.

Megatron-core 0.16.1 assumes a GPU in a few dozen places that the trainer path reaches even when
every tensor lives on the CPU:

- `torch.cuda.current_device()`, `current_stream()`, `Stream`, `Event`, `synchronize()`,
  `stream(...)` are called by DDP's grad buffers, the schedules, the optimizer and
  dist_checkpointing; without CUDA they raise ("Torch not compiled with CUDA enabled").
- tensors are created with a hard-coded `device="cuda"` (optimizer scalars, clip_grads, schedules'
  token counters, grad buffer warm-up, dist_checkpointing exchange buffers) or moved with
  `.cuda()`, and a few asserts compare `param.type()` with `"torch.cuda.FloatTensor"`.

`install_megatron_cpu_shims()` fixes both, only when `torch.cuda.is_available()` is false, so the
same code runs unchanged on a GPU machine:

1. CPU stand-ins replace the CUDA runtime functions on the `torch.cuda` module (streams and
   events become no-ops: on CPU every op is synchronous, so ordering is already guaranteed).
2. `CudaToCpuMode`, a `torch.overrides.TorchFunctionMode`, is pushed on the (thread-local)
   torch-function mode stack of the installing thread. It rewrites `device="cuda"` / `"cuda:N"` /
   integer devices to the CPU, makes `.cuda()` the identity, and answers `Tensor.type()` with the
   CUDA spelling of the same dtype so Megatron's fp32/fp16 dispatch asserts hold.

The shims are pinned to one Megatron-core version: what they patch was read from that version's
source. `tests/unit/trainer/test_megatron_cpu_shims.py` checks that every patched call site still
exists, so an upgrade fails loudly instead of silently running half-shimmed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

PINNED_MEGATRON_CORE_VERSION = "0.16.1"

# Set to "1" to accept another megatron-core version with a warning instead of an error.
ALLOW_VERSION_DRIFT_ENV = "TIDE_ALLOW_MEGATRON_DRIFT"

# The `torch.cuda` attributes replaced by CPU stand-ins. The drift test checks each still exists.
PATCHED_CUDA_ATTRIBUTES = (
    "current_device",
    "set_device",
    "device_count",
    "synchronize",
    "current_stream",
    "default_stream",
    "stream",
    "Stream",
    "Event",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "empty_cache",
)

_install_lock = threading.Lock()
_installed_mode: "CudaToCpuMode | None" = None


class CpuStream:
    """Stand-in for `torch.cuda.Stream`: CPU work is synchronous, so waits are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: "CpuStream") -> None:
        pass

    def wait_event(self, event: "CpuEvent") -> None:
        pass

    def record_event(self, event: "CpuEvent | None" = None) -> "CpuEvent":
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class CpuEvent:
    """Stand-in for `torch.cuda.Event`; `elapsed_time` reads wall clock between two records."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: CpuStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "CpuEvent") -> float:
        if self._recorded_at is None or end._recorded_at is None:
            raise RuntimeError("CpuEvent.elapsed_time: both events must be recorded")
        return (end._recorded_at - self._recorded_at) * 1000.0  # milliseconds, as CUDA reports


_DEFAULT_STREAM = CpuStream()


def _cpu_stream_context(stream: CpuStream | None = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext(stream)


def _cpu_cuda_functions() -> dict[str, Any]:
    """The CPU stand-ins, keyed by `torch.cuda` attribute name."""
    return {
        # Device 0 means "the accelerator"; CudaToCpuMode maps integer devices to the CPU.
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 1,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": _cpu_stream_context,
        "Stream": CpuStream,
        "Event": CpuEvent,
        # The CUDA RNG follows the CPU RNG: Megatron's tracker saves/restores it around TP regions.
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": lambda seed: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "empty_cache": lambda: None,
    }


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An integer device index means a CUDA ordinal to torch; without CUDA it can only be a
    # Megatron `torch.cuda.current_device()` result.
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU for every torch call made under it.

    Cheap on the hot path: the common case (no `device` keyword, no `.cuda`/`.to`/`.type`) costs
    one dict lookup and one identity comparison per torch call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            # Positional args after self: device (str/device/int), dtype, tensor, bools.
            # An int here can only be a device ordinal (a bool is a flag, not a device).
            args = args[:1] + tuple(
                _CPU if not isinstance(a, bool) and _is_cuda_device(a) else a for a in args[1:]
            )
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts `param.type() == "torch.cuda.FloatTensor"`; answer in CUDA terms.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _check_megatron_version() -> str:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version != PINNED_MEGATRON_CORE_VERSION:
        message = (
            f"tide_megatron.compat.megatron_cpu is pinned to megatron-core "
            f"{PINNED_MEGATRON_CORE_VERSION}, found {version}. Re-read the patched call sites "
            f"(see tests/unit/trainer/test_megatron_cpu_shims.py) before moving the pin."
        )
        if os.environ.get(ALLOW_VERSION_DRIFT_ENV) == "1":
            logger.warning(message)
        else:
            raise RuntimeError(message + f" Set {ALLOW_VERSION_DRIFT_ENV}=1 to try anyway.")
    return version


def shims_needed() -> bool:
    """True on a machine where CUDA is absent (the only case the shims change anything), unless
    the compat layer is switched off (`TIDE_DISABLE_CPU_COMPAT=1`, see `tide_megatron.compat`)."""
    from tide_megatron import compat

    if os.environ.get(getattr(compat, "DISABLE_ENV", "TIDE_DISABLE_CPU_COMPAT")) == "1":
        return False
    return not torch.cuda.is_available()


def shims_installed() -> bool:
    return _installed_mode is not None


def install_megatron_cpu_shims() -> bool:
    """Install the CPU stand-ins once per process; returns True if they are active.

    Idempotent. A no-op (returns False) when CUDA is available. The device-mapping mode is pushed
    on the calling thread's torch-function mode stack; call this from the thread that runs
    Megatron (the main thread of a rank).
    """
    global _installed_mode
    if not shims_needed():
        return False
    with _install_lock:
        if _installed_mode is not None:
            return True
        _check_megatron_version()
        # torch.cuda.is_available() must stay False: Megatron and torch branch on it correctly.
        for name, replacement in _cpu_cuda_functions().items():
            if not hasattr(torch.cuda, name):
                raise RuntimeError(f"torch.cuda.{name} no longer exists; update megatron_cpu shims")
            setattr(torch.cuda, name, replacement)
        # Activation recompute (`trainer.recompute`) saves the CUDA RNG state through
        # `torch.cuda.random.get_rng_state`, the submodule's own binding of the same function.
        torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
        mode = CudaToCpuMode()
        mode.__enter__()  # stays on this thread's mode stack for the life of the process
        _installed_mode = mode
        logger.info("megatron-core CPU shims installed (CUDA absent)")
        return True
