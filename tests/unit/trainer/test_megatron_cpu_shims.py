"""The Megatron-core CPU shims: what they patch still exists upstream, they work, they are needed.

The pytest process never installs the shims (they change `torch.cuda` for the whole process);
the mode is exercised as a context manager, and the real install runs in subprocesses.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from tide_megatron.compat import megatron_cpu
from tide_megatron.compat.megatron_cpu import (
    PATCHED_CUDA_ATTRIBUTES,
    PINNED_MEGATRON_CORE_VERSION,
    CudaToCpuMode,
)

PROBE = os.path.join(os.path.dirname(__file__), "megatron_shim_probe.py")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are inert with CUDA")


def test_megatron_core_is_the_pinned_version():
    import megatron.core

    assert megatron.core.__version__ == PINNED_MEGATRON_CORE_VERSION


def test_version_drift_raises_unless_allowed(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    monkeypatch.delenv(megatron_cpu.ALLOW_VERSION_DRIFT_ENV, raising=False)
    with pytest.raises(RuntimeError, match="pinned to megatron-core 0.16.1, found 0.99.0"):
        megatron_cpu._check_megatron_version()
    monkeypatch.setenv(megatron_cpu.ALLOW_VERSION_DRIFT_ENV, "1")
    assert megatron_cpu._check_megatron_version() == "0.99.0"


def test_patched_torch_cuda_attributes_still_exist():
    for name in PATCHED_CUDA_ATTRIBUTES:
        assert hasattr(torch.cuda, name), f"torch.cuda.{name} is gone: update megatron_cpu"
    assert set(megatron_cpu._cpu_cuda_functions()) == set(PATCHED_CUDA_ATTRIBUTES)


def _source(obj) -> str:
    return inspect.getsource(obj)


def test_upstream_call_sites_the_shims_cover_are_unchanged():
    """If one of these fails, upstream moved: re-read the call site and adjust the shims."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    # Hard-coded CUDA tensor creation that CudaToCpuMode redirects.
    assert 'device="cuda"' in _source(schedules.forward_backward_no_pipelining)
    assert "device='cuda'" in _source(clip_grads.get_grad_norm_fp32)
    assert "'torch.cuda.FloatTensor'" in _source(clip_grads.clip_grad_by_total_norm_fp32)
    assert "device='cuda'" in _source(optimizer.FP32Optimizer)
    assert "torch.cuda.current_device()" in _source(param_and_grad_buffer._ParamAndGradBuffer)
    # Activation recompute saves the CUDA RNG state through torch.cuda.random's own binding.
    from megatron.core.tensor_parallel import random as tp_random
    assert "torch.cuda.random.get_rng_state(device=device)" in _source(tp_random._get_cuda_rng_state)
    # The default attention mask is built on CUDA, which is why callers pass one explicitly.
    assert 'device="cuda"' in _source(transformer_utils)


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_upstream_signatures_the_trainer_calls():
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import schedules

    assert _params(GPTModel.forward)[1:4] == ["input_ids", "position_ids", "attention_mask"]
    assert {"inference_rng_tracker", "force_reset_rng"} <= set(
        _params(tensor_parallel.model_parallel_cuda_manual_seed))
    assert _params(tensor_parallel.vocab_parallel_cross_entropy)[:2] == ["vocab_parallel_logits", "target"]
    assert _params(get_megatron_optimizer)[:2] == ["config", "model_chunks"]
    assert _params(DistributedDataParallel.__init__)[1:4] == ["config", "ddp_config", "module"]
    assert _params(finalize_model_grads)[:2] == ["model", "num_tokens"]
    assert {"forward_step_func", "data_iterator", "model", "num_microbatches", "forward_only"} <= set(
        _params(schedules.forward_backward_no_pipelining))
    assert _params(dist_checkpointing.save)[:2] == ["sharded_state_dict", "checkpoint_dir"]
    assert _params(dist_checkpointing.load)[:2] == ["sharded_state_dict", "checkpoint_dir"]
    # The 3-tuple (sum, num_tokens, metrics) loss contract.
    assert "calculate_per_token_loss" in _source(schedules.forward_step_calc_loss)


def test_cuda_to_cpu_mode_redirects_devices_and_type_names():
    with CudaToCpuMode():
        created = torch.zeros(2, device="cuda")
        by_index = torch.ones(1, device=0)
        moved = torch.ones(2).to("cuda:0")
        same = torch.ones(2)
        assert same.cuda() is same
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        kept = torch.ones(2).to(torch.float64)
    assert created.device.type == by_index.device.type == moved.device.type == "cpu"
    assert kept.dtype == torch.float64
    assert torch.ones(1).type() == "torch.FloatTensor"  # nothing leaks out of the mode


def _run_probe(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True, env=env,
                          timeout=300)


@needs_no_cuda
@pytest.mark.integration
def test_megatron_training_path_needs_the_shims_on_cpu():
    """Without the shims Megatron's DDP/optimizer path dies on CPU; with them it steps.

    If the first half fails, upstream made Megatron CPU-clean: the shims may be dropped.
    """
    bare = _run_probe()
    assert bare.returncode != 0, "Megatron trained on CPU without shims: revisit megatron_cpu"
    assert "CUDA" in bare.stderr or "cuda" in bare.stderr
    shimmed = _run_probe("--shims")
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    assert "PROBE OK" in shimmed.stdout
