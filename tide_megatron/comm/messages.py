"""Typed control messages between the rank-0 controller and every other rank: both ends here.

Every message is a dataclass with a wire `KIND`; the mailbox turns it into one small JSON
document and back (`to_wire` / `decode`), and sets `src` on the receiving side. A sender
builds the dataclass, a receiver dispatches on its type: a misspelt field fails at the
sender, not silently at the receiver.

Per destination, messages arrive in the order they were posted (the mailbox is a queue per
destination), so a rank sees a task's `RunTask` before any `PauseTask` / `ResumeTask` /
`CancelTask` of that task, and the controller sees a rank's `TrajectoryDone` before the
`Heartbeat` that counts it.

Quarantine (see `controller/quarantine.py`): a rank that went silent gets `CancelAll` at once;
it is the first thing the rank reads after whatever was already queued for it, so when it
wakes it starts and drops any stale `RunTask` and answers `AllCancelled` after every
`TaskCancelled` of its tasks. Only then is it sent weights again (`LoadWeights`, which names
its sender: rank 0 posts one to each rank it sends to, and to no other).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from tide_megatron.core.trajectory import Trajectory

_KINDS: dict[str, type["Message"]] = {}


@dataclass
class TaskAssignment:
    """One trajectory to run: a task of the env and its place in a GRPO group."""

    task: dict[str, Any]
    """The env's task spec (`TaskSpec.to_json()`)."""
    group_id: str
    """GRPO group of this trajectory."""
    index: int
    """Position within the group, 0..G-1."""
    is_eval: bool = False
    """Evaluation task (reward only; never trained on)."""
    attempt: int = 0
    """0 for the first run; n for the n-th retry after a failure."""

    @property
    def trajectory_id(self) -> str:
        return f"{self.group_id}/{self.index}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Message:
    """Base of every control message. Subclasses are dataclasses with a unique `KIND`."""

    KIND: ClassVar[str] = ""
    src: int = -1
    """Sending rank (set by the mailbox on receipt)."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.KIND:
            if cls.KIND in _KINDS:
                raise TypeError(f"message kind {cls.KIND!r} defined twice")
            _KINDS[cls.KIND] = cls

    def to_wire(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, list):  # e.g. trajectories: each record as its JSON
                value = [_wire(v) for v in value]
            out[f.name] = _wire(value)
        return out

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "Message":
        return cls(**payload)  # type: ignore[call-arg]


def _wire(value: Any) -> Any:
    """A field's JSON form: a trajectory packed (`Trajectory.to_wire`), other records by `to_json`."""
    if isinstance(value, Trajectory):
        return value.to_wire()
    return value.to_json() if hasattr(value, "to_json") else value


def decode(data: dict[str, Any]) -> Message:
    """The typed message of one wire document (`kind`, `src` and the fields)."""
    data = dict(data)
    kind, src = data.pop("kind"), data.pop("src", -1)
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown control message kind {kind!r} from rank {src}")
    msg = cls.from_wire(data)
    msg.src = int(src)
    return msg


def _assignment(data: dict[str, Any]) -> TaskAssignment:
    return data if isinstance(data, TaskAssignment) else TaskAssignment(**data)


# ---------------------------------------------------------------- controller -> rollout rank
@dataclass
class RunTask(Message):
    """Start a trajectory now. `tag` carries CTB's fields for its requests (None: untagged);
    `carry`: go on with a task another rank handed over (`TaskCarried.carry`) instead of
    starting it."""

    KIND: ClassVar[str] = "task"
    assignment: TaskAssignment
    tag: Optional[dict[str, Any]] = None
    carry: Optional[dict[str, Any]] = None

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "RunTask":
        return cls(_assignment(payload["assignment"]), payload.get("tag"), payload.get("carry"))


@dataclass
class PauseTask(Message):
    """Stop the task before its next turn and release its engine session (CTB)."""

    KIND: ClassVar[str] = "pause"
    task_id: str


@dataclass
class ResumeTask(Message):
    """Let a paused task go on, on this rank, with fresh CTB tag fields."""

    KIND: ClassVar[str] = "resume"
    task_id: str
    tag: Optional[dict[str, Any]] = None


@dataclass
class CancelTask(Message):
    """Stop the task for good (its group can no longer be trained on); answer `TaskCancelled`."""

    KIND: ClassVar[str] = "cancel"
    task_id: str
    reason: str = ""


