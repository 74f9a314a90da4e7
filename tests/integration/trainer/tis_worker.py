"""Train-inference mismatch correction on the Megatron actor (run as a script, one CPU rank).

    python tis_worker.py --hf HF_DIR --out OUT_DIR

Writes `OUT_DIR/results.pt` for `test_tis_trainer.py`: the mismatch the actor reports when the
rollout log-probs are its own fp32 numbers, and, for SGLang-like rollout log-probs (the actor's
plus noise), the loss, metrics and gradients of each `trainer.tis_mode` with the old log-probs
recomputed or not, ordinary or loss-in-backward, padded or packed.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from megatron_worker import MODEL_KWARGS, _grads, _max_abs, _max_diff, make_trajectories
from packed_copy import packed_like
from tide_megatron.testing import worker_args

NOISE = 0.4  # std of the simulated rollout-vs-trainer log-prob gap (large, so the cap of 2 binds)
MISMATCH_KEYS = ("mismatch_abs", "mismatch_kl", "tis_clip_frac")


def scenario(hf_dir: str) -> dict:
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
    from tide_megatron.trainer.batch import BatchLayout, micro_batches_by_budget
    from tide_megatron.trainer.config import TrainerConfig

    init_parallel(tp_size=1, seed=0)
    cfg = ModelConfig(**MODEL_KWARGS)
    tcfg = TrainerConfig(lr=5e-4, kl_coef=0.05, kl_estimator="k3", clip_grad=1.0, micro_batch_tokens=96,
                         tis_mode="truncate", tis_cap=2.0)
    results: dict = {}
    actor = MegatronActor(cfg, tcfg, hf_dir)
    ref = ReferenceModel(cfg, hf_dir)
    trajectories = make_trajectories(cfg.vocab_size)
    mbs = micro_batches_by_budget(trajectories, tcfg.micro_batch_tokens, BatchLayout(packed=False))
    ref.attach_logprobs(mbs)
    # One on-policy step first, so that the actor has left the reference (KL terms non-zero).
    for mb in mbs:
        mb.old_logprobs = actor.logprobs(mb) * mb.loss_mask
    actor.train_step(mbs)
    own = [actor.logprobs(mb) for mb in mbs]  # [B, T] each: the pre-update trainer log-probs

    def mean_metrics(reports) -> dict[str, float]:
        totals = actor._reduce_reports(reports)
        return {key: pair[0] / pair[1] for key, pair in totals.items()}

    # 1. fp32 on both sides: the rollout log-probs are the actor's own.
    for mb, lp in zip(mbs, own):
        mb.old_logprobs = lp * mb.loss_mask
    results["fp32"] = {}
    for recompute in (False, True):
        actor.cfg = dataclasses.replace(tcfg, recompute_old_logprobs=recompute)
        results["fp32"][recompute] = mean_metrics(actor.forward_backward(mbs))

    # 2. SGLang-like rollout log-probs: the actor's plus noise (a bf16 engine, a stale version).
    g = torch.Generator().manual_seed(7)
    noisy = []
    for mb, lp in zip(mbs, own):
        clone = dataclasses.replace(mb)
        clone.old_logprobs = (lp + NOISE * torch.randn(lp.shape, generator=g)) * mb.loss_mask
        noisy.append(clone)
    packed = [packed_like(mb, trajectories) for mb in noisy]
    mask = torch.cat([mb.loss_mask.reshape(-1) for mb in noisy])
    q = torch.cat([lp.reshape(-1) for lp in own])
    o = torch.cat([mb.old_logprobs.reshape(-1) for mb in noisy])
    results["expected"] = {
        "mismatch_abs": float(((q - o).abs() * mask).sum() / mask.sum()),
        "truncate_share": float(((torch.exp(q - o) > 2.0).float() * mask).sum() / mask.sum()),
        "mask_share": float((((torch.exp(q - o) > 2.0) | (torch.exp(q - o) < 0.5)).float() * mask).sum()
                            / mask.sum()),
    }
    results["runs"] = {}
    grads = {}
    for mode in ("none", "truncate", "mask"):
        for layout, batches in (("padded", noisy), ("packed", packed)):
            for lib in (False, True):
                for recompute in (False, True):
                    key = (mode, layout, lib, recompute)
                    actor.cfg = dataclasses.replace(tcfg, tis_mode=mode, recompute_old_logprobs=recompute,
                                                    loss_in_backward=lib)
                    metrics = mean_metrics(actor.forward_backward(batches))
                    grads[key] = _grads(actor)
                    results["runs"][key] = metrics
    results["grad_scale"] = {key: _max_abs(g_) for key, g_ in grads.items()}
    # Each run against the same mode's padded, ordinary, not-recomputed run.
    results["grad_diff"] = {key: _max_diff(grads[(key[0], "padded", False, False)], g_) for key, g_ in grads.items()}
    base = ("truncate", "padded", False, False)
    results["grad_diff_modes"] = {
        "truncate_vs_none": _max_diff(grads[("none", "padded", False, False)], grads[base]),
        "mask_vs_truncate": _max_diff(grads[("mask", "padded", False, False)], grads[base]),
    }

    # 3. A real step with the recompute on: UpdateResult carries the mismatch metrics.
    actor.cfg = dataclasses.replace(tcfg, recompute_old_logprobs=True)
    results["step"] = dataclasses.asdict(actor.train_step(noisy))
    return results


def _rank(rank: int, hf_dir: str, out_dir: str) -> None:
    torch.save(scenario(hf_dir), os.path.join(out_dir, "results.pt"))


def main() -> None:
    from tide_megatron.models.megatron_gpt import spawn_ranks

    args = worker_args(paths=("hf",))
    spawn_ranks(_rank, 1, args.hf, args.out)


if __name__ == "__main__":
    main()
