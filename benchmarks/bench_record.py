"""What every benchmark record starts with, and how it is written (benchmarks/results/NAME.json)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
# A resolved config whose canonical JSON is longer than this is recorded by its hash alone.
CONFIG_INLINE_CHARS = 20_000
# Settings a record must not keep (an env server's auth_token): recorded as "<redacted>" when set.
SECRET_KEY = re.compile(r"(^|_)(token|secret|password|api_key)$")


def header(benchmark: str, *, config=None, **machine) -> dict:
    """The benchmark's name, the command that ran it, the commit (and whether the tree was dirty),
    the date (UTC), the machine (plus `machine`'s extra facts: the device, library versions; load
    averages say how busy the shared machine was) and, given `config` (the benchmark's resolved
    settings: its argparse namespace, a dict, a dataclass such as a composed JobConfig, an
    OmegaConf container), `config_sha256` and, when small, the `config` itself (`config_record`)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return {
        "benchmark": benchmark,
        "command": " ".join(["python", script, *sys.argv[1:]]),
        **git_state(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1_5_15": os.getloadavg(), **machine},
        **({} if config is None else config_record(config)),
    }


def config_record(config) -> dict:
    """`config` as plain JSON (`plain_config`) under "config" when its canonical JSON has at most
    CONFIG_INLINE_CHARS characters, and the sha256 of that canonical JSON (keys sorted, no
    spaces) under "config_sha256": two records with the same hash ran the same settings."""
    plain = plain_config(config)
    text = canonical_json(plain)
    out = {"config": plain} if len(text) <= CONFIG_INLINE_CHARS else {}
    out["config_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    return out


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def plain_config(value):
    """`value` as JSON types: a namespace, dataclass or OmegaConf container as its fields, a set
    sorted, an enum as its value, a path as a string; a path inside the checkout (also inside a
    longer string, a command line) relative to it, so the hash does not depend on where the
    checkout lies; a secret's value (SECRET_KEY) as "<redacted>"; anything else as its str()."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): "<redacted>" if v and SECRET_KEY.search(str(k)) else plain_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain_config(v) for v in value), key=canonical_json)
    if isinstance(value, enum.Enum):
        return plain_config(value.value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return "." if value == REPO else value.replace(REPO + os.sep, "")
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)


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
