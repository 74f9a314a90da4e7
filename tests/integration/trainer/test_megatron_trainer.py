"""The Megatron actor end to end on CPU: TP=1 (1 rank) and TP=2 (2 ranks, gloo).

Each TP size runs once (`megatron_worker.py`, a spawned process group); the tests below compare
what it recorded against Hugging Face transformers and against each other. Megatron never runs in
the pytest process itself (its CPU shims are process-wide).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import load_hf_model, write_random_hf_checkpoint
from tide_megatron.testing import run_script

pytestmark = pytest.mark.integration

sys.path.insert(0, os.path.dirname(__file__))
from megatron_worker import MODEL_KWARGS  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "megatron_worker.py")
LOGPROB_ATOL = 1e-5  # fp32, different kernels (Megatron local spec vs HF eager)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return write_random_hf_checkpoint(tmp_path_factory.mktemp("hf"), ModelConfig(**MODEL_KWARGS), seed=0)


def _run_worker(hf_dir: str, out_dir: str, world: int, tp: int) -> dict:
    run_script(WORKER, "--world", world, "--tp", tp, "--hf", hf_dir, "--out", out_dir, timeout=600)
    results = torch.load(os.path.join(out_dir, "results.pt"), weights_only=False)
    results["hf_after"] = torch.load(os.path.join(out_dir, "hf_after.pt"))
    results["out_dir"] = out_dir
    return results


@pytest.fixture(scope="module")
def tp1(hf_dir, tmp_path_factory) -> dict:
    return _run_worker(hf_dir, str(tmp_path_factory.mktemp("tp1")), world=1, tp=1)


@pytest.fixture(scope="module")
def tp2(hf_dir, tmp_path_factory) -> dict:
    return _run_worker(hf_dir, str(tmp_path_factory.mktemp("tp2")), world=2, tp=2)


@pytest.fixture(scope="module")
def dp2(hf_dir, tmp_path_factory) -> dict:
    """Two data-parallel ranks, each given the same micro-batches."""
    return _run_worker(hf_dir, str(tmp_path_factory.mktemp("dp2")), world=2, tp=1)


@pytest.fixture(params=["tp1", "tp2"])
def run(request) -> dict:
    return request.getfixturevalue(request.param)


@torch.no_grad()
def _hf_logprobs(model, token_ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) from transformers, aligned like the trainer's (0 at t = 0). # [B, T]"""
    logits = model(token_ids).logits.float()  # [B, T, V]
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, token_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1)


def test_megatron_logprobs_equal_hf(hf_dir, run):
    hf = load_hf_model(hf_dir)
    for ids, lp, ref in zip(run["token_ids"], run["initial_logprobs"], run["ref_logprobs"]):
        torch.testing.assert_close(lp, _hf_logprobs(hf, ids), rtol=0, atol=LOGPROB_ATOL)
        torch.testing.assert_close(ref, lp, rtol=0, atol=LOGPROB_ATOL)  # ref == actor at start


def test_tp2_matches_tp1(tp1, tp2):
    for key in ("initial_logprobs", "ref_logprobs", "after_logprobs"):
        for a, b in zip(tp1[key], tp2[key]):
            torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL)
    for s1, s2 in zip(tp1["steps"], tp2["steps"]):
        assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)
        assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-4)


def test_overlapped_grad_reduce_gives_the_same_gradients(dp2):
    diff, scale = dp2["overlap_grad_diff"]
    assert scale > 0 and diff <= 1e-6 * max(1.0, scale), (diff, scale)


def test_dp2_on_identical_shards_matches_one_rank(tp1, dp2):
    """The step's gradient is the token mean over every DP rank: two ranks holding the same
    data take the one-rank step (DDP once also divided by the DP size: half the gradient)."""
    for s1, s2 in zip(tp1["steps"], dp2["steps"]):
        assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)
        assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-4)
    for a, b in zip(tp1["after_logprobs"], dp2["after_logprobs"]):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL)


def test_grpo_steps_lower_the_loss_and_follow_the_advantage(run):
    losses = [s["loss"] for s in run["steps"]]
    assert losses[0] > losses[1] > losses[2], losses
    assert all(s["update_successful"] and s["num_tokens"] == run["steps"][0]["num_tokens"] for s in run["steps"])
    assert run["steps"][1]["kl"] > 0.0  # the actor left the reference
    up = down = 0.0
    for before, after, adv, mask in zip(run["initial_logprobs"], run["after_logprobs"], run["advantages"],
                                        run["loss_masks"]):
        delta = ((after - before) * mask).sum(1) / mask.sum(1)  # [B] mean change on generated tokens
        up += delta[adv > 0].sum().item()
        down += delta[adv < 0].sum().item()
    assert up > 0 > down, (up, down)


def test_masked_tokens_get_no_gradient(run):
    assert run["grad_scale"] > 1e-4
    assert run["masked_scramble_grad_diff"] == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_in_backward_gradient_equals_ordinary(run, estimator):
    diff, scale = run["lib_grad_diff"][estimator]
    assert scale > 1e-4
    assert diff <= 1e-6 * scale + 1e-8, (diff, scale)


def test_megatron_to_hf_after_training_reproduces_logprobs(hf_dir, run):
    hf = load_hf_model(hf_dir)
    state = run["hf_after"]
    assert set(state) == set(hf.state_dict()) - {k for k in hf.state_dict() if "rotary" in k}
    hf.load_state_dict(state, strict=True)
    for ids, lp in zip(run["token_ids"], run["after_logprobs"]):
        torch.testing.assert_close(_hf_logprobs(hf, ids), lp, rtol=0, atol=LOGPROB_ATOL)


def test_checkpoint_resume_round_trip(run):
    assert run["resumed_step"] == 3
    continued, resumed = run["resume_loss"]
    assert continued == resumed
    assert run["resume_logprob_diff"] == 0.0
    root = os.path.join(run["out_dir"], "ckpt")
    assert open(os.path.join(root, "latest")).read().strip() == "step_000003"


def test_missing_checkpoint_error_names_the_path(run):
    assert run["missing_error"] is not None
    assert os.path.join(run["out_dir"], "no_such_step") in run["missing_error"]


def test_activation_recompute_gives_the_same_gradients(run):
    for mode, (diff, scale) in run["recompute_grad_diff"].items():
        assert scale > 0, "the plain gradients are all zero: the comparison would prove nothing"
        assert diff <= 1e-6 * max(1.0, scale), (mode, diff, scale)


def test_packed_micro_batches_give_the_padded_loss_and_gradients(run):
    """One row per micro-batch, trajectories end to end, attention within each: the loss sums,
    token counts and gradients of the padded layout, to fp32 rounding."""
    assert all(shape[0] == 1 for shape in run["packed_shapes"])
    assert sum(shape[1] for shape in run["packed_shapes"]) < sum(a * b for a, b in run["micro_batch_shapes"])
    for padded_sum, packed_sum, padded_count, packed_count in run["packed_loss"]:
        assert packed_count == padded_count > 0
        assert abs(packed_sum - padded_sum) <= 1e-5 * max(1.0, abs(padded_sum))
    diff, scale = run["packed_grad_diff"]
    assert scale > 0 and diff <= 1e-5 * max(1.0, scale)

