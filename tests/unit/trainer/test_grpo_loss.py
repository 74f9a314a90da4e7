"""GRPO loss terms, their closed-form gradient, and the loss-in-backward autograd node (pure torch)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from tide_megatron.trainer.batch import BatchLayout, MicroBatch, TrajectoryTensors, collate, micro_batches_by_budget
from tide_megatron.trainer.config import KL_ESTIMATORS, TrainerConfig
from tide_megatron.trainer.grpo_loss import (
    grpo_loss,
    grpo_loss_grad_wrt_logprobs,
    kl_penalty,
)
from tide_megatron.trainer.loss_in_backward import FutureLogprobs, deferred_grpo_loss


def _random_batch(seed: int, batch: int = 4, seq: int = 24, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=g) * 3  # [B, T]
    new = old + spread * torch.randn(batch, seq, generator=g)  # ratios on both sides of the clip
    ref = old + spread * torch.randn(batch, seq, generator=g)
    adv = torch.randn(batch, generator=g)
    mask = (torch.rand(batch, seq, generator=g) > 0.4).float()
    mask[:, 0] = 0
    new[0, :5] = old[0, :5]  # exact ratio 1: the tie case of the clipped max
    return new, old, ref, adv, mask


def test_kl_estimators_match_their_definitions():
    x, y = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    r = torch.exp(y - x)  # pi_ref / pi
    torch.testing.assert_close(kl_penalty(x, y, "k1"), x - y)
    torch.testing.assert_close(kl_penalty(x, y, "k2"), 0.5 * (x - y) ** 2)
    torch.testing.assert_close(kl_penalty(x, y, "k3"), r - torch.log(r) - 1)
    assert (kl_penalty(x, y, "k3") >= 0).all()


def test_ppo_clip_zeroes_gradient_outside_the_trust_region():
    cfg = TrainerConfig(clip_eps_low=0.2, clip_eps_high=0.2)
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5]])).requires_grad_()
    adv = torch.tensor([1.0])
    loss, n, _ = grpo_loss(new, old, adv, None, torch.ones(1, 3), cfg)
    loss.backward()
    # A > 0: ratio 1.5 is clipped (no push further up), 1.0 gets -A*r, 0.5 gets -A*r (below 1-eps
    # the unclipped term is the max for A > 0, so it still gets a gradient).
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -1.0, -0.5]]))
    assert int(n) == 3


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_closed_form_gradient_equals_autograd(estimator, kl_coef):
    cfg = TrainerConfig(kl_coef=kl_coef, kl_estimator=estimator, clip_eps_low=0.2, clip_eps_high=0.28)
    for seed in range(3):
        new, old, ref, adv, mask = _random_batch(seed)
        new = new.requires_grad_()
        loss, _, _ = grpo_loss(new, old, adv, ref, mask, cfg)
        (autograd,) = torch.autograd.grad(loss, new)
        closed = grpo_loss_grad_wrt_logprobs(new.detach(), old, adv, ref, mask, cfg)
        torch.testing.assert_close(closed, autograd, rtol=1e-6, atol=1e-7)  # fp32 rounding
        assert (closed[mask == 0] == 0).all()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_deferred_loss_waits_in_backward_and_matches(estimator):
    cfg = TrainerConfig(kl_coef=0.1, kl_estimator=estimator)
    new, old, ref, adv, mask = _random_batch(7)
    mb = MicroBatch(torch.zeros_like(old, dtype=torch.long), torch.zeros_like(old, dtype=torch.long),
                    mask, old, adv)
    future: concurrent.futures.Future = concurrent.futures.Future()
    mb.ref_logprobs = FutureLogprobs(future, timeout_s=10)
    leaf = new.clone().requires_grad_()
    logprobs = leaf * 1.0  # a non-leaf, like a model output
    loss_sum, num_tokens, report = deferred_grpo_loss(logprobs, mb, cfg)  # forward: no wait
    assert not future.done()
    threading.Timer(0.05, future.set_result, args=(ref,)).start()  # the "reference rank"
    loss_sum.backward()

    expected_leaf = new.clone().requires_grad_()
    expected, expected_tokens, expected_report = grpo_loss(expected_leaf, old, adv, ref, mask, cfg)
    expected.backward()
    torch.testing.assert_close(leaf.grad, expected_leaf.grad, rtol=1e-6, atol=1e-7)
    assert int(num_tokens) == int(expected_tokens)
    for key in ("loss", "pg_loss", "kl", "clip_frac"):
        torch.testing.assert_close(report[key], expected_report[key], rtol=1e-6, atol=1e-6)
    assert report["ref_wait_s"] > 0.0


def _traj(n: int, adv: float = 1.0) -> TrajectoryTensors:
    mask = torch.ones(n)
    mask[0] = 0
    return TrajectoryTensors(torch.arange(n), mask, torch.zeros(n), adv)


def test_collate_right_pads_with_masked_tokens():
    mb = collate([_traj(3), _traj(5)], pad_to_multiple_of=4)
    assert mb.token_ids.shape == (2, 8)  # [B, T] padded to a multiple of 4
    assert mb.loss_mask[0, 3:].sum() == 0 and mb.loss_mask[1, 5:].sum() == 0
    assert mb.lengths == [3, 5]
    assert mb.num_loss_tokens == 2 + 4


def test_split_respects_the_padded_token_budget():
    trajs = [_traj(n) for n in (4, 4, 4, 10, 3)]
    mbs = micro_batches_by_budget(trajs, 12, BatchLayout(packed=False))
    assert [mb.token_ids.shape for mb in mbs] == [(3, 4), (1, 10), (1, 3)]
    assert sum(mb.token_ids.shape[0] for mb in mbs) == len(trajs)
    assert all(mb.token_ids.numel() <= 12 for mb in mbs)


def test_first_token_cannot_be_a_loss_token():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        TrajectoryTensors(torch.arange(3), torch.ones(3), torch.zeros(3), 1.0)


def test_config_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="kl_estimator"):
        TrainerConfig(kl_estimator="k4")
