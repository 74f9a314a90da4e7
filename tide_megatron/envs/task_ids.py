"""Task ids of the built-in envs (`<split>/<index>`) and the stable seeds derived from them.

Python's `hash` is salted per process, so every seed here comes from blake2b: the same task
gives the same game in the server, in a test and in the simulator.
"""

from __future__ import annotations

import hashlib


def make_task_id(split: str, index: int) -> str:
    return f"{split}/{index}"


def pool_task_ids(split: str, pool_sizes: dict[str, int]) -> list[str]:
    """Every task id of a split; KeyError for a split that is not one of the pools."""
    if split not in pool_sizes:
        raise KeyError(f"unknown split {split!r}; splits are {sorted(pool_sizes)}")
    return [make_task_id(split, i) for i in range(pool_sizes[split])]


def parse_task_id(task_id: str, pool_sizes: dict[str, int]) -> tuple[str, int]:
    """(split, index) of `task_id`; KeyError when it is not a task of these pools."""
    split, sep, index = task_id.partition("/")
    if not sep or split not in pool_sizes or not index.isdigit():
        raise KeyError(f"malformed task id {task_id!r} (want '<split>/<index>', split in {sorted(pool_sizes)})")
    i = int(index)
    if i >= pool_sizes[split]:
        raise KeyError(f"task id {task_id!r} out of range: the {split} pool has {pool_sizes[split]} tasks")
    return split, i


def stable_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on `parts` (their str forms)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
