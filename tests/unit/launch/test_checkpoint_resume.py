"""Checkpoint manifests, the fallback past corrupt checkpoints, and how a run chooses where to
resume (`run.resume=auto|true|false`, `run.resume_from`), on fake checkpoint directories: the
files are opaque bytes here, what matters is what the manifest says about them."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tide_megatron.config import JobConfig, RunConfig, validate
from tide_megatron.controller.run_state import RunState
from tide_megatron.job import resolve_resume
from tide_megatron.trainer import checkpoint as ckpt


def run_state(step: int) -> dict:
    return RunState(step=step, version=step,
                    sampler={"rng": [3, list(random.Random(step).getstate()[1]), None], "groups_started": 2 * step,
                             "num_tasks": 8},
                    counters={"groups_started": 2 * step},
                    ledger={"in_flight": 0, "ready": 0, "consumed": 10 * step, "dropped_stale": 0, "cancelled": 0,
                            "failed": 0, "lost": 0, "evaluated": 0, "generated": 10 * step}).to_json()


def fake_checkpoint(root: Path, step: int, *, state: dict | None = None, latest: bool = True) -> Path:
    """A step directory shaped like dist_checkpointing's, saved the way save_checkpoint saves."""
    path = root / ckpt.step_dir_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"pickled metadata %d" % step)
    (path / "__0_0.distcp").write_bytes(os.urandom(4096))
    (path / "common.pt").write_bytes(b"common")
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (path / ckpt.RUN_STATE).write_text(json.dumps(state if state is not None else run_state(step)))
    ckpt.write_manifest(path, step)
    if latest:
        (root / ckpt.LATEST_MARKER).write_text(path.name + "\n")
    return path


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


# -- manifest -------------------------------------------------------------------------------
def test_manifest_lists_every_file_and_verifies(tmp_path):
    path = fake_checkpoint(tmp_path, 4)
    manifest = ckpt.verify_checkpoint(path)
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "common.pt", "metadata.json", ckpt.RUN_STATE}
    assert manifest["step"] == 4 and manifest["files"]["__0_0.distcp"]["bytes"] == 4096


@pytest.mark.parametrize("damage,reason", [
    (lambda p: truncate(p / "__0_0.distcp", 100), "file __0_0.distcp is truncated (100 of 4096 bytes)"),
    (lambda p: (p / "__0_0.distcp").unlink(), "file __0_0.distcp is missing"),
    (lambda p: (p / ".metadata").write_bytes(b"pickled metadata 9"), "file .metadata does not match its sha256"),
    (lambda p: (p / "common.pt").write_bytes(b"common and more"), "file common.pt has 15 bytes, manifest.json says 6"),
    (lambda p: (p / ckpt.MANIFEST).write_text("{not json"), "manifest.json is unreadable"),
    (lambda p: (p / ckpt.MANIFEST).write_text('{"format": 7}'), "manifest.json has an unknown format"),
])
def test_damaged_checkpoints_are_named_with_the_file(tmp_path, damage, reason):
    path = fake_checkpoint(tmp_path, 4)
    damage(path)
    with pytest.raises(ckpt.CheckpointCorrupt) as info:
        ckpt.verify_checkpoint(path)
    assert str(info.value).startswith(f"checkpoint {path} is corrupt: ") and reason in str(info.value)


def test_shallow_check_hashes_the_pickled_metadata_and_small_files_only(tmp_path, monkeypatch):
    path = fake_checkpoint(tmp_path, 4)
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[0] ^= 0xFF  # same size, other bytes
    (path / "__0_0.distcp").write_bytes(bytes(data))
    monkeypatch.setattr(ckpt, "SHALLOW_HASH_LIMIT", 1024)  # the shard counts as large
    ckpt.verify_checkpoint(path, deep=False)  # sizes match: a loading rank's check passes
    with pytest.raises(ckpt.CheckpointCorrupt, match="__0_0.distcp does not match its sha256"):
        ckpt.verify_checkpoint(path, deep=True)  # the rank that chooses the checkpoint sees it
    (path / ".metadata").write_bytes(b"pickled metadata X")
    with pytest.raises(ckpt.CheckpointCorrupt, match=".metadata does not match"):
        ckpt.verify_checkpoint(path, deep=False)