@dataclass
class ReleaseCarry(Message):
    """A task handed over by a rank that left rollout will not go on (its group ended while it
    was in transit): close its env session (`claim`, see `rollout/task_carry.py`) rather than
    leave it to the env server's idle reaper; an OSWorld session holds a VM. No answer."""

    KIND: ClassVar[str] = "release_carry"
    claim: str


@dataclass
class LoadWeights(Message):
    """Load the weights `manifest` describes (`weight_sync.py`): from the shared-memory buckets
    whose handles `shared` holds (a sender on this node), else received point to point from
    `sender`, then passed on to the ranks of `relay_to` (this rank is its node's relay). Posted to
    exactly the ranks the weights go to."""

    KIND: ClassVar[str] = "weights"
    manifest: dict[str, Any]
    sender: int = 0
    shared: list[str] = field(default_factory=list)
    """One serialized handle per bucket (`weight_sync.bucket_handles`, for this rank alone); empty: point to point."""
    relay_to: list[int] = field(default_factory=list)
    group: str = ""
    """Broadcast path (`comm/update_group.py`): the update group whose bucketed broadcast
    carries the weights; the engine receives each bucket of `bucket_broadcast.bucket_specs`
    through SGLang's `update_weights_from_distributed`. Empty: the host path above."""


@dataclass
class JoinUpdateGroup(Message):
    """Have the engine join the weight update group `group_name` (SGLang's
    `init_weights_update_group`), leaving `leave` first (its previous group; empty: none).
    Rank 0 posts it to every member when the group is (re)formed, before the `LoadWeights`
    that uses it; its own end blocks until every member has joined. No answer: a member that
    cannot join does not confirm the weights, and is quarantined as for any unconfirmed sync."""

    KIND: ClassVar[str] = "join_update_group"
    address: str
    port: int
    rank_offset: int
    """The group rank of the engine's first TP worker (rank 0 is the sender)."""
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    """The member gives up (and replaces its engine, stuck in the collective) after this long."""
    leave: str = ""


@dataclass
class CancelAll(Message):
    """You were quarantined (silent past the heartbeat timeout): stop every task you hold, as
    `CancelTask` would, and answer `AllCancelled` once none is left. Rank 0 took the tasks
    back already; `epoch` matches the answer to this quarantine.

    With `carry` (ERS moves the rank to the trainer) each task that has begun its episode is
    handed over instead: it stops at its next await (a turn in flight ends first), hands its
    env session off and answers `TaskCarried`; one that cannot be carried answers
    `TaskCancelled` and starts afresh elsewhere."""

    KIND: ClassVar[str] = "cancel_all"
    epoch: int
    reason: str = ""
    carry: bool = False


STOP_GRACE_S = 30.0
"""At `Stop`, how long a rollout rank's cancelled tasks may take to close their sessions before
it answers `Stopped` regardless (rank 0 waits a little longer than this, see `controller/loop.py`)."""


@dataclass
class Stop(Message):
    """Finish: running tasks end, the rank reports its last heartbeat, answers `Stopped` (a
    rollout rank) and exits."""

    KIND: ClassVar[str] = "stop"


# ---------------------------------------------------------------- rollout rank -> controller
@dataclass
class EngineFacts:
    """A rollout rank's SGLang engine as it started: what it allocated, which CTB sizes its
    budget from (`controller/ctb_placement.py`), and what it was configured with."""

    kv_tokens: Optional[int] = None
    """Tokens the KV pool holds, as SGLang allocated it (None: not reported)."""
    request_rows: Optional[int] = None
    """Requests the engine runs at once, as SGLang allocated them (None: not reported)."""
    max_total_tokens: Optional[int] = None
    """`rollout.engine.max_total_tokens` (None: SGLang sizes the pool from free memory)."""
    max_running_requests: Optional[int] = None
    """`rollout.engine.max_running_requests` (None: SGLang's default)."""
    use_sessions: bool = False
    """The engine keeps each task's context between turns (CTB's sessions)."""
    restarts: int = 0
    """Times the rank restarted its engine after it died."""
    weight_version: int = 0
    """The weights the engine holds (a restarted engine reloads the rank's host copy, if any)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RankReady(Message):
    """The rank's engine is up."""

    KIND: ClassVar[str] = "ready"
    engine: EngineFacts = field(default_factory=EngineFacts)
    pid: int = 0
    """The rank's process id (for an operator, and for fault-injection tests)."""

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "RankReady":
        return cls(EngineFacts(**payload.get("engine", {})), int(payload.get("pid", 0)))


