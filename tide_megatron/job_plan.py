"""A job's rank plan and resource estimates, from its `JobConfig` and the machine.

The bridge between the configuration and `core/rank_plan.py` / `core/memory_estimate.py`, used
in three places, so that they agree: the launcher's check before any rank starts
(`launch/torchrun.py`, the Slurm script), the dry run (`launch/train.py --dry-run`), and every
rank at start-up (`job.Job`: its role, GPU, engine GPUs and groups).
"""

from __future__ import annotations

import dataclasses
import json
import os

from tide_megatron.config import JobConfig, check_runnable, validate
from tide_megatron.controller.modes import moves_ranks
from tide_megatron.core.memory_estimate import (
    GB,
    LinkModel,
    ModelShape,
    TrainerMemoryInputs,
    broadcast_sync_seconds,
    engine_memory,
    node_sync_seconds,
    relay_sync_seconds,
    trainer_memory,
)
from tide_megatron.core.rank_plan import PlanError, PlanRequest, RankPlan, describe, plan_ranks

# Shapes of the models the shipped recipes name, from the `config.json` of each Hugging Face
# release (only the fields memory depends on), for a dry run on a machine without the weights.
PUBLISHED_CONFIGS: dict[str, dict] = {
    "Qwen2.5-1.5B-Instruct": dict(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12,
                                  num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                  tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                                num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                tie_word_embeddings=False),
    "Qwen2.5-14B-Instruct": dict(num_hidden_layers=48, hidden_size=5120, num_attention_heads=40,
                                 num_key_value_heads=8, intermediate_size=13824, vocab_size=152064,
                                 tie_word_embeddings=False),
    "Qwen3-VL-4B-Instruct": dict(
        tie_word_embeddings=True,
        text_config=dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=9728, vocab_size=151936),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560,
                           spatial_merge_size=2, deepstack_visual_indexes=[5, 11, 17])),
}


# SGLang picks `mem_fraction_static` from the GPU's memory and its parallel sizes when a recipe
# leaves it unset; the dry run assumes this share of an 80 GB GPU instead of guessing its rules.
ASSUMED_MEM_FRACTION = 0.88


