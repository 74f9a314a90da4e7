"""Train-inference mismatch correction in the GRPO loss (`trainer.tis_mode`, pure torch).

Notation as in `grpo_loss.py`: x the actor's log-probs (with gradient), q the trainer's old
log-probs (pre-update weights), o the rollout's (SGLang's) log-probs, w = exp(q - o).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from tide_megatron.trainer.batch import MicroBatch
from tide_megatron.trainer.config import TIS_MODES, TrainerConfig
from tide_megatron.trainer.grpo_loss import (
    METRIC_KEYS,
    grpo_loss,
    grpo_loss_grad_wrt_logprobs,
    grpo_token_loss,
    policy_gradient_loss,
    tis_weights,
)
from tide_megatron.trainer.loss_in_backward import FutureLogprobs, deferred_grpo_loss

REPO = Path(__file__).resolve().parents[3]


def _batch(seed: int, batch: int = 4, seq: int = 32, mismatch: float = 0.3, step: float = 0.3,
           per_token_adv: bool = False):
    """(x, q, o, ref, advantages, mask): q = o + mismatch noise (bf16 vs SGLang), x = q + the
    policy's move (so both the TIS weight and the PPO ratio land on both sides of their caps)."""
    g = torch.Generator().manual_seed(seed)
    o = -torch.rand(batch, seq, generator=g) * 3  # [B, T]
    q = o + mismatch * torch.randn(batch, seq, generator=g)
    x = q + step * torch.randn(batch, seq, generator=g)
    ref = q + step * torch.randn(batch, seq, generator=g)
    adv = torch.randn(batch, seq, generator=g) if per_token_adv else torch.randn(batch, generator=g)
    mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
    mask[:, 0] = 0
    return x, q, o, ref, adv, mask


def _loss_and_grad(x, o, adv, ref, mask, cfg, q=None):
    leaf = x.clone().requires_grad_()
    loss, n, metrics = grpo_loss(leaf, o, adv, ref, mask, cfg, q)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics, int(n)


# ---- tis_mode "none" is today's objective ---------------------------------------------------

def test_tis_off_is_the_ppo_ratio_against_the_rollout_logprobs():
    """The pre-TIS formula, written out: nothing changes with tis_mode none (q only feeds metrics)."""
    cfg = TrainerConfig(kl_coef=0.05, clip_eps_low=0.2, clip_eps_high=0.28)
    assert cfg.tis_mode == "none"
    x, q, o, ref, adv, mask = _batch(0)
    leaf = x.clone().requires_grad_()
    ratio = torch.exp(leaf - o)
    pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.28))
    kl = torch.exp(ref - leaf) - (ref - leaf) - 1
    expected = ((pg + 0.05 * kl) * mask).sum()
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    for trainer_old in (None, q):  # recomputed or not: the ratio ignores q
        loss, grad, _, _ = _loss_and_grad(x, o, adv, ref, mask, cfg, trainer_old)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)


# ---- TIS with no cap = the plain loss where no PPO clip binds -------------------------------

