"""The text action format of the GUI envs, parsed strictly.

A reply is exactly one action; surrounding whitespace is ignored, anything else is not:

    click X,Y        left click at pixel (X, Y) of the screenshot; 0 <= X < width, 0 <= Y < height
    type "TEXT"      type TEXT into the focused field; printable ASCII, \\" and \\\\ escape a
                     quote and a backslash, 1..64 characters
    key NAME         press one key: enter, backspace, escape or tab
    done             declare the task finished

Keywords are lowercase; `click 12, 40` (a space after the comma) is accepted, `Click(12,40)`,
two actions, or prose around an action are not. A reply that does not parse raises
`ActionError` with a one-line reason the env shows the model. `to_pyautogui` translates an
action into the pyautogui call OSWorld's VM server executes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

KEYS = ("enter", "backspace", "escape", "tab")
MAX_TYPE_CHARS = 64
MAX_ACTION_CHARS = 256
ACTION_HELP = 'Reply with one action: click X,Y | type "text" | key enter|backspace|escape|tab | done.'

_CLICK = re.compile(r"click (\d{1,5}), ?(\d{1,5})")
_TYPE = re.compile(r'type "((?:[^"\\]|\\["\\])*)"')
_KEY = re.compile(r"key (\S+)")


@dataclass(frozen=True)
class Click:
    x: int
    y: int


@dataclass(frozen=True)
class TypeText:
    text: str


@dataclass(frozen=True)
class KeyPress:
    key: str


@dataclass(frozen=True)
class Done:
    pass


Action = Union[Click, TypeText, KeyPress, Done]


class ActionError(ValueError):
    """A reply that is not one well-formed action; the message says why, in one line."""


def parse_action(reply: str, width: int, height: int) -> Action:
    """The one action of `reply` on a `width` x `height` screen; raises `ActionError`."""
    if len(reply) > MAX_ACTION_CHARS:
        raise ActionError(f"reply of {len(reply)} characters; an action is at most {MAX_ACTION_CHARS}")
    text = reply.strip()
    if not text:
        raise ActionError("empty reply")
    if "\n" in text or "\r" in text:
        raise ActionError("more than one line; reply with exactly one action")
    if text == "done":
        return Done()
    if m := _CLICK.fullmatch(text):
        x, y = int(m.group(1)), int(m.group(2))
        if not (0 <= x < width and 0 <= y < height):
            raise ActionError(f"click {x},{y} is outside the {width}x{height} screen")
        return Click(x, y)
    if m := _TYPE.fullmatch(text):
        typed = re.sub(r"\\([\"\\])", r"\1", m.group(1))
        if not typed:
            raise ActionError("type needs at least one character")
        if len(typed) > MAX_TYPE_CHARS:
            raise ActionError(f"type of {len(typed)} characters; at most {MAX_TYPE_CHARS}")
        if not all(32 <= ord(c) < 127 for c in typed):
            raise ActionError("type takes printable ASCII characters only")
        return TypeText(typed)
    if m := _KEY.fullmatch(text):
        if m.group(1) not in KEYS:
            raise ActionError(f"unknown key {m.group(1)!r}; keys are {', '.join(KEYS)}")
        return KeyPress(m.group(1))
    word = text.split(maxsplit=1)[0]
    if word in ("click", "type", "key"):
        raise ActionError(f"malformed {word} action {_clip(text)!r}")
    raise ActionError(f"not an action: {_clip(text)!r}")


def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def to_pyautogui(action: Action) -> str | None:
    """The pyautogui call performing `action` (None for `done`, which performs nothing)."""
    if isinstance(action, Click):
        return f"pyautogui.click({action.x}, {action.y})"
    if isinstance(action, TypeText):
        return f"pyautogui.typewrite({action.text!r})"
    if isinstance(action, KeyPress):
        return f"pyautogui.press({action.key!r})"
    return None
