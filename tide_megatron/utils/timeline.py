"""A run's timeline: what every rank did over time, and what each training step looked like.

One schema for the real run (`controller/timeline_log.py` writes `timeline.json` next to
`metrics.jsonl`) and the simulator (`RunMetrics.timeline`), so one plot
(`plot_timeline`, below) shows either, and a simulated run can be laid next to a real one.

- `steps`: one `TimelineStep` per training step: its wall interval, the trainer's waiting time
  (TWT) and the rollout ranks' mean waiting time (RWT) in it, the RA2P mode it ran in, the
  staleness of the trajectories it consumed, and how many ranks held each role.
- `ranks`: rank -> `RoleSpan`s, contiguous while the rank keeps a role. A role change is one
  call, `set_role(rank, role, t)`, whoever decides it (a static topology at start-up, RA2P's
  mode choice each step, ERS moving a rank between rollout and training, quarantine).
- `events`: a few labelled instants worth a line on the plot (a resume).

Times are seconds from `origin_unix` (the real run's first dispatch, as Unix time so that a
resumed process continues the same axis and the downtime shows as a gap; the simulator's zero).
Pure Python, no torch: the simulator and the tests read it without the ML stack; matplotlib is
imported by `plot_timeline` only.

The plot: three panels over one time axis, so what the scheduler did reads at a glance:
  1. the role of every rank over time (one bar per rank, coloured by role);
  2. the trainer's (TWT) and the rollout ranks' (RWT) waiting time of every step;
  3. the RA2P mode of every step (a band per mode) and the staleness of what it consumed.
It uses matplotlib's object API on a bare `Figure` (no pyplot): no global figure state and no
backend switch in the caller's process, so the trainer can call it between steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from tide_megatron.core.roles import Role
from tide_megatron.utils.atomic import write_atomic

FORMAT = 1
IDLE = "idle"
"""A rank that holds no work (a dedicated reference rank during a colocated step)."""
QUARANTINED = "quarantined"
"""A rank taken out of service (a dead engine being replaced, a rank fenced off)."""
ROLES = tuple(r.value for r in Role) + (IDLE, QUARANTINED)
"""Every role a span may have: `Role`'s values (rollout, actor, ref, actor_ref), idle, quarantined."""


@dataclass
class TimelineStep:
    """One training step."""

    step: int
    start: float
    end: float
    twt_s: float = 0.0
    """Trainer waiting time in the step (data, evaluation, reference log-probs)."""
    rwt_s: float = 0.0
    """Rollout waiting time: mean idle seconds per rollout rank in the step."""
    ra2p_mode: str = ""
    """`decoupled` or `colocated` (RA2PMode's value)."""
    staleness_mean: float = 0.0
    """Mean policy-version lag of the trajectories the step consumed."""
    staleness_max: int = 0
    rollout_ranks: int = 0
    trainer_ranks: int = 0
    """Ranks that train the actor (actor or actor_ref)."""
    ref_ranks: int = 0
    """Dedicated reference ranks in use (decoupled RA2P)."""


@dataclass
class RoleSpan:
    start: float
    end: Optional[float]
    """None while the rank still holds the role."""
    role: str


@dataclass
class TimelineEvent:
    t: float
    text: str


