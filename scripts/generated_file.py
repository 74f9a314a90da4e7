"""The command line of a script that writes a file of the repository from the code (docs/'s
generated pages and pictures): write it, or with --check fail when the committed one differs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def main(path: Path, render: Callable[[], str], script: str, description: str) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {path.relative_to(REPO)} is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path.relative_to(REPO)} is out of date: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path.relative_to(REPO)}")
    return 0
