"""`gui_desktop`: an offline GUI environment with screenshots that a tiny model can learn.

The agent sees a screenshot of a small desktop (224x160 PNG by default, drawn with Pillow:
icons for Settings, Notes and Files, a taskbar, one app window at a time; `gui_screen.py`),
the task's instruction, optionally an accessibility tree, and answers with one text action
(`gui_actions.py`): `click X,Y`, `type "text"`, `key enter|backspace|escape|tab`, `done`.
Every action is followed by a fresh screenshot. A reply that is not one well-formed action is
answered with an observation saying what is wrong and costs a penalty; it never crashes.

Tasks (task type `gui_desktop/<family>`; shortest solution in brackets):
- open_app [1]      "Open the Notes app."                   click its icon
- close_window [1]  "Close the Files window."               click the window's close button
- toggle [1-2]      "Turn on Wi-Fi in Settings."            open Settings (if closed), click the switch
- write_note [3]    "Write "milk" in Notes and save it."    open Notes, type, click Save
- delete_file [3]   "Delete the file report.txt in Files."  open Files, select the file, click Delete
A task is a pure function of (seed, task id): icon order, switch states, file names, the open
window and the goal are drawn from it, so the G members of a group share their first
screenshot byte for byte. The checker reads the desktop's state, never its pixels; toggle and
delete_file also require that nothing else was changed.

Reward (the sum over an episode is `info["episode_return"]`; 1.0 for a shortest success):
- progress: each task has ordered milestones ending in the goal (e.g. Settings open, then the
  switch in place); reaching a milestone further than any before pays its share of
  `progress_weight` (0.5), so partial solutions differ from nothing done;
- success: `1 - progress_weight` when the goal holds (at once with `auto_done`, else at `done`);
- near miss: on failure, up to `near_miss_credit` (0.1) for how close the best click came to
  the element the next milestone needed, so random clicks already give GRPO a spread;
- penalties: `malformed_penalty` (0.1) per malformed reply, `extra_step_penalty` (0.02) per
  action beyond the shortest solution.
An icon covers about 5% of the screen, so a uniformly random clicker wins about a quarter of
its open_app episodes (six tries) and a few percent of the others: groups of 8 on the short
tasks see successes and a spread of returns from the first step (the unit tests measure it).

Emulated heavy-tailed latency comes from the generic latency wrapper (`EnvConfig.latency`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tide_megatron.envs.env_config import EnvConfig, GuiDesktopConfig
from tide_megatron.envs.gui_actions import ACTION_HELP, ActionError, Click, Done, KeyPress, TypeText, parse_action
from tide_megatron.envs.gui_screen import APPS, SETTINGS, DesktopState, a11y_tree, find, hit, layout, render
from tide_megatron.envs.images import encode_image
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.task_ids import parse_task_id, pool_task_ids, stable_seed

FAMILIES = ("open_app", "close_window", "toggle", "write_note", "delete_file")
FILE_POOL = ("report.txt", "photo.png", "budget.xls", "notes.md", "song.mp3", "draft.doc", "todo.txt", "map.pdf")
WORDS = ("milk", "eggs", "gym", "call mom", "pay rent", "dentist", "buy bread", "meeting")
MAX_NOTE_CHARS = 24


@dataclass(frozen=True)
class GuiTask:
    spec: TaskSpec
    family: str
    instruction: str
    initial: DesktopState
    target: str
    """The app, setting, word or file the task is about."""
    value: bool = True
    """For toggle: the wanted switch state."""
    shortest: int = 1
    """Actions of the shortest solution."""


def build_gui_task(cfg: GuiDesktopConfig, env_key: str, task_id: str) -> GuiTask:
    """The task of `task_id`; a pure function of the config's seed and the id."""
    split, index = parse_task_id(task_id, {"train": cfg.num_train_tasks, "eval": cfg.num_eval_tasks})
    rng = random.Random(stable_seed("gui_desktop", cfg.seed, split, index))
    family = rng.choice(list(cfg.families))
    state = DesktopState(icon_order=rng.sample(APPS, len(APPS)), settings={s: rng.random() < 0.5 for s in SETTINGS},
                         files=rng.sample(FILE_POOL, 4))
    spec = TaskSpec(env=env_key, task_id=task_id, task_type=f"gui_desktop/{family}", split=split)
    value, shortest = True, 3
    if family == "open_app":
        target = rng.choice(APPS)
        state.window = rng.choice([None] + [a for a in APPS if a != target])
        instruction, shortest = f"Open the {target} app.", 1
    elif family == "close_window":
        target = state.window = rng.choice(APPS)
        instruction, shortest = f"Close the {target} window.", 1
    elif family == "toggle":
        target = rng.choice(SETTINGS)
        value = not state.settings[target]
        state.window = rng.choice([None, "Settings"])
        instruction = f"Turn {'on' if value else 'off'} {target} in Settings."
        shortest = 1 if state.window == "Settings" else 2
    elif family == "write_note":
        target = rng.choice(WORDS)
        instruction = f'Write "{target}" in Notes and save it.'
    else:
        target = rng.choice(state.files)
        instruction = f"Delete the file {target} in Files."
    state.note_focused = state.window == "Notes"
    return GuiTask(spec, family, instruction, state, target, value, shortest)