@dataclass
class Timeline:
    source: str = ""
    """`run` (the real system) or `sim`."""
    label: str = ""
    """The scheduling mode (the simulator's run label)."""
    origin_unix: float = 0.0
    steps: list[TimelineStep] = field(default_factory=list)
    ranks: dict[int, list[RoleSpan]] = field(default_factory=dict)
    events: list[TimelineEvent] = field(default_factory=list)

    # -- recording -----------------------------------------------------------------------------
    def set_role(self, rank: int, role: str, t: float) -> bool:
        """`rank` holds `role` from `t` on; returns whether that is a change. A time before the
        open span's start (a step booked after the fact) is moved up to it, so spans never
        overlap."""
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {ROLES}")
        spans = self.ranks.setdefault(rank, [])
        if spans and spans[-1].end is None:
            if spans[-1].role == role:
                return False
            t = max(t, spans[-1].start)
            if spans[-1].start == t:  # two changes at one instant: the first never held
                spans.pop()
                if spans and spans[-1].end == t and spans[-1].role == role:
                    spans[-1].end = None
                    return True
            else:
                spans[-1].end = t
        spans.append(RoleSpan(t, None, role))
        return True

    def role_at(self, rank: int, t: float) -> Optional[str]:
        for span in reversed(self.ranks.get(rank, [])):
            if span.start <= t and (span.end is None or t < span.end):
                return span.role
        return None

    def add_step(self, step: TimelineStep) -> None:
        self.steps.append(step)

    def note(self, t: float, text: str) -> None:
        self.events.append(TimelineEvent(t, text))

    def close(self, t: float) -> None:
        """End every open span at `t` (the run ended, or stopped recording)."""
        for spans in self.ranks.values():
            if spans and spans[-1].end is None:
                spans[-1].end = max(t, spans[-1].start)

    def end_time(self) -> float:
        """The latest time anything was recorded at."""
        times = [s.end for s in self.steps] + [e.t for e in self.events]
        times += [s.end if s.end is not None else s.start for spans in self.ranks.values() for s in spans]
        return max(times, default=0.0)

    # -- resume --------------------------------------------------------------------------------
    def truncate_after(self, step: int) -> None:
        """Keep what a run resumed at `step` will not record again, as `metrics.jsonl` does:
        steps up to `step`, and the role spans and events up to that step's end (what ran after
        the checkpoint is redone by the resumed run). Open spans end there: the process died."""
        self.steps = [s for s in self.steps if s.step <= step]
        cut = max((s.end for s in self.steps), default=0.0)
        for rank in list(self.ranks):
            kept = [s for s in self.ranks[rank] if s.start < cut]
            for s in kept:
                s.end = cut if s.end is None else min(s.end, cut)
            if kept:
                self.ranks[rank] = kept
            else:
                del self.ranks[rank]
        self.events = [e for e in self.events if e.t <= cut]

    # -- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "source": self.source, "label": self.label, "origin_unix": self.origin_unix,
                "steps": [asdict(s) for s in self.steps],
                "ranks": {str(r): [asdict(s) for s in spans] for r, spans in sorted(self.ranks.items())},
                "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Timeline":
        """Parse a saved timeline; ValueError naming the first bad field."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT}")
        known = {f.name for f in fields(TimelineStep)}
        try:
            steps = [TimelineStep(**{k: v for k, v in s.items() if k in known}) for s in data.get("steps", [])]
            ranks = {int(r): [RoleSpan(s["start"], s["end"], s["role"]) for s in spans]
                     for r, spans in data.get("ranks", {}).items()}
            events = [TimelineEvent(e["t"], e["text"]) for e in data.get("events", [])]
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise ValueError(f"steps/ranks/events: {exc!r}") from None
        for rank, spans in ranks.items():
            for s in spans:
                if s.role not in ROLES:
                    raise ValueError(f"ranks.{rank}: unknown role {s.role!r}")
        return cls(source=str(data.get("source", "")), label=str(data.get("label", "")),
                   origin_unix=float(data.get("origin_unix", 0.0)), steps=steps, ranks=ranks, events=events)

    def save(self, path: str) -> None:
        """Atomically: a crash mid-write leaves the previous timeline readable."""
        write_atomic(path, json.dumps(self.to_json(), indent=None, separators=(",", ":")).encode())

    @classmethod
    def load(cls, path: str) -> "Timeline":
        with open(path) as f:
            return cls.from_json(json.load(f))


# -- the plot ------------------------------------------------------------------------------------
ROLE_COLOURS = {
    "rollout": "tab:blue",
    "actor": "tab:red",
    "ref": "tab:green",
    "actor_ref": "tab:purple",
    IDLE: "lightgrey",
    QUARANTINED: "black",
}
ROLE_LABELS = {"rollout": "rollout", "actor": "actor", "ref": "reference", "actor_ref": "actor+ref",
               IDLE: "idle", QUARANTINED: "quarantined"}
MODE_COLOURS = {"decoupled": "tab:green", "colocated": "tab:purple"}
MAX_RANK_LABELS = 32
"""Above this many ranks the y axis labels every few ranks only (the sim's 64-rank clusters)."""


def plot_timeline(timeline: Timeline, path, title: str = "", time_label: Optional[str] = None) -> None:
    """Write the timeline PNG to `path`."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    end = timeline.end_time()
    n_ranks = len(timeline.ranks)
    fig = Figure(figsize=(10, 3.0 + min(n_ranks, 32) * 0.12 + 3.6), dpi=90)
    grid = fig.add_gridspec(3, 1, height_ratios=[max(1.5, min(n_ranks, 32) * 0.25), 1.2, 1.2])
    ax_roles = fig.add_subplot(grid[0])
    ax_wait = fig.add_subplot(grid[1], sharex=ax_roles)
    ax_mode = fig.add_subplot(grid[2], sharex=ax_roles)

    # 1. roles: one broken_barh per (rank, role), open spans drawn to the end of the record
    used = []
    for row, rank in enumerate(sorted(timeline.ranks)):
        by_role: dict[str, list[tuple[float, float]]] = {}
        for span in timeline.ranks[rank]:
            stop = span.end if span.end is not None else end
            by_role.setdefault(span.role, []).append((span.start, max(stop - span.start, 0.0)))
        for role, bars in by_role.items():
            ax_roles.broken_barh(bars, (row - 0.4, 0.8), facecolors=ROLE_COLOURS.get(role, "white"),
                                 edgecolor="none")
            if role not in used:
                used.append(role)
    ranks = sorted(timeline.ranks)
    every = max(1, -(-len(ranks) // MAX_RANK_LABELS))
    ax_roles.set_yticks(range(0, len(ranks), every))
    ax_roles.set_yticklabels([str(ranks[i]) for i in range(0, len(ranks), every)], fontsize=7)
    ax_roles.set_ylim(-0.6, max(len(ranks), 1) - 0.4)
    ax_roles.invert_yaxis()
    ax_roles.set_ylabel("rank")
    if used:
        order = [r for r in ROLE_COLOURS if r in used]
        ax_roles.legend(handles=[Patch(color=ROLE_COLOURS[r], label=ROLE_LABELS[r]) for r in order],
                        fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for event in timeline.events:
        for ax in (ax_roles, ax_wait, ax_mode):
            ax.axvline(event.t, color="k", ls="--", lw=0.8)
        ax_roles.annotate(event.text, (event.t, 0), xytext=(3, 3), textcoords="offset points", fontsize=7,
                          xycoords=("data", "axes fraction"))
    if len(timeline.steps) <= 60:  # step boundaries help while they stay readable
        for s in timeline.steps:
            ax_roles.axvline(s.end, color="k", lw=0.3, alpha=0.4)

    # 2. waiting times, one point per step at its end
    steps = timeline.steps
    ends = _broken_at_events([s.end for s in steps], timeline.events)
    ax_wait.plot(ends, _values(steps, ends, "twt_s"), "o-", ms=3, lw=1, color="tab:red", label="TWT (trainer)")
    ax_wait.plot(ends, _values(steps, ends, "rwt_s"), "s-", ms=3, lw=1, color="tab:blue",
                 label="RWT (rollout, per rank)")
    ax_wait.set_ylabel("wait per step (s)", fontsize=8)
    ax_wait.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    # 3. RA2P mode as a band over each step's interval, staleness on the right axis
    modes = sorted({s.ra2p_mode or "?" for s in steps})
    for row, mode in enumerate(modes):
        bars = [(s.start, s.end - s.start) for s in steps if (s.ra2p_mode or "?") == mode]
        ax_mode.broken_barh(bars, (row - 0.35, 0.7), facecolors=MODE_COLOURS.get(mode, "grey"), alpha=0.6)
    ax_mode.set_yticks(range(len(modes)))
    ax_mode.set_yticklabels(modes, fontsize=7)
    ax_mode.set_ylim(-0.6, max(len(modes), 1) - 0.4)
    ax_mode.set_ylabel("RA2P mode", fontsize=8)
    ax_stale = ax_mode.twinx()
    ax_stale.plot(ends, _values(steps, ends, "staleness_mean"), "o-", ms=3, lw=1, color="k", label="staleness mean")
    ax_stale.plot(ends, _values(steps, ends, "staleness_max"), "v:", ms=3, lw=1, color="tab:orange",
                  label="staleness max")
    top = max([s.staleness_max for s in steps] + [1])
    ax_stale.set_ylim(-0.1, top + 0.5)
    ax_stale.set_ylabel("staleness (versions)", fontsize=8)
    ax_stale.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.09, 1.0))

    if time_label is None:
        time_label = "simulated time (s)" if timeline.source == "sim" else "wall time since the first dispatch (s)"
    ax_mode.set_xlabel(time_label)
    ax_roles.set_xlim(0.0, max(end, 1e-6) * 1.01)
    heading = title or f"{timeline.label or timeline.source}: {len(steps)} steps, {n_ranks} ranks"
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def _broken_at_events(ends: list[float], events: list[TimelineEvent]) -> list[float]:
    """Step end times with a NaN between two steps an event (a resume) separates: the per-step
    lines stop at the downtime instead of drawing across it."""
    out: list[float] = []
    for i, t in enumerate(ends):
        if i and any(ends[i - 1] < e.t <= t for e in events):
            out.append(float("nan"))
        out.append(t)
    return out


def _values(steps: list[TimelineStep], ends: list[float], name: str) -> list[float]:
    """`name` of every step, aligned with `_broken_at_events`'s output (NaN at the breaks)."""
    values = iter(getattr(s, name) for s in steps)
    return [float("nan") if t != t else next(values) for t in ends]
