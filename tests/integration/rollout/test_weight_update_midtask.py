"""A task keeps running across a weight update: its next turn is prefilled under the new weights
(no stale KV is reused), each segment records the version that produced it, and training uses the
behaviour log-probs of each token. See weight_update_worker.py."""

from __future__ import annotations

import math
import os

import pytest

from tide_megatron.testing import report_fixture

pytestmark = pytest.mark.integration

WORKER = os.path.join(os.path.dirname(__file__), "weight_update_worker.py")
ATOL = 1e-4  # fp32: SGLang torch_native attention vs Megatron local attention


report = report_fixture(WORKER, timeout=900, report_file="report.json")


def test_the_update_drops_every_session_of_the_old_weights(report):
    assert report["sessions_open_before_update"] > 0
    assert report["sessions_open_after_update"] == 0


def test_segments_carry_the_version_that_produced_them(report):
    spanning = [t for t in report["trajectories"] if t["versions"] == [0, 1]]
    assert spanning, "no trajectory ran across the update"
    for t in spanning:
        assert t["policy_version"] == 0  # staleness is judged on the oldest segment
        assert t["segments"][0]["version"] == 0 and all(s["version"] == 1 for s in t["segments"][1:])
        assert sum(s["tokens"] for s in t["segments"]) == t["generated_tokens"]


def test_each_segment_was_generated_by_its_own_weights_with_a_fresh_prefill(report):
    for t in report["trajectories"]:
        for s in t["segments"]:
            # Equal to the trainer under the segment's own version: after the update the whole
            # context was prefilled again (KV of the old weights would break this equality) ...
            assert s["diff_own_version"] < ATOL, s
            # ... and measurably different under the other version (the update changed the policy).
            if s["tokens"] >= 2:
                assert s["diff_other_version"] > 10 * ATOL, s


def test_training_on_mixed_version_trajectories_runs(report):
    assert math.isfinite(report["train_loss"])