@dataclass
class TurnEvent(Message):
    """A CTB task's turn started or finished (`phase`), with its context and the plugin's report."""

    KIND: ClassVar[str] = "turn"
    task_id: str
    phase: str
    context_tokens: int
    report: Optional[dict[str, Any]] = None
    """The `tide_ctb` plugin's report of a finished turn: the task's context, the engine's KV
    state and its cumulative decode counters (`sglang_patches.scheduler_hooks`)."""


@dataclass
class TrajectoryDone(Message):
    """A task finished; its whole trajectory."""

    KIND: ClassVar[str] = "trajectory"
    trajectory: Trajectory
    carried_tokens: int = 0
    """Of its generated tokens, those generated on ranks that handed it over (the rest are this
    rank's own, which its heartbeats count)."""

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "TrajectoryDone":
        return cls(Trajectory.from_json(payload["trajectory"]), int(payload.get("carried_tokens", 0)))


@dataclass
class TaskFailed(Message):
    """A task attempt failed; the tokens it had produced are lost to it: `generated_tokens` on
    this rank, `carried_tokens` on ranks that handed it over."""

    KIND: ClassVar[str] = "task_failed"
    assignment: TaskAssignment
    error: str
    traceback: str = ""
    generated_tokens: int = 0
    carried_tokens: int = 0

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "TaskFailed":
        payload = dict(payload)
        return cls(_assignment(payload.pop("assignment")), **payload)


@dataclass
class TaskReleased(Message):
    """A paused task holds nothing on the rank any more (its session is closed)."""

    KIND: ClassVar[str] = "task_released"
    task_id: str


@dataclass
class TaskCancelled(Message):
    """A task stopped on `CancelTask` and holds nothing any more (or was not there); its
    tokens are wasted: `generated_tokens` on this rank, `carried_tokens` on ranks that handed
    it over. No trajectory or failure of it follows."""

    KIND: ClassVar[str] = "task_cancelled"
    task_id: str
    generated_tokens: int = 0
    carried_tokens: int = 0


@dataclass
class TaskCarried(Message):
    """Answer to `CancelAll(carry=True)` for one task: it holds nothing here any more and goes
    on elsewhere from `carry` (its episode so far and its env session's claim, see
    `rollout/task_carry.py`). `generated_tokens`: its tokens generated on this rank;
    `carried_tokens`: on ranks that handed it over before (the episode holds their sum)."""

    KIND: ClassVar[str] = "task_carried"
    task_id: str
    carry: dict[str, Any]
    generated_tokens: int = 0
    carried_tokens: int = 0


@dataclass
class AllCancelled(Message):
    """Answer to `CancelAll`: no task runs here any more; every `TaskCancelled` came before."""

    KIND: ClassVar[str] = "all_cancelled"
    epoch: int


@dataclass
class Stopped(Message):
    """Answer to `Stop`: the rank's tasks have ended and it exits now."""

    KIND: ClassVar[str] = "stopped"


@dataclass
class Heartbeat(Message):
    """A rollout rank's health and its own token count (the ledger's independent side)."""

    KIND: ClassVar[str] = "heartbeat"
    generated_tokens: int
    """Tokens this rank's engine generated for tasks since it started."""
    running_tokens: int
    """Of those, tokens of tasks still running here (not yet reported done, failed or cancelled)."""
    running_tasks: int
    env_steps: int
    """Environment steps answered since start (progress even when no token is generated)."""
    waiting: list[str] = field(default_factory=list)
    """What the longest-waiting tasks wait for, e.g. `g3/1: env step for 41 s`."""
    busy_s: float = 0.0
    """Seconds with at least one task running, since start."""
    idle_s: float = 0.0


@dataclass
class WeightsLoaded(Message):
    """The rank loaded weights `version` into its engine."""

    KIND: ClassVar[str] = "weights_loaded"
    version: int
    transfer_s: float = 0.0
    load_s: float = 0.0
    busy_s: float = 0.0
    idle_s: float = 0.0


