"""What every benchmark record starts with (benchmarks/bench_record.py): the command, the commit
and whether the tree was dirty, the machine, and the benchmark's resolved settings with their
hash, so two records can be told to have run the same settings or not."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_record  # noqa: E402

HELPERS = ("bench_record", "cpu_busy", "emulated_runs", "rank_memory_sampler")  # modules the benchmarks import; they write no record
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.stem not in HELPERS)


@dataclasses.dataclass
class Inner:
    path: Path
    tags: frozenset


@dataclasses.dataclass
class Job:
    steps: int
    inner: Inner


def test_the_header_records_the_command_commit_machine_and_config_hash(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "soak.py"), "--minutes", "1"])
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    record = bench_record.header("soak", config=argparse.Namespace(minutes=1.0, out=None), device="cpu")
    assert record["command"] == "python benchmarks/soak.py --minutes 1"
    assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool)
    assert record["machine"]["device"] == "cpu" and record["machine"]["cpu_count"]
    assert record["config"] == {"minutes": 1.0, "out": None}
    assert record["config_sha256"] == hashlib.sha256(b'{"minutes":1.0,"out":null}').hexdigest()
    json.dumps(record)  # all of it JSON
    assert "config" not in bench_record.header("soak") and "config_sha256" not in bench_record.header("soak")


def test_the_commit_named_by_bench_commit_is_taken_as_a_clean_checkout(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "a" * 40)
    assert bench_record.git_state() == {"commit": "a" * 40, "dirty": False, "commit_from": "BENCH_COMMIT"}


def test_the_config_hash_depends_on_the_settings_only():
    a = bench_record.config_record({"b": 2, "a": [1, {"y": 1, "x": 2}]})
    b = bench_record.config_record(argparse.Namespace(a=[1, {"x": 2, "y": 1}], b=2))
    assert a == b  # key order and the container do not count
    sha = lambda config: bench_record.config_record(config)["config_sha256"]  # noqa: E731
    assert sha({"a": 1}) != sha({"a": 2})
    # paths inside the checkout are relative to it, wherever the checkout lies
    repo = bench_record.REPO
    here = bench_record.config_record({"out": f"{repo}/outputs/x", "cmd": f"{repo}/launch/train.py +a"})
    assert here["config"] == {"out": "outputs/x", "cmd": "launch/train.py +a"}
    # a secret is not written into a record that gets committed
    assert bench_record.config_record({"server": {"auth_token": "s3cret", "max_new_tokens": 4}})["config"] == \
        {"server": {"auth_token": "<redacted>", "max_new_tokens": 4}}
    assert bench_record.config_record({"auth_token": ""})["config"] == {"auth_token": ""}


def test_a_dataclass_or_omegaconf_config_is_recorded_as_its_fields():
    job = Job(steps=3, inner=Inner(path=Path(bench_record.REPO) / "recipes", tags=frozenset({"b", "a"})))
    assert bench_record.config_record(job)["config"] == {"steps": 3, "inner": {"path": "recipes", "tags": ["a", "b"]}}
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"steps": 3, "twice": "${steps}"})
    assert bench_record.config_record(cfg)["config"] == {"steps": 3, "twice": 3}  # resolved


def test_a_large_config_is_recorded_by_its_hash_alone(monkeypatch):
    monkeypatch.setattr(bench_record, "CONFIG_INLINE_CHARS", 20)
    small, large = bench_record.config_record({"a": 1}), bench_record.config_record({"a": "x" * 100})
    assert small["config"] == {"a": 1} and "config" not in large and len(large["config_sha256"]) == 64


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_benchmark_writes_its_resolved_config_into_its_header(script):
    calls = [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)
             and (getattr(node.func, "attr", None) == "header" or getattr(node.func, "id", None) == "header")]
    assert calls, f"{script.name} does not start its record with bench_record.header"
    assert all(any(k.arg == "config" for k in call.keywords) for call in calls), \
        f"{script.name}: bench_record.header(..., config=...) names no config"
