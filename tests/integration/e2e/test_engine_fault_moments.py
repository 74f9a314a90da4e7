"""A rollout rank's SGLang engine dies at each moment something else is in flight (issue 39):
right after a weight load, in the middle of one, at a step boundary (a new version announced,
not yet loaded), after rank 0 saved a checkpoint, while the rank hands its tasks over (an ERS
move), with one and with two rollout ranks, and every engine at once. Each run finishes every
step with whole groups and a balanced ledger (no token lost: every task that failed with its
engine left CTB's residency and was retried), and the dead engines were restarted.

The fault is `TIDE_FAULT_KILL_ENGINE=<moment>:<n>[:<which>]` (`utils/fault_injection.py`)."""

from __future__ import annotations

import time

import pytest

from tide_megatron.utils.fault_injection import KILL_ENGINE_ENV, RUN_DIR_ENV
from tide_megatron.testing import child_env, read_metrics, run_job, slow_env

pytestmark = pytest.mark.integration

STEPS = 4
BUCKETS = ("in_flight", "ready", "consumed", "dropped_stale", "cancelled", "failed", "lost", "evaluated")
SLOW_ENV = slow_env(0.5)
# ERS's split drill: rank 1 leaves rollout (handing its running tasks over) at the first boundary.
HANDOVER = ["ers.enabled=true", "ers.drill=split", "ers.drill_every=1", "scheduler.min_groups_per_step=2", *SLOW_ENV]

CASES = {
    # id: (fault, rollout ranks, extra overrides)
    # after_version (the load finished) is tests/integration/e2e/test_engine_faults.py's moment.
    "during_weight_sync": ("during_weight_sync:2", 2, []),
    "at_step_boundary": ("at_step_boundary:2", 2, []),
    "after_checkpoint": ("after_checkpoint:2", 2, ["run.checkpoint_interval=2"]),
    "during_handover": ("during_handover:1", 2, HANDOVER),
    "all_engines_at_once": ("during_weight_sync:2:all", 2, []),
    "one_rank_at_step_boundary": ("at_step_boundary:2", 1, []),
}


# SGLang's watchdog reports a dead scheduler with SIGQUIT, handled on the engine's asyncio loop:
# when the rank left rollout before that (a quick hand-over), the death went unnoticed and the
# rank, back in rollout with the dead engine, fell silent (seen once in two runs). A rank now
# checks its engine's processes when it comes back to rollout (`RolloutEngine.check_alive`);
# non-strict until that has been seen to hold over many runs.
FLAKY = {"during_handover": pytest.mark.xfail(reason="a death during a quick hand-over was once missed; "
                                                     "see the comment above", strict=False)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=FLAKY.get(c, ())) for c in CASES])
def test_a_dead_engine_at_any_moment(tmp_path, case):
    fault, rollout_ranks, extra = CASES[case]
    overrides = ["metrics.tensorboard=false", "scheduler.mode=tide", f"cluster.rollout_ranks={rollout_ranks}",
                 f"run.steps={STEPS}", "scheduler.stall_timeout_s=180", f"run.output_dir={tmp_path}"]
    if not any(o.startswith("run.checkpoint_interval=") for o in extra):
        overrides.append("run.checkpoint_interval=0")
    t0 = time.monotonic()
    proc = run_job(*overrides, *extra, nproc=1 + rollout_ranks, timeout=900,
                   env=child_env(**{KILL_ENGINE_ENV: fault, RUN_DIR_ENV: str(tmp_path)}))
    print(f"{case}: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    for r in rows:  # every step's ledger balances and nothing is lost
        assert r["ledger/lost"] == 0
        assert r["ledger/generated"] == sum(r[f"ledger/{b}"] for b in BUCKETS), r
    # a task that failed with its engine came back to the queue exactly once
    assert last.get("rollout/retries", 0) == last.get("rollout/task_failures", 0)
    if case == "during_handover":
        assert all(2 <= r["groups"] <= 4 for r in rows) and last["rollout/moves_out"] >= 1
    else:
        assert all(r["groups"] == 4 for r in rows)  # every step trained whole groups
    assert last["rollout/quarantines"] == 0
    if case != "during_handover":  # the drill's rank is out of rollout (kind "trainer") by design
        assert last["rollout/out_of_service"] == 0
    killed = range(1, 1 + rollout_ranks) if fault.endswith(":all") else [1]
    for rank in killed:
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert "fault injection: killing SGLang scheduler" in log, rank
        assert "restarting its engine" in log and "engine ready (restarts: 1)" in log, rank
