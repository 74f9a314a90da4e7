"""The memory a job's rank processes cost, from /proc/<pid>/smaps_rollup (Linux).

Issue 37 budgets a hollow (emulated) rank at 250 MB of memory no other process shares, so that
64 of them fit on a 24 GiB host. Two figures say what a rank costs:

- PSS: every page the rank maps, a shared page divided by the number of processes mapping it.
  The PSS of all processes together is what the host holds, which makes it the figure to budget.
  Ranks forked from the preloaded server (`tide_megatron/utils/forked_ranks.py`) share the pages
  of torch, Megatron-core and the rest until they write to them.
- USS (private clean + private dirty): the pages only this rank maps, what killing it frees.

The sampler looks at every process below this one (the benchmark launches the job with
`subprocess.run`), every `interval_s`, and keeps each rank's peak; the job's total PSS (all its
processes, servers and shm managers included) is kept at its peak too.
"""

from __future__ import annotations

import statistics
import threading
from pathlib import Path

import psutil

_FIELDS = {"Pss": "pss", "Private_Clean": "private", "Private_Dirty": "private"}


def smaps_rollup(pid: int) -> dict[str, float] | None:
    """{"pss": MB, "uss": MB} of one process; None when it is gone or /proc is unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {"pss": 0, "private": 0}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in _FIELDS:
            kb[_FIELDS[name]] += int(rest.split()[0])
    return {"pss": kb["pss"] / 1024, "uss": kb["private"] / 1024}


def is_rank(cmdline: list[str]) -> bool:
    """A torchrun worker running launch/train.py (started, or forked and retitled), not the launcher."""
    text = " ".join(cmdline)
    return "train.py" in text and "torchrun.py" not in text and "--nproc-per-node" not in text


class RankMemorySampler:
    """While the context is open, samples the memory of every process below this one."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.rank_peaks: dict[int, dict[str, float]] = {}  # pid -> peak {"pss", "uss"} in MB
        self.job_pss_peak_mb = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-memory-sampler", daemon=True)

    def __enter__(self) -> "RankMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        total = 0.0
        try:
            procs = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            mem = smaps_rollup(p.pid)
            if mem is None:
                continue
            total += mem["pss"]
            try:
                rank = is_rank(p.cmdline())
            except psutil.Error:
                continue
            if rank:
                peak = self.rank_peaks.setdefault(p.pid, {"pss": 0.0, "uss": 0.0})
                peak["pss"], peak["uss"] = max(peak["pss"], mem["pss"]), max(peak["uss"], mem["uss"])
        self.job_pss_peak_mb = max(self.job_pss_peak_mb, total)
        self.samples += 1

    def summary(self) -> dict | None:
        """Each rank's peak, as the median and the largest over the ranks (rank 0, which also
        hosts the controller, is usually the largest), and the job's peak PSS per rank; None
        when no rank was seen."""
        if not self.rank_peaks:
            return None
        pss = sorted(p["pss"] for p in self.rank_peaks.values())
        uss = sorted(p["uss"] for p in self.rank_peaks.values())
        return {"ranks_seen": len(pss), "samples": self.samples,
                "rank_pss_mb_median": round(statistics.median(pss), 1), "rank_pss_mb_max": round(pss[-1], 1),
                "rank_uss_mb_median": round(statistics.median(uss), 1), "rank_uss_mb_max": round(uss[-1], 1),
                "job_pss_mb_peak": round(self.job_pss_peak_mb, 1),
                "job_pss_mb_per_rank": round(self.job_pss_peak_mb / len(pss), 1)}
