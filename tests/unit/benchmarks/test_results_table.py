"""docs/results.md, the table of every benchmark record (scripts/results_table.py): each record
gets its benchmark's headline figures, and a mark when its figures may no longer hold (STALE:
its benchmark code changed after the commit it ran on; DIRTY; UNKNOWN COMMIT)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import results_table  # noqa: E402

RECORDS = results_table.record_paths()


def never_asked(commit, paths):
    raise AssertionError("a record without a commit needs no git")


# ---------------------------------------------------------------- headline figures
@pytest.mark.parametrize("path", RECORDS, ids=[str(p.relative_to(results_table.RESULTS)) for p in RECORDS])
def test_every_record_gets_its_benchmarks_headline_figures(path):
    record = json.loads(path.read_text())
    benchmark = results_table.benchmark_of(path, record)
    assert benchmark in results_table.EXTRACTORS, f"{path.name}: no extractor for {benchmark!r}"
    figures = results_table.EXTRACTORS[benchmark](record)  # raises where the record's format is not read
    assert figures and "see JSON" not in figures
    assert results_table.machine_of(record) != "?"


def test_there_are_records_and_a_benchmark_without_an_extractor_gets_see_json():
    assert RECORDS
    assert results_table.headline("no_such_benchmark", {"x": 1}) == "see JSON"
    assert results_table.headline("e2e_goodput", {"ratios": 3}).startswith("see JSON (no headline")


def test_the_benchmark_and_the_machine_come_from_the_record():
    path = Path("x/renamed.json")
    assert results_table.benchmark_of(path, {"command": "python benchmarks/soak.py --minutes 30"}) == "soak"
    assert results_table.benchmark_of(path, {"benchmark": "sim_speed"}) == "sim_speed"
    assert results_table.benchmark_of(path, {}) == "renamed"
    assert results_table.machine_of({"machine": {"cpu_count": 2, "device": "cpu"}}) == "CPU, 2 cores"
    assert results_table.machine_of({"machine": {"cpu_count": 16, "device": "NVIDIA H200"}}) == "NVIDIA H200"
    assert results_table.machine_of({"machine": {"device": "cuda", "gpu": "NVIDIA H200"}}) == "NVIDIA H200"
    assert results_table.machine_of({"machine": "vm x86_64 2 cpus, Python 3.11.7"}) == "CPU, 2 cores"


# ---------------------------------------------------------------- marks
def test_a_record_without_a_commit_is_marked_unknown_commit(tmp_path):
    assert results_table.mark({"date": "2026-01-01"}, ["benchmarks/soak.py"], never_asked) == "UNKNOWN COMMIT"
    assert results_table.mark({"commit": None, "dirty": None}, ["benchmarks/soak.py"], never_asked) == "UNKNOWN COMMIT"
    path = tmp_path / "soak_cpu.json"
    path.write_text(json.dumps({"command": "python benchmarks/soak.py", "date": "2026-01-01T00:00:00",
                                "machine": {"cpu_count": 2}}))
    row = results_table.row(path, never_asked)
    assert row[0] == "soak" and row[3] == "-" and row[-1] == "UNKNOWN COMMIT"
    assert results_table.git_changes("0" * 40, ["benchmarks/soak.py"]) is None  # a commit this repo lacks
    assert results_table.mark({"commit": "0" * 40}, ["benchmarks/soak.py"]) == "UNKNOWN COMMIT"


def test_changed_benchmark_code_marks_the_record_stale_and_a_dirty_tree_dirty():
    files = results_table.code_files("sleep_on_idle")
    assert files == ["benchmarks/bench_record.py", "benchmarks/cpu_busy.py", "benchmarks/e2e_goodput.py",
                     "benchmarks/sleep_on_idle.py"]  # the script, the header, what it imports (transitively)
    changed = lambda commit, paths: ["benchmarks/e2e_goodput.py"] if commit == "old" else []  # noqa: E731
    assert results_table.mark({"commit": "old", "dirty": False}, files, changed) == "STALE: e2e_goodput.py"
    assert results_table.mark({"commit": "new", "dirty": False}, files, changed) == "current"
    assert results_table.mark({"commit": "new", "dirty": True}, files, changed) == "DIRTY"
    assert results_table.mark({"commit": "old", "dirty": True}, files, changed) == "STALE: e2e_goodput.py; DIRTY"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_git_tells_which_benchmark_files_changed_after_a_commit(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    for name in ("bench_record", "soak", "other"):
        (tmp_path / "benchmarks" / f"{name}.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "measured here")
    measured = git(tmp_path, "rev-parse", "HEAD")
    files = ["benchmarks/bench_record.py", "benchmarks/soak.py"]
    changes = lambda commit, paths: results_table.git_changes(commit, paths, repo=tmp_path)  # noqa: E731
    record = {"commit": measured, "dirty": False}

    (tmp_path / "benchmarks" / "other.py").write_text("x = 2\n")  # not the benchmark's code
    git(tmp_path, "commit", "-qam", "another benchmark")
    assert results_table.mark(record, files, changes) == "current"

    (tmp_path / "benchmarks" / "soak.py").write_text("x = 2\n")
    assert results_table.mark(record, files, changes) == "STALE: soak.py"  # not committed yet
    git(tmp_path, "commit", "-qam", "the script changed after it was measured")
    assert results_table.mark(record, files, changes) == "STALE: soak.py"
    assert results_table.mark({"commit": git(tmp_path, "rev-parse", "HEAD")}, files, changes) == "current"
    assert results_table.mark({"commit": "f" * 40}, files, changes) == "UNKNOWN COMMIT"


# ---------------------------------------------------------------- the page
def test_the_committed_results_table_is_what_the_script_writes():
    """As `python scripts/results_table.py --check`: the table, written again in memory, equals
    the page's (the marks read git as the script does)."""
    assert results_table.render() == results_table.DOC.read_text(), \
        "docs/results.md is out of date: run python scripts/results_table.py"


def test_the_table_is_rewritten_between_its_markers_and_the_rest_kept():
    no_git = lambda commit, paths: []  # noqa: E731
    page = f"# Title\n\nprose\n\n{results_table.BEGIN}\n| old | table |\n{results_table.END}\n\nmore prose\n"
    out = results_table.render(no_git, page)
    assert out.startswith("# Title\n\nprose\n\n") and out.endswith(f"{results_table.END}\n\nmore prose\n")
    assert "| old | table |" not in out and out.count("\n| ") == len(RECORDS) + 1  # the heading's line too
    assert results_table.render(no_git, out) == out
    with pytest.raises(SystemExit):
        results_table.render(no_git, "# no markers\n")


def test_a_control_plane_record_names_the_sizes_that_failed_beside_the_figures_of_those_that_ran():
    mean = {"ranks": 16, "control_poll_s": 0.02, "cpu_busy_share": 0.5,
            "control": {"cpu_rollout_thread_s": 4.66, "loops": 4293, "rollout_thread_share_of_step": 0.158}}
    runs = [{"ranks": 16, "failed": False}, {"ranks": 64, "failed": True, "error": "timed out after 2700 s\nrest"}]
    row = results_table.control_plane({"means": [mean], "runs": runs})
    assert row == ("16 ranks, poll 0.02 s: rollout thread 4.66 CPU s/step, 4293 passes, 15.8% of the modelled "
                   "step, host busy 0.50; 64 ranks failed (timed out after 2700 s)")
    assert results_table.control_plane({"means": [], "runs": [{"ranks": 64, "failed": True}]}) == \
        "64 ranks failed (no figures)"
