"""Draw `docs/architecture.svg`: the processes, threads and messages of one tide-megatron job.

    python scripts/draw_architecture.py          # rewrite docs/architecture.svg
    python scripts/draw_architecture.py --check  # exit 1 if the file differs from what it would write

Hand-made SVG from the lists below, with no graphviz or matplotlib, so the same code always
writes the same bytes. Text is monospace and box widths are fixed, so nothing depends on the
fonts of the machine that draws it. `tests/unit/docs/test_readme.py` checks that the committed
file is what this script writes, that every control message it names is a message class of
`tide_megatron/comm/messages.py` (and that none is left out), and that every file it names exists.

Sources: `tide_megatron/job.py` (what each rank runs), `tide_megatron/controller/loop.py` and
`rollout_service.py` (rank 0's threads), `tide_megatron/rollout/worker.py` and `engine.py`
(a rollout rank), `tide_megatron/trainer/worker.py` (a trainer rank), `tide_megatron/comm/`
(mailbox, messages, weight sync, groups), `launch/torchrun.py` (the store on loopback).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import generated_file  # noqa: E402

OUT = REPO / "docs" / "architecture.svg"

FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
SIZE = 11  # px; a monospace character is 0.6 em wide
CHAR_W = SIZE * 0.6
LINE_H = 15
WIDTH, HEIGHT = 1500, 1040

# Colours: one per kind of thing.
PROCESS = "#f4f4f4"
THREAD = "#ffffff"
CONTROL = "#1f5fa8"  # control messages through the store
DATA = "#b5471b"  # weights, log-probs, gradients: process groups and shared memory
ENV = "#2f7d32"  # env protocol
MOVE = "#6b4aa0"  # ERS role changes
FILE_GREY = "#666666"


@dataclass
class Box:
    """A process (grey) or a thread / component inside one (white): a title and lines of
    (what it does, the file it is in)."""

    x: float
    y: float
    w: float
    title: str
    lines: list[tuple[str, str]] = field(default_factory=list)
    fill: str = THREAD
    h: float = 0.0
    """0: fit the lines."""

    def height(self) -> float:
        return self.h or 24 + LINE_H * len(self.lines) + 6


@dataclass
class MessageList:
    """The typed control messages of one direction (class names of `comm/messages.py`)."""

    x: float
    y: float
    w: float
    title: str
    messages: list[tuple[str, str]]
    """(class name, what it says)."""

    def height(self) -> float:
        return 22 + LINE_H * len(self.messages) + 6


# ---------------------------------------------------------------- what is drawn
PROCESSES = [
    Box(20, 60, 560, "rank 0: controller + trainer DP rank 0  (job.py)", fill=PROCESS, h=500),
    Box(980, 60, 500, "rollout rank (the last ranks; one per engine)", fill=PROCESS, h=500),
    Box(20, 640, 560, "other trainer ranks: ACTOR, ACTOR_REF or REF", fill=PROCESS, h=250),
    Box(980, 640, 500, "env server: a separate process  (envs/server.py)", fill=PROCESS, h=150),
]

THREADS = [
    Box(34, 90, 532, "main thread", [
        ("step loop, one for every scheduler.mode", "controller/loop.py"),
        ("mode policy: sync, async_static, stream, tide", "controller/modes.py"),
        ("trainer driver; RA2P picks CM or DM", "controller/training.py"),
        ("ERS: plans roles, moves ranks at the sync", "controller/trainer_roles.py"),
        ("its trainer share: Megatron actor,", "trainer/worker.py"),
        ("  + the reference when colocated", "trainer/ra2p/"),
        ("metrics.jsonl, TensorBoard, checkpoints", "controller/step_log.py"),
    ]),
    Box(34, 240, 532, "rollout-service thread (reads rank 0's mailbox)", [
        ("trainer ranks' replies -> main thread's inbox", "controller/rollout_service.py"),
        ("global buffer, token ledger, staleness", "core/buffer.py"),
        ("readiness: RAS, TPRM, HoL latency", "core/signals.py"),
        ("task placement: CTB (tide mode)", "controller/ctb_placement.py"),
        ("  or request level (other modes)", "controller/placement.py"),
        ("retries, heartbeats, quarantine", "controller/quarantine.py"),
        ("sends the weights after each update", "controller/weight_push.py"),
        ("streams late groups into the open step", "trainer/step_feed.py"),
    ]),
    Box(34, 405, 532, "timeline-writer thread", [
        ("timeline.json and timeline.png", "controller/timeline_log.py"),
    ]),
    Box(34, 460, 532, "env-server supervisor thread (unless envs.external)", [
        ("starts, watches and restarts the env server", "envs/server_process.py"),
        ("started by rank 0 at set-up", "job.py"),
    ]),
    Box(994, 90, 472, "main thread: the engine's asyncio loop", [
        ("worker: polls its mailbox, heartbeats", "rollout/worker.py"),
        ("one asyncio task per trajectory:", "rollout/ctb_task_runner.py"),
        ("  generate, env step, append, again", "rollout/task_runner.py"),
        ("hands tasks over when ERS moves it", "rollout/task_carry.py"),
        ("SGLang Engine in process (no HTTP)", "rollout/engine.py"),
    ]),
    Box(994, 210, 472, "SGLang scheduler subprocess", [
        ("batches, KV pool, radix cache", ""),
        ("tide_ctb plugin: admission, retraction", "sglang_patches/"),
        ("  order, per-turn KV and decode report", ""),
        ("loads weights: shared buckets or broadcast", ""),
    ]),
    Box(994, 315, 472, "SGLang detokenizer subprocess", [
        ("engine channels: ZMQ ipc, no TCP port", ""),
    ]),
    Box(994, 370, 472, "executor thread (a node's relay only)", [
        ("receives packed weights point to point", "comm/weight_sync.py"),
        ("  into shared memory, for its node", ""),
    ]),
    Box(994, 440, 472, "restart-heartbeat thread (while an engine restarts)", [
        ("a dead engine is replaced; last weights", "rollout/worker.py"),
        ("  reloaded, its tasks retried", ""),
    ]),
    Box(34, 670, 532, "main thread: serves rank 0's commands in order", [
        ("Megatron actor (DDP + optimizer) or reference", "trainer/worker.py"),
        ("RA2P executors: colocated, decoupled", "trainer/ra2p/"),
        ("loss in backward (decoupled)", "trainer/loss_in_backward.py"),
        ("state to a joining actor over the DP group", "trainer/state_transfer.py"),
    ]),
    Box(34, 775, 532, "mailbox-reader thread", [
        ("micro-batches straight into the running step", "trainer/ra2p/source.py"),
    ]),
    Box(34, 830, 532, "standby SGLang engine, parked (ers.standby_engines)", [
        ("a move into rollout costs a weight load", "controller/trainer_roles.py"),
    ], h=50),
    Box(994, 670, 472, "asyncio server + worker threads", [
        ("reset / step / detach / attach, rewards", "envs/protocol.py"),
        ("door game, TextWorld, GUI desktop, OSWorld", "envs/registry.py"),
        ("token required off loopback", "envs/server.py"),
    ]),
]

STORE = Box(610, 250, 340, "torchrun's store, 127.0.0.1", [
    ("one mailbox queue per rank", "comm/mailbox.py"),
    ("typed messages, JSON", "comm/messages.py"),
    ("nothing blocks a sender or a reader", ""),
], fill="#e8f0fa")

TO_ROLLOUT = MessageList(610, 60, 340, "rank 0 -> rollout rank", [
    ("RunTask", "start or go on with a task"),
    ("PauseTask", "CTB: stop before its next turn"),
    ("ResumeTask", "CTB: go on, on this rank"),
    ("CancelTask", "its group cannot be trained"),
    ("CancelAll", "quarantine; ERS: hand over"),
    ("ReleaseCarry", "close a handed-over session"),
    ("LoadWeights", "bucket handles / relay / group"),
    ("JoinUpdateGroup", "broadcast path: form the group"),
    ("SetRoles", "ERS: join the trainer"),
    ("Stop", "finish"),
])

FROM_ROLLOUT = MessageList(610, 370, 340, "rollout rank -> rank 0", [
    ("RankReady", "engine up: KV pool, rows"),
    ("TurnEvent", "CTB: turn start/end, report"),
    ("TrajectoryDone", "the whole trajectory"),
    ("TaskFailed", "retried from scratch"),
    ("TaskReleased", "paused, holds nothing"),
    ("TaskCancelled", "its tokens are wasted"),
    ("TaskCarried", "ERS: episode + env claim"),
    ("AllCancelled", "answer to CancelAll"),
    ("Heartbeat", "own token count, waits"),
    ("WeightsLoaded", "version loaded"),
    ("Stopped", "answer to Stop"),
])

TO_TRAINER = MessageList(610, 640, 340, "rank 0 -> trainer ranks", [
    ("OpenStep", "RA2P mode, micro-batches"),
    ("TrainMicroBatch", "whole trajectories"),
    ("OpenRefStep", "decoupled: serve ref"),
    ("RefMicroBatch", "a DP rank's micro-batch"),
    ("SetRoles", "ERS: new assignment"),
    ("PushWeights", "join the TP gather"),
    ("SaveCheckpoint", "collective save"),
    ("LoadCheckpoint", "collective load"),
    ("Stop", "finish"),
])

FROM_TRAINER = MessageList(610, 830, 340, "trainer ranks -> rank 0", [
    ("Trained", "step result + report"),
    ("RefDone", "report + measured costs"),
    ("RolesDone", "role now, change times"),
    ("EngineStandby", "standby engine parked"),
])

MESSAGE_LISTS = [TO_ROLLOUT, FROM_ROLLOUT, TO_TRAINER, FROM_TRAINER]


@dataclass
class Edge:
    points: list[tuple[float, float]]
    colour: str
    label: list[str]
    at: tuple[float, float]
    """Where the label's first line starts."""
    both: bool = False
    """Arrow heads at both ends."""
    dashed: bool = False


