"""The run timeline: its schema (role spans, JSON, resume), the real run's recorder, and the plot."""

from __future__ import annotations

import json
import logging

import pytest

from tide_megatron.controller.timeline_log import TimelineLog, trainer_side_roles
from tide_megatron.core.roles import RA2PMode
from tide_megatron.utils.timeline import Timeline, TimelineEvent, TimelineStep, _broken_at_events, plot_timeline


def synthetic(steps: int = 6) -> Timeline:
    """Rank 0 trains, rank 1 is the reference (idle in colocated steps), ranks 2-3 roll out;
    rank 3 moves to the trainer after step 3 (an elastic role change)."""
    tl = Timeline(source="run", label="tide")
    for rank, role in {0: "actor_ref", 1: "ref", 2: "rollout", 3: "rollout"}.items():
        tl.set_role(rank, role, 0.0)
    for i in range(1, steps + 1):
        start, mode = 10.0 * (i - 1), "decoupled" if i % 2 else "colocated"
        tl.set_role(0, "actor" if mode == "decoupled" else "actor_ref", start)
        tl.set_role(1, "ref" if mode == "decoupled" else "idle", start)
        if i == 4:
            tl.set_role(3, "actor_ref", start)
        tl.add_step(TimelineStep(i, start, start + 10.0, twt_s=1.0 + i % 3, rwt_s=0.5, ra2p_mode=mode,
                                 staleness_mean=0.5, staleness_max=1, rollout_ranks=2, trainer_ranks=1,
                                 ref_ranks=int(mode == "decoupled")))
    return tl


def test_set_role_opens_a_span_only_on_a_change_and_spans_never_overlap():
    tl = Timeline()
    assert tl.set_role(0, "rollout", 0.0)
    assert not tl.set_role(0, "rollout", 5.0)  # unchanged: the span goes on
    assert tl.set_role(0, "actor", 10.0)
    assert tl.set_role(0, "ref", 4.0)  # booked late: moved up to the open span's start, replacing it
    assert [(s.start, s.end, s.role) for s in tl.ranks[0]] == [(0.0, 10.0, "rollout"), (10.0, None, "ref")]
    assert tl.set_role(0, "rollout", 10.0)  # back at the same instant: the first span just goes on
    assert [(s.start, s.end, s.role) for s in tl.ranks[0]] == [(0.0, None, "rollout")]
    with pytest.raises(ValueError):
        tl.set_role(0, "trainer", 11.0)


def test_role_at_and_close():
    tl = synthetic()
    assert tl.role_at(3, 25.0) == "rollout" and tl.role_at(3, 35.0) == "actor_ref"
    assert tl.role_at(1, 15.0) == "idle" and tl.role_at(1, 25.0) == "ref"
    tl.close(60.0)
    assert all(spans[-1].end == 60.0 for spans in tl.ranks.values())
    assert tl.end_time() == 60.0


def test_json_round_trip(tmp_path):
    tl = synthetic()
    tl.note(12.0, "resumed from step 1")
    path = str(tmp_path / "timeline.json")
    tl.save(path)
    data = json.loads(open(path).read())
    assert data["format"] == 1 and set(data["ranks"]) == {"0", "1", "2", "3"}
    back = Timeline.load(path)
    assert back == tl
    with pytest.raises(ValueError, match="role"):
        Timeline.from_json({**data, "ranks": {"0": [{"start": 0, "end": None, "role": "chef"}]}})
    with pytest.raises(ValueError, match="format"):
        Timeline.from_json({**data, "format": 99})


def test_truncate_after_keeps_what_a_resumed_run_will_not_redo():
    tl = synthetic()
    tl.truncate_after(3)
    assert [s.step for s in tl.steps] == [1, 2, 3]
    assert all(s.end is not None and s.end <= 30.0 for spans in tl.ranks.values() for s in spans)
    assert tl.role_at(3, 29.0) == "rollout" and tl.role_at(3, 35.0) is None
    tl.truncate_after(0)
    assert tl.steps == [] and tl.ranks == {}


