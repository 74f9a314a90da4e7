"""Pushing the actor's weights from trainer rank 0 to the rollout engines.

At the weight-sync boundary the trainer gathers its (TP-sharded) weights into Hugging Face
tensors on rank 0 (`WeightSet`), and `WeightSender.send` delivers them to the rollout ranks
the controller names, each by the cheapest path its place in the rank plan allows:

- **Same node as the sender**: the tensors are written once into shared-memory buckets
  (`scheduler.weight_bucket_mb` each) and every engine on the node loads them from there. The
  `LoadWeights` message carries each bucket's handle (a few hundred bytes: torch's
  `file_system` sharing names a /dev/shm file), which the rank passes unchanged to SGLang's
  `update_weights_from_tensor`; the engine's scheduler maps the bucket and copies it into its
  parameters. One copy of the model per node, however many engines: the node's engines read it
  in parallel, and neither the rollout rank nor SGLang's serializer copies it again.
- **Another node**: the lowest receiver of that node is its relay. Rank 0 sends it the packed
  buffer point to point (`LoadWeights` with `relay_to`, then a tagged gloo send); the relay
  receives it straight into shared memory, loads its own engine from it and passes the bucket
  handles on to the node's other receivers in their own `LoadWeights`. Each node's network
  link carries the model once, not once per engine.

Nothing here waits on a receiver. A receiver confirms with `WeightsLoaded`, and the controller
quarantines one that does not within `scheduler.weight_sync_timeout_s` (a hung relay leaves its
node's receivers unconfirmed too: they are quarantined with it and rejoin at the next sync).
A collective over the receivers would let one hung rank stall every sync.

Why nothing waits on a gloo send: in gloo (torch 2.13) a `Work.wait(timeout)` that expires
closes every connection of the process ("Application timeout caused pair closure"), and
`Work.is_completed()` of gloo point-to-point work stays False even after the transfer. Each
`Send` keeps what its receiver reads (the work object with its buffer, or the shared buckets)
until the receiver confirms. A receiver maps the buckets it loaded and holds them until its next
version, so their memory outlives the sender's hold and an engine that dies and restarts
reloads them (`rollout/worker.py`). A receiver
that wakes up late still finds its send pending and completes it; the tag keeps versions apart.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import io
import os
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from multiprocessing.reduction import ForkingPickler

from tide_megatron.comm.messages import LoadWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class WeightManifest:
    """What a flat weight buffer holds, in order."""

    version: int
    names: list[str]
    shapes: list[list[int]]
    dtype: str
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Largest shared-memory bucket (a relay cuts the buffer it received the same way)."""

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    def to_json(self) -> dict:
        return {"version": self.version, "names": self.names, "shapes": self.shapes, "dtype": self.dtype,
                "bucket_bytes": self.bucket_bytes}

    @classmethod
    def from_json(cls, data: dict) -> WeightManifest:
        return cls(int(data["version"]), list(data["names"]), [list(s) for s in data["shapes"]], str(data["dtype"]),
                   int(data.get("bucket_bytes", DEFAULT_BUCKET_BYTES)))


