"""The small desktop of `gui_desktop`: its state, its layout, its pixels and its a11y tree.

One screen, drawn with Pillow: a column of app icons (Settings, Notes, Files) on a wallpaper,
a taskbar, and at most one app window with a title bar and a close button.

- Settings: five on/off switches (Wi-Fi, Bluetooth, Dark mode, Notifications, Airplane mode).
  Dark mode recolours the whole desktop.
- Notes: a text field (focused when the app opens), Save and Clear buttons, the saved note.
- Files: a list of files (click one to select it) and a Delete button.

`layout(state, w, h)` lists every visible element (role, name, box, state, what a click
does), back to front, so a click hits the last element containing the point. The same list
is what `render` draws and what `a11y_tree` prints, so pixels, the tree and the checker (which
reads `DesktopState`, never pixels) cannot disagree. Coordinates are laid out on a 224x160
grid and scaled to the configured screen size.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

APPS = ("Settings", "Notes", "Files")
SETTINGS = ("Wi-Fi", "Bluetooth", "Dark mode", "Notifications", "Airplane mode")
BASE_W, BASE_H = 224, 160

_THEMES = {
    False: {"wallpaper": (58, 110, 165), "window": (245, 245, 240), "title": (200, 205, 215), "text": (20, 20, 25),
            "taskbar": (35, 40, 50), "field": (255, 255, 255), "button": (215, 218, 225), "select": (170, 200, 240),
            "label": (255, 255, 255)},
    True: {"wallpaper": (25, 28, 38), "window": (55, 58, 66), "title": (80, 84, 96), "text": (230, 230, 235),
           "taskbar": (10, 10, 14), "field": (35, 37, 44), "button": (90, 94, 106), "select": (60, 90, 140),
           "label": (220, 220, 225)},
}
_ICON_COLOURS = {"Settings": (120, 124, 136), "Notes": (232, 196, 64), "Files": (70, 140, 220)}


@dataclass
class DesktopState:
    """Everything the checker reads; pure data, copied freely."""

    icon_order: list[str]
    """Apps in icon slot order, top to bottom."""
    settings: dict[str, bool]
    files: list[str]
    window: str | None = None
    """The open app, if any."""
    note_text: str = ""
    note_focused: bool = False
    saved_note: str | None = None
    selected_file: str | None = None

    def copy(self) -> DesktopState:
        return copy.deepcopy(self)


@dataclass(frozen=True)
class Element:
    role: str
    """icon, window, button, switch, textfield, listitem, text."""
    name: str
    box: tuple[int, int, int, int]
    """x0, y0, x1, y1 in pixels, x1 and y1 exclusive."""
    state: str = ""
    """on/off for a switch, focused for a field, selected for a list item."""
    click: tuple[str, ...] = ()
    """What a click does: ("open", app), ("close",), ("toggle", setting), ("focus",), ("save",),
    ("clear",), ("select", file), ("delete",); empty for nothing."""
    depth: int = 0
    """0 on the desktop, 1 inside the window (indentation of the a11y tree)."""
    text: str = field(default="", compare=False)

    @property
    def center(self) -> tuple[int, int]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1 - 1) // 2, (y0 + y1 - 1) // 2

    def contains(self, x: int, y: int) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 <= x < x1 and y0 <= y < y1


def layout(state: DesktopState, width: int = BASE_W, height: int = BASE_H) -> list[Element]:
    """Every visible element, back to front."""
    sx, sy = width / BASE_W, height / BASE_H

    def box(x0: float, y0: float, x1: float, y1: float) -> tuple[int, int, int, int]:
        return round(x0 * sx), round(y0 * sy), round(x1 * sx), round(y1 * sy)

    els = [Element("taskbar", "Taskbar", box(0, 148, 224, 160))]
    for i, app in enumerate(state.icon_order):
        els.append(Element("icon", app, box(4, 4 + 46 * i, 44, 46 + 46 * i), click=("open", app)))
    if state.window is None:
        return els
    els.append(Element("window", state.window, box(52, 4, 220, 144)))
    els.append(Element("button", "Close", box(207, 5, 219, 16), click=("close",), depth=1))
    if state.window == "Settings":
        for i, name in enumerate(SETTINGS):
            on = state.settings[name]
            els.append(Element("switch", name, box(180, 24 + 22 * i, 212, 38 + 22 * i), "on" if on else "off",
                               ("toggle", name), depth=1))
    elif state.window == "Notes":
        els.append(Element("textfield", "Note", box(58, 22, 214, 40), "focused" if state.note_focused else "",
                           ("focus",), depth=1, text=state.note_text))
        els.append(Element("button", "Save", box(58, 46, 98, 60), click=("save",), depth=1))
        els.append(Element("button", "Clear", box(104, 46, 144, 60), click=("clear",), depth=1))
        saved = "(none)" if state.saved_note is None else state.saved_note
        els.append(Element("text", f"Saved: {saved}", box(58, 68, 214, 80), depth=1))
    elif state.window == "Files":
        for i, name in enumerate(state.files):
            els.append(Element("listitem", name, box(58, 20 + 18 * i, 214, 36 + 18 * i),
                               "selected" if name == state.selected_file else "", ("select", name), depth=1))
        els.append(Element("button", "Delete", box(58, 120, 104, 136), click=("delete",), depth=1))
    return els


def hit(elements: list[Element], x: int, y: int) -> Element | None:
    """The frontmost element under (x, y)."""
    for el in reversed(elements):
        if el.contains(x, y):
            return el
    return None


def find(elements: list[Element], role: str, name: str) -> Element | None:
    return next((e for e in elements if e.role == role and e.name == name), None)


def a11y_tree(elements: list[Element], width: int, height: int, dark: bool) -> str:
    """A compact accessibility tree: one line per element with its centre, window children
    indented (OSWorld agents get an a11y tree beside the screenshot, too)."""
    lines = [f"desktop {width}x{height} theme={'dark' if dark else 'light'}"]
    for el in elements:
        if el.role == "taskbar":
            continue
        state = f" {el.state}" if el.state else ""
        value = f" value={el.text!r}" if el.role == "textfield" else ""
        x, y = el.center
        lines.append(f"{'  ' * el.depth}{el.role} \"{el.name}\"{state}{value} at ({x},{y})")
    return "\n".join(lines)


@functools.lru_cache(maxsize=8)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def render(state: DesktopState, elements: list[Element], width: int, height: int):
    """The screenshot (a Pillow RGB image) of `elements`."""
    from PIL import Image, ImageDraw

    theme = _THEMES[state.settings["Dark mode"]]
    scale = min(width / BASE_W, height / BASE_H)
    font = _font(max(6, round(8 * scale)))
    img = Image.new("RGB", (width, height), theme["wallpaper"])
    draw = ImageDraw.Draw(img)

    def label(xy: tuple[float, float], text: str, fill, anchor: str = "lm") -> None:
        draw.text(xy, text, fill=fill, font=font, anchor=anchor)

    for el in elements:
        x0, y0, x1, y1 = el.box
        xm, ym = (x0 + x1) / 2, (y0 + y1) / 2
        if el.role == "taskbar":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=theme["taskbar"])
            label((x1 - 3 * scale, ym), "12:00", (200, 200, 200), "rm")
            if state.window:
                label((x0 + 4 * scale, ym), state.window, (200, 200, 200))
        elif el.role == "icon":
            glyph_bottom = y0 + (y1 - y0) * 0.7
            draw.rounded_rectangle((x0 + 6 * scale, y0, x1 - 6 * scale, glyph_bottom), radius=max(1, round(4 * scale)),
                                   fill=_ICON_COLOURS[el.name])
            label((xm, (y0 + glyph_bottom) / 2), el.name[0], (255, 255, 255), "mm")
            label((xm, (glyph_bottom + y1) / 2), el.name, theme["label"], "mm")
        elif el.role == "window":
            title_bottom = y0 + 12 * scale
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=theme["window"], outline=theme["title"])
            draw.rectangle((x0, y0, x1 - 1, title_bottom), fill=theme["title"])
            label((x0 + 4 * scale, (y0 + title_bottom) / 2), el.name, theme["text"])
        elif el.role == "button" and el.name == "Close":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=(205, 70, 60))
            label((xm, ym), "x", (255, 255, 255), "mm")
        elif el.role == "button":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=theme["button"], outline=theme["text"])
            label((xm, ym), el.name, theme["text"], "mm")
        elif el.role == "switch":
            label((58 * width / BASE_W, ym), el.name, theme["text"])
            on = el.state == "on"
            draw.rounded_rectangle((x0, y0, x1 - 1, y1 - 1), radius=(y1 - y0) // 2,
                                   fill=(60, 180, 90) if on else (150, 150, 155))
            r = (y1 - y0) / 2 - 2
            cx = x1 - 2 - r if on else x0 + 2 + r
            draw.ellipse((cx - r, ym - r, cx + r, ym + r), fill=(255, 255, 255))
        elif el.role == "textfield":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=theme["field"],
                           outline=(60, 120, 230) if el.state == "focused" else theme["text"])
            caret = "|" if el.state == "focused" else ""
            label((x0 + 3 * scale, ym), el.text + caret, theme["text"])
        elif el.role == "listitem":
            if el.state == "selected":
                draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=theme["select"])
            label((x0 + 3 * scale, ym), el.name, theme["text"])
        elif el.role == "text":
            label((x0, ym), el.name, theme["text"])
    return img
