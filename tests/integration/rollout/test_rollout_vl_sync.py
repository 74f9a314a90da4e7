"""The vision-language rollout on the real stack: SGLang (CPU) with images, the Megatron Qwen3-VL
trainer, and a weight push by HF names. See rollout_vl_worker.py: one subprocess runs everything
and reports; the tests read the report."""

from __future__ import annotations

import os

import pytest

from tide_megatron.testing import report_fixture

pytestmark = pytest.mark.integration

WORKER = os.path.join(os.path.dirname(__file__), "rollout_vl_worker.py")
LOGPROB_ATOL = 1e-4  # fp32; SGLang torch_native attention + sdpa vision vs Megatron local attention


report = report_fixture(WORKER, timeout=1200)


def test_trajectories_keep_expanded_image_pads_and_their_images(report):
    trajs = report["trajectories"]
    assert len(trajs) == 8
    for t in trajs:
        n = len(t["token_ids"])
        assert len(t["loss_mask"]) == n and len(t["logprobs"]) == n
        assert t["images"] and len(t["images"]) == len(t["image_grid_thw"])
        pads = t["token_ids"].count(report["image_token_id"])
        generated_pads = sum(1 for tok, m in zip(t["token_ids"], t["loss_mask"]) if m and tok == report["image_token_id"])
        assert t["image_tokens"] == pads - generated_pads > 0
        assert all(lp == 0.0 for lp, m in zip(t["logprobs"], t["loss_mask"]) if not m)
    assert any(len(t["images"]) >= 3 for t in trajs), "no trajectory reached the two-image turn"


def test_sessions_keep_the_prefix_with_its_image_tokens_cached(report):
    multi = [t for t in report["trajectories"] if t["turns"] > 1]
    assert multi, "no multi-turn trajectory to check"
    assert sum(t["cached_tokens"] for t in multi) > 0.4 * sum(t["engine_prompt_tokens"] for t in multi)


def test_group_members_share_their_first_prompt_and_image(report):
    by_group: dict[str, list] = {}
    for t in report["trajectories"]:
        by_group.setdefault(t["group_id"], []).append(t)
    for members in by_group.values():
        assert len({tuple(m["token_ids"][: m["loss_mask"].index(1)]) for m in members}) == 1
        assert len({m["images"][0] for m in members}) == 1


def test_engine_logprobs_equal_the_trainers_before_the_weight_sync(report):
    assert report["pre_sync_tokens"] > 0
    assert report["pre_sync_max_abs_diff"] < LOGPROB_ATOL


def test_engine_logprobs_equal_the_trainers_after_the_weight_sync(report):
    assert report["vision_weight_change"] > 1e-3  # the push really changes the vision tower
    assert report["post_sync_policy_versions"] == [1]
    assert report["post_sync_tokens"] > 0
    # Same screenshots as before the sync: a stale vision-encoder cache would show here.
    assert report["post_sync_max_abs_diff"] < LOGPROB_ATOL
    # Whole context and every image resent each turn (a fresh session's path).
    assert report["post_sync_no_session_max_abs_diff"] < LOGPROB_ATOL
