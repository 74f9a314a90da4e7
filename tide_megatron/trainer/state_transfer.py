"""Hand a joining actor rank the current weights and optimizer state of a DP replica.

With the plain (non-distributed) optimizer every actor DP rank holds the same model and the same
optimizer state, so a rank joining the actors (ERS scale-up, or after a resume where it was not
an actor) copies them from one current actor at the same TP position, over the new
configuration's DP group (`assignment.plan_transition` picks the pairs; the group exists from
start-up). Nothing else is needed: gradients are zeroed at the start of every step.

What moves, in one fixed order both sides derive from their identical modules:
  1. the model's parameters (`named_parameters` order);
  2. the optimizer's own parameters when they are separate tensors (fp32 master copies under
     bf16), per torch optimizer, param-group order;
  3. every tensor of the optimizer state, per parameter, keys sorted.
The sender first sends a small manifest (its step counter and the state entries with shapes,
dtypes and where they live), so a receiver whose optimizer has not stepped yet creates the
entries first. Tensors go as one flat buffer per dtype, on the GPU when there is one (NCCL
point-to-point), else in host memory (gloo).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch
import torch.distributed as dist

from tide_megatron.trainer.actor import MegatronActor

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.int32)}


def _torch_optimizers(actor: MegatronActor) -> list[torch.optim.Optimizer]:
    opt = actor.optimizer
    inner = getattr(opt, "chained_optimizers", None) or [opt]
    return [getattr(o, "optimizer", o) for o in inner if getattr(o, "optimizer", o) is not None]


def _optimizer_params(actor: MegatronActor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(optimizer index, parameter index, parameter) in param-group order."""
    for oi, opt in enumerate(_torch_optimizers(actor)):
        params = [p for group in opt.param_groups for p in group["params"]]
        for pi, param in enumerate(params):
            yield oi, pi, param


def manifest(actor: MegatronActor) -> dict:
    """What the sender holds besides the parameters: step counter and optimizer state entries."""
    entries = []
    for oi, pi, param in _optimizer_params(actor):
        state = _torch_optimizers(actor)[oi].state.get(param, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                where = "param" if value.device == param.device else "cpu"
                entries.append([oi, pi, key, list(value.shape), str(value.dtype), where])
            else:
                entries.append([oi, pi, key, value])
    return {"step": actor.step, "state": entries}


def _materialise(actor: MegatronActor, spec: dict) -> None:
    """Create the optimizer-state entries of `spec` that this actor lacks (a fresh optimizer)."""
    params = {(oi, pi): p for oi, pi, p in _optimizer_params(actor)}
    optimizers = _torch_optimizers(actor)
    for entry in spec["state"]:
        oi, pi, key = entry[:3]
        param = params[(oi, pi)]
        state = optimizers[oi].state[param]
        if len(entry) == 4:
            state[key] = entry[3]
            continue
        shape, dtype, where = entry[3], _DTYPES[entry[4]], entry[5]
        current = state.get(key)
        if not isinstance(current, torch.Tensor) or list(current.shape) != shape or current.dtype != dtype:
            state[key] = torch.empty(shape, dtype=dtype, device=param.device if where == "param" else "cpu")
    actor.step = int(spec["step"])


def state_tensors(actor: MegatronActor) -> list[torch.Tensor]:
    """Everything a joining replica must receive, in the transfer order (see module docstring)."""
    out = [p for _, p in actor.module.named_parameters()]
    seen = {id(p) for p in out}
    optimizers = _torch_optimizers(actor)
    ordered = list(_optimizer_params(actor))
    out += [p for _, _, p in ordered if id(p) not in seen]
    for oi, _, param in ordered:
        state = optimizers[oi].state.get(param, {})
        out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def _transport_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _flat_by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _check_plain(actor: MegatronActor) -> None:
    if actor.cfg.distributed_optimizer:
        raise NotImplementedError("state transfer needs the plain optimizer: with the distributed "
                                  "optimizer no single DP rank holds the whole state")


def send_actor_state(actor: MegatronActor, dst: int, group: dist.ProcessGroup) -> float:
    """Send this actor's weights and optimizer state to global rank `dst`; returns seconds."""
    _check_plain(actor)
    started = time.perf_counter()
    dist.send_object_list([manifest(actor)], dst=dst, group=group)
    device = _transport_device()
    for dtype, tensors in sorted(_flat_by_dtype(state_tensors(actor)).items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
        dist.send(flat, dst=dst, group=group)
    return time.perf_counter() - started


@torch.no_grad()
def recv_actor_state(actor: MegatronActor, src: int, group: dist.ProcessGroup) -> float:
    """Receive weights and optimizer state from global rank `src` into this actor; seconds."""
    _check_plain(actor)
    started = time.perf_counter()
    box: list = [None]
    dist.recv_object_list(box, src=src, group=group)
    _materialise(actor, box[0])
    device = _transport_device()
    for dtype, tensors in sorted(_flat_by_dtype(state_tensors(actor)).items(), key=lambda kv: str(kv[0])):
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
        dist.recv(flat, src=src, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return time.perf_counter() - started
