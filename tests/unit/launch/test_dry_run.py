"""`launch/train.py --dry-run`, the memory estimates behind it, and the launcher's check before
any rank starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tide_megatron.core.memory_estimate import (
    LinkModel,
    ModelShape,
    TrainerMemoryInputs,
    broadcast_sync_seconds,
    engine_memory,
    relay_sync_seconds,
    trainer_memory,
)
from tide_megatron.job_plan import PUBLISHED_CONFIGS, dry_run

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
from hydra_schema import compose_job_config  # noqa: E402

RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))


def _header_world_sizes(recipe: str) -> list[tuple[int, int]]:
    """(nodes, processes per node) of each world size the recipe's header names."""
    header = (REPO / "recipes" / "recipe" / f"{recipe}.yaml").read_text()
    line = next(ln for ln in header.splitlines() if ln.startswith("# World sizes:"))
    return [(int(n), int(g)) for n, g in re.findall(r"\((\d+) nodes? x (\d+)", line)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_passes_the_dry_run_at_the_world_sizes_its_header_names(recipe):
    sizes = _header_world_sizes(recipe)
    assert sizes, f"{recipe}.yaml names no world size"
    cfg = compose_job_config([f"+recipe={recipe}"])
    for nodes, gpus in sizes:
        report = dry_run(cfg, nodes, gpus)
        assert report.error is None, (recipe, nodes, gpus, report.error)
        text = "\n".join(report.lines)
        assert f"{nodes * gpus} ranks" in text and "trainer rank" in text and "weight sync" in text


def test_the_gpu_plans_page_matches_the_code():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "dry_run_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_the_dry_run_command_prints_the_plan_and_fails_with_one_line_naming_the_key():
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "+recipe=webshop_qwen2_5_7b", "--dry-run"]
    ok = subprocess.run(cmd + ["--nnodes", "4", "--nproc-per-node", "8"], capture_output=True, text=True,
                        timeout=300, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert "32 ranks: 24 actor, 0 reference, 8 rollout" in ok.stdout
    assert "node 3: [24:engine GPUs 0]" in ok.stdout
    bad = subprocess.run(cmd + ["--nnodes", "1", "--nproc-per-node", "8", "trainer.recompute=none",
                                "trainer.packing=false", "trainer.micro_batch_tokens=16384"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode == 1
    assert bad.stderr.strip().count("\n") == 0 and "trainer.recompute=selective" in bad.stderr
    no_trainer = subprocess.run(cmd + ["--nproc-per-node", "8", "cluster.rollout_share=0", "cluster.rollout_ranks=8"],
                                capture_output=True, text=True, timeout=300, cwd=REPO)
    assert no_trainer.returncode == 1 and "leave no trainer rank" in no_trainer.stderr


def test_the_reference_counts_on_the_trainer_gpu_unless_it_is_parked_in_host_memory():
    def trainer_line(*overrides: str) -> str:
        report = dry_run(compose_job_config(["+recipe=webshop_qwen2_5_7b", *overrides]), 1, 8)
        return next(line for line in report.lines if "trainer rank" in line)

    assert "reference" in trainer_line()
    assert "reference" not in trainer_line("ra2p.offload_idle_model=true")


@pytest.mark.parametrize("name,params_b", [("Qwen2.5-1.5B-Instruct", 1.54), ("Qwen2.5-7B-Instruct", 7.61),
                                           ("Qwen2.5-14B-Instruct", 14.7), ("Qwen3-VL-4B-Instruct", 4.4)])
def test_published_shapes_give_the_model_cards_parameter_counts(name, params_b):
    shape = ModelShape.from_hf_config(name, PUBLISHED_CONFIGS[name])
    assert shape.params / 1e9 == pytest.approx(params_b, rel=0.03)


def _seven_b() -> ModelShape:
    return ModelShape.from_hf_config("7b", PUBLISHED_CONFIGS["Qwen2.5-7B-Instruct"])


def test_trainer_memory_by_part():
    shape = _seven_b()
    base = TrainerMemoryInputs(tp=4, pp=1, dp=2, bf16=True, distributed_optimizer=False, with_reference=True,
                               micro_batch_tokens=8192, row_tokens=8192)
    line = dict(trainer_memory(shape, base, 80).parts)
    shard = shape.params / 4
    assert line["weights"] == pytest.approx(shard * 2 / 1e9)
    assert line["grads"] == pytest.approx(shard * 4 / 1e9)
    assert line["optimizer"] == pytest.approx(shard * 12 / 1e9)
    assert line["reference"] == line["weights"]
    sharded = dict(trainer_memory(shape, TrainerMemoryInputs(**{**base.__dict__, "distributed_optimizer": True}), 80).parts)
    assert sharded["optimizer"] == pytest.approx(line["optimizer"] / 2)
    # Recompute only ever lowers activations, and halving the row length halves the O(L^2) part.
    acts = {mode: dict(trainer_memory(shape, TrainerMemoryInputs(**{**base.__dict__, "recompute": mode}), 80).parts)[
        "activations"] for mode in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    short = dict(trainer_memory(shape, TrainerMemoryInputs(**{**base.__dict__, "row_tokens": 4096}), 80).parts)
    assert short["activations"] < acts["none"]
    # Packed micro-batches hold no score matrix: below padded, and independent of the row length.
    packed = [dict(trainer_memory(shape, TrainerMemoryInputs(**{**base.__dict__, "packed": True, "row_tokens": row}),
                                  80).parts)["activations"] for row in (4096, 8192)]
    assert packed[0] == packed[1] < short["activations"]


def test_engine_kv_pool_is_what_the_static_share_leaves_after_the_weights():
    shape = _seven_b()
    mem = engine_memory(shape, 80, engine_tp=1, dtype_bytes=2, mem_fraction_static=0.8, max_total_tokens=None)
    weights, kv = dict(mem.line.parts)["weights"], dict(mem.line.parts)["kv pool"]
    assert weights + kv == pytest.approx(64, abs=0.01)
    assert mem.kv_tokens == int((64e9 - shape.params * 2) // (2 * 28 * 4 * 128 * 2))
    fixed = engine_memory(shape, 80, 1, 2, 0.8, max_total_tokens=1000)
    assert fixed.kv_tokens == 1000
    two = engine_memory(shape, 80, 2, 2, 0.8, None)
    assert two.kv_tokens > mem.kv_tokens  # half the weights and half the KV heads per GPU
    assert not engine_memory(shape, 16, 1, 2, 0.8, None).line.fits


def test_the_relay_estimate_grows_linearly_with_engines():
    t1, t2, t3 = (relay_sync_seconds(15e9, n, 4, LinkModel()) for n in (1, 2, 3))
    assert t3 - t2 == pytest.approx(t2 - t1) == pytest.approx(15e9 / (LinkModel().gloo_gbps * 1e9))


def test_the_launcher_checks_the_config_once_before_any_rank_starts(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
                           str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu", "scheduler.groups_per_step=0",
                           f"run.output_dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("launch/torchrun.py: the job cannot start: scheduler.groups_per_step=0: a step "
                                   "trains at least one group")
    assert not (tmp_path / "logs").exists()  # no rank started


def test_tokens_stay_off_command_lines_and_out_of_config_json(tmp_path):
    from tide_megatron.job import redact_secrets

    proc = subprocess.run([sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
                           str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu", "envs.client.auth_token=s3cret-s3cret-s3cret"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "TIDE_ENV_TOKEN" in proc.stderr and "s3cret" not in proc.stderr
    written = redact_secrets({"envs": {"client": {"auth_token": "s3cret", "port": 1}, "server": {"auth_token": ""}},
                              "list": [{"auth_token": "x"}]})
    assert written == {"envs": {"client": {"auth_token": "<redacted>", "port": 1}, "server": {"auth_token": ""}},
                       "list": [{"auth_token": "<redacted>"}]}


def test_the_broadcast_estimate_does_not_grow_with_engines_and_crosses_nodes_at_nic_speed():
    link = LinkModel()
    same_node, across = (broadcast_sync_seconds(15e9, off, 4, link) for off in (False, True))
    gather = 15e9 * 3 / 4 / (link.nvlink_gbps * 1e9)
    assert same_node == pytest.approx(gather + 15e9 / (link.nvlink_gbps * 1e9))
    assert across == pytest.approx(gather + 15e9 / (link.nic_gbps * 1e9))
    assert across < relay_sync_seconds(15e9, 1, 4, link)  # below even the relay to one engine