EDGES = [
    # control: every rank <-> the store
    Edge([(580, 295), (610, 295)], CONTROL, [], (0, 0), both=True),
    Edge([(950, 295), (980, 295)], CONTROL, [], (0, 0), both=True),
    Edge([(630, 325), (630, 345), (596, 345), (596, 620), (400, 620), (400, 640)], CONTROL, [], (0, 0),
         both=True),
    # data: weights from rank 0 to the rollout ranks
    Edge([(540, 560), (540, 575), (1100, 575), (1100, 560)], DATA,
         ["weights after each update: shared memory",
          "+ a relay per node (comm/weight_sync.py),",
          "or a broadcast group (comm/update_group.py)"], (606, 592)),
    # data: trainer collectives and the reference stream
    Edge([(300, 560), (300, 640)], DATA,
         ["DP all-reduce, TP gather,", "ref log-probs point to point", "(trainer/ra2p/decoupled.py)"],
         (308, 580), both=True),
    # env protocol
    Edge([(1300, 560), (1300, 640)], ENV, ["reset/step over TCP", "(envs/client.py)"], (1308, 596), both=True),
    # ERS moves a rank between rollout and the trainer
    Edge([(300, 890), (300, 935), (965, 935), (965, 545), (980, 545)], MOVE,
         ["ERS moves a rank between rollout and the trainer at the weight-sync boundary (SetRoles)"],
         (310, 953), both=True, dashed=True),
]

