"""Streaming the actor's weights to every engine as bucketed broadcasts over one update group.

The path slime, verl and AReaL take through SGLang's `update_weights_from_distributed`: the
sender and every receiver belong to one process group (NCCL between GPUs, gloo on CPU); the
sender copies consecutive HF-named tensors into a flat bucket of at most `bucket_bytes` and
broadcasts it, and each receiver copies the bucket's tensors into its parameters. Two buckets
alternate on each side, so filling the next bucket (where `named` is a generator that gathers a
TP-sharded weight lazily, the gather) overlaps the previous bucket's broadcast, and neither side
ever holds more than two buckets: no full-model copy, on the host or on the GPU.

On GPU the overlap costs the host nothing: a `Work.wait()` of NCCL work makes the current
stream wait for the collective, not the host, and a collective launched later waits for the
copies queued before it. Gloo (CPU) runs each broadcast on its own thread in posting order.

The bucket layout is a function of the manifest alone (`bucket_ranges`), so the receivers
know every bucket's size and contents before it arrives. A bucket travels as its bytes: the
tensors' bytes end to end, which is what SGLang's receiver of
`update_weights_from_distributed(..., load_format="flattened_bucket")` allocates
(`FlattenedTensorBucket`) and what a test checks it reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from tide_megatron.comm.weight_sync import _DTYPES, WeightManifest, bucket_ranges

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Takes one bucket's tensors (views into a buffer that is reused once it returns: copy them)."""


@dataclass
class BroadcastStats:
    """One side's account of one sync."""

    nbytes: int
    buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _numels(manifest: WeightManifest) -> list[int]:
    return [int(torch.Size(s).numel()) for s in manifest.shapes]


def _layout(manifest: WeightManifest) -> tuple[list[int], list[tuple[int, int]], int]:
    """(numel per tensor, bucket ranges, elements of the largest bucket)."""
    numels = _numels(manifest)
    itemsize = torch.empty((), dtype=_DTYPES[manifest.dtype]).element_size()
    ranges = bucket_ranges([n * itemsize for n in numels], manifest.bucket_bytes)
    return numels, ranges, max(sum(numels[lo:hi]) for lo, hi in ranges)


def bucket_specs(manifest: WeightManifest) -> list[tuple[list[str], list[list[int]]]]:
    """Each bucket's tensor names and shapes, in order (all of the manifest's dtype): what an
    SGLang engine is told for each `update_weights_from_distributed` call."""
    _, ranges, _ = _layout(manifest)
    return [(manifest.names[lo:hi], manifest.shapes[lo:hi]) for lo, hi in ranges]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def broadcast_weights(group: dist.ProcessGroup | None, named: Iterable[tuple[str, torch.Tensor]],
                      manifest: WeightManifest, src: int, device: torch.device | str) -> BroadcastStats:
    """The sender's end: broadcast `named` (in the manifest's order, names and shapes checked)
    from global rank `src` to every member of `group`. Returns when every bucket is sent."""
    device = torch.device(device)
    numels, ranges, largest = _layout(manifest)
    dtype = _DTYPES[manifest.dtype]
    bufs = [torch.empty(largest, dtype=dtype, device=device) for _ in range(2)]
    works: list = [None, None]
    items = iter(named)
    total = 0
    t0 = time.perf_counter()
    for b, (lo, hi) in enumerate(ranges):
        buf = bufs[b % 2]
        if works[b % 2] is not None:
            works[b % 2].wait()  # the broadcast that last read this buffer is done
        offset = 0
        for k in range(lo, hi):
            name, t = next(items, (None, None))
            if name != manifest.names[k] or list(t.shape) != manifest.shapes[k]:
                got = "nothing" if name is None else f"{name} {list(t.shape)}"
                raise ValueError(f"weight {k}: expected {manifest.names[k]} {manifest.shapes[k]}, got {got}")
            buf[offset: offset + numels[k]].copy_(t.detach().reshape(-1), non_blocking=True)
            offset += numels[k]
        works[b % 2] = dist.broadcast(buf[:offset].view(torch.uint8), src, group=group, async_op=True)
        total += offset * buf.element_size()
    for work in works:
        if work is not None:
            work.wait()
    _sync(device)
    return BroadcastStats(total, len(ranges), time.perf_counter() - t0)


def receive_weights(group: dist.ProcessGroup | None, manifest: WeightManifest, src: int,
                    device: torch.device | str, load: Loader) -> BroadcastStats:
    """A receiver's end: take every bucket `src` broadcasts and hand its tensors to `load`,
    which copies them (into an engine's parameters) while the next bucket arrives."""
    device = torch.device(device)
    numels, ranges, largest = _layout(manifest)
    dtype = _DTYPES[manifest.dtype]
    bufs = [torch.empty(largest, dtype=dtype, device=device) for _ in range(2)]
    total = 0

    def finish(b: int, work) -> None:
        work.wait()
        lo, hi = ranges[b]
        buf, views, offset = bufs[b % 2], [], 0
        for k in range(lo, hi):
            views.append((manifest.names[k], buf[offset: offset + numels[k]].view(manifest.shapes[k])))
            offset += numels[k]
        load(views)

    t0 = time.perf_counter()
    pending = None
    for b, (lo, hi) in enumerate(ranges):
        n = sum(numels[lo:hi])
        # This buffer's previous bucket was loaded in the iteration before last; on GPU the
        # broadcast below waits for those copies (they were queued first on the current stream).
        work = dist.broadcast(bufs[b % 2][:n].view(torch.uint8), src, group=group, async_op=True)
        total += n * bufs[b % 2].element_size()
        if pending is not None:
            finish(*pending)
        pending = (b, work)
    if pending is not None:
        finish(*pending)
    _sync(device)
    return BroadcastStats(total, len(ranges), time.perf_counter() - t0)
