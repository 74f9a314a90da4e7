"""`textworld`: procedurally generated TextWorld games, offline, cached on disk.

TextWorld (Microsoft, the engine ALFWorld is built on) generates a world, a quest and its
text from a seed, compiles it to a Z-machine file with the Inform 7 compiler shipped in its
wheel, and plays it through Jericho. Only `make_game`, `compile_game` and `textworld.start`
are used, which need TextWorld's small pure-Python dependencies and Jericho's C library but
not spaCy (Jericho imports it only for features we do not use); requirements/envs.lock pins
exactly that set.

Generating a game takes a few seconds, so it happens lazily on the first reset of a task and
the compiled game is cached under `cache_dir/<params-hash>/<split>-<index>/`. The directory is
written under a temporary name and renamed into place, so concurrent servers never see half a
game. The reward of a step is its score gain over the game's max score, so a won game returns 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import threading

from tide_megatron.envs.config import EnvConfig, TextWorldConfig, default_cache_dir
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.task_ids import parse_task_id, pool_task_ids, stable_seed

# TextWorld's generator keeps module-level state (its knowledge base, grammar caches); one
# generation at a time per process keeps it safe under the server's worker threads.
_GENERATION_LOCK = threading.Lock()

_PROMPT_LINE = re.compile(r"^\s*>")  # the prompt, often followed by a status bar
_MAX_ACTION_CHARS = 200


def game_params(cfg: TextWorldConfig, split: str, index: int) -> dict[str, int]:
    """Generation parameters of one task, drawn from its seed (no game is generated)."""
    rng = random.Random(stable_seed("textworld", split, index))
    return {
        "seed": stable_seed("textworld-game", split, index) % (2**31 - 1),
        "nb_rooms": rng.randint(cfg.min_rooms, cfg.max_rooms),
        "nb_objects": cfg.num_objects,
        "quest_length": rng.randint(cfg.min_quest_length, cfg.max_quest_length),
    }


def clean_feedback(text: str) -> str:
    """Drop the interpreter's prompt and status-bar lines and squeeze blank runs."""
    lines = [ln.rstrip() for ln in text.splitlines() if not _PROMPT_LINE.match(ln)]
    out: list[str] = []
    for ln in lines:
        if ln or (out and out[-1]):
            out.append(ln)
    return "\n".join(out).strip()


def clean_action(action: str) -> str:
    """First non-empty line, printable ASCII only: the Z-machine parser takes one command."""
    for line in action.splitlines():
        line = "".join(ch for ch in line if 32 <= ord(ch) < 127).strip()
        if line:
            return line[:_MAX_ACTION_CHARS]
    return ""


class TextWorldEnv(Env):
    """One episode of a generated TextWorld game."""

    blocking = True

    def __init__(self, env_cfg: EnvConfig):
        self._cfg = env_cfg.textworld
        self._key = env_cfg.key
        self._pools = {"train": self._cfg.num_train_tasks, "eval": self._cfg.num_eval_tasks}
        self._cache_root = self._cfg.cache_dir or os.path.join(default_cache_dir(), "textworld")
        self._game = None
        self._steps = 0
        self._score = 0
        self._max_score = 1
        self._return = 0.0
        self._done = True

    # Catalogue -----------------------------------------------------------------------------

    def list_tasks(self, split: str) -> list[TaskSpec]:
        return [self.task(t) for t in pool_task_ids(split, self._pools)]

    def task(self, task_id: str) -> TaskSpec:
        split, index = parse_task_id(task_id, self._pools)
        params = game_params(self._cfg, split, index)
        return TaskSpec(env=self._key, task_id=task_id, task_type=f"textworld/quest{params['quest_length']}", split=split)

    # Game files ----------------------------------------------------------------------------

    def game_path(self, task_id: str) -> str:
        """Path of the compiled game of `task_id`, generating it on first use."""
        split, index = parse_task_id(task_id, self._pools)
        params = game_params(self._cfg, split, index)
        params_hash = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
        game_dir = os.path.join(self._cache_root, f"{split}-{index}-{params_hash}")
        game_file = os.path.join(game_dir, "game.z8")
        if os.path.exists(game_file):
            return game_file
        with _GENERATION_LOCK:
            if not os.path.exists(game_file):
                self._generate(params, game_dir)
        return game_file

    def _generate(self, params: dict[str, int], game_dir: str) -> None:
        from textworld import GameOptions
        from textworld.generator import compile_game, make_game

        os.makedirs(self._cache_root, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=".gen-", dir=self._cache_root)
        try:
            options = GameOptions()
            options.seeds = params["seed"]
            options.nb_rooms = params["nb_rooms"]
            options.nb_objects = params["nb_objects"]
            options.quest_length = params["quest_length"]
            options.path = os.path.join(tmp_dir, "game.z8")
            options.file_ext = ".z8"
            options.force_recompile = True
            compile_game(make_game(options), options)
            try:
                os.rename(tmp_dir, game_dir)
            except OSError:
                # Another process won the race; its game is identical (same seed and params).
                if not os.path.exists(os.path.join(game_dir, "game.z8")):
                    raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    # Episode -------------------------------------------------------------------------------

    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        import textworld

        spec = self.task(task_id)
        path = self.game_path(task_id)
        self.close()
        infos = textworld.EnvInfos(
            admissible_commands=self._cfg.include_admissible_commands, objective=True, description=True,
            max_score=True, won=True, lost=True,
        )
        self._game = textworld.start(path, request_infos=infos)
        state = self._game.reset()
        self._steps = 0
        self._score = 0
        self._max_score = max(1, int(state["max_score"] or 1))
        self._return = 0.0
        self._done = False
        text = f"{clean_feedback(state['objective'] or '')}\n\n{clean_feedback(state['description'] or '')}"
        info = {"max_steps": self._cfg.max_steps, "max_score": self._max_score}
        text = self._with_commands(text, state, info)
        return ResetResult(observation=text.strip(), info=info, task_type=spec.task_type)

    def step(self, action: str) -> StepResult:
        if self._game is None or self._done:
            raise RuntimeError("step on a finished or unstarted textworld episode")
        command = clean_action(action)
        state, score, game_over = self._game.step(command) if command else (None, self._score, False)
        self._steps += 1
        text = clean_feedback(state.feedback) if state is not None else "Type a command."
        reward = max(0, int(score) - self._score) / self._max_score
        self._score = max(self._score, int(score))
        self._return += reward
        won = bool(state is not None and state["won"])
        truncated = not game_over and self._steps >= self._cfg.max_steps
        info: dict = {}
        if game_over or truncated:
            self._done = True
            info.update(won=won, truncated=truncated, episode_return=self._return, score=self._score)
        elif state is not None:
            text = self._with_commands(text, state, info)
        return StepResult(observation=text, reward=reward, done=self._done, info=info)

    def _with_commands(self, text: str, state, info: dict) -> str:
        if not self._cfg.include_admissible_commands:
            return text
        commands = sorted(c for c in (state["admissible_commands"] or []) if c not in ("look", "inventory"))
        info["admissible_commands"] = commands
        if self._cfg.list_commands_in_text:
            text += "\nCommands: " + "; ".join(commands)
        return text

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None