def test_plot_writes_a_png_with_a_role_change(tmp_path):
    tl = synthetic()
    tl.note(20.0, "resumed from step 2")
    tl.close(60.0)
    path = tmp_path / "timeline.png"
    plot_timeline(tl, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    plot_timeline(Timeline(source="run"), tmp_path / "empty.png")  # a run that died before its first step
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_per_step_lines_break_at_a_resume():
    ends = _broken_at_events([1.0, 2.0, 9.0], [TimelineEvent(8.0, "resumed from step 2")])
    assert ends[:2] == [1.0, 2.0] and ends[2] != ends[2] and ends[3] == 9.0


def test_trainer_side_roles_follow_the_ra2p_mode():
    assert trainer_side_roles([0], [1], RA2PMode.DECOUPLED, True) == {0: "actor", 1: "ref"}
    assert trainer_side_roles([0], [1], RA2PMode.COLOCATED, True) == {0: "actor_ref", 1: "idle"}
    assert trainer_side_roles([0, 1], [], RA2PMode.COLOCATED, False) == {0: "actor", 1: "actor"}
    assert trainer_side_roles([0], [1], None, True) == {0: "actor_ref", 1: "ref"}


def record_steps(log: TimelineLog, first: int, last: int, checkpoint_every: int = 0) -> None:
    for step in range(first, last + 1):
        end = log.now()
        log.step(TimelineStep(step, end - 0.01, end, ra2p_mode="colocated", staleness_max=1),
                 {0: "actor_ref"}, checkpointed=bool(checkpoint_every) and step % checkpoint_every == 0)
        if log._writer is not None:  # periodic writes run in the background: one at a time here
            log._writer.join()


def test_recorder_writes_periodically_and_a_resumed_run_appends(tmp_path):
    first = TimelineLog(str(tmp_path), "tide", every=0)
    first.start_run({0: "actor_ref", 1: "rollout"})
    record_steps(first, 1, 5, checkpoint_every=3)  # written at the checkpoint of step 3 only
    assert [s.step for s in Timeline.load(first.json_path).steps] == [1, 2, 3]
    assert (tmp_path / "timeline.png").stat().st_size > 0
    # the process dies after step 5; the job restarts from step 3's checkpoint
    resumed = TimelineLog(str(tmp_path), "tide", every=2, resume_step=3)
    assert resumed.timeline.origin_unix == first.timeline.origin_unix  # one time axis across processes
    resumed.start_run({0: "actor_ref", 1: "rollout"})
    record_steps(resumed, 4, 6)
    resumed.write(closing=True)
    tl = Timeline.load(resumed.json_path)
    assert [s.step for s in tl.steps] == [1, 2, 3, 4, 5, 6]
    assert [e.text for e in tl.events] == ["resumed from step 3"]
    assert [s.role for s in tl.ranks[1]] == ["rollout", "rollout"]  # a gap for the downtime
    assert all(s.end is not None for spans in tl.ranks.values() for s in spans)
    # run.resume=false in the same directory: a new timeline, not one mixing two runs
    fresh = TimelineLog(str(tmp_path), "sync")
    assert fresh.timeline.steps == [] and fresh.timeline.label == "sync"
    # run.resume=auto restarting before the first checkpoint: nothing kept, a new time axis too
    restarted = TimelineLog(str(tmp_path), "tide", resume_step=0)
    assert restarted.timeline.steps == [] and restarted.timeline.origin_unix > first.timeline.origin_unix
    restarted.start_run({0: "actor_ref"})
    assert restarted.timeline.events == []


def test_a_broken_timeline_never_fails_the_run(tmp_path, monkeypatch, caplog):
    (tmp_path / "timeline.json").write_text("{not json")
    log = TimelineLog(str(tmp_path), "tide", resume_step=2)  # unreadable: a new one, with a warning
    assert log.timeline.steps == []

    def fail(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr("tide_megatron.controller.timeline_log.plot_timeline", fail)
    with caplog.at_level(logging.WARNING):
        log.start_run({0: "actor_ref"})
        record_steps(log, 1, 2, checkpoint_every=1)
        log.write(closing=True)
    warnings = [r for r in caplog.records if "timeline.png not written" in r.getMessage()]
    assert len(warnings) == 1  # once, then the run goes on without the plot
    assert [s.step for s in Timeline.load(log.json_path).steps] == [1, 2]  # the JSON still is written


def test_disabled_recorder_writes_nothing(tmp_path):
    log = TimelineLog(str(tmp_path), "tide", enabled=False)
    log.start_run({0: "actor_ref"})
    record_steps(log, 1, 2, checkpoint_every=1)
    log.write(closing=True)
    assert not (tmp_path / "timeline.json").exists()
