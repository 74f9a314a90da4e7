"""The image-only Qwen3-VL processor stand-in: needed without torchvision, active in fresh
interpreters (SGLang's processes), and the upstream code it mirrors has not moved."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest

import tide_megatron.compat as compat
from tide_megatron.compat import qwen3vl_processor as qp

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(compat.cuda_present() or not qp.torchvision_missing(),
                       reason="the processor stand-in is only installed where torchvision is missing (CPU)"),
]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    from tide_megatron.models.qwen3_vl_checkpoint import write_random_vl_checkpoint
    from tide_megatron.models.qwen3_vl_config import VLModelConfig
    from tide_megatron.tokenizer import TINY_BPE_DIR

    path, _ = write_random_vl_checkpoint(tmp_path_factory.mktemp("vl"), VLModelConfig(), TINY_BPE_DIR)
    return path


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_auto_processor_needs_torchvision(vl_dir):
    from transformers import AutoProcessor

    with pytest.raises(ImportError, match="Torchvision"):
        AutoProcessor.from_pretrained(vl_dir)


def test_sglang_gets_the_image_only_processor_in_a_fresh_interpreter(vl_dir):
    out = _python(
        "import numpy as np; from PIL import Image\n"
        "from sglang.srt.utils.hf_transformers.processor import get_processor\n"
        f"p = get_processor({vl_dir!r})\n"
        "img = Image.fromarray((np.random.RandomState(0).rand(64, 96, 3) * 255).astype('uint8'))\n"
        "r = p(text=['a <|vision_start|><|image_pad|><|vision_end|> b'], images=[img], return_tensors='pt')\n"
        "print(type(p).__name__, r['image_grid_thw'].tolist(), int((r['input_ids'] == p.image_token_id).sum()))\n"
        "try:\n    p(text=['x'], videos=[[img]])\nexcept ValueError as e:\n    print('video:', e)\n")
    assert out.returncode == 0, out.stderr[-3000:]
    name, rest = out.stdout.split(" ", 1)
    assert name == "ImageOnlyQwen3VLProcessor"
    assert rest.startswith("[[1, 4, 6]] 6"), out.stdout  # 64x96 -> 4x6 patches -> 6 merged tokens
    assert "video: video inputs need torchvision" in out.stdout


def test_upstream_get_processor_still_consults_the_registry():
    from sglang.srt.utils.hf_transformers import processor

    source = inspect.getsource(processor.get_processor)
    assert "_CUSTOMIZED_MM_PROCESSOR" in source and "AutoProcessor.from_pretrained" in source


def test_upstream_registry_is_where_the_hook_puts_the_class():
    import importlib

    module = importlib.import_module(qp.SGLANG_REGISTRY_MODULE)
    assert isinstance(getattr(module, qp.SGLANG_REGISTRY_NAME), dict)


def test_upstream_processor_sets_no_attribute_the_stand_in_misses():
    from transformers import Qwen3VLProcessor

    params = list(inspect.signature(Qwen3VLProcessor.__init__).parameters)
    assert params == ["self", "image_processor", "tokenizer", "video_processor", "chat_template", "kwargs"]
    upstream = set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(Qwen3VLProcessor.__init__)))
    ours = set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(qp.image_only_processor_class().__init__)))
    assert upstream <= ours, upstream - ours
