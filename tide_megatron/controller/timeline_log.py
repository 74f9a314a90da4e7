"""The real run's timeline (`utils/timeline.py`): `timeline.json` and `timeline.png` next to
`metrics.jsonl`, in the schema and plot the simulator writes too.

Fed by `StepLog` from what the controller already knows: the topology's ranks, each step's
RA2P mode, its TWT, RWT and staleness. Roles are static in this version apart from what RA2P's
mode means for the trainer side (decoupled: actor + dedicated reference; colocated: actor+ref,
the reference rank idle); a component that moves a rank (ERS, quarantine) records it with one
call, `set_role(rank, role)`, on the controller's thread (the timeline takes no lock). Each
step re-asserts the trainer-side roles of the ranks the topology lists as trainer or reference
ranks then, so a component that moves a rank also updates the topology's lists.

The files are rewritten every `metrics.timeline_every` steps, at every checkpoint and when the
run ends (cleanly or not), so a crashed run still leaves one. The periodic writes plot a copy on
a background thread (a plot costs about half a second of CPU, the first one more with
matplotlib's import: the step loop should not wait for it); the last write is synchronous.
Writing them never fails the run: an error is one warning, then the run goes on without them.

Resume follows `metrics.jsonl`: a run resumed at step s keeps the saved timeline up to step s's
end and appends; its time axis continues from the first run's start (Unix time), so the downtime
shows as a gap, marked by a "resumed" line. A run that starts afresh starts a new timeline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from tide_megatron.core.roles import RA2PMode, Role
from tide_megatron.utils.timeline import IDLE, Timeline, TimelineStep, plot_timeline

logger = logging.getLogger(__name__)

JSON_NAME = "timeline.json"
PNG_NAME = "timeline.png"


def trainer_side_roles(trainer_ranks: list[int], ref_ranks: list[int], mode: Optional[RA2PMode],
                       has_reference: bool) -> dict[int, str]:
    """The trainer side's roles in a step of `mode` (None: before the first step, when RA2P has
    not chosen yet: what the ranks hold, both models on the actor ranks). Without a reference
    model (`trainer.kl_coef=0`) the actor ranks hold the actor only."""
    decoupled = mode is RA2PMode.DECOUPLED
    actor = Role.ACTOR if decoupled or not has_reference else Role.ACTOR_REF
    roles = {r: actor.value for r in trainer_ranks}
    roles.update({r: (Role.REF.value if decoupled or mode is None else IDLE) for r in ref_ranks})
    return roles


class TimelineLog:
    def __init__(self, output_dir: str, label: str, *, enabled: bool = True, every: int = 10,
                 resume_step: Optional[int] = None, on_png: Optional[Callable[[str, Optional[int]], None]] = None):
        """`resume_step`: as `MetricsLogger`'s (None: a fresh run). `on_png(path, step)`: called
        (in the writer's thread) each time `timeline.png` is rewritten, with the timeline's last
        step (`MetricsLogger.image`: W&B and MLflow show it)."""
        self.enabled, self.every = enabled, every
        self.on_png = on_png
        self.json_path = os.path.join(output_dir, JSON_NAME)
        self.png_path = os.path.join(output_dir, PNG_NAME)
        self.resume_step = resume_step
        self.timeline = Timeline(source="run", label=label, origin_unix=time.time())
        self._resumed = False
        self._broken: set[str] = set()  # "json", "png": warned once, not tried again
        self._writer: Optional[threading.Thread] = None
        self.written_png = False
        if enabled and resume_step is not None and os.path.isfile(self.json_path):
            try:
                saved = Timeline.load(self.json_path)
            except (OSError, ValueError) as exc:
                logger.warning("%s: not readable (%s); this run starts a new timeline", self.json_path, exc)
            else:
                saved.truncate_after(resume_step)
                saved.label = label
                if saved.steps:  # else (a restart before the first checkpoint): a new timeline
                    self.timeline, self._resumed = saved, True

    def now(self) -> float:
        """Seconds on the timeline's axis (wall clock: a resumed process continues the axis)."""
        return time.time() - self.timeline.origin_unix

    # -- recording ----------------------------------------------------------------------------
    def start_run(self, roles: dict[int, str]) -> None:
        """The first dispatch: a fresh timeline's zero; every rank's role from here."""
        if not self.enabled:
            return
        if self._resumed:
            self.timeline.note(self.now(), f"resumed from step {self.resume_step}")
        else:
            self.timeline.origin_unix = time.time()
        t = self.now()
        for rank, role in sorted(roles.items()):
            self.timeline.set_role(rank, role, t)

    def set_role(self, rank: int, role: str, t: Optional[float] = None) -> None:
        """`rank` holds `role` from `t` (default: now) on. The one call a role change needs."""
        if self.enabled:
            self.timeline.set_role(rank, role, self.now() if t is None else t)

    def step(self, record: TimelineStep, roles: dict[int, str], checkpointed: bool) -> None:
        """A finished step (times already on this axis, see `now`); `roles` held from its start."""
        if not self.enabled:
            return
        for rank, role in sorted(roles.items()):
            self.timeline.set_role(rank, role, record.start)
        self.timeline.add_step(record)
        if checkpointed or (self.every and record.step % self.every == 0):
            self.write(closing=False)

    # -- files ----------------------------------------------------------------------------------
    def write(self, closing: bool) -> None:
        """Rewrite both files. `closing`: the run ends here; open role spans end now, and this
        returns once the files are written. Otherwise a copy is written in the background
        (skipped while the previous one still is: the next write catches up). Never raises."""
        if not self.enabled:
            return
        if closing:
            if self._writer is not None:
                self._writer.join()
            self.timeline.close(self.now())
            self._write_files(self.timeline)
        elif self._writer is None or not self._writer.is_alive():
            snapshot = Timeline.from_json(self.timeline.to_json())
            self._writer = threading.Thread(target=self._write_files, args=(snapshot,), name="timeline-writer",
                                            daemon=True)
            self._writer.start()

    def _write_files(self, timeline: Timeline) -> None:
        self._attempt("json", lambda: timeline.save(self.json_path))
        self._attempt("png", lambda: self._plot(timeline))

    def _plot(self, timeline: Timeline) -> None:
        tmp = f"{self.png_path}.tmp.png"  # whole or not at all, as the JSON: the process may die mid-plot
        plot_timeline(timeline, tmp)
        os.replace(tmp, self.png_path)
        self.written_png = True
        if self.on_png is not None:
            try:  # a viewer's copy: its failure is not the PNG's
                self.on_png(self.png_path, timeline.steps[-1].step if timeline.steps else None)
            except Exception:
                logger.exception("timeline.png hook failed")

    def _attempt(self, what: str, write) -> None:
        if what in self._broken:
            return
        try:
            write()
        except Exception as exc:  # a report: it must never end a training run
            self._broken.add(what)
            logger.warning("timeline.%s not written (%s: %s); training goes on without it",
                           what, type(exc).__name__, exc)