def milestones(task: GuiTask, state: DesktopState) -> list[bool]:
    """The task's ordered milestones in `state`; the last one is the goal."""
    t = task.target
    if task.family == "open_app":
        return [state.window == t]
    if task.family == "close_window":
        return [state.window is None]
    if task.family == "toggle":
        wanted = {**task.initial.settings, t: task.value}
        return [state.window == "Settings", state.settings == wanted]
    if task.family == "write_note":
        return [state.window == "Notes", state.note_text == t, state.saved_note == t]
    remaining = [f for f in task.initial.files if f != t]
    return [state.window == "Files", state.selected_file == t, state.files == remaining]


def progress(task: GuiTask, state: DesktopState) -> float:
    """Fraction of the milestones reached: the furthest one that holds now."""
    ms = milestones(task, state)
    return next(((k + 1) / len(ms) for k in reversed(range(len(ms))) if ms[k]), 0.0)


def next_step(task: GuiTask, state: DesktopState) -> tuple[str, str]:
    """What a perfect agent does next: (role, name) of the element to click, or ("type", text)."""
    t = task.target
    if task.family == "close_window":
        return ("button", "Close")
    app = {"open_app": t, "toggle": "Settings", "write_note": "Notes", "delete_file": "Files"}[task.family]
    if state.window != app:
        return ("icon", app)
    if task.family == "toggle":
        wanted = {**task.initial.settings, t: task.value}
        return ("switch", next(s for s in SETTINGS if state.settings[s] != wanted[s]))
    if task.family == "write_note":
        if state.note_text != t:
            if state.note_text:
                return ("button", "Clear")
            return ("type", t) if state.note_focused else ("textfield", "Note")
        return ("button", "Save")
    return ("listitem", t) if state.selected_file != t else ("button", "Delete")


