"""Multi-process Megatron scenario for the Qwen3-VL trainer tests (run as a script).

    python qwen3_vl_worker.py --world 2 --tp 2 --hf HF_DIR --records RECORDS.json --out OUT_DIR

Spawns `world` ranks (gloo, CPU); every rank builds the Megatron Qwen3-VL actor and reference from
the HF checkpoint, turns the trajectory records (the rollout's JSON form: token ids with expanded
image pads, loss mask, base64 images and their grids) into micro-batches, and records log-probs,
GRPO steps, gradients, the weights converted back to HF, and a checkpoint round trip. Rank 0 writes
`OUT_DIR/results.pt`; the test process compares it with Hugging Face.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from packed_copy import packed_like
from tide_megatron.testing import worker_args


def scenario(rank: int, tp: int, hf_dir: str, records: list[dict], out_dir: str) -> dict:
    from tide_megatron.trainer.payload import to_train_trajectory
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.models.policy import model_config_from_checkpoint
    from tide_megatron.core.trajectory import Trajectory
    from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
    from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
    from tide_megatron.trainer.batch import BatchLayout, micro_batches_by_budget
    from tide_megatron.trainer.checkpoint import load_latest_checkpoint, save_checkpoint
    from tide_megatron.trainer.config import TrainerConfig

    init_parallel(tp_size=tp, seed=0)
    cfg = model_config_from_checkpoint(hf_dir)
    tcfg = TrainerConfig(lr=2e-3, kl_coef=0.05, clip_grad=1.0, micro_batch_tokens=160)
    images = TrajectoryImages.for_model(cfg, hf_dir)
    trajectories = [to_train_trajectory(Trajectory.from_tokens(**r), images) for r in records]
    mbs = micro_batches_by_budget(trajectories, tcfg.micro_batch_tokens, BatchLayout(packed=False))
    actor = MegatronActor(cfg, tcfg, hf_dir)
    ref = ReferenceModel(cfg, hf_dir)
    results: dict = {"rows": [[len(t) for t in trajectories]], "micro_batches": len(mbs),
                     "images_per_micro_batch": [0 if mb.image_grid_thw is None else len(mb.image_grid_thw) for mb in mbs]}
    results["initial_logprobs"] = [actor.logprobs(mb) for mb in mbs]
    results["ref_logprobs"] = [ref.logprobs(mb) for mb in mbs]
    results["loss_masks"] = [mb.loss_mask for mb in mbs]
    results["advantages"] = [mb.advantages for mb in mbs]
    for mb, lp in zip(mbs, results["initial_logprobs"]):
        mb.old_logprobs = lp * mb.loss_mask
    ref.attach_logprobs(mbs)

    # Gradients reach the vision tower (through the image features and DeepStack) and the LM.
    padded_reports = actor.forward_backward(mbs)
    grads = {n: p.main_grad.detach().norm().item() for n, p in actor.module.named_parameters()}
    results["grad_norms"] = grads
    # The same trajectories packed (MRoPE positions and images travel with each trajectory).
    padded_grads = {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()}
    packed = [packed_like(mb, trajectories) for mb in mbs]
    packed_reports = actor.forward_backward(packed)
    results["packed_grad_diff"] = (max((p.main_grad - padded_grads[n]).abs().max().item()
                                       for n, p in actor.module.named_parameters()),
                                   max(g.abs().max().item() for g in padded_grads.values()))
    results["packed_loss"] = [(float(a["loss"][0]), float(b["loss"][0]), float(a["loss"][1]), float(b["loss"][1]))
                              for a, b in zip(padded_reports, packed_reports)]
    results["packed_images"] = [0 if mb.image_grid_thw is None else len(mb.image_grid_thw) for mb in packed]

    steps = [actor.train_step(mbs) for _ in range(3)]
    results["steps"] = [dataclasses.asdict(s) for s in steps]
    results["after_logprobs"] = [actor.logprobs(mb) for mb in mbs]
    hf_after = {name: t.clone() for name, t in actor.hf_weights()}
    if rank == 0:
        torch.save(hf_after, os.path.join(out_dir, "hf_after.pt"))

    # Checkpoint round trip: a fresh actor resumed from the checkpoint has the same policy.
    root = os.path.join(out_dir, "ckpt")
    save_checkpoint(actor, root)
    resumed = MegatronActor(cfg, tcfg, hf_dir)
    results["resumed_step"] = load_latest_checkpoint(resumed, root)
    results["resume_logprob_diff"] = max((resumed.logprobs(mb) - lp).abs().max().item()
                                         for mb, lp in zip(mbs, results["after_logprobs"]))
    trained = dict(actor.module.named_parameters())
    local = {f"rank{rank}:{n}": (p - trained[n]).abs().max().item()
             for n, p in resumed.module.named_parameters() if not torch.equal(p, trained[n])}
    every_rank: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, local)
    results["resume_param_diffs"] = {k: v for d in every_rank for k, v in d.items()}
    return results


def _rank(rank: int, tp: int, hf_dir: str, records_path: str, out_dir: str) -> None:
    with open(records_path) as f:
        records = json.load(f)
    results = scenario(rank, tp, hf_dir, records, out_dir)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def main() -> None:
    from tide_megatron.models.megatron_gpt import spawn_ranks

    args = worker_args("world", "tp", paths=("hf", "records"))
    spawn_ranks(_rank, args.world, args.tp, args.hf, args.records, args.out)


if __name__ == "__main__":
    main()
