"""Save and resume the actor with Megatron `dist_checkpointing` (model + optimizer + step).

Layout under a root directory:

    root/step_000012/     a dist_checkpointing directory (each rank writes its own shards)
    root/latest           text file: the name of the newest complete step directory

`latest` is written by rank 0 after every rank has finished writing (a barrier), via an atomic
rename, so a crash mid-save leaves the previous checkpoint as the one to resume from. The
format is dist_checkpointing's, which can reshard to another TP size on load; the tests cover
save/load at the same TP size only (TP=1 and TP=2).

Who takes part: every current actor rank, and no other. dist_checkpointing runs its collectives
on the default group, which spans the whole job (rollout ranks too), so they run with the
actors' group of the current configuration as the default (`comm.groups.as_default_group`; the
actors are ranks 0..n-1, so its ranks are the global ranks). DP replicas beyond the first write
nothing (Megatron's replica ids); a rank that joins later receives the state from a current
actor instead of reading it (`state_transfer.py`).
"""

from __future__ import annotations

import os

import torch

from tide_megatron.trainer.actor import MegatronActor

LATEST_MARKER = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _sharded_state_dict(actor: MegatronActor, is_loading: bool) -> dict:
    model_sd = actor.module.sharded_state_dict(metadata={"dp_cp_group": actor.groups.dp_cp})
    return {
        "model": model_sd,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "step": actor.step,  # a plain value: saved once as common state
    }


def save_checkpoint(actor: MegatronActor, root: str | os.PathLike) -> str:
    """Write the actor's model, optimizer and step under `root`; returns the step directory.

    Collective over every actor rank of the current configuration (`actor.groups.tp_dp_cp`).
    """
    from megatron.core import dist_checkpointing

    from tide_megatron.comm.groups import as_default_group

    root = os.fspath(root)
    path = os.path.join(root, step_dir_name(actor.step))
    actors = actor.groups.tp_dp_cp
    with as_default_group(actors):
        rank = torch.distributed.get_rank()
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(_sharded_state_dict(actor, is_loading=False), path)
        torch.distributed.barrier()
        if rank == 0:
            tmp = os.path.join(root, LATEST_MARKER + ".tmp")
            with open(tmp, "w") as f:
                f.write(step_dir_name(actor.step) + "\n")
            os.replace(tmp, os.path.join(root, LATEST_MARKER))
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


def load_checkpoint(actor: MegatronActor, path: str | os.PathLike) -> int:
    """Load model, optimizer and step from one step directory into `actor`; returns the step.

    Collective over every actor rank (as `save_checkpoint`). Raises FileNotFoundError naming
    `path` when it is not a checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    from tide_megatron.comm.groups import as_default_group

    path = os.fspath(path)
    if not os.path.isdir(path) or not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise FileNotFoundError(f"no Megatron dist_checkpointing checkpoint at {path}")
    with as_default_group(actor.groups.tp_dp_cp):
        state = dist_checkpointing.load(_sharded_state_dict(actor, is_loading=True), path)
    actor.module.load_state_dict(state["model"])
    actor.optimizer.load_state_dict(state["optimizer"])
    actor.step = int(state["step"])
    return actor.step


def load_latest_checkpoint(actor: MegatronActor, root: str | os.PathLike) -> int:
    """Resume from `root/latest`; returns the restored step."""
    return load_checkpoint(actor, latest_checkpoint(root))
