"""Replace a file whole or not at all: a crash mid-write leaves the old file (checkpoint markers
and manifests, a truncated metrics log on resume)."""

from __future__ import annotations

import os


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
