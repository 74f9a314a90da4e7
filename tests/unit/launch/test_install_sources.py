"""Install sources name registry packages only: no file of one machine in a lock or packaging file.

A lock line `sglang @ file:///tmp/...whl` once made every fresh clone fail to install while CI,
on the machine that held the wheel, stayed green. These tests keep it from coming back.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CHECKED = ("requirements/*.lock", "requirements/*.txt", "setup.py", "pyproject.toml")

# What only exists on one machine: file URLs, direct references to a path, absolute or home
# paths, relative paths outside the package, Windows drives, local find-links/index options.
_LOCAL = [
    (re.compile(r"file:", re.I), "a file: URL"),
    (re.compile(r"@\s*(/|\.{1,2}/|~)"), "a direct reference to a local path"),
    (re.compile(r"""(^|[\s"'=])(/(?!/)|~/|\.{1,2}/)[\w.\-]"""), "a local path"),
    (re.compile(r"""(^|[\s"'=])[A-Za-z]:[\\/]"""), "a Windows path"),
    (re.compile(r"^\s*(-f|--find-links|-i|--index-url|--extra-index-url|-e|--editable)\b"), "a local install option"),
]


def local_references(root: Path) -> list[str]:
    """`file:line: what: text` for every line of the checked files that names a local file."""
    found = []
    for pattern in CHECKED:
        for path in sorted(root.glob(pattern)):
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                text = line.split("#", 1)[0] if path.suffix in (".lock", ".txt") else line
                if path.suffix == ".py" and text.lstrip().startswith("#"):
                    continue
                for regex, what in _LOCAL:
                    if regex.search(text):
                        found.append(f"{path.relative_to(root)}:{lineno}: {what}: {line.strip()}")
                        break
    return found


def test_locks_and_packaging_name_registry_packages_only():
    problems = local_references(REPO)
    assert not problems, "install sources that only exist on one machine:\n" + "\n".join(problems)


def test_lock_lines_are_pinned_registry_names():
    bad = []
    for path in sorted(REPO.glob("requirements/*.lock")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            text = line.split("#", 1)[0].strip()
            if text and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*(\[[\w,\-]+\])?==[\w.\-+!]+", text):
                bad.append(f"{path.relative_to(REPO)}:{lineno}: {text}")
    assert not bad, "lock lines must be name==version:\n" + "\n".join(bad)


def test_the_check_names_a_local_wheel_line(tmp_path):
    """The check fails on the line that broke fresh installs (in a copy, never in the repo)."""
    for pattern in CHECKED:
        for path in REPO.glob(pattern):
            dest = tmp_path / path.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, dest)
    assert local_references(tmp_path) == []
    lock = tmp_path / "requirements" / "cpu.lock"
    lines = lock.read_text().splitlines()
    lines.insert(5, "sglang @ file:///tmp/sgl/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl#sha256=00b3")
    lock.write_text("\n".join(lines) + "\n")
    (tmp_path / "requirements" / "extra.txt").write_text("mypkg @ /home/me/wheels/mypkg.whl\n-e ../sibling\n")
    problems = local_references(tmp_path)
    assert any(p.startswith("requirements/cpu.lock:6: a file: URL: sglang @ file:///tmp/") for p in problems), problems
    assert any(p.startswith("requirements/extra.txt:1:") for p in problems), problems
    assert any(p.startswith("requirements/extra.txt:2:") for p in problems), problems
    setup = tmp_path / "setup.py"
    setup.write_text(setup.read_text().replace('"torch==2.13.0"', '"torch @ file:///opt/wheels/torch.whl"'))
    assert any(p.startswith("setup.py:") for p in local_references(tmp_path))
