"""metrics.jsonl after a resume holds each step once, and the test-only fault injector."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tide_megatron.utils.fault_injection import KILL_AFTER_STEP_ENV
from tide_megatron.utils.metrics import MetricsLogger, is_eval_record, truncate_after


def write_lines(path, records, tail: str = "") -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)


def steps(path) -> list[tuple[int, bool]]:
    return [(r["step"], is_eval_record(r)) for r in map(json.loads, open(path))]


# scheduler.eval_every=2: the evaluation of step s runs during step s+1 and is logged then.
EARLIER_RUN = [{"step": 0, "eval/mean_reward": 0.0}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9},
               {"step": 2, "eval/mean_reward": 0.1, "eval/wait_s": 0.0}, {"step": 3, "loss": 0.8},
               {"step": 4, "loss": 0.7}, {"step": 4, "eval/mean_reward": 0.4}, {"step": 5, "loss": 0.6}]


def test_records_after_the_resumed_step_go_and_earlier_evals_stay(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, EARLIER_RUN, tail='{"step": 6, "lo')  # the crash cut the last write short
    assert truncate_after(str(path), 4) == 3
    # Step 4's own line stays; its evaluation ran after the checkpoint and runs again.
    assert steps(path) == [(0, True), (1, False), (2, False), (2, True), (3, False), (4, False)]


def test_resuming_at_zero_keeps_nothing_of_the_dead_attempt(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, EARLIER_RUN)
    truncate_after(str(path), 0)
    assert path.read_text() == ""


def test_metrics_logger_appends_after_truncating_and_leaves_fresh_runs_alone(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", EARLIER_RUN)
    logger = MetricsLogger(str(tmp_path), total_steps=6, start_step=3, tensorboard=False, progress=False,
                           resume_step=3)
    logger.log(4, {"loss": 0.5})
    logger.close()
    assert [s for s, _ in steps(tmp_path / "metrics.jsonl")] == [0, 1, 2, 2, 3, 4]
    fresh = MetricsLogger(str(tmp_path), total_steps=6, tensorboard=False, progress=False)  # run.resume=false
    fresh.close()
    assert [s for s, _ in steps(tmp_path / "metrics.jsonl")] == [0, 1, 2, 2, 3, 4]


def test_tensorboard_purges_the_events_after_the_resumed_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(str(tmp_path), 4, jsonl=False, progress=False)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close()
    resumed = MetricsLogger(str(tmp_path), 4, start_step=2, jsonl=False, progress=False, resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


KILL_SCRIPT = "from tide_megatron.utils.fault_injection import after_step_logged as f; f(2); f(3); print('alive')"


def test_fault_injector_kills_after_the_step_in_the_first_attempt_only():
    env = {**os.environ, KILL_AFTER_STEP_ENV: "3", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = subprocess.run([sys.executable, "-c", KILL_SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == -9 and "alive" not in first.stdout
    restarted = subprocess.run([sys.executable, "-c", KILL_SCRIPT], env={**env, "TORCHELASTIC_RESTART_COUNT": "1"},
                               capture_output=True, text=True, timeout=60)
    unset = subprocess.run([sys.executable, "-c", KILL_SCRIPT], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != KILL_AFTER_STEP_ENV})
    assert restarted.stdout.strip() == unset.stdout.strip() == "alive"


def test_the_summary_of_a_tide_run_says_what_ctb_ra2p_and_ers_did(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=3, tensorboard=False, progress=False)
    logger.log(1, {"mode": "tide", "ra2p/mode": "colocated", "placement/admits": 40, "placement/pauses": 2,
                   "placement/resumes": 1, "ers/changes": 1.0, "ers/moves": 2.0})
    logger.log(2, {"mode": "tide", "ra2p/mode": "decoupled", "placement/admits": 72, "placement/pauses": 5,
                   "placement/resumes": 4})  # no role change this step: ERS keys absent
    logger.log(3, {"mode": "tide", "ra2p/mode": "colocated", "placement/admits": 90, "placement/pauses": 5,
                   "placement/resumes": 5, "ers/changes": 2.0, "ers/moves": 3.0})
    assert ("CTB: 90 tasks admitted, 5 paused, 5 resumed; RA2P steps by mode: colocated 2, decoupled 1; "
            "ERS: 2 role changes, 3 rank moves") in logger.summary()
    still = MetricsLogger(str(tmp_path / "still"), total_steps=1, tensorboard=False, progress=False)
    still.log(1, {"mode": "tide", "ra2p/mode": "colocated", "placement/admits": 8})
    assert any(line.endswith("RA2P steps by mode: colocated 1; ERS: no role change") for line in still.summary())
    sync = MetricsLogger(str(tmp_path / "sync"), total_steps=1, tensorboard=False, progress=False)
    sync.log(1, {"mode": "sync", "ra2p/mode": "colocated", "placement/admits": 4})
    assert not any(line.startswith("CTB:") for line in sync.summary())
