"""Running a worker script or a whole job from a test or a benchmark: one place for what a
child process is given and how its failure reads.

Every integration test starts its ranks in a child process (a process group, SGLang's engine
and Megatron's globals must not outlive the test), with one intra-op thread per process (the
development and CI machines have two cores) and without the variable through which torchrun
tells its children to use the agent's store (a test run under torchrun would hand it on).
The worker scripts' side is here too: their command line (`worker_args`) and the tiny random
checkpoint they start from (`tiny_checkpoint`); their ranks start with
`models.megatron_gpt.spawn_ranks`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker_args(*ints: str, paths: tuple[str, ...] = ()) -> argparse.Namespace:
    """The command line of a test's worker script: `--out DIR` (created), an `--NAME N` for each
    of `ints` (default 1, e.g. `world`, `tp`) and a required `--NAME PATH` for each of `paths`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    for name in ints:
        parser.add_argument(f"--{name}", type=int, default=1)
    for name in paths:
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return args


def tiny_checkpoint(out_dir: str | os.PathLike, **model: Any) -> str:
    """A random Qwen2 checkpoint with the tiny BPE tokenizer under `out_dir/hf` (seed 0;
    `model` overrides `ModelConfig`'s fields). Returns its path."""
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.tokenizer import write_tokenizer

    tok = write_tokenizer(os.path.join(out_dir, "tok"), kind="tiny_bpe")
    return write_random_hf_checkpoint(os.path.join(out_dir, "hf"), ModelConfig(**model), seed=0, tokenizer_dir=tok)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.update(extra)
    return env


def run_script(script: str | os.PathLike, *args: Any, timeout: float, check: bool = True,
               stderr_tail: int = 6000) -> subprocess.CompletedProcess:
    """`python script args...` in a child process; with `check`, a non-zero exit fails the
    caller with the end of the child's stderr (where its traceback is)."""
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env=child_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{Path(script).name} exited {proc.returncode}:\n{proc.stderr[-stderr_tail:]}")
    return proc


def run_report(script: str | os.PathLike, out_dir: str | os.PathLike, *args: Any, timeout: float,
               report: str = "results.json") -> dict:
    """Run a worker script that writes a JSON `report` into `--out out_dir`; return it."""
    run_script(script, *args, "--out", out_dir, timeout=timeout)
    return json.loads((Path(out_dir) / report).read_text())


def report_fixture(script: str | os.PathLike, *, timeout: float, report_file: str = "results.json"):
    """A module-scoped pytest fixture named `report`: `run_report` of `script` once, into a
    temporary folder, for every test of the module that asks for it."""
    import pytest

    def report(tmp_path_factory) -> dict:
        return run_report(script, tmp_path_factory.mktemp(Path(script).stem), timeout=timeout, report=report_file)

    return pytest.fixture(scope="module", name="report")(report)


def run_job(*overrides: str, recipe: str = "tiny_cpu", nproc: int = 2, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`launch/torchrun.py --nproc-per-node N launch/train.py +recipe=R overrides...` from the
    repository root, progress lines off; the caller checks the outcome (errors are tested too)."""
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", str(nproc),
           str(REPO / "launch" / "train.py"), f"+recipe={recipe}", "metrics.progress=false", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or child_env(), cwd=REPO)


def checked_job(run_dir: str | os.PathLike, *overrides: str, recipe: str, steps: int,
                timeout: float = 600) -> Path:
    """`run_job` writing into `run_dir` for `steps` steps (a checkpoint every step); a non-zero
    exit fails the caller with the end of the job's stderr. Returns `run_dir`."""
    proc = run_job(f"run.output_dir={run_dir}", f"run.steps={steps}", "run.checkpoint_interval=1", *overrides,
                   recipe=recipe, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{recipe} exited {proc.returncode}:\n{proc.stderr[-8000:]}")
    return Path(run_dir)


def slow_env(step_median_s: float = 0.5) -> list[str]:
    """Overrides that give the run's first env a long-tailed latency (log-normal env steps of
    median `step_median_s`, sigma 0.3; 0.1 s resets), so that tasks are resident when a step
    boundary, a move or a fault comes."""
    return ["envs.server.envs.0.latency.enabled=true", f"envs.server.envs.0.latency.step_median_s={step_median_s}",
            "envs.server.envs.0.latency.step_sigma=0.3", "envs.server.envs.0.latency.reset_median_s=0.1"]


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """A run's per-step metrics (`metrics.jsonl`), in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
