"""Save and resume the actor with Megatron `dist_checkpointing` (model + optimizer + step),
with a sha256 manifest that is checked before anything in a checkpoint is read.

Layout under a root directory:

    root/step_000012/              a dist_checkpointing directory (each rank writes its own shards)
    root/step_000012/run_state.json  the controller's run state (optional; opaque JSON here)
    root/step_000012/manifest.json   size and sha256 of every other file of the directory
    root/latest                    text file: the name of the newest complete step directory

Order of a save: every rank writes its shards; after a barrier rank 0 writes `run_state.json`,
then `manifest.json`, then moves `latest`, each by an atomic rename. A crash at any point leaves
`latest` naming the previous complete checkpoint; a step directory without a manifest is an
interrupted save and is never loaded.

Why a manifest: dist_checkpointing reads `.metadata` (and byte items of the shards) with
`pickle`, and a truncated shard fails deep inside the loader (`EOFError`). Checking sizes and
hashes first turns a damaged checkpoint into one line naming the file, and lets a resume fall
back to the previous checkpoint. It is an integrity check, not authentication: whoever can
write the checkpoint directory can rewrite the manifest too, so checkpoints are trusted input,
like model weights (see docs/threat_model.md).

The format is dist_checkpointing's, which can reshard to another TP size on load; the tests
cover resuming at the same TP size (TP=1 and TP=2) and loading the model of a TP=2 checkpoint at
TP=1 (`models/hf_export.py`).

Who takes part: every current actor rank, and no other. dist_checkpointing runs its collectives
on the default group, which spans the whole job (rollout ranks too), so they run with the
actors' group of the current configuration as the default (`comm.groups.as_default_group`; the
actors are ranks 0..n-1, so its ranks are the global ranks). DP replicas beyond the first write
nothing (Megatron's replica ids); a rank that joins later receives the state from a current
actor instead of reading it (`state_transfer.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from tide_megatron.utils.atomic import write_atomic

if TYPE_CHECKING:
    from tide_megatron.trainer.actor import MegatronActor

logger = logging.getLogger(__name__)

LATEST_MARKER = "latest"
MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
MANIFEST_FORMAT = 1
SHALLOW_HASH_LIMIT = 16 << 20
"""A shallow check hashes files up to this size (metadata, common state, run state) and only
measures the larger shards; `.metadata` is always hashed, since it is unpickled first."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the checkpoint and why."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files do not match its manifest (or it has none)."""

    def __init__(self, path: str, reason: str, incomplete: bool = False):
        super().__init__(f"checkpoint {path} is {'incomplete' if incomplete else 'corrupt'}: {reason}")
        self.path, self.reason, self.incomplete = path, reason, incomplete


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(path: str | os.PathLike) -> Optional[int]:
    """The step of a `step_NNNNNN` directory name, None for any other name."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(m.group(1)) if m else None


