"""Turn deltas built token by token equal the tokenized full conversation."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tide_megatron.rollout.chat import ChatFormat
from tide_megatron.tokenizer import tokenizer_dir


@pytest.fixture(scope="module", params=["tiny_bpe", "qwen2_5"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(tokenizer_dir(request.param))


@pytest.mark.parametrize("stopped", [True, False])
def test_incremental_tokens_match_the_template(tokenizer, stopped):
    chat = ChatFormat(tokenizer)
    obs = ["You are in a room with a red door and a blue door.", "Wrong door. Try again.", "You won."]
    actions = ["open the red door", "blue"]
    tokens = chat.prompt_ids(obs[0])
    messages = [{"role": "user", "content": obs[0]}]
    for action, nxt in zip(actions, obs[1:]):
        out = tokenizer(action, add_special_tokens=False)["input_ids"]
        if stopped:  # the model ended its turn itself
            out = out + [chat.eos_token_id]
        tokens += out + chat.user_turn_ids(nxt, out)
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": nxt}]
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(tokens) == full
    if stopped:
        # Token-exact, not just text-exact, whenever turns end the way the template writes them.
        assert tokens == tokenizer(full, add_special_tokens=False)["input_ids"]


def test_system_prompt_is_used(tokenizer):
    chat = ChatFormat(tokenizer, system_prompt="Pick doors.")
    assert "Pick doors." in tokenizer.decode(chat.prompt_ids("hello"))
