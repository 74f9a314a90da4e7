"""Train the tiny byte-level BPE tokenizer committed under `tide_megatron/assets/tiny_bpe/`.

    python -m tide_megatron.tokenizer.train_tiny_bpe [--out DIR] [--vocab-size 3072]

The corpus covers what a tiny model reads and writes in this project: every door_game text
(instructions, rooms, clues, feedback), TextWorld's text grammars and the transcripts of a few
generated games, the latency wrapper's retry message, and ChatML / tool-call scaffolding.
Byte-level BPE with all 256 bytes in the alphabet, so any text encodes (no unknown token);
Qwen2's pre-tokenizer regex, so words split the way they do for the real recipes.

Special tokens come first, at fixed ids: `<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2.
Everything here is seeded and ordered, so a rerun writes the same files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import tempfile

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from tide_megatron.tokenizer.chat_templates import TINY_CHAT_TEMPLATE, TINY_DEFAULT_SYSTEM, chatml_tokenizer_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
DEFAULT_VOCAB_SIZE = 3072
ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny_bpe")
NUM_TEXTWORLD_GAMES = 6

GENERIC_TEXT = [
    TINY_DEFAULT_SYSTEM,
    "You are an agent in a text game. Read the observation and answer with one action.",
    "Think step by step, then give the final answer.",
    "The answer is 0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024.",
    '<tool_call>\n{"name": "click", "arguments": {"id": 3}}\n</tool_call>',
    "<tool_response>\nok\n</tool_response>",
    '{"name": "search", "arguments": {"query": "red shoes", "page": 1}}',
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "yes no ok done stop wait look inventory help north south east west up down",
]


def door_game_texts(num_tasks: int = 3000) -> list[str]:
    """Observations of door_game episodes under a right and a random policy, plus all clues."""
    from tide_megatron.envs.config import EnvConfig
    from tide_megatron.envs.door_game import COLOURS, INDIRECT_CLUES, DoorGameEnv

    env = DoorGameEnv(EnvConfig())
    rng = random.Random(0)
    texts: list[str] = []
    for i in range(num_tasks):
        first = env.reset(f"train/{i}", "corpus")
        texts.append(first.observation)
        while True:
            doors = env.current_doors()
            action = env.solution() if rng.random() < 0.6 else rng.choice(doors + COLOURS[:1] + ("hmm",))
            texts.append(action)
            res = env.step(action)
            texts.append(res.observation)
            if res.done:
                break
    texts += [c for clues in INDIRECT_CLUES.values() for c in clues] + list(COLOURS)
    return texts


def textworld_grammar_texts() -> list[str]:
    """Plain phrases of TextWorld's text grammars (the generator's whole vocabulary)."""
    try:
        import textworld
    except ImportError:
        return []
    root = os.path.join(os.path.dirname(textworld.__file__), "generator", "data", "text_grammars")
    texts = []
    for path in sorted(glob.glob(os.path.join(root, "*.twg"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("#") or ":" not in line:
                    continue
                body = line.split(":", 1)[1]
                for alt in re.split(r"[;|]", body):
                    # Drop grammar markup: #symbols#, (type) slots, [...] and {...} blocks.
                    alt = re.sub(r"#[^#]*#|\([^)]*\)|\[[^\]]*\]|\{[^}]*\}|<[^>]*>", " ", alt)
                    alt = re.sub(r"\s+", " ", alt).strip()
                    if len(alt) > 3:
                        texts.append(alt)
    return texts


def textworld_game_texts(num_games: int = NUM_TEXTWORLD_GAMES) -> list[str]:
    """Transcripts of a few generated games: objective, room text, commands, walkthrough feedback."""
    try:
        import textworld
        from textworld import GameOptions
        from textworld.generator import compile_game, make_game
    except ImportError:
        return []
    from tide_megatron.envs.textworld_env import clean_feedback

    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(num_games):
            options = GameOptions()
            options.seeds = 1000 + seed
            options.nb_rooms = 1 + seed % 3
            options.nb_objects = 4
            options.quest_length = 1 + seed % 3
            options.path = os.path.join(tmp, f"g{seed}.z8")
            options.file_ext = ".z8"
            path = compile_game(make_game(options), options)
            infos = textworld.EnvInfos(objective=True, description=True, admissible_commands=True, policy_commands=True)
            env = textworld.start(path, request_infos=infos)
            state = env.reset()
            texts += [clean_feedback(state["objective"]), clean_feedback(state["description"])]
            texts += state["admissible_commands"]
            for command in state["policy_commands"]:
                state, _, _ = env.step(command)
                texts += [command, clean_feedback(state.feedback)]
            env.close()
    return texts


def chat_texts(samples: list[str]) -> list[str]:
    """ChatML-wrapped turns, so `<|im_start|>user\\n` and friends merge like in real prompts."""
    roles = ["system", "user", "assistant", "tool"]
    return [f"<|im_start|>{roles[i % 4]}\n{s}<|im_end|>\n" for i, s in enumerate(samples)]


def build_corpus() -> list[str]:
    from tide_megatron.envs.latency import RETRY_TEXT

    texts = door_game_texts() + textworld_grammar_texts() + textworld_game_texts() + GENERIC_TEXT + [RETRY_TEXT]
    return texts + chat_texts(texts[:2000:7])


def train(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save(tokenizer: Tokenizer, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(chatml_tokenizer_config("PreTrainedTokenizerFast", TINY_CHAT_TEMPLATE, 4096), f, indent=2)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=ASSET_DIR)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    texts = build_corpus()
    tokenizer = train(texts, args.vocab_size)
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))
    save(tokenizer, args.out)
    print(f"trained on {len(texts)} texts: vocab {tokenizer.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
