"""What every CTB benchmark record starts with, and how it is written (benchmarks/results/NAME.json)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def header() -> dict:
    """Command, machine and date of this run."""
    return {
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def write(name: str, record: dict) -> str:
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
    return path