@pytest.mark.parametrize("recomputed", [False, True])
def test_uncapped_tis_equals_the_plain_loss_where_no_ppo_clip_binds(recomputed):
    """Why this is the right comparison: the TIS term is w * r_q = exp(q - o) * exp(x - q) =
    exp(x - o), the plain term's ratio, and w carries no gradient, so value and gradient agree
    token by token. The two objectives differ only in what the PPO clip looks at (x - q with TIS,
    x - o without), so they can only differ on tokens where one of the two clips binds. With an
    infinite cap nothing is truncated; with a clip range so wide that it never binds, the whole
    losses and gradients must agree; with the usual range, every token where neither clip binds
    must agree and the rest may not."""
    x, q, o, ref, adv, mask = _batch(1)
    trainer_old = q if recomputed else None
    wide = dict(clip_eps_low=0.999999, clip_eps_high=1e9)
    plain_cfg = TrainerConfig(kl_coef=0.05, **wide)
    tis_cfg = dataclasses.replace(plain_cfg, tis_mode="truncate", tis_cap=math.inf)
    plain = _loss_and_grad(x, o, adv, ref, mask, plain_cfg, trainer_old)
    tis = _loss_and_grad(x, o, adv, ref, mask, tis_cfg, trainer_old)
    torch.testing.assert_close(tis[0], plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tis[1], plain[1], rtol=1e-5, atol=1e-7)
    assert float(tis[2]["tis_clip_frac"][0]) == 0.0

    # The usual clip range: token by token where neither clip binds.
    plain_cfg = TrainerConfig(kl_coef=0.05, clip_eps_low=0.2, clip_eps_high=0.2)
    tis_cfg = dataclasses.replace(plain_cfg, tis_mode="truncate", tis_cap=math.inf)
    plain_terms = grpo_token_loss(x, o, adv, ref, plain_cfg, trainer_old)
    tis_terms = grpo_token_loss(x, o, adv, ref, tis_cfg, trainer_old)
    q_eff = x if trainer_old is None else q
    _, binds_q = policy_gradient_loss(x, q_eff, adv, 0.2, 0.2)
    _, binds_o = policy_gradient_loss(x, o, adv, 0.2, 0.2)
    free = (mask > 0) & ~binds_q & ~binds_o
    assert binds_o[mask > 0].any(), "the batch should make the plain clip bind somewhere"
    torch.testing.assert_close(tis_terms["loss"][free], plain_terms["loss"][free], rtol=1e-5, atol=1e-6)
    plain_grad = grpo_loss_grad_wrt_logprobs(x, o, adv, ref, mask, plain_cfg, trainer_old)
    tis_grad = grpo_loss_grad_wrt_logprobs(x, o, adv, ref, mask, tis_cfg, trainer_old)
    torch.testing.assert_close(tis_grad[free], plain_grad[free], rtol=1e-5, atol=1e-6)
    if trainer_old is None:
        # On the trainer's own log-probs r_q = 1: the PPO clip never binds with TIS.
        assert not binds_q.any() and float(grpo_loss(x, o, adv, ref, mask, tis_cfg)[2]["clip_frac"][0]) == 0.0


# ---- a finite cap changes the capped tokens only ---------------------------------------------

@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_small_cap_changes_only_the_capped_tokens(mode):
    x, q, o, ref, adv, mask = _batch(2, mismatch=0.5)
    cap = 1.3
    base = TrainerConfig(kl_coef=0.05, tis_mode="truncate", tis_cap=math.inf)
    capped_cfg = dataclasses.replace(base, tis_mode=mode, tis_cap=cap)
    for trainer_old in (None, q):
        q_eff = x if trainer_old is None else q
        w = torch.exp(q_eff - o)
        hit = (w > cap) if mode == "truncate" else (w > cap) | (w < 1 / cap)
        assert hit[mask > 0].any() and (~hit)[mask > 0].any()
        free_terms = grpo_token_loss(x, o, adv, ref, base, trainer_old)
        capped_terms = grpo_token_loss(x, o, adv, ref, capped_cfg, trainer_old)
        torch.testing.assert_close(capped_terms["loss"][~hit], free_terms["loss"][~hit])
        if mode == "truncate":
            # Truncated: the PPO term scaled by cap / w; the KL term untouched.
            torch.testing.assert_close(capped_terms["pg"][hit], free_terms["pg"][hit] * cap / w[hit],
                                       rtol=1e-5, atol=1e-6)
        else:
            assert (capped_terms["pg"][hit] == 0).all()  # masked: no PPO term, the KL term stays
        torch.testing.assert_close(capped_terms["kl"], free_terms["kl"])
        free_grad = grpo_loss_grad_wrt_logprobs(x, o, adv, ref, mask, base, trainer_old)
        capped_grad = grpo_loss_grad_wrt_logprobs(x, o, adv, ref, mask, capped_cfg, trainer_old)
        torch.testing.assert_close(capped_grad[~hit], free_grad[~hit])
        # ... and on a capped token wherever its PPO term has a gradient (not where the clip zeroes it).
        free_pg_grad = grpo_loss_grad_wrt_logprobs(x, o, adv, ref, mask, dataclasses.replace(base, kl_coef=0.0),
                                                   trainer_old)
        changed = hit & (free_pg_grad != 0)
        assert changed.any()
        assert (capped_grad[changed] != free_grad[changed]).all()
        # The reported share is the share of loss tokens the cap changed.
        _, _, metrics = grpo_loss(x, o, adv, ref, mask, capped_cfg, trainer_old)
        share = float(metrics["tis_clip_frac"][0] / metrics["tis_clip_frac"][1])
        assert share == pytest.approx(float((hit.float() * mask).sum() / mask.sum()))


