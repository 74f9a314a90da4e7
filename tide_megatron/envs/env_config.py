"""Typed configs of the environments themselves: which env, its options, its latency.

The server, client and process configs live in `config.py`, which re-exports these, so
`tide_megatron.envs.config` stays the one import for every env config. Every field carries
an attribute docstring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def default_cache_dir() -> str:
    """Where generated games are cached: $TIDE_CACHE_DIR, else ~/.cache/tide_megatron."""
    root = os.environ.get("TIDE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tide_megatron")
    return os.path.join(root, "envs")


@dataclass
class DoorGameConfig:
    """The learnable door game (`door_game`): pick the right door from a clue, room after room."""

    num_doors: int = 5
    """Doors per room (2..6). The chance that a uniformly random door is right is 1/num_doors."""

    min_rooms: int = 2
    """Fewest rooms in a task. One room is one turn when the agent answers right."""

    max_rooms: int = 3
    """Most rooms in a task; each task draws its room count from [min_rooms, max_rooms]."""

    extra_attempts: int = 1
    """Wrong answers allowed over the whole episode beyond one per room. A wrong answer keeps
    the agent in the room, so turn counts vary with how well the policy plays."""

    indirect_clue_prob: float = 0.5
    """Chance that a room's clue names the door indirectly ("the colour of the sky") instead of
    directly ("the blue door"); indirect clues make it a lookup rather than a copy."""

    near_miss_credit: float = 0.2
    """Partial credit, at most this much of a room's share, for the unsolved room at the end,
    scaled by the character-bigram similarity of the best attempt to the right door. It gives a
    policy that emits no valid door yet (a random-init model) a reward signal that varies."""

    num_train_tasks: int = 10_000
    """Size of the train task pool (task ids `door_game/train/<i>`)."""

    num_eval_tasks: int = 200
    """Size of the held-out eval pool (task ids `door_game/eval/<i>`)."""


@dataclass
class TextWorldConfig:
    """Procedurally generated TextWorld games (`textworld`), generated lazily and cached on disk."""

    cache_dir: str = ""
    """Directory for compiled games; empty means `default_cache_dir()/textworld`."""

    min_rooms: int = 1
    """Fewest rooms of a generated world."""

    max_rooms: int = 3
    """Most rooms of a generated world."""

    num_objects: int = 4
    """Objects placed in a world besides the quest's."""

    min_quest_length: int = 1
    """Shortest winning policy, in commands."""

    max_quest_length: int = 3
    """Longest winning policy, in commands; the task type records the quest length."""

    max_steps: int = 20
    """Steps before the episode is cut off (done with `info["truncated"] = True`)."""

    include_admissible_commands: bool = True
    """Put the admissible commands into every observation's info (and into the text when
    `list_commands_in_text`). Keeps the action space small for tiny models."""

    list_commands_in_text: bool = False
    """Also append the admissible commands to the observation text."""

    num_train_tasks: int = 1000
    """Size of the train task pool (each a distinct generation seed)."""

    num_eval_tasks: int = 50
    """Size of the eval task pool."""


@dataclass
class GuiDesktopConfig:
    """The offline GUI desktop (`gui_desktop`): screenshots of a small Pillow-drawn desktop,
    text actions, a checker that reads the desktop's state. See `gui_desktop.py` for the
    action format and the reward."""

    seed: int = 0
    """Seed of the task pool; a task is a pure function of (seed, task id)."""

    width: int = 224
    """Screenshot width in pixels (the layout scales with it; at least 112)."""

    height: int = 160
    """Screenshot height in pixels (at least 80)."""

    image_format: str = "png"
    """`png` (lossless, about 3 KB at 224x160) or `jpeg`."""

    families: list[str] = field(default_factory=lambda: [
        "open_app", "close_window", "toggle", "write_note", "delete_file"])
    """Task families drawn from (1 action: open_app, close_window; 1-2: toggle; 3: write_note,
    delete_file). Keep only the short ones for a first learning test."""

    max_steps: int = 6
    """Actions before the episode is cut off (done with `info["truncated"] = True`)."""

    auto_done: bool = True
    """End the episode as a success as soon as the goal holds. Off: the agent must say `done`."""

    a11y_tree: bool = True
    """Put the accessibility tree (one line per element, with its centre) in `info["a11y_tree"]`."""

    a11y_in_observation: bool = False
    """Also append the accessibility tree to the observation text (lets a text-only model play)."""

    progress_weight: float = 0.5
    """Share of the return paid for progress through the task's milestones; the rest is paid
    on success, so a success is worth 1 before penalties."""

    extra_step_penalty: float = 0.02
    """Paid for every action beyond the task's shortest solution."""

    malformed_penalty: float = 0.1
    """Paid for a reply that is not one well-formed action (it still uses up a step)."""

    near_miss_credit: float = 0.1
    """At most this much, on failure, for how close the best click came to the element the next
    milestone needed (1 at its centre, 0 half a screen diagonal away)."""

    num_train_tasks: int = 5000
    """Size of the train task pool."""

    num_eval_tasks: int = 100
    """Size of the eval task pool."""


