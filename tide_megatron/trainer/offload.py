"""Model offloading: move a model's device memory to host memory and back (RA2P colocated mode).

In colocated RA2P the Ref and the Actor share the same ranks, so the idle model's memory is parked
in host memory while the other runs (paper, "Optimized Colocated Mode"). `ModelOffloader` does
that for any module, plus, for the actor, the Megatron DDP grad buffers (`param.main_grad`) and
the optimizer's tensors (master params of mixed precision, Adam moments).

Mechanism: storages, not tensors. Every tensor to move is reduced to its *untyped storage*,
deduplicated (views into Megatron's contiguous grad buffer, tied embeddings, params that alias a
DDP param buffer all share one storage). Offload copies each storage byte-for-byte into a host
buffer, then `storage.resize_(0)` frees the device memory while every Python object (Parameter,
`main_grad` view, optimizer state entry) keeps its identity; restore re-grows the storage and
copies the bytes back. Nothing outside needs to be re-pointed: the DDP hooks, the optimizer's
param groups and Megatron's buffers all still hold the same tensors. (FSDP frees unsharded
params the same way.) The copy is bit-exact by construction.

Devices:
- CUDA: host buffers are pinned (allocated once and reused, so page-locking is not paid per
  swap), copies are `non_blocking` on a dedicated side stream, and the caller's stream waits on
  it. `synchronize=True` (default) makes `offload`/`restore` return only once the bytes have
  moved, so the measured time is the real swap time.
- CPU: the same code path. The "device" is host memory too, so offload copies into a separate
  host buffer and frees the original storage, restore re-allocates and copies back: two real
  memcpys and an allocation per swap, i.e. a real, measurable cost of the same shape as PCIe.

What is moved for the actor (documented choice): params and grad buffers by default, optimizer
state on request (`OffloadConfig.optimizer_state`). Optimizer state is only touched by
`optimizer.step()` at the end of the step, so swapping it at every Ref/Actor alternation would
only add traffic; a deployment that needs its memory during the Ref pass turns it on.

Dropping (`OffloadConfig.keep_host_copy=False`) frees the device memory without a host copy:
for a rank leaving the actors while other DP ranks keep the same state (ERS). `restore` then
re-allocates the storages uninitialised, to be refilled by the caller (`state_transfer.py`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch


@dataclass
class OffloadConfig:
    """What `ModelOffloader` moves, and how."""

    params: bool = True
    """Move the module's parameters (the weights)."""

    grads: bool = True
    """Move gradient storage: Megatron DDP grad buffers (`param.main_grad`) and `param.grad`."""

    optimizer_state: bool = False
    """Move the optimizer's tensors (Adam moments, fp32 master params). Only meaningful for the
    actor; off by default because only `optimizer.step()` reads them (see module docstring)."""

    buffers: bool = True
    """Move the module's registered buffers (e.g. rotary caches)."""

    pin_memory: bool = True
    """Pin host buffers on CUDA (needed for async PCIe copies). Ignored on CPU."""

    synchronize: bool = True
    """Wait for the copies to finish before `offload`/`restore` return (exact swap timing)."""

    keep_host_copy: bool = True
    """False: `offload` frees without copying and `restore` leaves the memory uninitialised
    (the bytes live elsewhere: another DP replica, a checkpoint)."""


@dataclass
class _Slot:
    """One device storage and its host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # [nbytes] uint8, on CPU (pinned on CUDA); None when dropped


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage. # [nbytes]"""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (storage.nbytes(),), (1,))