def test_a_step_directory_without_manifest_is_an_interrupted_save(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    (path / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointCorrupt, match="is incomplete: no manifest.json") as info:
        ckpt.verify_checkpoint(path)
    assert info.value.incomplete


# -- find_resumable: none / latest good / latest corrupt ------------------------------------
def test_nothing_saved_yet_is_none(tmp_path):
    assert ckpt.find_resumable(tmp_path / "checkpoints") is None
    (tmp_path / "checkpoints").mkdir()
    assert ckpt.find_resumable(tmp_path / "checkpoints") is None


def test_latest_good_checkpoint_is_chosen_with_its_run_state(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    point = ckpt.find_resumable(tmp_path, RunState.from_json)
    assert (point.path, point.step, point.notes) == (str(tmp_path / "step_000004"), 4, [])
    assert RunState.from_json(point.run_state).sampler["groups_started"] == 8


def test_corrupt_latest_falls_back_to_the_previous_one_with_one_line(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    truncate(newest / "__0_0.distcp", 1000)
    point = ckpt.find_resumable(tmp_path, RunState.from_json)
    assert point.step == 2
    assert point.notes == [f"checkpoint {newest} is corrupt: file __0_0.distcp is truncated (1000 of 4096 bytes); "
                           "falling back to step_000002"]


def test_bad_run_state_falls_back(tmp_path):
    fake_checkpoint(tmp_path, 2)
    bad = run_state(4)
    bad["ledger"]["consumed"] += 1  # no longer adds up
    newest = fake_checkpoint(tmp_path, 4, state=bad)
    point = ckpt.find_resumable(tmp_path, RunState.from_json)
    assert point.step == 2
    assert f"checkpoint {newest} is corrupt: run_state.json is not a valid run state (ledger: buckets do not add up" \
        in point.notes[0]


def test_interrupted_save_after_latest_is_not_considered(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newer = fake_checkpoint(tmp_path, 4, latest=False)  # `latest` never moved: a crash in the save
    assert ckpt.find_resumable(tmp_path).step == 2
    (newer / ckpt.MANIFEST).unlink()
    assert ckpt.find_resumable(tmp_path).step == 2


def test_only_an_interrupted_first_save_means_start_fresh(tmp_path):
    path = fake_checkpoint(tmp_path, 2, latest=False)
    (path / ckpt.MANIFEST).unlink()
    assert ckpt.find_resumable(tmp_path) is None


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    for step in (2, 4):
        truncate(fake_checkpoint(tmp_path, step) / "__0_0.distcp", 10)
    with pytest.raises(ckpt.CheckpointError, match=r"no usable checkpoint under .*step_000004 corrupt \(file "
                                                   r"__0_0.distcp is truncated.*step_000002 corrupt"):
        ckpt.find_resumable(tmp_path)


def test_latest_naming_a_missing_directory_scans_them_all(tmp_path):
    fake_checkpoint(tmp_path, 2)
    (tmp_path / ckpt.LATEST_MARKER).write_text("step_000009\n")
    point = ckpt.find_resumable(tmp_path)
    assert point.step == 2 and any("names 'step_000009'" in n for n in point.notes)


# -- resolve_resume: the config keys ----------------------------------------------------------
def test_auto_without_checkpoint_starts_fresh(tmp_path):
    assert resolve_resume(RunConfig(resume="auto"), str(tmp_path / "checkpoints")) is None


def test_auto_and_true_take_the_latest_good(tmp_path):
    fake_checkpoint(tmp_path, 2)
    for mode in ("auto", "True", "true"):
        assert resolve_resume(RunConfig(resume=mode), str(tmp_path)).step == 2


def test_true_without_checkpoint_says_so_and_points_at_auto(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run.resume=true: no checkpoint to resume under .*run.resume=auto"):
        resolve_resume(RunConfig(resume="true"), str(tmp_path / "checkpoints"))


def test_false_ignores_checkpoints(tmp_path):
    fake_checkpoint(tmp_path, 2)
    assert resolve_resume(RunConfig(resume="false"), str(tmp_path)) is None


def test_auto_prefers_its_own_progress_over_resume_from(tmp_path):
    other = fake_checkpoint(tmp_path / "other", 7)
    own = tmp_path / "own"
    own.mkdir()
    run = RunConfig(resume="auto", resume_from=str(other))
    assert resolve_resume(run, str(own)).step == 7  # nothing of its own yet: resume_from
    fake_checkpoint(own, 9)
    assert resolve_resume(run, str(own)).step == 9  # restarted: its own newest


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing", "run.resume_from='{p}' does not exist"),
    (lambda p: (p / "file.txt").write_text("x") and p / "file.txt",
     "run.resume_from='{p}' is a file, expected a checkpoint directory"),
    (lambda p: fake_checkpoint(p, 3).parent, "run.resume_from='{p}' holds checkpoints, expected one of them"),
])
def test_resume_from_bad_paths_are_one_line(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises((FileNotFoundError, ValueError)) as info:
        resolve_resume(RunConfig(resume_from=str(path)), str(tmp_path / "checkpoints"))
    assert message.format(p=path) in str(info.value)


def test_resume_from_a_corrupt_checkpoint_is_refused_without_fallback(tmp_path):
    fake_checkpoint(tmp_path, 2)
    path = fake_checkpoint(tmp_path, 4)
    truncate(path / "__0_0.distcp", 5)
    with pytest.raises(ckpt.CheckpointError, match=rf"run.resume_from='{path}': checkpoint {path} is corrupt: "
                                                   r"file __0_0.distcp is truncated \(5 of 4096 bytes\)"):
        resolve_resume(RunConfig(resume_from=str(path)), str(tmp_path))


def test_unknown_resume_mode_names_the_key():
    cfg = JobConfig()
    cfg.run.resume = "maybe"
    with pytest.raises(ValueError, match=r"run.resume='maybe': expected one of \('auto', 'true', 'false'\)"):
        validate(cfg, 2)
