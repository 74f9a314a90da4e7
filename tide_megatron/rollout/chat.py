"""Token-level chat formatting for multi-turn rollouts.

The trainer must see exactly the tokens the engine saw, so a trajectory is built by
appending token deltas, never by re-tokenizing the whole conversation: the first prompt
comes from the tokenizer's chat template, and each later user turn is the template's
text *between* the end of an assistant message and the start of the next assistant
message, tokenized on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PROBE = "\u2063TIDE\u2063"  # a marker no template rewrites


@dataclass
class ChatFormat:
    """Renders prompts and turn deltas with a Hugging Face tokenizer's chat template."""

    tokenizer: Any
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        tok = self.tokenizer
        self.eos_token_id: int = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else -1
        head = self._messages(_PROBE) + [{"role": "assistant", "content": _PROBE}]
        closed = tok.apply_chat_template(head, tokenize=False)
        # What the template writes after an assistant's content, e.g. "<|im_end|>\n".
        self._assistant_close = closed[closed.rindex(_PROBE) + len(_PROBE) :]
        follow = tok.apply_chat_template(
            head + [{"role": "user", "content": _PROBE}], tokenize=False, add_generation_prompt=True
        )
        assert follow.startswith(closed), "chat template is not append-only across turns"
        user_turn = follow[len(closed) :]
        self._user_before, self._user_after = user_turn.split(_PROBE)

    def _messages(self, first_user: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": first_user}]

    def prompt_ids(self, observation: str) -> list[int]:
        """Tokens of the first prompt, ending with the assistant's generation header."""
        text = self.tokenizer.apply_chat_template(
            self._messages(observation), tokenize=False, add_generation_prompt=True
        )
        return self._encode(text)

    def user_turn_ids(self, observation: str, output_ids: list[int]) -> list[int]:
        """Tokens that follow the assistant's `output_ids` up to the next generation header:
        the rest of the assistant's closing (whatever the model did not generate itself),
        the user's observation, and the new assistant header."""
        close = self._assistant_close
        eos_text = self.tokenizer.eos_token or ""
        if output_ids and output_ids[-1] == self.eos_token_id and close.startswith(eos_text):
            close = close[len(eos_text) :]
        return self._encode(close + self._user_before + observation + self._user_after)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
