import json
import os

import pytest
from transformers import AutoTokenizer

from tide_megatron.tokenizer import TINY_BPE_DIR, tokenizer_dir, write_tokenizer
from tide_megatron.tokenizer.chat_templates import TINY_CHAT_TEMPLATE
from tide_megatron.tokenizer.train_tiny_bpe import SPECIAL_TOKENS, train


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_BPE_DIR)


def test_asset_is_small_and_loadable(tok):
    assert os.path.getsize(os.path.join(TINY_BPE_DIR, "tokenizer.json")) < 400_000
    assert 2048 <= len(tok) <= 4096
    assert tokenizer_dir("tiny_bpe") == TINY_BPE_DIR


def test_special_token_ids(tok):
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == 0 and tok.bos_token is None
    # Specials are atomic, and tokenizing adds no BOS/EOS of its own.
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == 1
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"][-1] == 2
    assert tok("hi")["input_ids"] == tok.encode("hi", add_special_tokens=True)


@pytest.mark.parametrize("text", [
    "You are in a house of 3 rooms. Room 1 of 3. Doors: red, blue, green, gold, white. Clue: the way on is the colour of the sky.",
    "take the TextWorld style key from the shelf; go north",
    "Unicode never seen in training: héllo wörld ✓ 你好 🤖\ttabs\n\nnewlines  spaces",
    "",
])
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert 0 not in ids or "<|endoftext|>" in text  # byte-level: no unknown token


def test_game_text_is_compact(tok):
    text = "Room 2 of 3. Doors: red, blue, green, gold, white. Clue: the way on is the colour of grass."
    assert len(tok(text)["input_ids"]) <= 30
    for colour in ["red", "blue", "green", "gold", "white", "black"]:
        assert len(tok(" " + colour)["input_ids"]) == 1 and len(tok(colour)["input_ids"]) == 1


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "Room 1 of 2."}, {"role": "assistant", "content": "blue"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nRoom 1 of 2.<|im_end|>\n<|im_start|>assistant\nblue<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)
    with_system = tok.apply_chat_template([{"role": "system", "content": "Play."}] + msgs, tokenize=False)
    assert with_system.startswith("<|im_start|>system\nPlay.<|im_end|>\n") and "helpful" not in with_system


def test_write_tokenizer_copies_a_loadable_tokenizer(tmp_path, tok):
    dest = write_tokenizer(str(tmp_path / "ckpt"), "tiny_bpe")
    assert sorted(os.listdir(dest)) == ["tokenizer.json", "tokenizer_config.json"]
    again = AutoTokenizer.from_pretrained(dest)
    assert again("Clue: the way on")["input_ids"] == tok("Clue: the way on")["input_ids"]
    with open(os.path.join(dest, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == TINY_CHAT_TEMPLATE
    with pytest.raises(ValueError):
        write_tokenizer(str(tmp_path / "x"), "gpt2")


def test_training_is_deterministic_and_pins_specials():
    texts = ["Room 1 of 3. Doors: red, blue.", "Clue: the way on is the blue door."] * 50
    a, b = train(texts, vocab_size=300), train(texts, vocab_size=300)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