class GuiDesktopEnv(Env):
    """One episode of the GUI desktop. Rendering is CPU work, so it runs on a worker thread."""

    blocking = True

    def __init__(self, env_cfg: EnvConfig):
        cfg = self._cfg = env_cfg.gui_desktop
        self._key = env_cfg.key
        unknown = sorted(set(cfg.families) - set(FAMILIES))
        if unknown or not cfg.families:
            raise ValueError(f"gui_desktop.families must be a non-empty subset of {FAMILIES}, got {cfg.families}")
        if cfg.width < 112 or cfg.height < 80:
            raise ValueError(f"gui_desktop screen must be at least 112x80, got {cfg.width}x{cfg.height}")
        if cfg.image_format not in ("png", "jpeg"):
            raise ValueError(f"gui_desktop.image_format must be png or jpeg, got {cfg.image_format!r}")
        if cfg.max_steps < 1:
            raise ValueError(f"gui_desktop.max_steps must be >= 1, got {cfg.max_steps}")
        self._task: GuiTask | None = None
        self.state: DesktopState | None = None
        self._done = True
        self._steps = 0
        self._start = self._best = self._best_closeness = self._return = 0.0

    def list_tasks(self, split: str) -> list[TaskSpec]:
        pools = {"train": self._cfg.num_train_tasks, "eval": self._cfg.num_eval_tasks}
        return [self.task(t) for t in pool_task_ids(split, pools)]

    def task(self, task_id: str) -> TaskSpec:
        return build_gui_task(self._cfg, self._key, task_id).spec

    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        task = self._task = build_gui_task(self._cfg, self._key, task_id)
        self.state = task.initial.copy()
        self._steps = 0
        self._start = self._best = progress(task, self.state)
        self._best_closeness = 0.0
        self._return = 0.0
        self._done = False
        text = (f"{task.instruction}\n{ACTION_HELP} The screen is {self._cfg.width}x{self._cfg.height} pixels; "
                "(0,0) is the top left.")
        text, info, images = self._observe(text)
        return ResetResult(observation=text, info=info, task_type=task.spec.task_type, image_data=images)

    def step(self, action: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("step on a finished or unstarted gui_desktop episode")
        cfg, task, state = self._cfg, self._task, self.state
        self._steps += 1
        shortest = task.shortest + (0 if cfg.auto_done else 1)  # without auto_done, `done` is an action too
        reward = -cfg.extra_step_penalty if self._steps > shortest else 0.0
        invalid = False
        try:
            act = parse_action(action, cfg.width, cfg.height)
        except ActionError as e:
            act, invalid = None, True
            reward -= cfg.malformed_penalty
            feedback = f"Invalid action: {e}. {ACTION_HELP}"
        else:
            if isinstance(act, Click):
                self._note_closeness(act)
            feedback = self._apply(act)
        now = progress(task, state)
        if now > self._best:
            reward += cfg.progress_weight * (now - self._best) / (1.0 - self._start)
            self._best, self._best_closeness = now, 0.0
        goal = milestones(task, state)[-1]
        done = won = truncated = False
        if goal and (cfg.auto_done or isinstance(act, Done)):
            reward += 1.0 - cfg.progress_weight
            done = won = True
            feedback += " Task complete."
        elif isinstance(act, Done) or self._steps >= cfg.max_steps:
            done, truncated = True, not isinstance(act, Done)
            reward += cfg.near_miss_credit * self._best_closeness
            feedback += " Task failed." if isinstance(act, Done) else " Out of steps."
        self._return += reward
        self._done = done
        text, info, images = self._observe(feedback)
        if invalid:
            info["invalid_action"] = True
        if done:
            info.update(won=won, truncated=truncated, episode_return=self._return, steps=self._steps)
        return StepResult(observation=text, reward=reward, done=done, info=info, image_data=images)

    def _apply(self, act) -> str:
        s = self.state
        if isinstance(act, Done):
            return "Done."
        if isinstance(act, TypeText):
            if s.window != "Notes" or not s.note_focused:
                return "Nothing to type into."
            s.note_text = (s.note_text + act.text)[:MAX_NOTE_CHARS]
            return f"Typed {act.text!r}."
        if isinstance(act, KeyPress):
            return self._key_press(act.key)
        el = hit(layout(s, self._cfg.width, self._cfg.height), act.x, act.y)
        if el is None or not el.click:
            return "Nothing happens."
        kind, *arg = el.click
        if kind == "open":
            s.window, s.note_focused, s.selected_file = arg[0], arg[0] == "Notes", None
            return f"Opened {arg[0]}."
        if kind == "close":
            s.window, s.note_focused, s.selected_file = None, False, None
            return "Closed the window."
        if kind == "toggle":
            s.settings[arg[0]] = not s.settings[arg[0]]
            return f"{arg[0]} is now {'on' if s.settings[arg[0]] else 'off'}."
        if kind == "focus":
            s.note_focused = True
            return "The note field is focused."
        if kind == "save":
            s.saved_note = s.note_text
            return f"Saved the note {s.note_text!r}."
        if kind == "clear":
            s.note_text = ""
            return "Cleared the note."
        if kind == "select":
            s.selected_file = arg[0]
            return f"Selected {arg[0]}."
        if s.selected_file is None:  # delete
            return "No file is selected."
        s.files.remove(s.selected_file)
        deleted, s.selected_file = s.selected_file, None
        return f"Deleted {deleted}."

    def _key_press(self, key: str) -> str:
        s = self.state
        if key == "escape" and s.window is not None:
            s.window, s.note_focused, s.selected_file = None, False, None
            return "Closed the window."
        if s.window == "Notes" and s.note_focused:
            if key == "enter":
                s.saved_note = s.note_text
                return f"Saved the note {s.note_text!r}."
            if key == "backspace":
                s.note_text = s.note_text[:-1]
                return "Deleted a character."
        if key == "tab" and s.window == "Notes":
            s.note_focused = not s.note_focused
            return "Moved the focus."
        return f"Pressed {key}; nothing happens."

    def _note_closeness(self, click: Click) -> None:
        """Remember how close a click came to the element the next milestone needs."""
        role, name = next_step(self._task, self.state)
        el = find(layout(self.state, self._cfg.width, self._cfg.height), role, name)
        if el is None:
            return
        cx, cy = el.center
        half_diagonal = math.hypot(self._cfg.width, self._cfg.height) / 2
        closeness = max(0.0, 1.0 - math.hypot(click.x - cx, click.y - cy) / half_diagonal)
        self._best_closeness = max(self._best_closeness, closeness)

    def _observe(self, text: str) -> tuple[str, dict, list[bytes]]:
        cfg = self._cfg
        elements = layout(self.state, cfg.width, cfg.height)
        image = encode_image(render(self.state, elements, cfg.width, cfg.height), cfg.image_format)
        info: dict = {}
        if cfg.a11y_tree or cfg.a11y_in_observation:
            tree = a11y_tree(elements, cfg.width, cfg.height, self.state.settings["Dark mode"])
            if cfg.a11y_tree:
                info["a11y_tree"] = tree
            if cfg.a11y_in_observation:
                text = f"{text}\n{tree}"
        return text, info, [image]

    # A scripted perfect player for tests and reference runs; never shown to the model.
    def expert_action(self) -> str:
        assert self._task is not None and not self._done
        role, name = next_step(self._task, self.state)
        if role == "type":
            return f'type "{name}"'
        x, y = find(layout(self.state, self._cfg.width, self._cfg.height), role, name).center
        return f"click {x},{y}"