def test_tis_weights_follow_slime_and_verl():
    q = torch.log(torch.tensor([[0.25, 0.6, 1.0, 1.9, 2.5]]))  # w = exp(q - 0)
    o = torch.zeros(1, 5)
    truncate = tis_weights(q, o, "truncate", 2.0)
    torch.testing.assert_close(truncate["weight"], torch.tensor([[0.25, 0.6, 1.0, 1.9, 2.0]]))
    assert truncate["capped"].tolist() == [[False, False, False, False, True]]  # no lower bound
    mask = tis_weights(q, o, "mask", 2.0)  # kept in [1/2, 2] with their own w, zero outside
    torch.testing.assert_close(mask["weight"], torch.tensor([[0.0, 0.6, 1.0, 1.9, 0.0]]))
    assert mask["capped"].tolist() == [[True, False, False, False, True]]
    none = tis_weights(q, o, "none", 2.0)
    assert (none["weight"] == 1).all() and not none["capped"].any()
    r = torch.exp(q - o)  # k3 estimate of KL(rollout || trainer) from rollout samples
    torch.testing.assert_close(none["kl"], r - torch.log(r) - 1)
    torch.testing.assert_close(none["abs_diff"], (q - o).abs())


def test_no_overflow_under_masked_or_pathological_rollout_logprobs():
    """Rollout log-probs are arbitrary under loss_mask 0 (padding, prompt) and may be absurd on
    a real token: with TIS on, weights, loss and metrics stay finite (log w is bounded before
    exp). (tis_mode none keeps today's exp(x - o), which the trainer feeds o = 0 under the mask.)"""
    x, q, o, ref, adv, mask = _batch(3)
    o = torch.where(mask > 0, o, torch.full_like(o, -1e4))
    o[1, 5], mask[1, 5] = -500.0, 1.0  # w = e^500 on a loss token
    for mode in ("truncate", "mask"):
        cfg = TrainerConfig(kl_coef=0.05, tis_mode=mode, tis_cap=2.0)
        loss, grad, metrics, _ = _loss_and_grad(x, o, adv, ref, mask, cfg, q)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v).all() for v in metrics.values())


# ---- recompute on/off -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", TIS_MODES)
def test_recomputed_old_logprobs_equal_the_forwards_own(mode):
    """One optimizer step per RL step: the recomputed q equals the forward's x (same weights),
    and passing it gives the loss and gradient of passing nothing (q = x.detach())."""
    x, _, o, ref, adv, mask = _batch(4)
    cfg = TrainerConfig(kl_coef=0.05, tis_mode=mode)
    own = _loss_and_grad(x, o, adv, ref, mask, cfg, None)
    recomputed = _loss_and_grad(x, o, adv, ref, mask, cfg, x.clone())
    torch.testing.assert_close(recomputed[0], own[0], rtol=0, atol=0)
    torch.testing.assert_close(recomputed[1], own[1], rtol=0, atol=0)
    for key in METRIC_KEYS:
        torch.testing.assert_close(recomputed[2][key], own[2][key], rtol=0, atol=0)


# ---- loss-in-backward: closed form = autograd with TIS on ------------------------------------

