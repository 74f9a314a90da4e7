"""The end-to-end benchmark scripts, dry: every job they would launch composes and validates as
`launch/train.py` would compose it, and each script writes its record when its runs fail.

A benchmark runs for tens of minutes, so a stale override or an argument a shared helper reads
but a script does not define otherwise shows only at its first run (`run_one` is shared by
`e2e_goodput.py`, `sleep_on_idle.py` and `task_handover.py`). Here `subprocess.run` is replaced
by a check that composes the job from the command line and fails the run ("dry run")."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
sys.path.insert(0, str(REPO / "benchmarks"))
import emulated_runs  # noqa: E402
import hydra_schema  # noqa: E402

from tide_megatron.config import JobConfig, validate  # noqa: E402


class LaunchedJobs(list):
    """(nproc, JobConfig) per launch, and in `envs` each launch's environment."""

    def __init__(self):
        super().__init__()
        self.envs: list[dict[str, str]] = []
        self.trees: list[Path] = []


@pytest.fixture()
def launched(monkeypatch):
    """The jobs a benchmark launches, as (nproc, JobConfig); each run fails without starting."""
    jobs = LaunchedJobs()
    hydra_schema.register()
    real_run = subprocess.run

    def dry_run(cmd, **kwargs):
        if len(cmd) < 2 or Path(cmd[1]).parts[-2:] != ("launch", "torchrun.py"):  # e.g. `platform`'s `uname -p`
            return real_run(cmd, **kwargs)
        tree = Path(cmd[1]).parent.parent  # this checkout, or a baseline's worktree
        assert cmd[2] == "--nproc-per-node"
        assert Path(cmd[4]) == tree / "launch" / "train.py"
        jobs.trees.append(tree)
        nproc, overrides = int(cmd[3]), cmd[5:]
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=hydra_schema.CONFIG_DIR, version_base="1.3"):
            job = hydra_schema.to_job_config(compose(config_name="config", overrides=overrides))
        validate(job, nproc)
        jobs.append((nproc, job))
        jobs.envs.append(kwargs.get("env") or {})
        return subprocess.CompletedProcess(cmd, 1, "", "dry run")

    def dry_job(cmd, timeout_s, env, cwd):  # emulated_runs.run_job: a launch in a session of its own
        return dry_run(cmd, env=env).returncode, "dry run"

    monkeypatch.setattr(subprocess, "run", dry_run)
    monkeypatch.setattr(emulated_runs, "run_job", dry_job)
    yield jobs
    GlobalHydra.instance().clear()


def run_script(name: str, monkeypatch, *argv: str) -> int:
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / f"{name}.py"), *argv])
    return module.main()


def record(path: Path, runs: int) -> dict:
    data = json.loads(path.read_text())
    assert data["command"].startswith("python benchmarks/") and data["date"] and data["machine"]["cpu_count"]
    assert len(data["runs"]) == runs and all(r["failed"] and "dry run" in r["error"] for r in data["runs"])
    return data


def test_e2e_goodput_runs_tide_with_ers_on_and_off_at_every_split(launched, monkeypatch, tmp_path):
    out = tmp_path / "e2e.json"
    assert run_script("e2e_goodput", monkeypatch, "--ranks", "4", "--modes", "tide", "--ers", "--steps", "2",
                      "--reps", "2", "--env-latency", "off", "--out", str(out)) == 1  # no run succeeded
    # 5 splits of 4 ranks (1-3 rollout ranks, with or without a reference rank), ERS off and on,
    # twice: the second repetition in reverse order, with the next seed
    assert len(launched) == 20 and all(n == 4 for n, _ in launched)
    first, second = [job for _, job in launched[:10]], [job for _, job in launched[10:]]
    splits = [(j.cluster.rollout_ranks, j.cluster.ref_ranks, j.ers.enabled) for j in first]
    assert len(set(splits)) == 10 and sum(e for *_, e in splits) == 5
    assert splits[::-1] == [(j.cluster.rollout_ranks, j.cluster.ref_ranks, j.ers.enabled) for j in second]
    assert {j.run.seed for j in first} == {0} and {j.run.seed for j in second} == {1}
    for job in first + second:
        assert job.scheduler.mode == "tide" and job.run.steps == 2 and job.scheduler.groups_per_step == 4
        assert job.envs.server.envs[0].latency.enabled is False  # --env-latency off wins over LATENCY
    data = record(out, 20)
    assert data["config"]["env_latency"] == "off" and data["ratios"] == {}


def test_e2e_goodput_runs_only_the_splits_named(launched, monkeypatch, tmp_path):
    out = tmp_path / "e2e.json"
    assert run_script("e2e_goodput", monkeypatch, "--ranks", "4", "--modes", "tide", "--ers", "--splits", "r1f1,r3f0",
                      "--reps", "1", "--out", str(out)) == 1
    assert [(j.cluster.rollout_ranks, j.cluster.ref_ranks, j.ers.enabled) for _, j in launched] == [
        (1, 1, False), (1, 1, True), (3, 0, False), (3, 0, True)]
    assert record(out, 4)["config"]["splits"] == ["r1f1", "r3f0"]
    with pytest.raises(SystemExit):  # r3f1 leaves no actor rank of 4
        run_script("e2e_goodput", monkeypatch, "--ranks", "4", "--modes", "tide", "--splits", "r3f1")