# ---------------------------------------------------------------- controller -> trainer ranks
# Rank 0 runs its own trainer share by direct calls; every other rank in a trainer role serves
# these in the order they were posted (`trainer/worker.py`), so the collectives they start
# (gradient all-reduce, TP gathers, state transfers, checkpoints) line up on every rank.
@dataclass
class OpenStep(Message):
    """Train one step in RA2P `mode` ("colocated" or "decoupled") on `num_micro_batches`
    micro-batches, which follow as `TrainMicroBatch`; answer `Trained`. 0 micro-batches: the
    rank still joins the step's gradient all-reduce."""

    KIND: ClassVar[str] = "step"
    mode: str
    num_micro_batches: int


def _trajectories(items: list[Any]) -> list[Trajectory]:
    return [t if isinstance(t, Trajectory) else Trajectory.from_json(t) for t in items]


@dataclass
class TrainMicroBatch(Message):
    """The next micro-batch of the open step: whole trajectories, which the rank collates."""

    KIND: ClassVar[str] = "mb"
    trajectories: list[Trajectory]

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "TrainMicroBatch":
        return cls(_trajectories(payload["trajectories"]))


@dataclass
class OpenRefStep(Message):
    """Serve the reference log-probs of one decoupled step: for each actor DP rank routed to this
    reference rank, how many micro-batches (`RefMicroBatch`) it will get; answer `RefDone`."""

    KIND: ClassVar[str] = "ref_step"
    num_micro_batches: dict[int, int]

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "OpenRefStep":  # JSON object keys are strings
        return cls({int(dp): int(n) for dp, n in payload["num_micro_batches"].items()})


@dataclass
class RefMicroBatch(Message):
    """DP rank `dp`'s next micro-batch, for its reference log-probs."""

    KIND: ClassVar[str] = "ref_mb"
    dp: int
    trajectories: list[Trajectory]

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "RefMicroBatch":
        return cls(int(payload["dp"]), _trajectories(payload["trajectories"]))


@dataclass
class SetRoles(Message):
    """The trainer configuration from now on (`trainer.assignment.TrainerAssignment`, whose
    layout every rank knows), and the one it replaces; answer `RolesDone`. A rollout rank reading
    it joins the trainer."""

    KIND: ClassVar[str] = "roles"
    actor_blocks: int
    ref_ranks: list[int]
    actors_hold_ref: bool
    was_actor_blocks: int
    """The configuration it replaces: every rank plans the same transition from it (which
    current actor sends a joining rank its state). A rank that rolled out while the trainer
    changed without it was not told of those changes."""
    was_ref_ranks: list[int]
    was_actors_hold_ref: bool


@dataclass
class PushWeights(Message):
    """Join the TP gather of the actor's weights for version `version` (actor DP rank 0's TP
    peers; rank 0 sends what the gather leaves it)."""

    KIND: ClassVar[str] = "push_weights"
    version: int


@dataclass
class SaveCheckpoint(Message):
    """Join the actors' checkpoint save (collective over the actor ranks)."""

    KIND: ClassVar[str] = "save"


@dataclass
class LoadCheckpoint(Message):
    """Join the actors' checkpoint load: `path`, or the latest under the checkpoint root."""

    KIND: ClassVar[str] = "load"
    path: Optional[str] = None


# ---------------------------------------------------------------- trainer ranks -> controller
@dataclass
class Trained(Message):
    """An actor rank's step is done: the actor's `UpdateResult` and the executor's `StepReport`,
    as their `asdict` forms."""

    KIND: ClassVar[str] = "trained"
    step: int
    result: dict[str, Any]
    report: dict[str, Any]


@dataclass
class RefDone(Message):
    """A reference rank served its step: its `StepReport` and the costs it measured."""

    KIND: ClassVar[str] = "ref_done"
    report: dict[str, Any]
    costs: dict[str, float]


@dataclass
class RolesDone(Message):
    """A rank applied `SetRoles`: its role now and the seconds each part of the change took."""

    KIND: ClassVar[str] = "roles_done"
    role: str
    times: dict[str, float]


@dataclass
class EngineStandby(Message):
    """A trainer rank started its standby rollout engine (ERS) and parked it."""

    KIND: ClassVar[str] = "engine_standby"
