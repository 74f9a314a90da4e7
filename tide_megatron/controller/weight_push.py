"""Rank 0's side of a weight sync: which rollout ranks get the new weights, by which path.

`scheduler.weight_sync_path` picks the path:

- `host` (`comm/weight_sync.py`): the gathered tensors are copied once into shared memory on
  rank 0's node; its engines map them, other nodes get one copy each through a relay.
- `broadcast` (`comm/update_group.py`): rank 0 streams them from the trainer's device through
  a process group with the engines (NCCL on GPU, gloo on CPU), bucket by bucket, into SGLang's
  `update_weights_from_distributed`. The group holds the steady engines (in service, every
  sent version confirmed); a rank rejoining or returning to rollout takes the host path that
  one sync and joins the group at a later one, so the host copy is made only in those syncs.

Nothing here waits for a receiver to confirm: rank 0 books every send with the rollout
service, which quarantines a rank that does not confirm within `scheduler.weight_sync_timeout_s`
(and a sync mode step waits until each receiver confirmed or was quarantined).

Runs on the trainer's thread: the TP gather that `named` streams from is a collective of the
trainer ranks in that thread's order. The rollout service's state is reached through
`rollout.call`, on its own thread.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

from tide_megatron.comm.update_group import UpdateGroupSender
from tide_megatron.comm.weight_sync import WeightManifest, WeightSet, manifest_of
from tide_megatron.config import WEIGHT_SYNC_PATHS

logger = logging.getLogger(__name__)


class WeightPush:
    def __init__(self, *, path: str, rollout, mailbox, bucket_bytes: int, engine_tp: int = 1,
                 broadcast_timeout_s: float = 60.0):
        if path not in WEIGHT_SYNC_PATHS:
            raise ValueError(f"scheduler.weight_sync_path must be one of {WEIGHT_SYNC_PATHS}, got {path!r}")
        self.path, self.rollout, self.mailbox, self.bucket_bytes = path, rollout, mailbox, bucket_bytes
        self.group: UpdateGroupSender | None = None
        if path == "broadcast":
            cuda = torch.cuda.is_available()
            self.group = UpdateGroupSender(
                backend="nccl" if cuda else "gloo", engine_tp=engine_tp, timeout_s=broadcast_timeout_s,
                device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
        self._layout: WeightManifest | None = None  # names, shapes and dtype: the same every version
        self.last: dict[str, float] = {}
        """The last sync's figures, for the step's metrics (`metrics`)."""

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send version `version` (`named`: the HF tensors in export order, possibly a lazy
        gather) to every receiver the rollout service names. Returns once rank 0's part is
        done: the host copy made, or every bucket broadcast."""
        if self.group is None:
            named = list(named)
            receivers = self.rollout.call(lambda: self.rollout.send_weights(WeightSet(named, version,
                                                                                    self.bucket_bytes)))
            self.last = {"weights/host_ranks": float(len(receivers))}
            return
        receivers, steady = self.rollout.call(self.rollout.weight_receivers)
        rebuild_s = self._form_group(steady)
        members = set(self.group.members)
        host = [r for r in receivers if r not in members]
        named = iter(named)
        if host or self._layout is None:  # the host copy needs every tensor at once; so does a first manifest
            named = list(named)
            self._layout = manifest_of(named, 0, self.bucket_bytes)
        manifest = WeightManifest(version, self._layout.names, self._layout.shapes, self._layout.dtype,
                                  self.bucket_bytes)
        if host:
            self.rollout.call(lambda: self.rollout.send_weights(WeightSet(named, version, self.bucket_bytes), host))
        self.last = {"weights/host_ranks": float(len(host)), "weights/broadcast_ranks": float(len(members)),
                     "weights/group_rebuild_s": rebuild_s}
        if not members:
            _drain(named)
            return
        loads = self.group.loads(manifest)
        self.rollout.call(lambda: self.rollout.sent_broadcast(loads, version))
        try:
            stats = self.group.broadcast(named, manifest)
        except Exception as exc:
            logger.error("broadcasting the weights of version %d to rollout ranks %s failed (%s); ranks that "
                         "do not confirm them are quarantined and rejoin by the host path", version,
                         sorted(members), exc)
            _drain(named)  # the TP peers gather every tensor: rank 0 takes part to the end
            return
        self.last.update({"weights/broadcast_s": stats.seconds, "weights/broadcast_gb_per_s": stats.gb_per_s})

    def _form_group(self, steady: list[int]) -> float:
        """(Re)form the update group for `steady` if it changed; the seconds it took (0: kept)."""
        change = self.group.change_for(steady)
        if change is None:
            return 0.0
        for rank, join in change.joins.items():
            self.mailbox.post(rank, join)
        try:
            return self.group.connect(change)
        except Exception as exc:
            logger.error("the weight update group with rollout ranks %s did not form within %.0f s "
                         "(scheduler.weight_broadcast_timeout_s): %s; this sync takes the host path",
                         list(change.members), self.group.timeout_s, exc)
            self.group.close()
            return 0.0

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def _drain(named: Iterator | list) -> None:
    for _ in named:
        pass