LEGEND = [
    (CONTROL, False, "control messages, through the store (comm/messages.py)"),
    (DATA, False, "tensors: process groups (gloo; NCCL on GPU) and shared memory"),
    (ENV, False, "env protocol: JSON over TCP, loopback by default"),
    (MOVE, True, "role change (ERS)"),
]

TITLE = "tide-megatron: the processes, threads and messages of one job (torchrun starts W ranks)"


# ---------------------------------------------------------------- what the test reads
def message_names() -> list[str]:
    """Every message class the picture names."""
    return sorted({name for lst in MESSAGE_LISTS for name, _ in lst.messages})


def named_paths() -> list[str]:
    """Every file or folder the picture names (relative to the repository or to tide_megatron/)."""
    texts = [f for box in PROCESSES + THREADS + [STORE] for _, f in box.lines]
    texts += [box.title for box in PROCESSES + THREADS] + [line for e in EDGES for line in e.label]
    texts += [text for *_, text in LEGEND]
    found = set()
    for text in texts:
        found |= set(re.findall(r"[\w./]+/[\w./]*|[\w]+\.py", text))
    return sorted(p for p in found if p.endswith((".py", "/")))


# ---------------------------------------------------------------- drawing
def _text(x: float, y: float, s: str, *, colour: str = "#000", weight: str = "normal", anchor: str = "start",
          size: int = SIZE) -> str:
    return (f'<text x="{x:g}" y="{y:g}" fill="{colour}" font-weight="{weight}" text-anchor="{anchor}" '
            f'font-size="{size}">{escape(s)}</text>')