@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_closed_form_gradient_equals_autograd_with_tis(mode, estimator, per_token_adv):
    cfg = TrainerConfig(kl_coef=0.05, kl_estimator=estimator, clip_eps_low=0.2, clip_eps_high=0.28,
                        tis_mode=mode, tis_cap=1.5)
    for seed in range(3):
        x, q, o, ref, adv, mask = _batch(10 + seed, per_token_adv=per_token_adv)
        x[0, :5] = q[0, :5]  # ratio exactly 1 against q: the tie of the clipped max
        for trainer_old in (None, q):  # q given: the PPO clip binds on some tokens
            _, autograd, _, _ = _loss_and_grad(x, o, adv, ref, mask, cfg, trainer_old)
            closed = grpo_loss_grad_wrt_logprobs(x, o, adv, ref, mask, cfg, trainer_old)
            torch.testing.assert_close(closed, autograd, rtol=1e-6, atol=1e-7)  # fp32 rounding
            assert (closed[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("recomputed", [False, True])
def test_deferred_loss_with_tis_matches_the_ordinary_loss(mode, recomputed):
    import concurrent.futures
    import threading

    cfg = TrainerConfig(kl_coef=0.1, tis_mode=mode, tis_cap=1.5)
    x, q, o, ref, adv, mask = _batch(20)
    trainer_old = q if recomputed else None
    mb = MicroBatch(torch.zeros_like(o, dtype=torch.long), torch.zeros_like(o, dtype=torch.long), mask, o, adv)
    future: concurrent.futures.Future = concurrent.futures.Future()
    mb.ref_logprobs = FutureLogprobs(future, timeout_s=10)
    leaf = x.clone().requires_grad_()
    loss_sum, num_tokens, report = deferred_grpo_loss(leaf * 1.0, mb, cfg, trainer_old)
    threading.Timer(0.02, future.set_result, args=(ref,)).start()
    loss_sum.backward()

    expected_loss, expected_grad, expected_report, expected_tokens = _loss_and_grad(x, o, adv, ref, mask, cfg,
                                                                                    trainer_old)
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-6, atol=1e-7)
    assert int(num_tokens) == expected_tokens
    for key in METRIC_KEYS:
        torch.testing.assert_close(report[key], expected_report[key], rtol=1e-6, atol=1e-6)
    assert float(report["tis_clip_frac"][0]) > 0


# ---- config --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(tis_mode="clip"), "trainer.tis_mode='clip': expected one of"),
    (dict(tis_mode="TIS"), "trainer.tis_mode"),
    (dict(tis_cap=0.5), "trainer.tis_cap=0.5: expected a number >= 1"),
    (dict(tis_cap=float("nan")), "trainer.tis_cap=nan"),
    (dict(tis_cap=True), "trainer.tis_cap=True"),
    (dict(tis_cap="2"), "trainer.tis_cap='2'"),
])
def test_bad_tis_config_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")):
        TrainerConfig(**kwargs)


def test_tis_config_accepts_the_edges():
    assert TrainerConfig(tis_mode="truncate", tis_cap=1.0).tis_cap == 1.0
    assert TrainerConfig(tis_mode="mask", tis_cap=math.inf).tis_cap == math.inf
    assert TrainerConfig(tis_cap=3).tis_cap == 3


@pytest.fixture()
def compose_job():
    from hydra.core.global_hydra import GlobalHydra

    sys.path.insert(0, str(REPO / "launch"))
    import hydra_schema

    yield hydra_schema.compose_job_config
    GlobalHydra.instance().clear()


def test_every_bf16_recipe_turns_truncated_importance_sampling_on(compose_job):
    recipes = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))
    bf16 = []
    for recipe in recipes:
        job = compose_job([f"+recipe={recipe}"])
        if job.trainer.bf16:
            bf16.append(recipe)
            assert job.trainer.tis_mode == "truncate" and job.trainer.tis_cap == 2.0, recipe
    assert bf16, "expected at least one bf16 recipe"


def test_bad_tis_override_fails_at_composition(compose_job):
    with pytest.raises(ValueError, match="trainer.tis_mode='clip': expected one of"):
        compose_job(["trainer.tis_mode=clip"])
    with pytest.raises(ValueError, match="trainer.tis_cap=0.5"):
        compose_job(["trainer.tis_cap=0.5"])
    assert compose_job(["trainer.tis_cap=inf"]).trainer.tis_cap == math.inf
