"""The one CPU compatibility layer of tide-megatron.

Four parts, all inert on a machine with CUDA:
- `standins`: import-time stand-ins for GPU-only packages SGLang imports (triton,
  torchvision, vllm). Loaded by a `.pth` file in site-packages (written by
  `python -m tide_megatron.compat.install`) so that SGLang's own scheduler and
  detokenizer subprocesses get them too; a conftest or an import in our code would not.
- `qwen3vl_processor`: an image-only Qwen3-VL processor that SGLang uses instead of
  `AutoProcessor` (whose video sub-processor needs torchvision), registered by an import
  hook that the same `.pth` file installs, only when torchvision is missing.
- `megatron_cpu`: runtime stand-ins for Megatron-core's CUDA assumptions, installed by
  the trainer when `torch.cuda.is_available()` is false.
- `sglang_fork`: SGLang's scheduler and detokenizer forked from the rollout rank instead of
  spawned, so that they do not import SGLang again (`rollout.engine.fork_children`).

All are pinned to the versions they were written for (see PINNED_VERSIONS) and
tests/integration/compat checks those versions and every patched attribute.
"""

from __future__ import annotations

import os
import sys
import warnings

PINNED_VERSIONS = {"sglang": "0.5.23", "megatron-core": "0.16.1", "torch": "2.13.0"}
DISABLE_ENV = "TIDE_DISABLE_CPU_COMPAT"

# Import-time notices that are expected, and say nothing, on a machine without a GPU: every
# rank and every SGLang subprocess would print each of them.
EXPECTED_CPU_WARNINGS = (
    r"Only CUDA, .* support .* currently",  # SGLang's quantization modules
    r"Triton is not supported on current platform",  # SGLang's FLA kernels fall back to torch
    r"Transformer Engine and Apex are not installed",  # Megatron-core falls back to torch
    r"Apex is not installed",
)


def cuda_present() -> bool:
    """A cheap check that needs no torch import: an NVIDIA driver is loaded."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def activate_standins() -> tuple[str, ...]:
    """Register stand-ins for missing GPU-only packages; returns the packages served."""
    from tide_megatron.compat.standins import StandinFinder

    if os.environ.get(DISABLE_ENV) == "1" or cuda_present():
        return ()
    for message in EXPECTED_CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    served = StandinFinder.for_missing()
    if served and StandinFinder not in sys.meta_path:
        sys.meta_path.insert(0, StandinFinder)
    if "torchvision" in served:
        from tide_megatron.compat.qwen3vl_processor import install_import_hook

        install_import_hook()
    return served
