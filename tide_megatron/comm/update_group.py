"""The weight update group: rank 0 and the engines of the current split, for the broadcast path.

`scheduler.weight_sync_path: broadcast` sends the actor's weights the way slime, verl and
AReaL do, through SGLang's own API: rank 0 (trainer DP rank 0, TP rank 0) and every engine in
service form one process group (NCCL on GPU, gloo on CPU), and rank 0 streams the HF-named
tensors as bucketed broadcasts (`bucket_broadcast.py`) straight from the trainer's device into
the engines' parameters (`update_weights_from_distributed`); no full-model copy on any host.

Who is in the group. The group is formed only from engines known to be alive and current:
rollout ranks in service that confirmed every weight version they were sent
(`Quarantine.steady`). Everything else a sync sends to (a rank rejoining after quarantine, a
rank ERS returns to rollout whose engine may still be starting, a rank whose engine
restarted) takes the host path that sync (`weight_sync.py`) and joins the group at a later
one. So a sync never waits for an engine that is starting, and never for a quarantined rank.
The group is rebuilt only when that membership changes (an ERS move, a quarantine, a rejoin);
each rebuild is timed (`rebuild_s`, logged per step as `weights/group_rebuild_s`).

A member that hangs inside a collective. A broadcast is a collective: one stopped member
stalls it for all. Rank 0's end of the group times out after
`scheduler.weight_broadcast_timeout_s` (joining or broadcasting), closes the group and
rebuilds it at the next sync; a member's own call gives up after the same bound and replaces
its engine (stuck in the collective, it cannot be reused); members that did not confirm are
quarantined by the usual `scheduler.weight_sync_timeout_s` and rejoin by the host path. The
cost of one hung member is then an engine restart for the members behind it, bounded in time.

Both ends build the group the same way: a TCPStore served by rank 0 at `address:port`, a
`PrefixStore` named after the group, torch's group constructor with ranks mapped one to one
(SGLang's `init_custom_process_group`, which the engines run; `new_update_group` mirrors it).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from tide_megatron.comm.bucket_broadcast import BroadcastStats, broadcast_weights
from tide_megatron.comm.messages import JoinUpdateGroup, LoadWeights
from tide_megatron.comm.weight_sync import WeightManifest
from tide_megatron.utils.net import free_port

logger = logging.getLogger(__name__)


def new_update_group(address: str, port: int, world_size: int, rank: int, group_name: str, backend: str,
                     timeout_s: float) -> dist.ProcessGroup:
    """Rank `rank`'s end of the update group (rank 0 serves the store). Blocks until every
    member has joined, or raises after `timeout_s`. Group ranks are global ranks in this
    process's view (`dist.broadcast(src=0, group=...)` means the sender), as SGLang maps them."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # Built directly, not through `rendezvous("tcp://...")`: under torchrun that would reuse
    # the elastic agent's store (TORCHELASTIC_USE_AGENT_STORE) instead of serving this one.
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@dataclass
class GroupChange:
    """What re-forming the group takes: a `JoinUpdateGroup` per member, then `connect`."""

    members: tuple[int, ...]
    joins: dict[int, JoinUpdateGroup]
    port: int
    world_size: int
    name: str


class UpdateGroupSender:
    """Rank 0's end of the broadcast path, owned by the thread that pushes the weights (the
    trainer's: the TP gather it streams from is a collective of that thread)."""

    def __init__(self, *, backend: str, device: torch.device | str, engine_tp: int, timeout_s: float,
                 address: Optional[str] = None, port_fn: Callable[[], int] = free_port):
        self.backend, self.device, self.engine_tp, self.timeout_s = backend, torch.device(device), engine_tp, timeout_s
        self.address = address or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._port_fn = port_fn
        self.members: tuple[int, ...] = ()
        """The engines in the group now (empty: no group)."""
        self.name = ""
        self._pg: Optional[dist.ProcessGroup] = None
        self._generation = 0
        self._joined: dict[int, str] = {}  # rank -> the group its engine joined last (left when it rejoins)
        self.rebuilds = 0
        self.rebuild_s = 0.0
        """Seconds the last (re)formation took on rank 0 (store, every member joined)."""

    def change_for(self, members: Iterable[int]) -> Optional[GroupChange]:
        """What forming the group for `members` takes; None while the current group serves them."""
        members = tuple(sorted(members))
        if members == self.members and self._pg is not None:
            return None
        self.close()
        if not members:
            return None
        self._generation += 1
        name = f"tide_weights_{os.getpid()}_{self._generation}"
        port, world = self._port_fn(), 1 + self.engine_tp * len(members)
        joins = {r: JoinUpdateGroup(self.address, port, rank_offset=1 + i * self.engine_tp, world_size=world,
                                    group_name=name, backend=self.backend, timeout_s=self.timeout_s,
                                    leave=self._joined.get(r, ""))
                 for i, r in enumerate(members)}
        return GroupChange(members, joins, port, world, name)

    def connect(self, change: GroupChange) -> float:
        """Rank 0's end of `change` (after its joins were posted); blocks until every member
        joined. Returns the seconds it took; raises (the group stays closed) on timeout."""
        t0 = time.perf_counter()
        self._pg = new_update_group(self.address, change.port, change.world_size, 0, change.name, self.backend,
                                    self.timeout_s)
        self.members, self.name = change.members, change.name
        self._joined.update({r: change.name for r in change.members})
        self.rebuilds += 1
        self.rebuild_s = time.perf_counter() - t0
        logger.info("weight update group %s formed with rollout ranks %s in %.2f s", change.name,
                    list(change.members), self.rebuild_s)
        return self.rebuild_s

    def loads(self, manifest: WeightManifest) -> dict[int, LoadWeights]:
        """The `LoadWeights` each member reads before the broadcast starts."""
        return {r: LoadWeights(manifest.to_json(), group=self.name) for r in self.members}

    def broadcast(self, named: Iterable[tuple[str, torch.Tensor]], manifest: WeightManifest) -> BroadcastStats:
        """Stream `named` to every member; on failure (a member gone or hung past the timeout)
        the group is closed, to be re-formed at the next sync, and the error raised."""
        if self._pg is None:
            raise RuntimeError("no weight update group: connect first")
        try:
            return broadcast_weights(self._pg, named, manifest, src=0, device=self.device)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Drop rank 0's end of the group (its members leave it when they next join one)."""
        pg, self._pg = self._pg, None
        self.members, self.name = (), ""
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except Exception as exc:  # a broken group may refuse; it is dropped either way
                logger.warning("closing the weight update group: %s", exc)