def pack(named: list[tuple[str, torch.Tensor]], version: int,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[WeightManifest, torch.Tensor]:
    """Flatten HF-named tensors into one contiguous host buffer (`share_named`'s layout, in
    private memory: the earlier path's buffer, kept for comparison in the benchmark)."""
    manifest = manifest_of(named, version, bucket_bytes)
    return manifest, torch.cat([t.detach().reshape(-1).to("cpu") for _, t in named])


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
    keep: Any = None
    """The buffer the receiver reads (the shared one it maps, or the one gloo sends)."""


def share_named(named: list[tuple[str, torch.Tensor]], version: int,
                bucket_bytes: int) -> tuple[WeightManifest, torch.Tensor]:
    """Copy HF-named tensors into one shared-memory buffer; returns (manifest, the buffer, which
    must outlive every load from it)."""
    manifest = manifest_of(named, version, bucket_bytes)
    flat = shared_empty(manifest)
    offset = 0
    for _, t in named:
        n = t.numel()
        flat[offset: offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return manifest, flat


def shared_empty(manifest: WeightManifest) -> torch.Tensor:
    """An uninitialised buffer for `manifest`'s tensors in shared memory that any process of
    the node can map (torch's `file_system` sharing: by /dev/shm file name; the default passes
    file descriptors through the owner's resource sharer, which reaches its own children only)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    flat = torch.empty(manifest.numel, dtype=_DTYPES[manifest.dtype]).share_memory_()
    _created_here(flat)
    return flat


_CREATED: list[str] = []


def _created_here(flat: torch.Tensor) -> None:
    """Remember the /dev/shm file behind `flat`, to unlink at this process's exit. torch unlinks
    it when its last mapping closes, but a process killed while it maps a buffer (an SGLang
    scheduler) never closes it, and the cleanup by torch's shared-memory manager is lost when
    the manager itself is killed (SGLang's engine shutdown kills every child of its process)."""
    if not _CREATED:
        atexit.register(_unlink_created)
    _CREATED[:] = [name for name in _CREATED if os.path.exists(_shm_path(name))]  # gone already: forget
    _CREATED.append(flat.untyped_storage()._share_filename_cpu_()[1].decode())


def _shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name.lstrip("/"))


def _unlink_created() -> None:
    for name in _CREATED:
        with contextlib.suppress(OSError):
            os.unlink(_shm_path(name))


def bucket_handles(manifest: WeightManifest, flat: torch.Tensor) -> list[str]:
    """Serialized handles of `flat`'s tensors (from `shared_empty`), one per bucket, for ONE
    receiver: torch counts each serialization as one reference that the process opening it
    takes over (`rebuild_storage_filename` drops it), so every opening needs its own."""
    if not flat.is_shared():
        raise ValueError("bucket_handles needs a buffer from shared_empty")
    return serialize_buckets(buckets(unpack(manifest, flat), manifest.bucket_bytes))


def serialize_buckets(mapped: list[list[tuple[str, torch.Tensor]]]) -> list[str]:
    """Handles of buckets of shared tensors (for one opening each, see `bucket_handles`)."""
    return [_serialize(bucket) for bucket in mapped]


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most `bucket_bytes` each (`bucket_ranges`)."""
    ranges = bucket_ranges([t.numel() * t.element_size() for _, t in named], bucket_bytes)
    return [named[lo:hi] for lo, hi in ranges]


def bucket_ranges(nbytes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of consecutive tensors of at most `bucket_bytes` together (a tensor
    larger than that alone). The one rule for cutting weights into buckets."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[tuple[int, int]] = []
    size = bucket_bytes
    for i, n in enumerate(nbytes):
        if size + n > bucket_bytes or not out:
            out.append((i, i))
            size = 0
        out[-1] = (out[-1][0], i + 1)
        size += n
    return out


def manifest_of(named: list[tuple[str, torch.Tensor]], version: int,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightManifest:
    """The manifest of HF-named tensors, which must share one dtype."""
    if not named:
        raise ValueError("no weights to send")
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"expected every tensor in one dtype, got {sorted(map(str, dtypes))}")
    dtype_name = next(k for k, v in _DTYPES.items() if v in dtypes)
    return WeightManifest(version, [n for n, _ in named], [list(t.shape) for _, t in named], dtype_name,
                          bucket_bytes)


def _serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """What SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)` writes, without
    importing SGLang here: a ForkingPickler dump (shared storages travel as /dev/shm names under
    torch's `file_system` strategy, which any process of the node can open), base64 encoded."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def map_buckets(handles: list[str]) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors behind serialized bucket handles, mapped into this process (no copy; each
    handle opened once). Holding them keeps their shared memory alive after its owner lets go:
    a receiver keeps the buckets its engine last loaded, so a replacement engine can load them
    again (`serialize_buckets` gives its engine handles of its own)."""
    return [pickle.loads(base64.b64decode(h)) for h in handles]


class WeightSet:
    """One version of the actor's weights on the sender: HF-named tensors until `shared()` first
    copies them into one shared-memory buffer, which both paths use (its layout is `pack`'s, so
    a relay is sent the same buffer that the sender's node maps)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.named, self.version, self.bucket_bytes = named, version, bucket_bytes
        self._shared: tuple[WeightManifest, torch.Tensor] | None = None

    def shared(self) -> tuple[WeightManifest, torch.Tensor]:
        if self._shared is None:
            self._shared = share_named(self.named, self.version, self.bucket_bytes)
            self.named = []  # the sends keep the buffer only (on GPU the gathered tensors free GPU memory)
        return self._shared


def route(receivers: Iterable[int], node_of: Callable[[int], int], sender_node: int) -> tuple[list[int], dict[int, list[int]]]:
    """(receivers that load the sender's shared buckets, {relay: the other receivers of its
    node}): one relay per other node, its lowest receiver."""
    local, remote = [], {}
    for r in sorted(receivers):
        if node_of(r) == sender_node:
            local.append(r)
        else:
            remote.setdefault(node_of(r), []).append(r)
    return local, {ranks[0]: ranks[1:] for ranks in remote.values()}


@dataclass
class WeightSender:
    """Rank 0's end (see the module docstring)."""

    group: dist.ProcessGroup
    mailbox: Any
    rank: int = 0
    node_of: Callable[[int], int] = field(default=lambda rank: 0)
    """The node of a rank (the rank plan's); one node when not given."""

    def send(self, weights: WeightSet, receivers: Iterable[int]) -> list[Send]:
        """Start delivering `weights` to each receiver; returns at once."""
        local, relays = route(receivers, self.node_of, self.node_of(self.rank))
        if not local and not relays:
            return []
        manifest, flat = weights.shared()
        out, now = [], time.monotonic()
        for r in local:
            self.mailbox.post(r, LoadWeights(manifest.to_json(), sender=self.rank, shared=bucket_handles(manifest, flat)))
            out.append(Send(r, weights.version, None, now, keep=flat))
        for relay, peers in relays.items():
            work = self.group.send([flat], relay, manifest.version)
            self.mailbox.post(relay, LoadWeights(manifest.to_json(), sender=self.rank, relay_to=peers))
            out.append(Send(relay, weights.version, work, now, keep=flat))
            out += [Send(p, weights.version, None, now) for p in peers]  # they load from the relay
        return out


def receive_flat(group: dist.ProcessGroup, manifest: WeightManifest, src: int,
                 timeout_s: float, shared: bool = False) -> tuple[torch.Tensor, float]:
    """A receiver's end: the buffer `manifest` describes, from `src` (`shared`: allocated in
    shared memory, for a relay). Returns it and the seconds spent. The sender started its send
    before posting the `LoadWeights` this answers, so only a dead sender (the job is over then)
    lets `timeout_s` pass; gloo then raises."""
    flat = shared_empty(manifest) if shared else torch.empty(manifest.numel, dtype=_DTYPES[manifest.dtype])
    t0 = time.perf_counter()
    group.recv([flat], src, manifest.version).wait(timedelta(seconds=timeout_s))
    return flat, time.perf_counter() - t0