def machine_from_env() -> tuple[int, int]:
    """(nodes, processes per node) of the torchrun job this process belongs to."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        raise PlanError(f"WORLD_SIZE={world} is not a whole number of nodes of LOCAL_WORLD_SIZE={local} processes")
    return world // local, local


def model_shape(cfg: JobConfig) -> tuple[ModelShape, str]:
    """The model's shape and where it was read: `model.path`'s config.json when it is there,
    else the published config of a release of that name, else the random model the run writes."""
    path = cfg.model.path
    if path:
        config = os.path.join(path, "config.json")
        name = os.path.basename(os.path.normpath(path))
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                return ModelShape.from_hf_config(name, json.load(f)), config
        if name in PUBLISHED_CONFIGS:
            return (ModelShape.from_hf_config(name, PUBLISHED_CONFIGS[name]),
                    f"the published config.json of {name} ({config} is not on this machine)")
        raise PlanError(f"model.path={path!r}: no config.json here and no published shape of {name!r} "
                        f"(known: {', '.join(PUBLISHED_CONFIGS)}); run the dry run where the model is")
    r = cfg.model.random_init
    shape = ModelShape(name="random", num_layers=r.num_layers, hidden_size=r.hidden_size,
                       num_attention_heads=r.num_attention_heads, num_key_value_heads=r.num_key_value_heads,
                       head_dim=r.hidden_size // r.num_attention_heads, ffn_hidden_size=r.ffn_hidden_size,
                       vocab_size=3072, tie_word_embeddings=r.tie_word_embeddings)
    return shape, "model.random_init (written at start-up)"


def plan_request(cfg: JobConfig, nnodes: int, gpus_per_node: int, shape: ModelShape | None = None) -> PlanRequest:
    return PlanRequest(
        nnodes=nnodes, gpus_per_node=gpus_per_node, rollout_ranks=cfg.cluster.rollout_ranks,
        rollout_share=cfg.cluster.rollout_share, ref_ranks=cfg.cluster.ref_ranks, trainer_tp=cfg.trainer.tp_size,
        trainer_pp=cfg.trainer.pp_size, engine_tp=cfg.rollout.engine.tp_size,
        ers_moves_ranks=moves_ranks(cfg),
        num_attention_heads=shape.num_attention_heads if shape else None,
        num_key_value_heads=shape.num_key_value_heads if shape else None)


def plan_job(cfg: JobConfig, nnodes: int, gpus_per_node: int,
             shape: ModelShape | None = None) -> tuple[JobConfig, RankPlan]:
    """The plan, and `cfg` with the plan's rollout count in `cluster.rollout_ranks`, checked as
    the job will check it (PlanError or ValueError, one line naming the key)."""
    plan = plan_ranks(plan_request(cfg, nnodes, gpus_per_node, shape))
    resolved = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, rollout_ranks=len(plan.rollout_ranks), rollout_share=0.0))
    validate(resolved, plan.world_size)
    check_runnable(resolved, plan.world_size)
    return resolved, plan


@dataclasses.dataclass
class DryRun:
    """What `launch/train.py --dry-run` prints, and whether the plan can work."""

    lines: list[str]
    error: str | None = None


def dry_run(cfg: JobConfig, nnodes: int, gpus_per_node: int, gpu_memory_gb: float = 80.0,
            link: LinkModel = LinkModel()) -> DryRun:
    """The plan, per-GPU memory and the weight-sync time of `cfg` on `nnodes` x `gpus_per_node`
    GPUs of `gpu_memory_gb` each, without loading a model or starting anything."""
    lines: list[str] = []
    try:
        shape, source = model_shape(cfg)
        lines.append(f"model: {shape.name}, {shape.params / 1e9:.2f}B parameters (shape from {source})")
        resolved, plan = plan_job(cfg, nnodes, gpus_per_node, shape)
    except (PlanError, ValueError) as exc:
        return DryRun(lines, str(exc))
    lines += describe(plan)
    tr, engine_cfg = resolved.trainer, resolved.rollout.engine
    wbytes = 2 if tr.bf16 else 4
    row = min(resolved.rollout.runner.max_context_tokens, tr.micro_batch_tokens)
    inputs = TrainerMemoryInputs(tp=tr.tp_size, pp=tr.pp_size, dp=plan.dp_size, bf16=tr.bf16,
                                 distributed_optimizer=tr.distributed_optimizer, with_reference=tr.kl_coef > 0 and not resolved.ra2p.offload_idle_model,
                                 micro_batch_tokens=tr.micro_batch_tokens, row_tokens=row, recompute=tr.recompute,
                                 packed=tr.packing)
    trainer = trainer_memory(shape, inputs, gpu_memory_gb)
    lines.append(f"memory per GPU ({gpu_memory_gb:g} GB each, estimates: core/memory_estimate.py)")
    rows = "packed" if tr.packing else f"in rows of {row}"
    lines.append(f"  trainer rank (TP {tr.tp_size}, PP {tr.pp_size}, recompute {tr.recompute}, micro-batch "
                 f"{tr.micro_batch_tokens} tokens {rows}): {trainer.describe()}")
    dtype_bytes = 2 if engine_cfg.dtype in ("bfloat16", "float16", "half") else 4
    fraction = engine_cfg.mem_fraction_static or ASSUMED_MEM_FRACTION
    engine = engine_memory(shape, gpu_memory_gb, engine_cfg.tp_size, dtype_bytes, fraction,
                           engine_cfg.max_total_tokens)
    lines.append(f"  rollout engine GPU (mem_fraction_static {fraction:g}): {engine.line.describe()}; "
                 f"KV pool {engine.kv_tokens} tokens = {engine.kv_tokens // max(1, resolved.rollout.runner.max_context_tokens)}"
                 f" full contexts of {resolved.rollout.runner.max_context_tokens}")
    by_node: dict[int, int] = {}
    for engine_placement in plan.engines:
        by_node[engine_placement.node] = by_node.get(engine_placement.node, 0) + 1
    model_bytes = shape.params * wbytes
    host = node_sync_seconds(model_bytes, by_node, plan.slot(0).node, tr.tp_size, link)
    relays = sum(1 for node in by_node if node != plan.slot(0).node)
    broadcast = broadcast_sync_seconds(model_bytes, relays > 0, tr.tp_size, link)
    paths = {"host": (f"one shared copy per node ({relays} relayed over the network): ~{host:.1f} s per step "
                      f"(PCIe {link.pcie_gbps:g} GB/s, gloo {link.gloo_gbps:g} GB/s assumed)"),
             "broadcast": (f"one bucketed broadcast from the trainer's GPU: ~{broadcast:.2f} s per step "
                           f"({'NIC' if relays else 'NVLink'} {link.nic_gbps if relays else link.nvlink_gbps:g} "
                           f"GB/s assumed)")}
    chosen = resolved.scheduler.weight_sync_path
    other = next(p for p in paths if p != chosen)
    other_s = f"~{host:.1f} s" if other == "host" else f"~{broadcast:.2f} s"
    lines.append(f"weight sync ({chosen} path, scheduler.weight_sync_path): {model_bytes / GB:.1f} GB to "
                 f"{len(plan.engines)} engine(s) on {len(by_node)} node(s), {paths[chosen]}; the {other} path: "
                 f"{other_s}; the earlier rank-0 relay: "
                 f"~{relay_sync_seconds(model_bytes, len(plan.engines), tr.tp_size, link):.1f} s")
    error = None
    if not trainer.fits:
        packing = "" if tr.packing else "set trainer.packing=true, "
        error = (f"trainer GPU memory {trainer.total_gb:.1f} GB over {trainer.budget_gb:.1f} GB: {packing}set "
                 f"trainer.recompute=selective (or full), raise trainer.tp_size, lower trainer.micro_batch_tokens, or "
                 f"park the reference in host memory (ra2p.offload_idle_model=true)")
    elif not engine.line.fits:
        error = (f"rollout engine weights {engine.line.parts[0][1]:.1f} GB do not fit rollout.engine.mem_fraction_static="
                 f"{fraction:g} of {gpu_memory_gb:g} GB: raise rollout.engine.tp_size or mem_fraction_static")
    elif engine.kv_tokens < resolved.rollout.runner.max_context_tokens:
        error = (f"rollout engine KV pool {engine.kv_tokens} tokens < rollout.runner.max_context_tokens="
                 f"{resolved.rollout.runner.max_context_tokens}: raise rollout.engine.mem_fraction_static or tp_size")
    return DryRun(lines, error)
