"""The controller's run state: what a checkpoint holds besides the weights and the optimizer.

A resumed run continues where the checkpoint left it, not where the seed starts:

- the step and the policy version;
- the task sampler: its RNG state and group counter (group ids keep counting), and how many
  tasks it drew from (a resumed run that is offered another task list says so);
- the rollout service's counters and the token ledger's buckets, so cumulative metrics go on;
- the ready groups the trainer had not consumed yet (whole trajectories): they re-enter the
  buffer with the same advantages and versions;
- rank 0's Python, NumPy and torch RNG states.

What is not kept, by rule: groups that were still running at the save. Their tasks die with the
job; the sampler has already drawn them, so a resumed run moves on instead of repeating them,
and the tokens of their finished trajectories (the ledger's `in_flight`) are booked as `failed`.
Evaluation in progress is not kept either: a resumed run starts the evaluation of its
first model again. The readiness estimates (TPRM) are re-learnt. SGLang's sampling RNG is
seeded afresh by each engine, so sampling after a resume is not bit-identical to an
uninterrupted run (the trainer uses no randomness: dropout is 0).

The interface with the controller is these two functions and the fields they touch, all here:
`capture(controller)` runs on the rollout service's thread through `RolloutService.call` (it
sees one consistent moment); `restore(controller, state)` runs before the service thread
starts (once it runs, it starts groups from the sampler as soon as the engines are up).
Controller: `step`, `version`, `rollout`, `log._generated_before`. Rollout service: `_rng`,
`groups.started`, `tasks`, `counters`, `buffer`, `version`, `lost_before`.
Buffer: `ledger`, `ready_groups()`, `open_group`, `add_trajectory`, `audit()`.
"""

from __future__ import annotations

import base64
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tide_megatron.core.buffer import GlobalBuffer
from tide_megatron.core.token_ledger import TokenLedger
from tide_megatron.core.trajectory import Trajectory

logger = logging.getLogger(__name__)

FORMAT = 1
_LEDGER_KEYS = (*TokenLedger.BUCKETS, "generated")


@dataclass
class RunState:
    """A JSON-able snapshot of the controller (see the module docstring)."""

    step: int
    version: int
    sampler: dict[str, Any]
    """`rng` (random.Random state as JSON), `groups_started`, `tasks_drawn` (training tasks; absent
    in run states of earlier versions: 0), `num_tasks`."""
    counters: dict[str, int]
    ledger: dict[str, int]
    """TokenLedger buckets and `generated`."""
    ready_groups: list[dict[str, Any]] = field(default_factory=list)
    """Unconsumed training groups: `group_id`, `task_id`, `trajectories` (Trajectory JSON)."""
    rng: dict[str, Any] = field(default_factory=dict)
    """Rank 0's global RNG states: `python`, `numpy`, `torch` (base64), `cuda` (base64 per device)."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunState":
        """Parse and check a saved run state; ValueError naming the first bad field."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT}")
        for key in ("step", "version"):
            _int(data, key)
        sampler = _dict(data, "sampler")
        state = sampler.get("rng")
        if not (isinstance(state, list) and len(state) == 3 and isinstance(state[1], list)
                and all(isinstance(x, int) for x in state[1])):
            raise ValueError("sampler.rng: not a random.Random state")
        _int(sampler, "groups_started", "sampler.")
        _int(sampler, "num_tasks", "sampler.")
        sampler.setdefault("tasks_drawn", 0)
        _int(sampler, "tasks_drawn", "sampler.")
        counters = _dict(data, "counters")
        for key in counters:
            _int(counters, key, "counters.")
        ledger = _dict(data, "ledger")
        for key in _LEDGER_KEYS:
            _int(ledger, key, "ledger.")
        if ledger["generated"] != sum(ledger[b] for b in TokenLedger.BUCKETS):
            raise ValueError("ledger: buckets do not add up to generated")
        groups = data.get("ready_groups", [])
        if not isinstance(groups, list):
            raise ValueError("ready_groups: not a list")
        for i, group in enumerate(groups):
            if not (isinstance(group, dict) and isinstance(group.get("trajectories"), list) and group["trajectories"]
                    and "group_id" in group and "task_id" in group):
                raise ValueError(f"ready_groups[{i}]: needs group_id, task_id and trajectories")
            try:
                for t in group["trajectories"]:
                    Trajectory.from_json(t).check()
            except (TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"ready_groups[{i}]: bad trajectory ({exc})") from None
        ready_tokens = sum(t["generated_tokens"] for g in groups for t in g["trajectories"])
        if ready_tokens != ledger["ready"]:
            raise ValueError(f"ready_groups hold {ready_tokens} tokens, ledger.ready says {ledger['ready']}")
        return cls(step=data["step"], version=data["version"], sampler=sampler, counters=counters, ledger=ledger,
                   ready_groups=groups, rng=data.get("rng") or {})


