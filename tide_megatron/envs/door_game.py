"""`door_game`: a small deterministic multi-turn game a tiny random-init model can learn.

The agent walks through a house of 2-3 rooms. Each room has a few coloured doors and a clue
naming the right one, directly ("the blue door") or indirectly ("the colour of the sky").
The agent answers with a colour; the first colour word in its reply counts.

    Room 1 of 3. Doors: red, blue, green, gold, white. Clue: the way on is the colour of the sky.
    > blue
    Right, the blue door opens. Room 2 of 3. Doors: ...

Why it suits a GRPO learning test on CPU:
- The action space is a handful of single words, and the right one is a function of a few
  clue tokens (a copy or a small lookup), which a 2-layer transformer learns quickly.
- The return is dense: each room is a share of the reward, a room solved after a wrong try
  still earns part of its share, and the unsolved room at the end earns a little for a
  near miss (character-bigram similarity), so rewards within a group differ early even for
  a model that does not yet emit a clean colour word.
- A uniformly random valid policy scores about 0.20 (5 doors, default config), a perfect one
  1.0; turn counts vary with play (a wrong answer keeps the agent in the room).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tide_megatron.envs.config import DoorGameConfig, EnvConfig
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.task_ids import parse_task_id, pool_task_ids, stable_seed

COLOURS = ("red", "blue", "green", "gold", "white", "black")

INDIRECT_CLUES = {
    "red": ("the colour of fire", "the colour of a ripe tomato"),
    "blue": ("the colour of the sky", "the colour of the sea"),
    "green": ("the colour of grass", "the colour of a leaf"),
    "gold": ("the colour of the sun", "the colour of a crown"),
    "white": ("the colour of snow", "the colour of milk"),
    "black": ("the colour of coal", "the colour of the night"),
}

INSTRUCTION = (
    "You are in a house of {rooms} rooms. In each room one door leads on. "
    "Answer with the colour of the door to open."
)

# Credit of a room solved only after a wrong answer, as a share of a first-try solve. Below 1
# so that answering right the first time stays strictly better than guessing twice.
RETRY_CREDIT = 0.5

_WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Room:
    doors: tuple[str, ...]
    target: str
    clue: str


@dataclass(frozen=True)
class DoorTask:
    spec: TaskSpec
    rooms: tuple[Room, ...]


def build_door_task(cfg: DoorGameConfig, env_key: str, task_id: str) -> DoorTask:
    """The task behind `task_id`; a pure function of the config and the id."""
    split, index = parse_task_id(task_id, {"train": cfg.num_train_tasks, "eval": cfg.num_eval_tasks})
    rng = random.Random(stable_seed("door_game", split, index))
    num_rooms = rng.randint(cfg.min_rooms, cfg.max_rooms)
    rooms = []
    for _ in range(num_rooms):
        doors = tuple(rng.sample(COLOURS, cfg.num_doors))
        target = rng.choice(doors)
        if rng.random() < cfg.indirect_clue_prob:
            clue = f"the way on is {rng.choice(INDIRECT_CLUES[target])}"
        else:
            clue = f"the way on is the {target} door"
        rooms.append(Room(doors=doors, target=target, clue=clue))
    spec = TaskSpec(env=env_key, task_id=task_id, task_type=f"door_game/rooms{num_rooms}", split=split)
    return DoorTask(spec=spec, rooms=tuple(rooms))


def parse_door(action: str) -> str | None:
    """The first colour word of the reply, or None."""
    for word in _WORD.findall(action.lower()):
        if word in COLOURS:
            return word
    return None


def bigram_similarity(a: str, b: str) -> float:
    """Dice coefficient of the character bigrams of two strings, in [0, 1]."""
    ga = {a[i : i + 2] for i in range(len(a) - 1)}
    gb = {b[i : i + 2] for i in range(len(b) - 1)}
    if not ga or not gb:
        return 0.0
    return 2 * len(ga & gb) / (len(ga) + len(gb))


def near_miss_similarity(action: str, target: str) -> float:
    """How close a reply came to naming `target`: the best bigram similarity of any of its
    first few letter runs (a reply of random tokens still scores something that varies)."""
    words = _WORD.findall(action.lower())[:8]
    return max((bigram_similarity(w, target) for w in words), default=0.0)


class DoorGameEnv(Env):
    """One episode of the door game."""

    def __init__(self, env_cfg: EnvConfig):
        self._cfg = env_cfg.door_game
        self._key = env_cfg.key
        if not 2 <= self._cfg.num_doors <= len(COLOURS):
            raise ValueError(f"door_game.num_doors must be in [2, {len(COLOURS)}], got {self._cfg.num_doors}")
        if not 1 <= self._cfg.min_rooms <= self._cfg.max_rooms:
            raise ValueError("door_game needs 1 <= min_rooms <= max_rooms")
        self._task: DoorTask | None = None
        self._room = 0
        self._steps_left = 0
        self._failed_in_room = False
        self._best_near_miss = 0.0
        self._return = 0.0
        self._done = True

    def list_tasks(self, split: str) -> list[TaskSpec]:
        pools = {"train": self._cfg.num_train_tasks, "eval": self._cfg.num_eval_tasks}
        return [self.task(t) for t in pool_task_ids(split, pools)]

    def task(self, task_id: str) -> TaskSpec:
        return build_door_task(self._cfg, self._key, task_id).spec

    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        self._task = build_door_task(self._cfg, self._key, task_id)
        num_rooms = len(self._task.rooms)
        self._room = 0
        self._steps_left = num_rooms + self._cfg.extra_attempts
        self._failed_in_room = False
        self._best_near_miss = 0.0
        self._return = 0.0
        self._done = False
        text = INSTRUCTION.format(rooms=num_rooms) + "\n" + self._describe_room()
        info = {"num_rooms": num_rooms, "max_steps": self._steps_left}
        return ResetResult(observation=text, info=info, task_type=self._task.spec.task_type)

    def step(self, action: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("step on a finished or unstarted door_game episode")
        room = self._task.rooms[self._room]
        share = 1.0 / len(self._task.rooms)
        self._steps_left -= 1
        chosen = parse_door(action)
        reward = 0.0
        if chosen == room.target:
            reward = share * (RETRY_CREDIT if self._failed_in_room else 1.0)
            self._room += 1
            self._failed_in_room = False
            self._best_near_miss = 0.0
            won = self._room == len(self._task.rooms)
            if won:
                return self._finish(reward, f"Right, the {chosen} door opens. You are out of the house!", won=True)
            feedback = f"Right, the {chosen} door opens."
        else:
            self._failed_in_room = True
            self._best_near_miss = max(self._best_near_miss, near_miss_similarity(action, room.target))
            if chosen is None:
                feedback = "No door named. Answer with one colour: " + ", ".join(room.doors) + "."
            elif chosen not in room.doors:
                feedback = f"There is no {chosen} door here."
            else:
                feedback = f"The {chosen} door is locked."
        if self._steps_left <= 0:
            # Out of tries: the room left unsolved earns a little for how close the best try came.
            reward += share * self._cfg.near_miss_credit * self._best_near_miss
            return self._finish(reward, feedback + " You are out of tries.", won=False)
        self._return += reward
        text = feedback + "\n" + self._describe_room()
        return StepResult(observation=text, reward=reward, done=False, info={"room": self._room})

    def _finish(self, reward: float, text: str, won: bool) -> StepResult:
        self._done = True
        self._return += reward
        info = {"won": won, "truncated": False, "episode_return": self._return, "rooms_solved": self._room}
        return StepResult(observation=text, reward=reward, done=True, info=info)

    def _describe_room(self) -> str:
        assert self._task is not None
        room = self._task.rooms[self._room]
        return (
            f"Room {self._room + 1} of {len(self._task.rooms)}. Doors: {', '.join(room.doors)}. "
            f"Clue: {room.clue}."
        )

    # Exposed for tests and scripted policies (a solver is how the test proves a perfect
    # policy scores 1.0); never sent to the model.
    def solution(self) -> str:
        assert self._task is not None and not self._done
        return self._task.rooms[self._room].target

    def current_doors(self) -> tuple[str, ...]:
        assert self._task is not None and not self._done
        return self._task.rooms[self._room].doors
