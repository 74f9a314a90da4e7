"""The CPU compatibility layer: it is needed, it is active in fresh interpreters, and the
upstream code it was written against has not moved."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tide_megatron.compat as compat
from tide_megatron.compat.install import PTH_NAME, pth_path

pytestmark = pytest.mark.integration

ENGINE_IMPORT = "import sglang.srt.entrypoints.engine"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.mark.skipif(compat.cuda_present(), reason="the stand-ins switch themselves off where CUDA exists")
def test_sglang_needs_the_standins_on_cpu():
    without = _python(ENGINE_IMPORT, **{compat.DISABLE_ENV: "1"})
    assert without.returncode != 0 and "No module named 'triton'" in without.stderr
    with_ = _python(ENGINE_IMPORT + "; import sys; print(sorted(m for m in ('triton','torchvision','vllm') "
                    "if m in sys.modules))")
    assert with_.returncode == 0, with_.stderr[-3000:]
    assert "triton" in with_.stdout


def test_pth_hook_is_installed_for_subprocesses():
    path = pth_path()
    assert path.name == PTH_NAME and path.exists(), "run: python -m tide_megatron.compat.install"
    assert "activate_standins" in path.read_text()


@pytest.mark.skipif(compat.cuda_present(), reason="the stand-ins switch themselves off where CUDA exists")
def test_torchvision_standin_is_invisible_to_availability_probes():
    # transformers probes before SGLang's multimodal code imports torchvision: the probe must miss
    # it (else transformers builds torchvision-backed processors), the import must succeed.
    out = _python("from transformers.utils import is_torchvision_available; probe = is_torchvision_available();"
                  "import torchvision.transforms as T; print(probe, T.__name__)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "torchvision.transforms"]


@pytest.mark.parametrize("package", sorted(compat.PINNED_VERSIONS))
def test_pinned_versions_are_installed(package):
    version = importlib.metadata.version(package)
    assert version.split("+")[0] == compat.PINNED_VERSIONS[package], (
        f"{package} {version} is installed, the compat layer was written for {compat.PINNED_VERSIONS[package]}: "
        "re-check tide_megatron/compat and sglang_patches, then update PINNED_VERSIONS")


SGLANG = Path(importlib.util.find_spec("sglang").origin).parent


@pytest.mark.parametrize("relpath,needle", [
    ("srt/utils/common.py", "import triton"),                      # why triton needs a stand-in
    ("srt/multimodal/internvl_utils.py", "import torchvision"),    # why torchvision does
])
def test_upstream_still_imports_what_the_standins_serve(relpath, needle):
    source = (SGLANG / relpath).read_text()
    assert needle in source, f"sglang {relpath} no longer does `{needle}`: drop or update its stand-in"


def test_engine_api_used_by_the_rollout_adapter_is_unchanged():
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    for name in ("open_session", "close_session", "update_weights_from_tensor", "begin_weight_update",
                 "end_weight_update", "flush_cache"):
        params = list(inspect.signature(getattr(TokenizerManager, name)).parameters)
        assert params[:3] == ["self", "obj", "request"][: len(params)] or params[:2] == ["self", "timeout_s"], (name, params)
    gen = inspect.signature(Engine.async_generate).parameters
    for arg in ("input_ids", "sampling_params", "return_logprob", "session_params"):
        assert arg in gen
    fields = inspect.signature(io_struct.UpdateWeightsFromTensorReqInput).parameters
    for f in ("serialized_named_tensors", "load_format", "flush_cache", "weight_version"):
        assert f in fields
    assert "streaming" in inspect.signature(io_struct.OpenSessionReqInput).parameters
