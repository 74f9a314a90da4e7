"""Multi-process scenario for the Hugging Face export tests (run as a script): saved runs to export.

    python export_worker.py --world 2 --tp 2 --case NAME HF_DIR INPUTS.pt RUN_DIR [--case ...]

Spawns `world` ranks (gloo, CPU); for each case every rank builds the Megatron actor (model, DDP,
optimizer) from the case's HF checkpoint, perturbs every weight (seeded; the same noise on every
rank for replicated weights), and records the model's full-vocabulary logits on the case's
inputs. Then it saves the actor the way a run does (`trainer.checkpoint.save_checkpoint` into
`RUN_DIR/checkpoints`), and rank 0 writes the run's `config.json` (the job config, as `Job` writes
it) and `RUN_DIR/megatron_logits.pt`. The test exports RUN_DIR with `launch/export_hf.py` and
compares the logits transformers computes from the export.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import zlib

import torch


PERTURB_STD = 0.02


def perturb_(model: torch.nn.Module, seed: int, tp_rank: int) -> None:
    """Add seeded noise to every parameter (# the same on every TP rank for replicated ones,
    which must stay equal; per-rank noise for TP-sharded ones)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            sharded = getattr(param, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()) + (1000 * tp_rank if sharded else 0))
            param.add_(PERTURB_STD * torch.randn(param.shape, generator=g).to(param.dtype))


def full_logits(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The model's logits on `inputs`, every TP rank's vocabulary slice joined. # [B, S, V]"""
    from tide_megatron.models.megatron_gpt import causal_attention_mask
    from tide_megatron.models.weight_conversion import unwrap_model

    ids = inputs["input_ids"]  # [B, S]
    batch, seq = ids.shape
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(seq)[None].expand(batch, seq)
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "image_mask") if k in inputs}
    with torch.no_grad():
        local = model(ids, positions, causal_attention_mask(seq), **extra).float()  # [B, S, V/tp]
    tp_group = unwrap_model(model).pg_collection.tp
    parts = [torch.empty_like(local) for _ in range(tp_group.size())]
    torch.distributed.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, -1)


def write_run_config(run_dir: str, hf_dir: str, tp: int) -> None:
    """The `config.json` a run writes at its start (`Job._setup_rank0`): the resolved job config."""
    from tide_megatron.config import JobConfig

    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=run_dir),
                              model=dataclasses.replace(cfg.model, path=hf_dir),
                              trainer=dataclasses.replace(cfg.trainer, tp_size=tp))
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)


def scenario(rank: int, tp: int, cases: list[tuple[str, str, str, str]]) -> None:
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.models.policy import model_config_from_checkpoint
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.checkpoint import save_checkpoint
    from tide_megatron.trainer.config import TrainerConfig

    registry = init_parallel(tp_size=tp, seed=0)
    tp_rank = registry.layout.tp_position(rank)
    for i, (_name, hf_dir, inputs_path, run_dir) in enumerate(cases):
        cfg = model_config_from_checkpoint(hf_dir)
        actor = MegatronActor(cfg, TrainerConfig(tp_size=tp), hf_dir)
        perturb_(actor.module, seed=100 + i, tp_rank=tp_rank)
        actor.step = 7 + i
        actor.module.eval()
        logits = full_logits(actor.module, torch.load(inputs_path))
        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            write_run_config(run_dir, hf_dir, tp)
            torch.save(logits, os.path.join(run_dir, "megatron_logits.pt"))
        save_checkpoint(actor, os.path.join(run_dir, "checkpoints"))
        del actor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--case", nargs=4, action="append", required=True,
                        metavar=("NAME", "HF_DIR", "INPUTS", "RUN_DIR"))
    args = parser.parse_args()
    from tide_megatron.models.megatron_gpt import spawn_ranks

    spawn_ranks(scenario, args.world, args.tp, args.case)


if __name__ == "__main__":
    main()
