"""Token-level chat formatting for multi-turn rollouts.

The trainer must see exactly the tokens the engine saw, so a trajectory is built by
appending token deltas, never by re-tokenizing the whole conversation: the first prompt
comes from the tokenizer's chat template, and each later user turn is the template's
text *between* the end of an assistant message and the start of the next assistant
message, tokenized on its own.

Images (vision-language policies): a user turn with images renders its content as the images
then the text (`[{"type": "image"}, ..., {"type": "text", ...}]`), which the template writes as one
`<|vision_start|><|image_pad|><|vision_end|>` per image. These are the ids SGLang is sent; the
rollout expands each pad to the image's token count (`rollout/multimodal.py`). Vision special
tokens are removed from observation text, so an env cannot forge an image placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tide_megatron.models.qwen3_vl_checkpoint import VISION_SPECIAL_TOKENS

if TYPE_CHECKING:
    from tide_megatron.rollout.multimodal import ImagePrompts

_PROBE = "\u2063TIDE\u2063"  # a marker no template rewrites


@dataclass
class ChatFormat:
    """Renders prompts and turn deltas with a Hugging Face tokenizer's chat template."""

    tokenizer: Any
    system_prompt: str | None = None
    images: "ImagePrompts | None" = None
    """The policy's image handling; None for a text-only policy."""
    _user_turns: dict[int, tuple[str, str]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        tok = self.tokenizer
        vocab = tok.get_vocab()
        self._vision_texts = [t for t in VISION_SPECIAL_TOKENS if t in vocab]
        self.eos_token_id: int = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else -1
        self._head = self._messages(_PROBE) + [{"role": "assistant", "content": _PROBE}]
        self._closed = tok.apply_chat_template(self._head, tokenize=False)
        # What the template writes after an assistant's content, e.g. "<|im_end|>\n".
        self._assistant_close = self._closed[self._closed.rindex(_PROBE) + len(_PROBE) :]
        self._user_turn(0)

    def _messages(self, first_user: str, num_images: int = 0) -> list[dict[str, Any]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": self._content(first_user, num_images)}]

    @staticmethod
    def _content(text: str, num_images: int) -> str | list[dict[str, str]]:
        if not num_images:
            return text
        return [{"type": "image"}] * num_images + [{"type": "text", "text": text}]

    def _clean(self, observation: str) -> str:
        for special in self._vision_texts:
            observation = observation.replace(special, "")
        return observation

    def prompt_ids(self, observation: str, num_images: int = 0) -> list[int]:
        """Tokens of the first prompt, ending with the assistant's generation header (one image
        pad per image: the form SGLang is sent)."""
        text = self.tokenizer.apply_chat_template(
            self._messages(self._clean(observation), num_images), tokenize=False, add_generation_prompt=True
        )
        return self._encode(text)

    def user_turn_ids(self, observation: str, output_ids: list[int], num_images: int = 0) -> list[int]:
        """Tokens that follow the assistant's `output_ids` up to the next generation header:
        the rest of the assistant's closing (whatever the model did not generate itself),
        the user's observation (after its images), and the new assistant header."""
        close = self._assistant_close
        eos_text = self.tokenizer.eos_token or ""
        if output_ids and output_ids[-1] == self.eos_token_id and close.startswith(eos_text):
            close = close[len(eos_text) :]
        before, after = self._user_turn(num_images)
        return self._encode(close + before + self._clean(observation) + after)

    def _user_turn(self, num_images: int) -> tuple[str, str]:
        """The template's text around a later user turn's observation text, with its images
        (rendered once per image count)."""
        if num_images not in self._user_turns:
            follow = self.tokenizer.apply_chat_template(
                self._head + [{"role": "user", "content": self._content(_PROBE, num_images)}], tokenize=False,
                add_generation_prompt=True)
            assert follow.startswith(self._closed), "chat template is not append-only across turns"
            before, after = follow[len(self._closed):].split(_PROBE)
            self._user_turns[num_images] = (before, after)
        return self._user_turns[num_images]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