def _fits(s: str, w: float) -> None:
    if len(s) * CHAR_W > w:
        raise ValueError(f"label does not fit its box ({len(s) * CHAR_W:.0f} > {w:.0f} px): {s!r}")


def _box(box: Box) -> list[str]:
    out = [f'<rect x="{box.x:g}" y="{box.y:g}" width="{box.w:g}" height="{box.height():g}" rx="6" '
           f'fill="{box.fill}" stroke="#444" stroke-width="{1.4 if box.fill == PROCESS else 1}"/>']
    _fits(box.title, box.w - 16)
    out.append(_text(box.x + 8, box.y + 16, box.title, weight="bold"))
    for i, (what, where) in enumerate(box.lines):
        y = box.y + 24 + 12 + LINE_H * i
        _fits(what + "  " + where, box.w - 16)
        out.append(_text(box.x + 8, y, what))
        if where:
            out.append(_text(box.x + box.w - 8, y, where, colour=FILE_GREY, anchor="end"))
    return out


def _message_list(lst: MessageList) -> list[str]:
    out = [f'<rect x="{lst.x:g}" y="{lst.y:g}" width="{lst.w:g}" height="{lst.height():g}" rx="6" '
           f'fill="#ffffff" stroke="{CONTROL}" stroke-width="1"/>']
    out.append(_text(lst.x + 8, lst.y + 16, lst.title, colour=CONTROL, weight="bold"))
    for i, (name, what) in enumerate(lst.messages):
        y = lst.y + 22 + 12 + LINE_H * i
        _fits(f"{name:<16}{what}", lst.w - 16)
        out.append(_text(lst.x + 8, y, name, colour=CONTROL))
        out.append(_text(lst.x + 8 + 16 * CHAR_W, y, what, colour="#333"))
    return out


def _edge(edge: Edge) -> list[str]:
    points = " ".join(f"{x:g},{y:g}" for x, y in edge.points)
    marker = f"arrow-{edge.colour[1:]}"
    attrs = f'marker-end="url(#{marker})"' + (f' marker-start="url(#{marker}-start)"' if edge.both else "")
    dash = ' stroke-dasharray="6 4"' if edge.dashed else ""
    out = [f'<polyline points="{points}" fill="none" stroke="{edge.colour}" stroke-width="1.8"{dash} {attrs}/>']
    for i, line in enumerate(edge.label):
        out.append(_text(edge.at[0], edge.at[1] + LINE_H * i, line, colour=edge.colour))
    return out


def _markers() -> list[str]:
    out = ["<defs>"]
    for colour in sorted({CONTROL, DATA, ENV, MOVE}):
        name = f"arrow-{colour[1:]}"
        out.append(f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                   f'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>')
        out.append(f'<marker id="{name}-start" viewBox="0 0 10 10" refX="1" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto"><path d="M10,0 L0,5 L10,10 z" fill="{colour}"/></marker>')
    out.append("</defs>")
    return out


def _legend() -> list[str]:
    out = []
    y = HEIGHT - 62
    for i, (colour, dashed, text) in enumerate(LEGEND):
        x = 20 + (i % 2) * 700
        yy = y + (i // 2) * 20
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        out.append(f'<line x1="{x:g}" y1="{yy - 4:g}" x2="{x + 36:g}" y2="{yy - 4:g}" stroke="{colour}" '
                   f'stroke-width="1.8"{dash}/>')
        out.append(_text(x + 44, yy, text, colour=colour))
    out.append(_text(20, HEIGHT - 14, "Paths are under tide_megatron/ unless they start with sglang_patches/. "
                     "Rank order: actors (rank 0 first), reference ranks, rollout ranks.", colour=FILE_GREY))
    return out


def render() -> str:
    body: list[str] = []
    body += _markers()
    body.append(f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>')
    body.append(_text(20, 34, TITLE, weight="bold", size=14))
    for box in PROCESSES:
        body += _box(box)
    for box in THREADS:
        body += _box(box)
    body += _box(STORE)
    for lst in MESSAGE_LISTS:
        body += _message_list(lst)
    for edge in EDGES:
        body += _edge(edge)
    body += _legend()
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="{FONT}">')
    comment = "<!-- Written by scripts/draw_architecture.py; edit the script, not this file. -->"
    return "\n".join([head, comment, *body, "</svg>"]) + "\n"


def main() -> int:
    return generated_file.main(OUT, render, "draw_architecture.py", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