class ModelOffloader:
    """Offloads a module's device memory to host memory and restores it, bit-exactly.

    Usage:
        offloader = ModelOffloader(ref.model)                       # reference: params only
        offloader = ModelOffloader(actor.model, optimizer=actor.optimizer)  # actor
        offloader.offload(); ...; offloader.restore()

    `resident` says where the model is. `offload`/`restore` are idempotent and return the
    seconds they took (also accumulated in `last_offload_s` / `last_restore_s`).
    """

    def __init__(self, module: torch.nn.Module, cfg: Optional[OffloadConfig] = None,
                 optimizer: object | None = None):
        self.module = module
        self.cfg = cfg or OffloadConfig()
        self.optimizer = optimizer
        self.resident = True
        self._slots: list[_Slot] = []
        self._host_pool: dict[int, torch.Tensor] = {}  # slot index -> host buffer, reused across swaps
        self.last_offload_s = 0.0
        self.last_restore_s = 0.0
        self._side_stream = None

    # ---- what to move ------------------------------------------------------------------

    def _optimizer_tensors(self) -> Iterable[torch.Tensor]:
        opt = self.optimizer
        if opt is None:
            return
        # Megatron: ChainedOptimizer -> [MegatronOptimizer] -> torch optimizer.
        inner = getattr(opt, "chained_optimizers", None) or [opt]
        for megatron_opt in inner:
            torch_opt = getattr(megatron_opt, "optimizer", megatron_opt)
            for group in getattr(torch_opt, "param_groups", []):
                yield from group["params"]  # fp32 master copies under mixed precision
            for state in getattr(torch_opt, "state", {}).values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def _tensors(self) -> Iterable[torch.Tensor]:
        cfg = self.cfg
        for param in torch.nn.Module.parameters(self.module):
            if cfg.params:
                yield param
            if cfg.grads:
                for grad in (getattr(param, "main_grad", None), param.grad):
                    if isinstance(grad, torch.Tensor):
                        yield grad
        if cfg.buffers:
            # Unbound: Megatron DDP shadows `buffers` with its list of param/grad buffers.
            yield from torch.nn.Module.buffers(self.module)
        if cfg.optimizer_state:
            yield from self._optimizer_tensors()

    def _collect_storages(self) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in self._tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.device.type == "meta":
                continue
            seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        """Bytes moved per swap (resident: what would be moved now; offloaded: what was moved)."""
        if self.resident:
            return sum(s.nbytes() for s in self._collect_storages())
        return sum(slot.nbytes for slot in self._slots)

    # ---- moving ------------------------------------------------------------------------

    def _host_buffer(self, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._host_pool.get(index)
        if buf is None or buf.numel() != nbytes:
            pin = self.cfg.pin_memory and device.type == "cuda"
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            self._host_pool[index] = buf
        return buf

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)
        return self._side_stream

    def offload(self, keep_host_copy: bool | None = None) -> float:
        """Copy every storage to host memory and free it on the device. Returns seconds.

        `keep_host_copy` overrides the config's for this call (False: free without copying)."""
        if not self.resident:
            return 0.0
        started = time.perf_counter()
        storages = self._collect_storages()
        self._slots = []
        device = storages[0].device if storages else torch.device("cpu")
        stream = self._stream(device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # pending writes land first
        keep = self.cfg.keep_host_copy if keep_host_copy is None else keep_host_copy
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for index, storage in enumerate(storages):
                nbytes = storage.nbytes()
                host = self._host_buffer(index, nbytes, storage.device) if keep else None
                if host is not None:
                    host.copy_(_bytes_view(storage), non_blocking=stream is not None)
                self._slots.append(_Slot(storage, nbytes, host))
        if stream is not None:
            # Freeing must wait for the D2H copies; the caching allocator re-uses the block only
            # after the side stream is done with it.
            stream.synchronize()
        for slot in self._slots:
            slot.storage.resize_(0)
        self.resident = False
        self.last_offload_s = time.perf_counter() - started
        return self.last_offload_s

    def drop_host_copy(self) -> None:
        """Forget the host copy of an offloaded model: `restore` then re-allocates the storages
        uninitialised (the caller refills them, e.g. from a checkpoint on disk)."""
        for slot in self._slots:
            slot.host = None
        self._host_pool.clear()

    def restore(self) -> float:
        """Re-allocate every storage on the device and copy the bytes back. Returns seconds."""
        if self.resident:
            return 0.0
        started = time.perf_counter()
        device = self._slots[0].storage.device if self._slots else torch.device("cpu")
        stream = self._stream(device)
        for slot in self._slots:
            slot.storage.resize_(slot.nbytes)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for slot in self._slots:
                if slot.host is not None:
                    _bytes_view(slot.storage).copy_(slot.host, non_blocking=stream is not None)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)  # compute waits for the H2D
            if self.cfg.synchronize:
                stream.synchronize()
        self._slots = []
        self.resident = True
        self.last_restore_s = time.perf_counter() - started
        return self.last_restore_s

