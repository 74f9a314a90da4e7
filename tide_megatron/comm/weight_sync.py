"""Pushing the actor's weights from trainer rank 0 to the rollout engines, point to point.

At the weight-sync boundary the trainer gathers its (TP-sharded) weights into Hugging Face
tensors on rank 0; rank 0 packs them into one flat buffer (`pack`) and sends it to each
rollout rank the controller names (`WeightSender.send`): a `LoadWeights` message over the
control mailbox first (the manifest, so the receiver can size the buffer, and the sender),
then a non-blocking gloo send over the job's group, tagged with the version. Each receiver
takes it with `receive_flat` and hands views into it (`unpack`) to its engine. Trainer and
reference ranks take no part; a rank left out (quarantined, see `controller/quarantine.py`)
blocks no one. A broadcast over the whole group, which every rank had to join, would let one
hung rank stall every sync.

Why rank 0 never waits on a send: in gloo (torch 2.13) a `Work.wait(timeout)` that expires
closes every connection of the process ("Application timeout caused pair closure"), so the
next send to any other rank fails too; and `Work.is_completed()` of gloo point-to-point work
stays False even after the transfer. So the bound on a transfer is the receiver's
`WeightsLoaded` over the mailbox: the controller quarantines a receiver that has not confirmed
within `scheduler.weight_sync_timeout_s`. Each `Send` keeps its work object (and with it the
buffer) until the receiver confirms; a receiver that wakes up late still finds its send
pending and completes it, and the tag keeps it apart from later versions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from tide_megatron.comm.messages import LoadWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WeightManifest:
    """What a flat weight buffer holds, in order."""

    version: int
    names: list[str]
    shapes: list[list[int]]
    dtype: str

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    def to_json(self) -> dict:
        return {"version": self.version, "names": self.names, "shapes": self.shapes, "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict) -> WeightManifest:
        return cls(int(data["version"]), list(data["names"]), [list(s) for s in data["shapes"]], str(data["dtype"]))


def pack(named: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[WeightManifest, torch.Tensor]:
    """Flatten HF-named tensors into one contiguous buffer (on CPU: gloo sends host memory)."""
    names, shapes, flats = [], [], []
    dtype = None
    for name, tensor in named:
        dtype = dtype or tensor.dtype
        if tensor.dtype != dtype:
            raise ValueError(f"{name} is {tensor.dtype}, expected every tensor in {dtype}")
        names.append(name)
        shapes.append(list(tensor.shape))
        flats.append(tensor.detach().reshape(-1).to("cpu"))
    if not flats:
        raise ValueError("no weights to pack")
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    return WeightManifest(version, names, shapes, dtype_name), torch.cat(flats)


def unpack(manifest: WeightManifest, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat`, one per named tensor."""
    out, offset = [], 0
    for name, shape in zip(manifest.names, manifest.shapes):
        n = int(torch.Size(shape).numel())
        out.append((name, flat[offset : offset + n].view(shape)))
        offset += n
    return out


@dataclass
class Send:
    """One buffer on its way to one rank. `work` (gloo's handle, which holds the buffer) is kept
    until the receiver confirms: dropping it earlier could free memory gloo still reads."""

    rank: int
    version: int
    work: Any
    started: float


class WeightSender:
    """Rank 0's end: the manifest by mailbox, the buffer by a tagged point-to-point send."""

    def __init__(self, group: dist.ProcessGroup, mailbox: Any, rank: int = 0):
        self.group, self.mailbox, self.rank = group, mailbox, rank

    def send(self, manifest: WeightManifest, flat: torch.Tensor, receivers: Iterable[int]) -> list[Send]:
        """Start sending `flat` to each receiver; returns at once (see the module docstring for
        why nothing here waits)."""
        out = []
        for rank in receivers:
            work = self.group.send([flat], rank, manifest.version)
            self.mailbox.post(rank, LoadWeights(manifest.to_json(), sender=self.rank))
            out.append(Send(rank, manifest.version, work, time.monotonic()))
        return out


def receive_flat(group: dist.ProcessGroup, manifest: WeightManifest, src: int,
                 timeout_s: float) -> tuple[torch.Tensor, float]:
    """A receiver's end: the buffer `manifest` describes, from `src`. Returns it and the seconds
    spent. The sender started its send before posting the `LoadWeights` this answers, so only a
    dead sender (the job is over then) lets `timeout_s` pass; gloo then raises."""
    flat = torch.empty(manifest.numel, dtype=_DTYPES[manifest.dtype])
    t0 = time.perf_counter()
    group.recv([flat], src, manifest.version).wait(timedelta(seconds=timeout_s))
    return flat, time.perf_counter() - t0