def _int(d: dict, key: str, where: str = "") -> int:
    value = d.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}{key}: expected an integer >= 0, got {value!r}")
    return value


def _dict(d: dict, key: str) -> dict:
    value = d.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected an object")
    return value


# -- capture ------------------------------------------------------------------------------------
def capture(controller) -> RunState:
    """The controller's run state now (the rollout side as of one turn of its thread)."""
    service = controller.rollout
    snapshot = service.call(lambda: _capture_service(service))
    return RunState(step=controller.step, version=controller.version, rng=_capture_rngs(), **snapshot)


def _capture_service(service) -> dict[str, Any]:
    """Runs on the rollout service's thread."""
    ledger = service.buffer.ledger
    return {
        "sampler": {"rng": _json_tuple(service._rng.getstate()), "groups_started": service.groups.started,
                    "tasks_drawn": service.groups.drawn,
                    "num_tasks": len(service.tasks)},
        "counters": {k: int(v) for k, v in service.counters.items()},
        "ledger": {k: getattr(ledger, k) for k in _LEDGER_KEYS},
        "ready_groups": [{"group_id": g.group_id, "task_id": g.task_id,
                          "trajectories": [t.to_json() for t in g.trajectories]}
                         for g in service.buffer.ready_groups() if not g.is_eval],
    }


def _json_tuple(value):
    return [_json_tuple(v) for v in value] if isinstance(value, (tuple, list)) else value


def _capture_rngs() -> dict[str, Any]:
    import numpy as np
    import torch

    np_state = np.random.get_state()
    out = {"python": _json_tuple(random.getstate()),
           "numpy": [np_state[0], np_state[1].tolist(), *[_plain(x) for x in np_state[2:]]],
           "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def _plain(x):
    return x.item() if hasattr(x, "item") else x


# -- restore ------------------------------------------------------------------------------------
def restore(controller, state: RunState) -> list[str]:
    """Put `state` into a controller built for the same step, before `controller.run()`.

    Returns lines worth showing the person running the job (what differs from the saved run)."""
    service = controller.rollout
    if service.is_alive():
        raise RuntimeError("run_state.restore must run before the rollout service thread starts")
    if (state.step, state.version) != (controller.step, controller.version):
        raise ValueError(f"run state of step {state.step} (version {state.version}) does not match the "
                         f"checkpoint's step {controller.step} (version {controller.version})")
    notes = []
    sampler = state.sampler
    service._rng.setstate(_tuple(sampler["rng"]))
    service.groups.started = sampler["groups_started"]
    service.groups.drawn = sampler.get("tasks_drawn", 0)
    if sampler["num_tasks"] != len(service.tasks):
        notes.append(f"the env offers {len(service.tasks)} training tasks, the checkpoint's sampler drew from "
                     f"{sampler['num_tasks']}: the task order differs from an uninterrupted run")
    service.counters.update(state.counters)
    _restore_buffer(service.buffer, state, service.version)
    # The reconciliation with the ranks' own counts starts from zero in this process: tokens
    # lost before the restart are already booked.
    service.lost_before = state.ledger["lost"]
    controller.log._generated_before = service.buffer.ledger.generated
    _restore_rngs(state.rng, notes)
    dropped = state.ledger["in_flight"]
    if dropped:
        notes.append(f"{dropped} tokens of groups still running at the checkpoint are booked as failed")
    return notes


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def _restore_buffer(buffer: GlobalBuffer, state: RunState, version: int) -> None:
    """The ledger as saved, with the in-flight tokens (of groups that died with the job) moved to
    `failed`, and the ready groups put back; re-adding a group books its tokens again, so they
    are taken out of `generated` and `ready` first."""
    saved = dict(state.ledger)
    ready = sum(t["generated_tokens"] for g in state.ready_groups for t in g["trajectories"])
    saved["failed"] += saved["in_flight"]
    saved["in_flight"] = 0
    saved["ready"] -= ready
    saved["generated"] -= ready
    buffer.ledger.restore(saved)  # closed tokens only: the ledger's accounts start afresh
    now = time.monotonic()
    for group in state.ready_groups:
        trajs = [Trajectory.from_json(t) for t in group["trajectories"]]
        buffer.open_group(group["group_id"], group["task_id"], now, size=len(trajs),
                          admitted_version=min(t.policy_version for t in trajs))
        for traj in trajs:
            buffer.add_trajectory(traj, now, consumer_version=version)
    problems = buffer.audit()
    if problems:
        raise ValueError(f"restored buffer is inconsistent: {'; '.join(problems)}")


def _restore_rngs(rng: dict[str, Any], notes: list[str]) -> None:
    import numpy as np
    import torch

    if "python" in rng:
        random.setstate(_tuple(rng["python"]))
    if "numpy" in rng:
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if "torch" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    if "cuda" in rng:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(rng["cuda"]):
            torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                          for s in rng["cuda"]])
        else:
            notes.append("the CUDA RNG states were saved on another device count: not restored")
