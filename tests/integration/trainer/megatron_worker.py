"""Multi-process Megatron scenario for the trainer integration tests (run as a script).

    python megatron_worker.py --world 2 --tp 2 --hf HF_DIR --out OUT_DIR

Spawns `world` ranks (gloo, CPU); every rank runs `scenario`; rank 0 writes `OUT_DIR/results.pt`
with the numbers the tests compare (across TP sizes and against Hugging Face). One process group
per run keeps the suite fast: most of a run is imports.
"""

from __future__ import annotations

import os
import threading

import torch

from packed_copy import packed_like
from tide_megatron.testing import worker_args

MODEL_KWARGS = dict(vocab_size=2048, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, ffn_hidden_size=128)


def make_trajectories(vocab_size: int):
    """A fixed batch: 6 trajectories, prompt/env tokens masked, mixed-sign advantages."""
    from tide_megatron.trainer.batch import TrajectoryTensors

    g = torch.Generator().manual_seed(1234)
    trajectories = []
    for i in range(6):
        length = 12 + 5 * i
        ids = torch.randint(0, vocab_size, (length,), generator=g)
        mask = torch.zeros(length)
        mask[length // 3: 2 * length // 3] = 1  # action tokens
        mask[length - 3:] = 1  # a second turn's action; the middle third is an env observation
        trajectories.append(TrajectoryTensors(ids, mask, torch.zeros(length), advantage=(1.0 if i % 2 else -0.5)))
    return trajectories


def _grads(actor) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _max_abs(a: dict) -> float:
    return max(v.abs().max().item() for v in a.values())


def scenario(rank: int, tp: int, hf_dir: str, out_dir: str) -> dict:
    import dataclasses

    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
    from tide_megatron.trainer.batch import BatchLayout, micro_batches_by_budget
    from tide_megatron.trainer.checkpoint import load_checkpoint, load_latest_checkpoint, save_checkpoint
    from tide_megatron.trainer.config import KL_ESTIMATORS, TrainerConfig
    from tide_megatron.trainer.loss_in_backward import FutureLogprobs

    init_parallel(tp_size=tp, seed=0)
    cfg = ModelConfig(**MODEL_KWARGS)
    tcfg = TrainerConfig(lr=5e-4, kl_coef=0.05, kl_estimator="k3", clip_grad=1.0, micro_batch_tokens=96)
    results: dict = {}

    actor = MegatronActor(cfg, tcfg, hf_dir)
    ref = ReferenceModel(cfg, hf_dir)
    trajectories = make_trajectories(cfg.vocab_size)
    # Padded micro-batches here (the reference layout: the checks below scramble the padding);
    # the packed layout is checked against them further down.
    mbs = micro_batches_by_budget(trajectories, tcfg.micro_batch_tokens, BatchLayout(packed=False))
    results["micro_batch_shapes"] = [tuple(mb.token_ids.shape) for mb in mbs]
    results["token_ids"] = [mb.token_ids for mb in mbs]
    results["initial_logprobs"] = [actor.logprobs(mb) for mb in mbs]
    results["ref_logprobs"] = [ref.logprobs(mb) for mb in mbs]
    for mb, lp in zip(mbs, results["initial_logprobs"]):
        mb.old_logprobs = lp * mb.loss_mask  # on-policy rollout
    ref.attach_logprobs(mbs)
    # Activation recompute (`trainer.recompute`) trades memory for time, never numbers: the
    # same gradients on the same weights with each mode.
    plain_reports = actor.forward_backward(mbs)
    plain = _grads(actor)
    if torch.distributed.get_world_size() > tp:  # DP > 1: the overlapped bucketed reduce changes no gradient
        overlapped = MegatronActor(cfg, dataclasses.replace(tcfg, overlap_grad_reduce=True), hf_dir)
        overlapped.forward_backward(mbs)
        results["overlap_grad_diff"] = (_max_diff(plain, _grads(overlapped)), _max_abs(plain))
        del overlapped
    # The same trajectories packed (one packed micro-batch per padded one): same loss, same
    # gradients, with and without recompute.
    packed = [packed_like(mb, trajectories) for mb in mbs]
    packed_reports = actor.forward_backward(packed)
    results["packed_grad_diff"] = (_max_diff(plain, _grads(actor)), _max_abs(plain))
    results["packed_loss"] = [(float(a["loss"][0]), float(b["loss"][0]), float(a["loss"][1]), float(b["loss"][1]))
                              for a, b in zip(plain_reports, packed_reports)]
    results["packed_shapes"] = [tuple(mb.token_ids.shape) for mb in packed]
    results["recompute_grad_diff"] = {}
    for mode in ("selective", "full"):
        recomputing = MegatronActor(cfg, dataclasses.replace(tcfg, recompute=mode), hf_dir)
        recomputing.forward_backward(mbs)
        results["recompute_grad_diff"][mode] = (_max_diff(plain, _grads(recomputing)), _max_abs(plain))
        recomputing.forward_backward(packed)
        results["recompute_grad_diff"][f"{mode}, packed"] = (_max_diff(plain, _grads(recomputing)), _max_abs(plain))
        del recomputing
    # One step first, so that below actor != old policy != reference (ratios off 1, some
    # clipped, KL non-zero): the gradient checks then exercise every branch.
    steps = [actor.train_step(mbs)]

    # Masked tokens get no gradient: scrambling everything the mask hides changes no gradient.
    actor.forward_backward(mbs)
    grads = _grads(actor)
    g = torch.Generator().manual_seed(99)
    scrambled = []
    for mb in mbs:
        hidden = mb.loss_mask == 0
        clone = dataclasses.replace(mb)
        clone.old_logprobs = torch.where(hidden, torch.randn(mb.old_logprobs.shape, generator=g), mb.old_logprobs)
        clone.ref_logprobs = torch.where(hidden, torch.randn(mb.old_logprobs.shape, generator=g), mb.ref_logprobs)
        pad = torch.zeros_like(hidden)
        for row, n in enumerate(mb.lengths):
            pad[row, n:] = True
        clone.token_ids = torch.where(pad, torch.randint(0, cfg.vocab_size, mb.token_ids.shape, generator=g), mb.token_ids)
        scrambled.append(clone)
    actor.forward_backward(scrambled)
    results["masked_scramble_grad_diff"] = _max_diff(grads, _grads(actor))
    results["grad_scale"] = _max_abs(grads)

    # Loss-in-backward: same gradients as the ordinary loss, each KL estimator, ref delivered late.
    results["lib_grad_diff"] = {}
    for estimator in KL_ESTIMATORS:
        for cfg_kl in (dataclasses.replace(tcfg, kl_estimator=estimator),):
            actor.cfg = cfg_kl
            actor.forward_backward(mbs)
            ordinary = _grads(actor)
            actor.cfg = dataclasses.replace(cfg_kl, loss_in_backward=True)
            deferred = []
            for mb in mbs:
                clone = dataclasses.replace(mb)
                future = torch.futures.Future()
                threading.Timer(0.01, future.set_result, args=(mb.ref_logprobs,)).start()
                clone.ref_logprobs = FutureLogprobs(future)
                deferred.append(clone)
            reports = actor.forward_backward(deferred)
            results["lib_grad_diff"][estimator] = (_max_diff(ordinary, _grads(actor)), _max_abs(ordinary))
            results[f"lib_report_{estimator}"] = [r["loss"].clone() for r in reports]
    actor.cfg = tcfg

    # Training on the fixed batch (continued): loss goes down, positive-advantage tokens go up.
    steps += [actor.train_step(mbs) for _ in range(2)]
    results["steps"] = [dataclasses.asdict(s) for s in steps]
    results["after_logprobs"] = [actor.logprobs(mb) for mb in mbs]
    results["advantages"] = [mb.advantages for mb in mbs]
    results["loss_masks"] = [mb.loss_mask for mb in mbs]

    # Megatron -> HF after training (collective over TP; rank 0 keeps the tensors).
    hf_weights = {name: t.clone() for name, t in actor.hf_weights()}
    if rank == 0:
        torch.save(hf_weights, os.path.join(out_dir, "hf_after.pt"))

    # Checkpoint round trip: save, step, reload into a fresh actor, same step -> same weights.
    ckpt_root = os.path.join(out_dir, "ckpt")
    save_checkpoint(actor, ckpt_root)
    continued = actor.train_step(mbs)
    continued_lp = [actor.logprobs(mb) for mb in mbs]
    resumed_actor = MegatronActor(cfg, tcfg, hf_dir)
    results["resumed_step"] = load_latest_checkpoint(resumed_actor, ckpt_root)
    resumed = resumed_actor.train_step(mbs)
    resumed_lp = [resumed_actor.logprobs(mb) for mb in mbs]
    results["resume_loss"] = (continued.loss, resumed.loss)
    results["resume_logprob_diff"] = max((a - b).abs().max().item() for a, b in zip(continued_lp, resumed_lp))
    try:
        load_checkpoint(resumed_actor, os.path.join(out_dir, "no_such_step"))
        results["missing_error"] = None
    except FileNotFoundError as e:
        results["missing_error"] = str(e)
    return results


def _rank(rank: int, tp: int, hf_dir: str, out_dir: str) -> None:
    results = scenario(rank, tp, hf_dir, out_dir)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def main() -> None:
    from tide_megatron.models.megatron_gpt import spawn_ranks

    args = worker_args("world", "tp", paths=("hf",))
    spawn_ranks(_rank, args.world, args.tp, args.hf, args.out)


if __name__ == "__main__":
    main()
