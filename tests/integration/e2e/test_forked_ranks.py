"""launch/torchrun.py with ranks forked from a preloaded server (`tide_megatron/utils/forked_ranks.py`,
on by default where CUDA is absent): a rank runs its script as `python -u script` would, ends as
that interpreter would, and fails as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tide_megatron.testing import child_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]

RANK_SCRIPT = """
import atexit, json, multiprocessing, os, sys, threading, time
from pathlib import Path

import psutil

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
seen = {
    "argv": sys.argv[1:],
    "name": __name__,
    "path0": sys.path[0],
    "preloaded": [m for m in ("torch", "megatron.core", "sglang.srt.entrypoints.engine") if m in sys.modules],
    "cmdline": " ".join(psutil.Process().cmdline()),
    "process_name": psutil.Process().name(),
    "omp_threads": os.environ.get("OMP_NUM_THREADS"),
}
(out / f"seen_{rank}.json").write_text(json.dumps(seen))

def late_write():  # a non-daemon thread still working when the script's end is reached
    time.sleep(1)
    (out / f"thread_{rank}").write_text("done")

def at_exit():  # the exit handlers run after the threads are joined
    (out / f"atexit_{rank}").write_text(str((out / f"thread_{rank}").exists()))

atexit.register(at_exit)
threading.Thread(target=late_write).start()
if rank == 1 and sys.argv[2] == "fail":
    sys.exit(3)
"""


def launch(tmp_path: Path, outcome: str, preload: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    return subprocess.run([sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2", str(script),
                           str(tmp_path), outcome], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=child_env(TIDE_PRELOAD_RANKS=preload))


def test_a_forked_rank_runs_its_script_as_python_would_and_ends_as_it_would(tmp_path):
    proc = launch(tmp_path, "succeed", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    script = str(tmp_path / "rank_script.py")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen_{rank}.json").read_text())
        assert seen["argv"] == [str(tmp_path), "succeed"] and seen["name"] == "__main__"
        assert seen["path0"] == str(tmp_path)  # the script's folder, as for `python script`
        assert seen["preloaded"] == ["torch", "megatron.core", "sglang.srt.entrypoints.engine"]
        assert f"-u {script} {tmp_path} succeed" in seen["cmdline"] and seen["process_name"].startswith("python")
        assert seen["omp_threads"] == "1"
        assert (tmp_path / f"atexit_{rank}").read_text() == "True"  # threads joined, then exit handlers
    assert "left behind" not in proc.stderr


def test_a_failed_forked_rank_is_one_line_as_a_started_one_is(tmp_path):
    lines = {}
    for preload in ("1", "0"):
        run_dir = tmp_path / preload
        run_dir.mkdir()
        proc = launch(run_dir, "fail", preload)
        assert proc.returncode == 1
        assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
        lines[preload] = proc.stderr.strip().splitlines()[-1]
        assert (run_dir / "atexit_1").read_text() == "True"  # a failing rank still runs its exit handlers
        assert not any(p.info["environ"] and str(run_dir) in " ".join(p.info["cmdline"] or [])
                       for p in psutil.process_iter(["environ", "cmdline"]))
    for line in lines.values():  # rank 0 may have ended by itself, or been stopped once rank 1 failed
        assert line.startswith("launch/torchrun.py: the job failed: rank 1 (exit code 3)"), lines
