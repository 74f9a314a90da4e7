"""Restartable jobs and bad input, end to end on the tiny recipe (two ranks, real SGLang and
Megatron), through `launch/torchrun.py`:

- rank 0 is SIGKILLed after step 3 (the test-only fault injector) under `--max-restarts 1`
  with `run.resume=auto`: torchrun restarts the job, it resumes from the step-2 checkpoint,
  every step is in metrics.jsonl once, the sampler and the ledger continue, and no process of
  the job listened off loopback;
- a truncated shard in the newest checkpoint: the next run falls back to the one before;
- bad inputs end with one line naming the key or file, and no traceback.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
FAST = ["scheduler.groups_per_step=2", "scheduler.group_size=2", "rollout.runner.max_turns=4"]
GROUPS_PER_STEP = 2


def launch(*overrides: str, restarts: int = 0, env: dict | None = None,
           timeout: int = 900) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run a job; returns its result and every address a process of the job listened on.
    Output goes to files, not pipes: a leftover process holding a pipe cannot hang the test,
    and none may be left (asserted here)."""
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
           "--max-restarts", str(restarts), str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu",
           "metrics.progress=false", *overrides]
    listeners: set[str] = set()
    seen: dict[int, psutil.Process] = {}
    done = threading.Event()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

        def watch() -> None:
            while not done.is_set():
                try:
                    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    return
                for p in tree:
                    seen.setdefault(p.pid, p)
                    try:
                        listeners.update(c.laddr.ip for c in p.net_connections(kind="tcp")
                                         if c.status == psutil.CONN_LISTEN)
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            proc.wait(timeout=timeout)
        finally:
            done.set()
            proc.kill()
        watcher.join(timeout=5)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[' '.join(p.cmdline())[:120] for p in left]}"
    return result, listeners


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def saved_run_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "run_state.json").read_text())


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    proc, listeners = launch(f"run.output_dir={run_dir}", "run.steps=4", "run.checkpoint_interval=2",
                             "run.resume=auto", *FAST, restarts=1, env={"TIDE_FAULT_KILL_RANK0_AFTER_STEP": "3"})
    assert proc.returncode == 0, proc.stderr[-8000:]
    return run_dir, proc, listeners


def test_killed_job_restarts_and_continues_where_it_was(restarted):
    run_dir, proc, listeners = restarted
    output = proc.stdout + proc.stderr
    assert "TIDE_FAULT_KILL_RANK0_AFTER_STEP=3: killing this process" in output  # the first attempt did die
    assert "run.resume=auto: no checkpoint under" in output  # the first attempt started fresh
    assert f"resuming from {run_dir / 'checkpoints' / 'step_000002'} (step 2)" in output
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 3 of the dead attempt is gone, once
    # The sampler and the counters continue: step 3 starts groups 5 and 6, not 1 and 2 again.
    assert [r["rollout/groups_started"] for r in rows] == [GROUPS_PER_STEP * s for s in (1, 2, 3, 4)]
    assert rows[-1]["ledger/consumed"] == sum(r["consumed_tokens"] for r in rows)
    assert rows[-1]["ledger/lost"] == 0 and rows[-1]["ledger/wasted"] == 0
    # The sampler's RNG at step 4 is the step-2 state advanced by the draws of steps 3 and 4.
    at2, at4 = saved_run_state(run_dir, 2)["sampler"], saved_run_state(run_dir, 4)["sampler"]
    rng = random.Random()
    rng.setstate((at2["rng"][0], tuple(at2["rng"][1]), at2["rng"][2]))
    for _ in range(2 * GROUPS_PER_STEP):
        rng.choice(range(at2["num_tasks"]))
    assert list(rng.getstate()[1]) == at4["rng"][1] and at4["groups_started"] == 4 * GROUPS_PER_STEP
    assert listeners and listeners <= {"127.0.0.1", "::1"}, listeners


def test_tide_mode_restart_puts_unconsumed_groups_back(tmp_path):
    """Rollout runs ahead in tide mode: the checkpoint holds ready groups the trainer had not
    consumed and groups still running; after the restart the ready ones are trained on and
    the ledger still adds up."""
    run_dir = tmp_path / "run"
    proc, listeners = launch(f"run.output_dir={run_dir}", "scheduler.mode=tide", "run.steps=4",
                             "run.checkpoint_interval=2", "run.resume=auto", *FAST, restarts=1,
                             env={"TIDE_FAULT_KILL_RANK0_AFTER_STEP": "3"})
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'step_000002'} (step 2)" in proc.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    saved = saved_run_state(run_dir, 2)
    if saved["ledger"]["in_flight"]:
        assert f"{saved['ledger']['in_flight']} tokens of groups still running at the checkpoint are booked as " \
               "failed" in proc.stdout
    last = rows[-1]
    assert last["ledger/consumed"] == sum(r["consumed_tokens"] for r in rows)  # restored groups included
    assert last["ledger/generated"] == sum(last[f"ledger/{b}"] for b in ("in_flight", "ready", "consumed",
                                                                         "dropped_stale", "cancelled", "failed",
                                                                         "lost", "evaluated"))
    assert last["ledger/lost"] == 0 and all(r["staleness/max"] <= 1 for r in rows)
    assert listeners <= {"127.0.0.1", "::1"}, listeners


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(restarted):
    run_dir = restarted[0]
    shard = run_dir / "checkpoints" / "step_000004" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    proc, _ = launch(f"run.output_dir={run_dir}", "run.steps=5", "run.resume=auto", *FAST)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert (f"checkpoint {shard.parent} is corrupt: file __0_0.distcp is truncated ({size // 2} of {size} bytes); "
            "falling back to step_000002") in proc.stdout
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]


def _bad_model(tmp_path: Path) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{\n  "model_type": "qwen2",\n    oops\n}\n')
    return f"model.path={model}"


def _file(tmp_path: Path) -> str:
    (tmp_path / "ckpt.pt").write_bytes(b"not a directory")
    return f"run.resume_from={tmp_path / 'ckpt.pt'}"


def _interrupted(tmp_path: Path) -> str:
    step = tmp_path / "step_000002"
    step.mkdir()
    (step / ".metadata").write_bytes(b"half a save")
    return f"run.resume_from={step}"


@pytest.mark.parametrize("make,message,before_start", [
    (_bad_model, "model.path='{d}/model': config.json is not valid JSON (line 3, column 5", False),
    (_file, "run.resume_from='{d}/ckpt.pt' is a file, expected a checkpoint directory", False),
    (_interrupted, "run.resume_from='{d}/step_000002': checkpoint {d}/step_000002 is incomplete: no manifest.json",
     False),
    # A bad value is caught by the launcher's check, once, before any rank starts.
    (lambda d: "run.resume=maybe", "run.resume='maybe': expected one of ('auto', 'true', 'false')", True),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, make, message, before_start):
    proc, _ = launch(f"run.output_dir={tmp_path / 'run'}", make(tmp_path), timeout=300)
    assert proc.returncode != 0
    assert message.format(d=tmp_path) in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    if before_start:
        assert proc.stderr.strip().startswith(f"launch/torchrun.py: the job cannot start: {message}")
        assert proc.stderr.strip().count("\n") == 0
        assert not (tmp_path / "run" / "logs").exists()
    else:
        assert "launch/torchrun.py: the job failed: rank " in proc.stderr
