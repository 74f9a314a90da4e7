"""What every benchmark record starts with, and how it is written (benchmarks/results/NAME.json)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")


def header(benchmark: str, **machine) -> dict:
    """The benchmark's name, the command that ran it, the date (UTC) and the machine (plus
    `machine`'s extra facts: the device, library versions); load averages say how busy the
    shared machine was."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return {
        "benchmark": benchmark,
        "command": " ".join(["python", script, *sys.argv[1:]]),
        **git_state(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1_5_15": os.getloadavg(), **machine},
    }


def git_state() -> dict:
    """The commit the benchmark ran on, and whether the working tree differed from it. Where the
    checkout's git metadata is not the tree's own (the lent GPU machine gets a copy of the working
    tree beside an older .git), the caller names the commit in BENCH_COMMIT, checked out clean."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "dirty": False, "commit_from": "BENCH_COMMIT"}
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def write(name_or_path: str, record: dict) -> str:
    """Write `record` as JSON to `name_or_path` (a path ending in .json, or a name under results/)."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(RESULTS_DIR, f"{name_or_path}.json")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
