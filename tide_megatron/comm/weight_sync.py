"""Pushing the actor's weights from trainer rank 0 to every rollout engine.

At the weight-sync boundary the trainer gathers its (TP-sharded) weights into Hugging Face
tensors on rank 0; rank 0 packs them into one flat buffer per dtype and broadcasts it
over the job's gloo group (one collective instead of one per tensor); each rollout rank
unpacks views into the flat buffer and hands them to its engine, which loads them in
place. Every rank takes part in the broadcast (see `topology.py`), so role changes
need no new group; trainer ranks other than 0 receive and drop the buffer.

The manifest (names, shapes, dtypes) travels first over the control mailbox, so the
receivers can size the buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

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
    """Flatten HF-named tensors into one contiguous buffer (on CPU: gloo broadcasts host memory)."""
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


def broadcast_flat(group: dist.ProcessGroup, flat: torch.Tensor | None, manifest: WeightManifest,
                   src: int = 0) -> tuple[torch.Tensor, float]:
    """The broadcast every rank of `group` joins. Returns the buffer and seconds spent."""
    if flat is None:
        flat = torch.empty(manifest.numel, dtype=_DTYPES[manifest.dtype])
    t0 = time.perf_counter()
    group.broadcast(flat, src).wait()
    return flat, time.perf_counter() - t0
