"""The ranks' memory in the emulated benchmarks: PSS and USS from /proc/<pid>/smaps_rollup, for
the processes below the benchmark that run launch/train.py (not the launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import rank_memory_sampler  # noqa: E402

pytestmark = pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/smaps_rollup").exists(),
                                reason="needs Linux's /proc/<pid>/smaps_rollup")


def test_a_process_pss_holds_its_private_pages_and_a_gone_one_reads_none():
    mem = rank_memory_sampler.smaps_rollup(os.getpid())
    assert mem is not None and 0 < mem["uss"] <= mem["pss"]
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert rank_memory_sampler.smaps_rollup(proc.pid) is None


@pytest.mark.parametrize("cmdline,rank", [
    (["python", "-u", "launch/train.py", "+recipe=text_emulated"], True),
    (["/venv/bin/python -u /repo/launch/train.py +recipe=text_emulated"], True),  # a forked rank's title
    (["python", "launch/torchrun.py", "--nproc-per-node", "8", "launch/train.py"], False),
    (["python", "-c", "from multiprocessing.forkserver import main; main()"], False),
])
def test_ranks_are_the_train_py_workers_not_the_launcher(cmdline, rank):
    assert rank_memory_sampler.is_rank(cmdline) is rank


def test_the_sampler_keeps_each_ranks_peak_and_the_jobs_total():
    # two children: one that looks like a rank (its argv names train.py), one that does not
    code = "import time, sys; x = b'x' * (int(sys.argv[1]) << 20); time.sleep(30)"
    rank = subprocess.Popen([sys.executable, "-c", code, "40", "launch/train.py"])
    other = subprocess.Popen([sys.executable, "-c", code, "1", "server"])
    try:
        sampler = rank_memory_sampler.RankMemorySampler()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sampler.sample()
            summary = sampler.summary()
            if summary and summary["rank_uss_mb_max"] >= 40:  # the bytearray was touched
                break
            time.sleep(0.1)
        assert summary["ranks_seen"] == 1 and list(sampler.rank_peaks) == [rank.pid]
        assert summary["rank_pss_mb_max"] >= summary["rank_uss_mb_max"] >= 40
        assert summary["job_pss_mb_peak"] > summary["rank_pss_mb_max"]  # the other child counts in the total
    finally:
        for p in (rank, other):
            p.kill()
            p.wait()
