"""Write (or remove) the `.pth` hook that activates the stand-ins in every interpreter.

Run as `python -m tide_megatron.compat.install [--remove]` inside the venv. The hook
must be a `.pth` file: SGLang spawns fresh interpreters for its scheduler and
detokenizer, and only site-packages hooks reach them.
"""

from __future__ import annotations

import argparse
import site
import sys
from pathlib import Path

PTH_NAME = "tide_megatron_compat.pth"
PTH_LINE = "import tide_megatron.compat as _tc; _tc.activate_standins()\n"


def pth_path() -> Path:
    return Path(site.getsitepackages()[0]) / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--remove", action="store_true", help="remove the hook instead")
    args = parser.parse_args(argv)
    path = pth_path()
    if args.remove:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    else:
        path.write_text(PTH_LINE)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
