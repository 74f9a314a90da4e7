"""Task ids of the built-in envs (`<split>/<index>`) and the stable seeds derived from them.

Python's `hash` is salted per process, so every seed here comes from blake2b: the same task
gives the same game in the server, in a test and in the simulator.

A task id comes from the wire, so parsing trusts nothing: the index must be ASCII digits
(`str.isdigit` is also true for "²", which `int` refuses, and for "١", which `int` accepts),
in canonical form (no leading zero: one task, one id) and at most `MAX_INDEX_DIGITS` long
(`int` refuses more than 4,300 digits with a ValueError; no pool is near 10**18 tasks).
"""

from __future__ import annotations

import hashlib

MAX_INDEX_DIGITS = 18
"""Longest index of a task id, in digits: any int64 pool size fits, and the parse stays cheap."""

_ASCII_DIGITS = frozenset("0123456789")


class MalformedTaskId(KeyError):
    """A task id that is not of the form `<split>/<index>` at all (the server answers
    `BadRequest`), as opposed to a well-formed id of no task (`UnknownTask`). A KeyError, so
    `Env.task`'s contract (KeyError for an unknown id) and its callers are unchanged."""


def make_task_id(split: str, index: int) -> str:
    return f"{split}/{index}"


def pool_task_ids(split: str, pool_sizes: dict[str, int]) -> list[str]:
    """Every task id of a split; KeyError for a split that is not one of the pools."""
    if split not in pool_sizes:
        raise KeyError(f"unknown split {split!r}; splits are {sorted(pool_sizes)}")
    return [make_task_id(split, i) for i in range(pool_sizes[split])]


def parse_task_id(task_id: str, pool_sizes: dict[str, int]) -> tuple[str, int]:
    """(split, index) of `task_id`; `MalformedTaskId` when it is not `<split>/<index>` with an
    index of ASCII digits, KeyError when it is but names no task of these pools."""
    if not isinstance(task_id, str):
        raise MalformedTaskId(f"task id must be a string, got {type(task_id).__name__}")
    split, sep, index = task_id.partition("/")
    want = f"want '<split>/<index>', split in {sorted(pool_sizes)}, index of ASCII digits"
    if not sep or not index or not set(index) <= _ASCII_DIGITS:
        raise MalformedTaskId(f"malformed task id {_clip(task_id)} ({want})")
    if len(index) > MAX_INDEX_DIGITS:
        raise MalformedTaskId(f"malformed task id {_clip(task_id)}: an index of {len(index)} digits "
                              f"(at most {MAX_INDEX_DIGITS})")
    if len(index) > 1 and index[0] == "0":
        raise MalformedTaskId(f"malformed task id {_clip(task_id)}: leading zero (the id of index i is "
                              f"'{split}/i')")
    if split not in pool_sizes:
        raise KeyError(f"unknown split in task id {_clip(task_id)}; splits are {sorted(pool_sizes)}")
    i = int(index)
    if i >= pool_sizes[split]:
        raise KeyError(f"task id {task_id!r} out of range: the {split} pool has {pool_sizes[split]} tasks")
    return split, i


def stable_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on `parts` (their str forms)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _clip(text: str, n: int = 64) -> str:
    """`text` quoted for an error message, cut to `n` characters (ids come from clients)."""
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"
