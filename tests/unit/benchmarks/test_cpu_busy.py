"""The benchmarks' core-busy share: read from /proc/stat's aggregate line, over the samples a
time window holds."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import cpu_busy  # noqa: E402
import e2e_goodput  # noqa: E402


def stat_line(user: int, idle: int, iowait: int = 0, system: int = 0) -> str:
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  {user} 0 {system} {idle} {iowait} 0 0 0 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_busy_and_total_leave_out_idle_iowait_and_guest(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(stat_line(user=30, idle=50, iowait=10, system=10))
    monkeypatch.setattr(cpu_busy, "_STAT", stat)
    assert cpu_busy.read_cpu_times() == (40.0, 100.0)  # guest (7) is inside user already
    monkeypatch.setattr(cpu_busy, "_STAT", tmp_path / "absent")
    assert cpu_busy.read_cpu_times() is None


def test_the_share_is_taken_between_the_first_and_last_sample_of_the_window():
    sampler = cpu_busy.CpuBusySampler()
    # (unix time, busy, total): 10 busy of 100 before t=10, then 150 busy of 200, then idle
    sampler.samples = [(0.0, 0.0, 0.0), (10.0, 10.0, 100.0), (20.0, 160.0, 300.0), (30.0, 160.0, 400.0)]
    assert sampler.busy_share(10.0, 20.0) == 0.75
    assert sampler.busy_share() == 0.4
    assert sampler.busy_share(5.0, 15.0) is None  # one sample: no interval
    assert sampler.busy_share(40.0, 50.0) is None


def test_the_sampler_reads_the_machine_while_open():
    if cpu_busy.read_cpu_times() is None:
        pytest.skip("no /proc/stat: not Linux")
    with cpu_busy.CpuBusySampler(interval_s=0.01) as sampler:
        time.sleep(0.3)  # several ticks of the kernel's 100 Hz counters
    share = sampler.busy_share()
    assert len(sampler.samples) >= 2 and share is not None and 0.0 <= share <= 1.0


def test_the_training_window_runs_from_the_first_dispatch_to_the_last_step(tmp_path):
    assert e2e_goodput.training_window(tmp_path) == (float("-inf"), float("inf"))
    (tmp_path / "timeline.json").write_text(json.dumps(
        {"origin_unix": 1000.0, "steps": [{"step": 1, "end": 3.0}, {"step": 2, "end": 7.5}]}))
    assert e2e_goodput.training_window(tmp_path) == (1000.0, 1007.5)
