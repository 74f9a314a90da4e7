"""`torchrun launch/train.py +recipe=tiny_vl_cpu` end to end: a random tiny Qwen3-VL written at
start-up, screenshots of the GUI desktop through SGLang, the Megatron Qwen3-VL trainer, weights
(vision tower included) pushed back each step, checkpoint and resume. Two ranks: rank 0 trains
(and controls), rank 1 rolls out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tide_megatron.testing import checked_job, read_metrics

pytestmark = pytest.mark.integration

FAST = ["scheduler.groups_per_step=2", "scheduler.group_size=4", "rollout.runner.max_turns=3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return checked_job(tmp_path_factory.mktemp("tiny_vl") / "run", *FAST, recipe="tiny_vl_cpu", steps=2, timeout=900)


def test_the_run_writes_a_vision_language_checkpoint(trained):
    with open(trained / "initial_model" / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3_vl"
    assert (trained / "initial_model" / "preprocessor_config.json").exists()


def test_steps_train_on_screenshots_and_count_their_tokens(trained):
    rows = read_metrics(trained)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["consumed_tokens"] > 0 and r["ledger/failed"] == 0
        # A 224x160 screenshot is 12 image tokens at the recipe's max_pixels; every turn shows one.
        assert r["image_tokens"] >= 12 * 2 * 4
        assert r["image_tokens"] % 12 == 0
        assert r["ledger/generated"] >= r["ledger/consumed"] > 0
        assert r["staleness/max"] == 0
    assert rows[1]["version"] == 2


def test_resume_continues_from_the_checkpoint(trained):
    assert (trained / "checkpoints" / "latest").read_text().strip() == "step_000002"
    checked_job(trained, "run.resume=true", *FAST, recipe="tiny_vl_cpu", steps=3, timeout=900)
    assert [r["step"] for r in read_metrics(trained)] == [1, 2, 3]
