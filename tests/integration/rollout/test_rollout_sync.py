"""The rollout side on the real stack: SGLang on CPU, the env server, the Megatron trainer.

See rollout_sync_worker.py: one subprocess runs everything and reports; tests read the report.
"""

from __future__ import annotations

import os

import pytest

from tide_megatron.testing import report_fixture

pytestmark = pytest.mark.integration

WORKER = os.path.join(os.path.dirname(__file__), "rollout_sync_worker.py")
LOGPROB_ATOL = 1e-4  # fp32; SGLang torch_native attention vs Megatron local attention


report = report_fixture(WORKER, timeout=900)


def test_trajectories_are_consistent_token_records(report):
    trajs = report["trajectories"]
    assert len(trajs) == 8
    for t in trajs:
        n = len(t["token_ids"])
        assert len(t["loss_mask"]) == n and len(t["logprobs"]) == n
        assert t["loss_mask"][0] == 0
        assert sum(t["loss_mask"]) == t["generated_tokens"] > 0
        # log-probs exist exactly where the policy generated
        assert all((lp != 0.0) == bool(m) for lp, m in zip(t["logprobs"], t["loss_mask"]) if m)
        assert all(lp == 0.0 for lp, m in zip(t["logprobs"], t["loss_mask"]) if not m)
        assert 1 <= t["turns"] <= 4
        assert 0.0 <= t["reward"] <= 1.0


def test_sessions_keep_the_prefix_cached(report):
    trajs = report["trajectories"]
    multi = [t for t in trajs if t["turns"] > 1]
    assert multi, "no multi-turn trajectory to check"
    # every later turn reuses at least the earlier context
    assert sum(t["cached_tokens"] for t in multi) > 0.4 * sum(t["prompt_tokens"] for t in multi)


def test_group_members_share_their_first_prompt(report):
    by_group: dict[str, list] = {}
    for t in report["trajectories"]:
        by_group.setdefault(t["group_id"], []).append(t)
    for members in by_group.values():
        firsts = {tuple(m["token_ids"][: m["loss_mask"].index(1)]) for m in members}
        assert len(firsts) == 1


def test_engine_logprobs_equal_trainer_before_and_after_weight_sync(report):
    assert report["pre_sync_max_abs_diff"] < LOGPROB_ATOL
    assert report["post_sync_tokens"] > 0
    assert report["post_sync_max_abs_diff"] < LOGPROB_ATOL
    assert report["post_sync_policy_version"] == 1
