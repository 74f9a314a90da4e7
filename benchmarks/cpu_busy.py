"""How busy the machine's cores were over a time window, from /proc/stat (Linux).

The end-to-end benchmarks run every rank of a job on one shared host. Whether a split of the
ranks leaves compute idle (what ERS exists to reclaim on dedicated GPUs) shows in the share of
core time that was busy while the job trained: near 1 in every split, a rank that waits hands
its core to the others and no split can gain by moving it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

_STAT = Path("/proc/stat")


def read_cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores together since boot; None without /proc/stat."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal guest guest_nice; guest time is
    # already counted in user and nice
    values = [float(v) for v in fields[1:9]]
    idle = values[3] + values[4]
    total = sum(values)
    return total - idle, total


class CpuBusySampler:
    """Samples /proc/stat every `interval_s` on a thread while the context is open; then
    `busy_share(start, end)` is the busy share of core time between the samples nearest
    those Unix times (None when the window holds fewer than two samples)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []  # (unix time, busy, total)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-busy-sampler", daemon=True)

    def __enter__(self) -> "CpuBusySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        times = read_cpu_times()
        if times is not None:
            self.samples.append((time.time(), *times))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def busy_share(self, start: float = float("-inf"), end: float = float("inf")) -> float | None:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] <= inside[0][2]:
            return None
        (_, busy0, total0), (_, busy1, total1) = inside[0], inside[-1]
        return round((busy1 - busy0) / (total1 - total0), 3)