def test_e2e_goodput_runs_stream_with_each_executor_and_sync_once(launched, monkeypatch, tmp_path):
    """stream is tuned like a user would: one run per executor (its best is the baseline); sync
    time-shares every rank, so its start-up split is run once."""
    assert run_script("e2e_goodput", monkeypatch, "--ranks", "3", "--modes", "sync,stream", "--reps", "1",
                      "--out", str(tmp_path / "e2e.json")) == 1
    assert [(j.scheduler.mode, j.ra2p.executor, j.cluster.rollout_ranks) for _, j in launched] == [
        ("sync", "auto", 1), ("stream", "vso", 1), ("stream", "vs", 1), ("stream", "colocated", 1),
        ("stream", "vso", 2), ("stream", "vs", 2), ("stream", "colocated", 2)]


def test_e2e_goodput_keeps_the_long_tailed_env_latency_by_default(launched, monkeypatch, tmp_path):
    assert run_script("e2e_goodput", monkeypatch, "--ranks", "2", "--modes", "sync", "--reps", "1",
                      "--out", str(tmp_path / "e2e.json")) == 1
    (nproc, job), = launched
    latency = job.envs.server.envs[0].latency
    assert nproc == 2 and job.scheduler.mode == "sync" and latency.enabled and latency.slow_step_factor == 20


@pytest.mark.parametrize("name,override", [("sleep_on_idle", "rollout.engine.sleep_on_idle"),
                                           ("task_handover", "ers.hand_over_tasks")])
def test_the_paired_benchmarks_alternate_their_two_variants(name, override, launched, monkeypatch, tmp_path):
    out = tmp_path / f"{name}.json"
    assert run_script(name, monkeypatch, "--reps", "2", "--out", str(out)) == 1
    section, key = override.rsplit(".", 1)
    values = []
    for _, job in launched:
        node = job
        for part in section.split("."):
            node = getattr(node, part)
        values.append(getattr(node, key))
        assert job.scheduler.mode == "tide" and job.envs.server.envs[0].latency.enabled
    assert values == [True, False, False, True]  # alternating order
    record(out, 4)


def test_engine_start_times_the_drill_job_with_forked_and_spawned_children(launched, monkeypatch, tmp_path):
    out = tmp_path / "engine_start.json"
    assert run_script("engine_start", monkeypatch, "--engine-reps", "0", "--job-reps", "2", "--rank-job-reps", "2",
                      "--out", str(out)) == 1
    # SGLang's children forked and spawned, then the ranks forked and started (children forked)
    assert [job.rollout.engine.fork_children for _, job in launched] == [True, False, False, True] + [True] * 4
    assert [env["TIDE_PRELOAD_RANKS"] for env in launched.envs] == ["1"] * 4 + ["1", "0", "0", "1"]
    for nproc, job in launched:
        assert nproc == 4 and job.scheduler.mode == "tide" and job.ers.drill_every == 1 and job.run.steps == 5
    data = json.loads(out.read_text())
    assert data["command"].startswith("python benchmarks/engine_start.py") and data["figures"]["engine_ready_s"]["mean"] == {}
    for runs in (data["job_runs"], data["rank_job_runs"]):
        assert len(runs) == 4 and all(r["failed"] and "dry run" in r["error"] for r in runs)


def test_control_plane_alternates_this_checkout_with_a_baseline_commits(launched, monkeypatch, tmp_path):
    out = tmp_path / "control_plane.json"
    assert run_script("control_plane", monkeypatch, "--ranks", "8", "--dilations", "2", "--reps", "2",
                      "--baseline", "HEAD", "--out", str(out)) == 1
    assert [n for n, _ in launched] == [8] * 4
    here = [tree == REPO for tree in launched.trees]
    assert here == [True, False, False, True] and all((t / "launch" / "train.py").is_absolute() for t in launched.trees)
    assert all(job.cluster.emulation.dilation == 2.0 for _, job in launched)
    data = record(out, 4)
    assert [r["tree"] for r in data["runs"]] == ["current", "baseline HEAD", "baseline HEAD", "current"]
    assert not launched.trees[1].exists()  # the worktree is removed


def test_rank_memory_alternates_forked_and_started_ranks(launched, monkeypatch, tmp_path):
    out = tmp_path / "rank_memory.json"
    assert run_script("rank_memory", monkeypatch, "--ranks", "8", "--reps", "2", "--out", str(out)) == 1
    assert [n for n, _ in launched] == [8] * 4
    assert [env["TIDE_PRELOAD_RANKS"] for env in launched.envs] == ["1", "0", "0", "1"]
    assert all(job.cluster.emulation.dilation == 4.0 and job.run.steps == 2 for _, job in launched)
    assert record(out, 4)["means"] == []  # no run measured anything
