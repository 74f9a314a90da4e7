"""Train-inference mismatch correction (`trainer.tis_mode`, `trainer.recompute_old_logprobs`) on
the Megatron actor, one CPU rank (`tis_worker.py` in a child process: Megatron's CPU shims are
process-wide)."""

from __future__ import annotations

import os

import pytest
import torch

from tide_megatron.testing import run_script

pytestmark = pytest.mark.integration

HERE = os.path.dirname(__file__)
MODES = ("none", "truncate", "mask")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    import sys

    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint

    sys.path.insert(0, HERE)
    from megatron_worker import MODEL_KWARGS

    hf_dir = write_random_hf_checkpoint(tmp_path_factory.mktemp("hf"), ModelConfig(**MODEL_KWARGS), seed=0)
    out = tmp_path_factory.mktemp("tis")
    run_script(os.path.join(HERE, "tis_worker.py"), "--hf", hf_dir, "--out", out, timeout=600)
    return torch.load(os.path.join(out, "results.pt"), weights_only=False)


@pytest.mark.parametrize("recompute", [False, True])
def test_fp32_on_both_sides_reports_no_mismatch(results, recompute):
    """The rollout log-probs are the actor's own fp32 numbers: whether the trainer's old
    log-probs come from the training forward or a separate no-grad forward, the recorded gap is
    rounding at most."""
    metrics = results["fp32"][recompute]
    assert metrics["mismatch_abs"] < 1e-4
    assert abs(metrics["mismatch_kl"]) < 1e-8
    assert metrics["tis_clip_frac"] == 0.0


def test_reported_mismatch_is_the_gap_to_the_rollout_logprobs(results):
    expected = results["expected"]
    assert 0.0 < expected["truncate_share"] < expected["mask_share"] < 1.0
    for (mode, _, _, _), metrics in results["runs"].items():
        assert metrics["mismatch_abs"] == pytest.approx(expected["mismatch_abs"], rel=1e-4)
        assert metrics["mismatch_kl"] > 0.0 and metrics["kl"] > 0.0
        share = {"none": 0.0, "truncate": expected["truncate_share"], "mask": expected["mask_share"]}[mode]
        assert metrics["tis_clip_frac"] == pytest.approx(share, abs=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_recompute_on_and_off_give_the_same_loss_and_gradients(results, mode):
    """One optimizer step per RL step: the recomputed old log-probs are the training forward's
    own, so recomputing changes no number (padded and packed, ordinary and loss-in-backward)."""
    for layout in ("padded", "packed"):
        for lib in (False, True):
            off, on = results["runs"][(mode, layout, lib, False)], results["runs"][(mode, layout, lib, True)]
            for key in ("loss", "pg_loss", "kl", "clip_frac", "mismatch_abs", "mismatch_kl", "tis_clip_frac"):
                assert on[key] == pytest.approx(off[key], rel=1e-6, abs=1e-8), (layout, lib, key)
            scale = results["grad_scale"][(mode, layout, lib, False)]
            diff = max(results["grad_diff"][(mode, layout, lib, r)] for r in (False, True))
            assert scale > 1e-4
            assert diff <= 1e-5 * scale, (layout, lib, diff, scale)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_tis_on_the_trainers_own_logprobs_never_clips(results, mode):
    """With TIS the PPO ratio is against the trainer's old policy, which the one-step update
    still is during the forward: ratio 1, no PPO clip (the cap does the bounding)."""
    for key, metrics in results["runs"].items():
        if key[0] == mode:
            assert metrics["clip_frac"] == 0.0
    assert results["runs"][("none", "padded", False, False)]["clip_frac"] > 0.0  # against the noisy rollout


def test_tis_changes_the_gradient(results):
    scale = {mode: results["grad_scale"][(mode, "padded", False, False)] for mode in MODES}
    assert results["grad_diff_modes"]["truncate_vs_none"] > 1e-3 * scale["none"]
    assert results["grad_diff_modes"]["mask_vs_truncate"] > 1e-3 * scale["truncate"]


def test_step_result_carries_the_mismatch_metrics(results):
    step, expected = results["step"], results["expected"]
    assert step["update_successful"]
    assert step["mismatch_abs"] == pytest.approx(expected["mismatch_abs"], rel=1e-4)
    assert step["tis_clip_frac"] == pytest.approx(expected["truncate_share"], abs=1e-9)
    assert step["mismatch_kl"] > 0.0
