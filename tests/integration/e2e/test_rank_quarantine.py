"""A rollout rank hangs mid-run (its worker process is SIGSTOPped past the heartbeat timeout,
then SIGCONTed): rank 0 quarantines it, its tasks run again on the other rollout rank, weights
go on to that rank only, and once it is heard from again it drops what it held and rejoins at a
weight sync. On the broadcast path a sync that reaches the hung rank before its quarantine
gives up after `scheduler.weight_broadcast_timeout_s`, and the update group is re-formed
without it, then with it once it rejoined (by the host path). The run completes every step with whole groups, no token lost and the staleness
bound held. Three ranks: the trainer (+ controller) and two rollout ranks.

The run's length is set by what happens, not by a step count: steps take from a fifth of a
second to over a second here depending on the load, and a fixed count either ended the run
before the rejoin or made the test slow. Once a step has trained after the rejoin, the test
creates the run's stop file (`run.stop_file`), and the run ends after its current step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
# Short, but above the control channel's own stalls on this loaded 2-core machine: in 2 of 6
# runs with a 4 s timeout the job's store answered a healthy rank's posts up to ~5 s late (a
# second store connection from that rank saw the same delay; once during the final checkpoint),
# and the healthy rank was taken for silent too.
HEARTBEAT_TIMEOUT_S = 8.0
BROADCAST_TIMEOUT_S = 4.0  # the broadcast path: a sync stuck on the hung member gives up after this
WALL_MINUTES = 5.0  # a backstop: the stop file ends the run ~20-30 s after the first dispatch
REJOINED = re.compile(r"rollout rank 2 rejoined with the weights of version (\d+)")


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if "eval/mean_reward" not in r]


def wait_for(what: str, cond, proc: subprocess.Popen, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


# sync_split: a fixed split (under `sync` every rank also trains, and a rank hung in the trainer's
# collectives stops the job: quarantine is for ranks that only roll out). Each mode and each
# weight-sync path runs once (a run is over a minute); the broadcast run's rejoin goes by the
# host path too, so tide with the host path alone adds no path of its own.
@pytest.mark.parametrize("mode,weight_sync_path", [("sync_split", "host"), ("tide", "broadcast")])
def test_a_hung_rollout_rank_is_quarantined_and_rejoins(tmp_path, mode, weight_sync_path):
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "3",
           str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu", f"scheduler.mode={mode}", "cluster.rollout_ranks=2",
           "metrics.progress=false", "metrics.tensorboard=false", "run.checkpoint_interval=0", "run.steps=1000",
           f"run.max_wall_minutes={WALL_MINUTES}",           "scheduler.groups_per_step=2", "scheduler.group_size=2", "scheduler.heartbeat_interval_s=0.5",
           f"scheduler.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", "scheduler.stall_timeout_s=120",
           f"run.output_dir={tmp_path}", f"scheduler.weight_sync_path={weight_sync_path}",
           f"scheduler.weight_broadcast_timeout_s={BROADCAST_TIMEOUT_S}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    stopped_pid = None
    try:
        log2 = tmp_path / "logs" / "rank2.log"
        pid_line = re.compile(r"rollout rank 2: pid (\d+)")
        stopped_pid = int(wait_for("rank 2's pid", lambda: log2.exists() and (m := pid_line.search(log2.read_text()))
                                   and m.group(1), proc, 300))
        wait_for("the first step", lambda: len(rows(tmp_path)) >= 1, proc, 300)
        os.kill(stopped_pid, signal.SIGSTOP)  # hung: no heartbeat, no answer, no weight receive
        time.sleep(HEARTBEAT_TIMEOUT_S + 6.0)  # past the timeout by several heartbeat intervals
        os.kill(stopped_pid, signal.SIGCONT)
        stopped_pid = None
        log0 = tmp_path / "logs" / "rank0.log"
        version = int(wait_for("rank 2 to rejoin", lambda: (m := REJOINED.search(log0.read_text())) and m.group(1),
                               proc, 300))
        wait_for("a step on the rejoined rank's weights", lambda: len(rows(tmp_path)) > version, proc, 300)
        (tmp_path / "STOP").touch()
        out, err = proc.communicate(timeout=600)
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-8000:]
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # every step it started, whole
    assert all(r["groups"] == 2 for r in steps)  # every step trained whole groups
    assert all(r["staleness/max"] <= 1 for r in steps)  # scheduler.max_staleness
    last = steps[-1]
    assert last["ledger/lost"] == 0
    assert last.get("rollout/groups_failed", 0) == 0  # its tasks ran again elsewhere: no group lost
    assert last["rollout/quarantines"] == 1 and last["rollout/rejoins"] == 1 and last["rollout/out_of_service"] == 0
    log0 = (tmp_path / "logs" / "rank0.log").read_text()
    assert re.search(r"quarantined rollout rank 2: rollout rank 2 sent nothing for \d+ s", log0)
    rejoined = REJOINED.search(log0)
    assert rejoined and int(rejoined.group(1)) < len(steps)  # and the run went on with it
    assert f"{tmp_path / 'STOP'} found: stopping after step" in log0 and len(steps) < 1000
    assert "quarantined by rank 0" in log2.read_text()
    if weight_sync_path == "broadcast":  # the update group follows: without rank 2, then with it again
        formed = re.findall(r"weight update group \S+ formed with rollout ranks \[([\d, ]*)\]", log0)
        assert formed[0] == "1, 2" and "1" in formed and formed[-1] == "1, 2", formed
        assert last["weights/broadcast_ranks"] == 2 and last["weights/host_ranks"] == 0
