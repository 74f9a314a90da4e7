"""What an emulated benchmark run keeps of a failed job (benchmarks/emulated_runs.py): at 64 ranks
the end of stderr held only the other ranks' shutdown, and the cause went with the run's folder."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
from emulated_runs import failure_text, run_job  # noqa: E402


def test_a_failure_keeps_every_ranks_own_line_and_the_traceback_of_its_log(tmp_path):
    stderr = "\n".join(["[rank0] RuntimeError: Connection reset by peer (full log: x/rank0.log)",
                        *(f"noise {i}" for i in range(5000)),
                        "[rank7] WARNING tide_megatron.job: stopping",
                        "launch/torchrun.py: the job failed: rank 0 (exit code 1)"])
    (tmp_path / "rank0.log").write_text("start\nTraceback (most recent call last):\n  in _read\nRuntimeError: reset\n")
    (tmp_path / "rank1.log").write_text("a clean log\n")
    text = failure_text(stderr, tmp_path, tail_chars=100)
    head = text.split("-- end of stderr --")[0]
    assert "[rank0] RuntimeError: Connection reset" in head and "[rank7] WARNING" in head
    assert "launch/torchrun.py: the job failed" in head and "noise 10" not in text
    assert "-- end of rank0.log --" in text and "in _read" in text and "rank1.log" not in text


def test_a_failure_without_logs_keeps_the_end_of_stderr(tmp_path):
    text = failure_text("x" * 50 + "the end", tmp_path / "absent", tail_chars=20)
    assert text.endswith("the end") and "rank" not in text


def test_a_timed_out_job_is_stopped_with_every_process_it_started(tmp_path):
    """The ranks are the launcher's grandchildren: a timeout that killed the launcher alone left
    them running."""
    pid_file = tmp_path / "grandchild"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('[rank3] started', file=sys.stderr, flush=True)\n"
              "time.sleep(300)\n")
    code, stderr = run_job([sys.executable, "-c", script], timeout_s=3, env=dict(os.environ), cwd=tmp_path)
    assert code is None and "[rank3] started" in stderr
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