# -- files: atomic writes, manifest ---------------------------------------------------------
def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checkpoint_files(path: str) -> list[str]:
    """Every regular file under `path` (relative, sorted), the manifest and temporaries aside."""
    out = []
    for base, _dirs, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), path)
            if rel != MANIFEST and not name.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(path: str | os.PathLike, step: int) -> dict[str, Any]:
    """Record the size and sha256 of every file of the checkpoint directory `path`."""
    path = os.fspath(path)
    files = {rel: {"bytes": os.path.getsize(os.path.join(path, rel)), "sha256": _sha256(os.path.join(path, rel))}
             for rel in _checkpoint_files(path)}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    write_atomic(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of checkpoint `path`; CheckpointCorrupt when missing or malformed."""
    path = os.fspath(path)
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointCorrupt(path, f"no {MANIFEST} (an interrupted save, or written before manifests)",
                                incomplete=True)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(path, f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointCorrupt(path, f"{MANIFEST} has an unknown format (expected format {MANIFEST_FORMAT})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()):
        raise CheckpointCorrupt(path, f"{MANIFEST} is malformed (needs step and files with bytes and sha256)")
    return manifest


def verify_checkpoint(path: str | os.PathLike, deep: bool = True) -> dict[str, Any]:
    """Check every file of checkpoint `path` against its manifest; returns the manifest.

    deep: hash every file. Otherwise hash `.metadata` and every file up to
    `SHALLOW_HASH_LIMIT`, and only measure the larger shards (a check every loading rank can
    afford; the rank that chooses the checkpoint runs the deep one). Raises CheckpointCorrupt
    naming the first file that differs.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    manifest = read_manifest(path)
    for rel, entry in sorted(manifest["files"].items()):
        full = os.path.join(path, rel)
        if os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            raise CheckpointCorrupt(path, f"{MANIFEST} names a file outside the checkpoint: {rel}")
        if not os.path.isfile(full):
            raise CheckpointCorrupt(path, f"file {rel} is missing")
        size = os.path.getsize(full)
        if size < entry["bytes"]:
            raise CheckpointCorrupt(path, f"file {rel} is truncated ({size} of {entry['bytes']} bytes)")
        if size != entry["bytes"]:
            raise CheckpointCorrupt(path, f"file {rel} has {size} bytes, {MANIFEST} says {entry['bytes']}")
        if (deep or rel == ".metadata" or size <= SHALLOW_HASH_LIMIT) and _sha256(full) != entry["sha256"]:
            raise CheckpointCorrupt(path, f"file {rel} does not match its sha256 in {MANIFEST} "
                                          "(changed after the save)")
    return manifest


def read_run_state(path: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The run state saved with checkpoint `path` (None if it was saved without one).

    Read only after `verify_checkpoint`; a listed but unparsable file is CheckpointCorrupt."""
    path = os.fspath(path)
    full = os.path.join(path, RUN_STATE)
    if not os.path.isfile(full):
        return None
    try:
        with open(full) as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(path, f"{RUN_STATE} is not valid JSON ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointCorrupt(path, f"{RUN_STATE} is not a JSON object")
    return state


# -- choosing a checkpoint to resume ------------------------------------------------------------
@dataclass
class ResumePoint:
    """A verified checkpoint to resume from, and what was skipped on the way."""

    path: str
    step: int
    run_state: Optional[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    """One line per newer checkpoint that was skipped (corrupt or incomplete) and why."""


def _candidates(root: str, notes: list[str]) -> list[str]:
    """Step directories to try, newest first, none newer than the one `latest` names (a newer
    directory is an interrupted save, or was left by an earlier run in this output directory)."""
    dirs = sorted((d for d in os.listdir(root) if step_of(d) is not None and os.path.isdir(os.path.join(root, d))),
                  key=step_of, reverse=True)
    marker = os.path.join(root, LATEST_MARKER)
    if not os.path.isfile(marker):
        return [os.path.join(root, d) for d in dirs]
    try:
        with open(marker) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        name = f"<unreadable: {exc}>"
    if step_of(name) is None or name not in dirs:
        notes.append(f"{marker} names {name!r}, which is not a step directory here; trying every checkpoint")
        return [os.path.join(root, d) for d in dirs]
    bound = step_of(name)
    return [os.path.join(root, d) for d in dirs if step_of(d) <= bound]


def open_resumable(path: str | os.PathLike,
                   check_run_state: Optional[Callable[[dict[str, Any]], Any]] = None) -> ResumePoint:
    """Checkpoint `path` as a ResumePoint, after `verify_checkpoint(deep=True)` and, if it was
    saved with a run state, `check_run_state` (which raises ValueError on a bad one).
    CheckpointCorrupt naming what is wrong otherwise."""
    path = os.fspath(path)
    manifest = verify_checkpoint(path, deep=True)
    step = manifest["step"]
    if step_of(path) is not None and step != step_of(path):
        raise CheckpointCorrupt(path, f"{MANIFEST} is of step {step}, not of {os.path.basename(path)}")
    state = read_run_state(path)
    if state is not None and check_run_state is not None:
        try:
            check_run_state(state)
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointCorrupt(path, f"{RUN_STATE} is not a valid run state ({exc})") from None
    return ResumePoint(path, step, state)


def find_resumable(root: str | os.PathLike,
                   check_run_state: Optional[Callable[[dict[str, Any]], Any]] = None) -> Optional[ResumePoint]:
    """The newest checkpoint under `root` that passes `verify_checkpoint(deep=True)` and whose run
    state (if saved) `check_run_state` accepts (it raises ValueError on a bad one).

    None when `root` holds no complete checkpoint (nothing saved yet, or only an interrupted
    first save). CheckpointError when checkpoints exist but every one is corrupt: starting
    afresh over them would silently throw the run away.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    notes: list[str] = []
    skipped: list[CheckpointCorrupt] = []
    for path in _candidates(root, notes):
        try:
            point = open_resumable(path, check_run_state)
        except CheckpointCorrupt as exc:
            skipped.append(exc)
            continue
        point.notes = notes + [f"{exc}; falling back to {os.path.basename(path)}" for exc in skipped]
        return point
    corrupt = [exc for exc in skipped if not exc.incomplete]
    if corrupt:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(
            f"{os.path.basename(exc.path)} {'incomplete' if exc.incomplete else 'corrupt'} ({exc.reason})"
            for exc in skipped))
    for exc in skipped:
        logger.warning("%s; ignored", exc)
    return None


# -- Megatron side ------------------------------------------------------------------------------
def _sharded_state_dict(actor: "MegatronActor", is_loading: bool) -> dict:
    model_sd = actor.module.sharded_state_dict(metadata={"dp_cp_group": actor.groups.dp_cp})
    return {
        "model": model_sd,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "step": actor.step,  # a plain value: saved once as common state
    }


def save_checkpoint(actor: "MegatronActor", root: str | os.PathLike,
                    run_state: Optional[dict[str, Any]] = None) -> str:
    """Write the actor's model, optimizer and step under `root`; returns the step directory.

    Collective over every actor rank of the current configuration (`actor.groups.tp_dp_cp`).
    `run_state` (rank 0's, JSON-able) is saved beside the shards, before the manifest and
    `latest` are written.
    """
    import torch
    from megatron.core import dist_checkpointing

    from tide_megatron.comm.groups import as_default_group

    root = os.fspath(root)
    path = os.path.join(root, step_dir_name(actor.step))
    with as_default_group(actor.groups.tp_dp_cp):
        rank = torch.distributed.get_rank()
        if rank == 0:
            # What an older save left here (a run that fell back past this step, or an earlier
            # run in this output directory) would be listed in the new manifest: start empty.
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        torch.distributed.barrier()
        dist_checkpointing.save(_sharded_state_dict(actor, is_loading=False), path)
        torch.distributed.barrier()
        if rank == 0:
            if run_state is not None:
                write_atomic(os.path.join(path, RUN_STATE), json.dumps(run_state).encode())
            write_manifest(path, actor.step)
            write_atomic(os.path.join(root, LATEST_MARKER), (step_dir_name(actor.step) + "\n").encode())
        torch.distributed.barrier()
    return path


def latest_checkpoint(root: str | os.PathLike) -> str:
    """The step directory named by `root/latest`; FileNotFoundError (naming the path) if absent."""
    root = os.fspath(root)
    marker = os.path.join(root, LATEST_MARKER)
    if not os.path.isfile(marker):
        raise FileNotFoundError(f"no checkpoint to resume: {marker} does not exist")
    with open(marker) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{marker} names {name!r} but {path} does not exist")
    return path


def load_checkpoint(actor: "MegatronActor", path: str | os.PathLike) -> int:
    """Load model, optimizer and step from one step directory into `actor`; returns the step.

    Collective over every actor rank (as `save_checkpoint`). The files are checked against the
    manifest first (shallow, see `verify_checkpoint`): FileNotFoundError when `path` is not a directory, CheckpointCorrupt
    when its files do not match, CheckpointError when the loader still fails.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from tide_megatron.comm.groups import as_default_group

    path = os.fspath(path)
    verify_checkpoint(path, deep=False)
    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise CheckpointCorrupt(path, "not a Megatron dist_checkpointing directory (no valid metadata.json)")
    try:
        with as_default_group(actor.groups.tp_dp_cp):
            state = dist_checkpointing.load(_sharded_state_dict(actor, is_loading=True), path)
        actor.module.load_state_dict(state["model"])
        actor.optimizer.load_state_dict(state["optimizer"])
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} could not be loaded into this model: "
                              f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                              ) from exc
    actor.step = int(state["step"])
    return actor.step


def load_latest_checkpoint(actor: "MegatronActor", root: str | os.PathLike) -> int:
    """Resume from the newest good checkpoint under `root` (see `find_resumable`); returns the
    restored step. FileNotFoundError naming `root` when there is none."""
    point = find_resumable(root)
    if point is None:
        raise FileNotFoundError(f"no checkpoint to resume under {os.fspath(root)}")
    for note in point.notes:
        logger.warning("%s", note)
    return load_checkpoint(actor, point.path)