@dataclass
class OSWorldConfig:
    """The adapter to OSWorld's VM servers (`osworld`); see `osworld.py` for the protocol."""

    vm_urls: list[str] = field(default_factory=list)
    """Base URLs of the VMs' OSWorld servers (`http://10.0.0.5:5000`). A session holds one VM
    from reset to close, so the env server's `max_sessions` should not exceed their count."""

    tasks_file: str = ""
    """JSON file (a list, or one object per line) of tasks: id, split, task_type, instruction,
    setup steps, check command, infeasible (see `osworld.py`)."""

    action_space: str = "gui_text"
    """`gui_text` (click x,y / type / key / done, translated to pyautogui) or `pyautogui`
    (Python code in a fenced block, or DONE / FAIL / WAIT: OSWorld's own action space)."""

    max_steps: int = 15
    """Actions before the episode is cut off and checked."""

    a11y_tree: bool = True
    """Fetch the accessibility tree after every action into `info["a11y_tree"]`."""

    a11y_max_chars: int = 20000
    """The tree is cut to this many characters (OSWorld's trees run to megabytes)."""

    settle_s: float = 2.0
    """Pause after an action before the screenshot (OSWorld's own default pause)."""

    request_timeout_s: float = 30.0
    """Time allowed for a screenshot, a11y tree or setup request."""

    execute_timeout_s: float = 150.0
    """Time allowed for an `/execute` call (the VM server itself stops a command at 120 s)."""

    revert_command: str = ""
    """Command run on the env server's host before each reset with the VM URL appended, to
    revert the VM to its snapshot (OSWorld reverts through its VM provider, outside the VM).
    Empty: no revert (tasks then share the VM's state; their setup must restore it)."""

    revert_timeout_s: float = 300.0
    """Time allowed for the revert command and for the VM server to answer again after it."""


@dataclass
class WorkloadEnvConfig:
    """The `workload` env: replays the simulator's task stream (`recipes/sim/workload/<name>.yaml`)
    for emulated runs (`cluster.device=emulated`), turn for turn."""

    workload: str = "text_webshop_alfworld"
    """Workload file under `recipes/sim/workload/`."""

    seed: int = 0
    """Seed of the draws (the simulator's `seed`): task `train/i` is the simulator's group i."""

    time_scale: float = 1.0
    """Env latencies (reset, step) are multiplied by this: set it to `cluster.emulation.dilation`
    so that env and device time dilate together."""

    num_train_tasks: int = 10_000
    """Tasks in the train split."""

    num_eval_tasks: int = 1_000
    """Tasks in the eval split."""


@dataclass
class LatencyConfig:
    """Emulated remote-environment latency and turn-count variation, deterministic under `seed`.

    Wraps any env. Step delays are lognormal around a per-task median (some tasks are
    systematically slower), with rare very slow steps; each task may also inject "retry"
    turns in which the remote env reports that the action was not applied.
    """

    enabled: bool = False
    """Wrap the env with the latency model."""

    seed: int = 0
    """Seed of every draw; the same (seed, task, trajectory, turn) always gives the same delay."""

    reset_median_s: float = 0.2
    """Median delay of a reset (environment start-up)."""

    step_median_s: float = 0.05
    """Median delay of a step for a task of average speed."""

    step_sigma: float = 0.5
    """Shape of the lognormal step delay (standard deviation of its log)."""

    task_speed_sigma: float = 0.5
    """Spread (log standard deviation) of the per-task speed multiplier."""

    slow_step_prob: float = 0.01
    """Chance that a step is a very slow one (a remote stall)."""

    slow_step_factor: float = 20.0
    """How much slower a slow step is than its ordinary draw."""

    max_delay_s: float = 30.0
    """Upper bound of any one delay."""

    extra_turns_mean: float = 0.0
    """Mean number of injected retry turns per task (Poisson); 0 keeps turn counts as the env's."""

    max_extra_turns: int = 4
    """Most injected retry turns per task."""

    extra_turns_within: int = 3
    """Injected turns fall before one of the first this-many real steps of a trajectory."""

    time_scale: float = 1.0
    """Multiplier of every delay (0 turns waiting off while keeping the recorded draws)."""

    error_prob: float = 0.0
    """Chance that a step fails (the remote environment crashed or refused the call): the env
    raises, the client sees the server's error, and the task is retried. For fault tests and
    soak runs; 0 in real use."""


@dataclass
class EnvConfig:
    """One environment served by the env server: which built-in env, its options, its latency."""

    name: str = "door_game"
    """Registered env name (`door_game`, `textworld`, `gui_desktop`, `osworld`, or one added
    with `register_env`)."""

    served_name: str = ""
    """Name clients use to reach it; empty means `name`. Lets one server offer the same env
    twice, e.g. `door_game` and a slow `door_game_remote` with latency on."""

    door_game: DoorGameConfig = field(default_factory=DoorGameConfig)
    """Options of `door_game`."""

    textworld: TextWorldConfig = field(default_factory=TextWorldConfig)
    """Options of `textworld`."""

    gui_desktop: GuiDesktopConfig = field(default_factory=GuiDesktopConfig)
    """Options of `gui_desktop`."""

    osworld: OSWorldConfig = field(default_factory=OSWorldConfig)
    """Options of `osworld`."""

    workload: WorkloadEnvConfig = field(default_factory=WorkloadEnvConfig)
    """Options of `workload`."""

    latency: LatencyConfig = field(default_factory=LatencyConfig)
    """Emulated latency and extra turns (off by default)."""

    @property
    def key(self) -> str:
        return self.served_name or self.name
