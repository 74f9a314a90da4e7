"""An image-only Qwen3-VL processor for machines without torchvision, served to SGLang.

transformers 5.19's `Qwen3VLProcessor` has three sub-processors, and `AutoProcessor.from_pretrained`
builds all of them. The video processor (`Qwen2VLVideoProcessor` / `Qwen3VLVideoProcessor`) exists
only with a torchvision backend, so without torchvision (PyPI's build cannot load beside torch
2.13.0+cpu) it raises `ImportError: ... requires the Torchvision library`, and SGLang's
`get_processor` (called by its tokenizer manager, scheduler and TP worker) cannot start a Qwen3-VL
engine. The image processor alone is fine: `AutoImageProcessor` picks the PIL backend.

`ImageOnlyQwen3VLProcessor` is `Qwen3VLProcessor` with the video sub-processor removed: the same
token attributes, the same image path, and a clear error for videos. It is put into SGLang's own
registry of custom processors (`customized_mm_processor_utils._CUSTOMIZED_MM_PROCESSOR`, consulted
by `get_processor` before `AutoProcessor`) the moment SGLang imports that registry, in every
interpreter: `tide_megatron.compat.activate_standins` installs the import hook from the `.pth` file,
and only when torchvision is missing. Pinned with the rest of the layer; the drift test is
tests/integration/compat/test_qwen3vl_processor_compat.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

SGLANG_REGISTRY_MODULE = "sglang.srt.multimodal.customized_mm_processor_utils"
SGLANG_REGISTRY_NAME = "_CUSTOMIZED_MM_PROCESSOR"
MODEL_TYPE = "qwen3_vl"

_processor_class = None


def image_only_processor_class():
    """The `ImageOnlyQwen3VLProcessor` class (built on first use: it imports transformers)."""
    global _processor_class
    if _processor_class is not None:
        return _processor_class
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        """`Qwen3VLProcessor` without its torchvision-only video sub-processor."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # The attribute set of Qwen3VLProcessor.__init__, minus the video processor.
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)
            self.vision_start_token = getattr(tokenizer, "vision_start_token", "<|vision_start|>")
            self.vision_end_token = getattr(tokenizer, "vision_end_token", "<|vision_end|>")
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise ValueError("video inputs need torchvision, which this machine lacks "
                                 "(tide_megatron.compat serves an image-only Qwen3-VL processor)")
            return super().__call__(images=images, text=text, **kwargs)

    _processor_class = ImageOnlyQwen3VLProcessor
    return _processor_class


def register_in_sglang(registry_module: Any) -> None:
    """Serve the image-only processor for `qwen3_vl` checkpoints from SGLang's registry."""
    registry = getattr(registry_module, SGLANG_REGISTRY_NAME)
    registry.setdefault(MODEL_TYPE, image_only_processor_class())


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs a callback on a module right after it is first executed (any finder loads it)."""

    def __init__(self, callbacks: dict[str, Callable[[Any], None]]):
        self.callbacks = dict(callbacks)

    def find_spec(self, fullname, path=None, target=None):
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        spec = None
        for finder in sys.meta_path:  # the finder that would have loaded it without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            callback(module)

        spec.loader.exec_module = exec_module
        return spec


def install_import_hook() -> PostImportHook:
    """Register the processor when SGLang's registry module is imported (idempotent)."""
    for finder in sys.meta_path:
        if isinstance(finder, PostImportHook) and SGLANG_REGISTRY_MODULE in finder.callbacks:
            return finder
    if SGLANG_REGISTRY_MODULE in sys.modules:  # already imported: register now
        register_in_sglang(sys.modules[SGLANG_REGISTRY_MODULE])
    hook = PostImportHook({SGLANG_REGISTRY_MODULE: register_in_sglang})
    sys.meta_path.insert(0, hook)
    return hook


def torchvision_missing() -> bool:
    return importlib.machinery.PathFinder.find_spec("torchvision") is None
