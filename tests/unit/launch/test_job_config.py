"""Hydra composition of the job config: recipes, overrides, and the errors users see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
import hydra_schema  # noqa: E402

from tide_megatron.config import JobConfig, check_runnable, validate  # noqa: E402


@pytest.fixture()
def compose_job():
    hydra_schema.register()
    GlobalHydra.instance().clear()

    def _compose(*overrides: str) -> JobConfig:
        with initialize_config_dir(config_dir=hydra_schema.CONFIG_DIR, version_base="1.3"):
            return hydra_schema.to_job_config(compose(config_name="config", overrides=list(overrides)))

    yield _compose
    GlobalHydra.instance().clear()


def test_no_recipe_is_the_tiny_cpu_run(compose_job):
    job = compose_job()
    assert isinstance(job, JobConfig)
    assert job.run.name == "tiny_cpu" and job.scheduler.mode == "sync_split" and job.rollout.engine.device == "cpu"
    assert job.run.output_dir == "outputs/tiny_cpu"  # interpolation resolved


@pytest.mark.parametrize("recipe,world", [("tiny_cpu", 2), ("webshop_qwen2_5_7b", 32), ("osworld_qwen3vl", 32),
                                          ("text_emulated", 32)])
def test_recipes_compose_and_validate(compose_job, recipe, world):
    from tide_megatron.job_plan import plan_job

    job = compose_job(f"+recipe={recipe}")
    assert job.run.name == recipe
    resolved, plan = plan_job(job, world // min(world, 8), min(world, 8))
    validate(resolved, world)
    assert resolved.cluster.rollout_ranks == len(plan.rollout_ranks) >= 1


@pytest.mark.parametrize("recipe,dp", [("webshop_qwen2_5_7b", 6), ("osworld_qwen3vl", 4)])
def test_real_recipes_lay_out_a_tp_by_dp_trainer_in_tide_mode(compose_job, recipe, dp):
    from tide_megatron.comm.groups import GroupLayout
    from tide_megatron.job_plan import plan_job
    from tide_megatron.trainer.assignment import TrainerAssignment

    job, plan = plan_job(compose_job(f"+recipe={recipe}"), 4, 8)
    assert job.scheduler.mode == "tide"
    trainers = 32 - job.cluster.rollout_ranks - job.cluster.ref_ranks
    start = TrainerAssignment.at_startup(GroupLayout(32, job.trainer.tp_size), range(trainers),
                                         range(trainers, trainers + job.cluster.ref_ranks))
    assert start.dp_size == dp == plan.dp_size and len(start.actor_ranks) == trainers


def test_reference_ranks_must_be_whole_tp_blocks(compose_job):
    job = compose_job("+recipe=osworld_qwen3vl", "cluster.ref_ranks=1")
    with pytest.raises(ValueError, match="whole TP blocks"):
        check_runnable(job, 32)


def test_overrides_reach_the_dataclasses(compose_job):
    job = compose_job("+recipe=tiny_cpu", "trainer.lr=3e-4", "scheduler.group_size=8", "run.name=x")
    assert job.trainer.lr == 3e-4 and job.scheduler.group_size == 8 and job.run.output_dir == "outputs/x"


@pytest.mark.parametrize("override,message", [
    ("trainer.no_such_key=1", "no_such_key"),
    ("run.steps=many", "run.steps"),
    ("+recipe=no_such_recipe", "recipe/no_such_recipe"),
    ("cluster.emulation.dilation=0", "cluster.emulation.dilation=0"),
])
def test_bad_overrides_fail_naming_the_key(compose_job, override, message):
    with pytest.raises(Exception) as info:
        compose_job(override)
    text = str(info.value) + str(getattr(info.value, "__cause__", ""))
    assert message in text


@pytest.mark.parametrize("override,world,message", [
    ("cluster.rollout_ranks=2", 2, "cluster.rollout_ranks=2"),
    ("trainer.tp_size=2", 2, "trainer.tp_size=2"),
    ("scheduler.group_size=1", 2, "group_size"),
    ("envs.train_env=nope", 2, "envs.train_env='nope'"),
    ("scheduler.mode=fast", 2, "scheduler.mode='fast'"),
    ("scheduler.task_order=shuffled", 2, "scheduler.task_order='shuffled': expected one of"),
    ("scheduler.min_groups_per_step=9", 2, "scheduler.min_groups_per_step=9: expected 0"),
    ("scheduler.groups_per_step=0", 2, "scheduler.groups_per_step=0: a step trains at least one group"),
    ("scheduler.control_poll_s=0", 2, "scheduler.control_poll_s=0.0: rank 0 reads its mailbox"),
    ("ra2p.executor=vs", 2, "ra2p.executor=vs with scheduler.mode=sync_split"),
    ("scheduler.mode=stream ra2p.executor=decoupled", 2, "ra2p.executor=decoupled with scheduler.mode=stream"),
    ("cluster.device=tpu", 2, "cluster.device='tpu'"),
    ("cluster.device=emulated scheduler.weight_sync_path=broadcast", 2, "scheduler.weight_sync_path=host"),
])
def test_validate_names_the_offending_keys(compose_job, override, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate(compose_job(*override.split()), world)


@pytest.mark.parametrize("executor,runs", [("auto", "vso"), ("vs", "vs"), ("vso", "vso"), ("colocated", "colocated")])
def test_the_stream_baseline_runs_the_executor_it_is_tuned_to(compose_job, executor, runs):
    from tide_megatron.controller.modes import mode_policy

    cfg = compose_job("scheduler.mode=stream", f"ra2p.executor={executor}")
    validate(cfg, 2)
    assert mode_policy("stream", ra2p_executor=cfg.ra2p.executor).executor == runs


@pytest.mark.parametrize("mode,executor", [("tide", "auto"), ("tide", "colocated"), ("async_static", "auto"),
                                           ("sync", "auto"), ("sync_split", "auto"), ("stream", "colocated"),
                                           ("stream", "vs"), ("stream", "vso")])
@pytest.mark.parametrize("offload", [False, True])
def test_only_vso_and_the_offload_key_park_the_idle_model(compose_job, mode, executor, offload):
    # No mode swaps models where another keeps both resident: RA2P's colocated mode and the
    # baselines' one-round executors park the idle model only under ra2p.offload_idle_model.
    from tide_megatron.controller.modes import mode_policy

    cfg = compose_job(f"scheduler.mode={mode}", f"ra2p.executor={executor}", f"ra2p.offload_idle_model={offload}")
    policy = mode_policy(mode, ra2p_executor=cfg.ra2p.executor)
    colocated = policy.colocated_config(cfg.ra2p.cost_model.aggregation_limit, cfg.ra2p.offload_idle_model)
    expected = {"vso": True, "vs": False}.get(policy.executor, offload)
    assert colocated.offload is expected


def test_cfg_job_prints_the_composed_real_recipe():
    out = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "+recipe=osworld_qwen3vl", "--cfg", "job"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "name: osworld_qwen3vl" in out.stdout and "train_env: osworld" in out.stdout


def test_train_outside_torchrun_says_how_to_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu",
                          f"run.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode != 0
    assert "torchrun" in out.stderr
