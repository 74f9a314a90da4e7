"""The types of the CTB policy (`ctb.py`): its configuration, task states, tasks and decisions."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Optional, Union


@dataclass
class CTBConfig:
    """Continuous Task Batching policy configuration. Defaults are the real system's."""

    rank_token_budget: int = 262_144
    """Default KV token budget of one rollout rank (below the engine's physical KV capacity,
    so CTB pauses before the engine starts evicting on its own)."""
    max_resident_per_rank: Optional[int] = None
    """Default cap on tasks one rank holds (resident + releasing) for ranks added without one.
    None: no count cap (tokens only; the simulator). The real dispatcher sets every rank's cap
    from its engine's request rows."""
    env_concurrency: int = 512
    """Most tasks that may hold an environment at once (running + paused)."""
    max_staleness: int = 1
    """Staleness bound shared with the buffer (consumer version - trajectory version)."""
    trainer_batch_trajectories: int = 128
    """B_ideal: trajectories the trainer consumes per step (staleness throttle)."""
    staleness_throttle: bool = True
    """Cap outstanding training trajectories at (max_staleness + 1) * trainer_batch_trajectories."""
    probe_turn_reserve_tokens: int = 2048
    """Tokens reserved beyond the prompt for an unmeasured probe's first turn."""
    probe_only_when_tight: bool = True
    """Probing exists to avoid over-admitting on a guessed footprint under KV pressure. When a
    rank can hold the whole group at the unmeasured estimate (prompt + probe reserve per task),
    its members start with the probe instead of waiting one turn for its measurement. False:
    always probe first (the paper's rule, as written)."""
    context_norm_tokens: int = 32_768
    """Context length that maps to L_context = 1 (the longest context expected)."""
    w_eval: float = 1000.0
    """w1: weight of I_eval (evaluation task)."""
    w_group: float = 100.0
    """w2: weight of G_completion (finished / total of the task's group)."""
    w_active: float = 10.0
    """w3: weight of I_active (task is generating now, not waiting for its environment)."""
    w_context: float = 1.0
    """w4: weight of L_context (normalised current context length)."""
    diversity_penalty: float = 0.05
    """Rank score penalty (in budget fractions) per resident same-type task from another group."""
    low_water: float = 0.85
    """Hysteresis: a rank admits or resumes a task only while its booked tokens stay at or below
    this fraction of its budget (pausing starts above the budget). 1.0: no hysteresis."""
    hard_water: float = 1.15
    """Above this fraction of its budget a rank pauses even protected tasks (out of pauses, or
    on their final turns), lowest P(t) first. Keep budget x hard_water within the engine's KV pool."""
    max_pauses_per_task: Optional[int] = 2
    """A task paused this often is protected from further pauses (below `hard_water`). None: no limit."""
    task_max_turns: Optional[int] = None
    """The runner's turn limit, for `protect_final_turns`. None: no task counts as near its end."""
    protect_final_turns: int = 1
    """A task on its last this-many turns (of `task_max_turns`) is protected from pauses."""
    move_after_s: float = 2.0
    """A paused task waits this long for room on the rank it ran on before it may resume on
    another rank; meanwhile that rank admits nothing new. 0: move at once; inf: never move. A
    carrier that cannot move tasks between ranks runs with inf whatever is set here: the real
    system's (`controller/ctb_placement.py`, a task's runner lives in its rank's process), so
    there this key has effect only in the simulator and in-process dispatchers."""
    deadline_admission: bool = False
    """With a `TrainerClock`, start a training group only if now + the predicted group latency
    (`latency_quantile` of the last `latency_window` completed groups) is within its deadline
    (the end of the step producing version v + max_staleness + 1, v the version it starts at).
    Cold start (no group completed yet): no prediction, the staleness throttle alone bounds
    admission. With no training work outstanding a group always starts: the trainer's next
    step, which moves every deadline, needs it. Off by default: a group that finishes in time
    may still wait behind the trainer's backlog, so the prediction is not the bound, and
    measured against the fixed window (`benchmarks/ctb_admission_rules.py`: three simulator
    workloads with ERS on and off; the real tide mode) it was never better and up to a quarter
    worse, and with ERS it wasted tokens the fixed window did not."""
    latency_quantile: float = 0.9
    """The prediction is this quantile of recent group latencies: a group starts only if 9 in 10
    recent groups would have made its deadline, so while the latency distribution holds about 1
    started group in 10 or fewer misses it (and is cancelled)."""
    latency_window: int = 32
    """Completed training groups the quantile is taken over: enough that the 0.9 quantile is not
    just the maximum (>= 10 samples, 3 beyond it at 32), few enough to follow a changing workload
    within a few steps (a step consumes B_ideal / G groups, e.g. 16)."""
    throttle_from_consumption: bool = False
    """With a measured consumption rate c (trajectories/s) in the clock, the staleness throttle
    caps outstanding training trajectories at c x (deadline of a group started now - now): what
    the trainer can take before work started now goes stale. False, or no rate measured yet: the
    fixed (max_staleness + 1) x trainer_batch_trajectories (the same when c = B_ideal / T_step
    and a step has just begun). Off by default: the fixed window is exactly what the staleness
    bound allows; the rate-based one overshoots it when steps speed up (see
    `deadline_admission` for the measurement)."""
    cancel_doomed: bool = True
    """With a clock, a started training group that can no longer be consumed within the staleness
    bound (the version the ranks serve is past v + max_staleness) is cancelled at once: a
    `GroupCancelled` decision, then `Cancel` for its running and paused tasks, freeing their KV,
    rows and env slots (its tokens are wasted either way; the caller books them)."""

    def __post_init__(self) -> None:
        if self.rank_token_budget <= 0 or self.env_concurrency <= 0:
            raise ValueError("rank_token_budget and env_concurrency must be positive")
        if self.trainer_batch_trajectories <= 0 or self.context_norm_tokens <= 0:
            raise ValueError("trainer_batch_trajectories and context_norm_tokens must be positive")
        if self.max_resident_per_rank is not None and self.max_resident_per_rank < 1:
            raise ValueError("max_resident_per_rank must be >= 1 (or None)")
        if not 0.0 < self.low_water <= 1.0 <= self.hard_water:
            raise ValueError(f"need 0 < low_water <= 1 <= hard_water, got {self.low_water}, {self.hard_water}")
        if (self.max_pauses_per_task is not None and self.max_pauses_per_task < 0) or self.protect_final_turns < 0:
            raise ValueError("max_pauses_per_task and protect_final_turns must be >= 0")
        if self.move_after_s < 0:
            raise ValueError("move_after_s must be >= 0")
        if not 0.0 < self.latency_quantile <= 1.0 or self.latency_window < 1:
            raise ValueError("need 0 < latency_quantile <= 1 and latency_window >= 1")


PAPER_RULES = {"low_water": 1.0, "max_pauses_per_task": None, "task_max_turns": None, "move_after_s": 0.0,
               "deadline_admission": False, "throttle_from_consumption": False, "cancel_doomed": False,
               "probe_only_when_tight": False}
"""`CTBConfig` options that reduce the policy to the paper's rules alone: no hysteresis, no
pause bounds, paused tasks free to move at once (resume-before-admit on every rank), the fixed
staleness throttle, no deadlines, and always a probe first."""


class TaskState(enum.Enum):
    QUEUED = "queued"
    """Submitted, not admitted (or re-queued to start from scratch)."""
    RUNNING = "running"
    """Resident on a rollout rank (generating or waiting for its environment)."""
    PAUSED = "paused"
    """Holds an environment but no KV: paused by priority, or handed back by a leaving rank."""
    FAILED = "failed"
    """Its runner raised; it holds nothing. The caller re-queues it (`requeue`) or cancels its group."""
    FINISHED = "finished"
    CANCELLED = "cancelled"
    """Dropped unfinished with its group (`cancel_group`); terminal."""


TERMINAL = (TaskState.FINISHED, TaskState.CANCELLED)


@dataclass(frozen=True)
class RolloutTask:
    """What CTB needs to know about one trajectory to run."""

    task_id: Hashable
    """Unique id of this trajectory-task."""
    group_id: Hashable
    """GRPO group (G tasks sharing one prompt)."""
    task_type: str
    """Environment/task family (diversity constraint)."""
    prompt_tokens: int
    """Initial prompt length."""
    is_eval: bool = False
    """Evaluation tasks get the highest priority and bypass the staleness throttle."""


@dataclass
class TaskStatus:
    """CTB's live view of one task."""

    task: RolloutTask
    state: TaskState = TaskState.QUEUED
    rank: Optional[int] = None
    """Rank the task is resident on (RUNNING only)."""
    context_tokens: Optional[int] = None
    """Last reported actual context (None until the first report)."""
    reserved_tokens: int = 0
    """Footprint reserved at admission, used until the first usage report."""
    active: bool = False
    """Generating now (True) vs waiting for the environment (False)."""
    turns_done: int = 0
    needs_prefill: bool = False
    """Lost its KV (paused or moved): the next turn recomputes the prefix."""
    seq: int = 0
    """Submission order (FIFO tie-break)."""
    pauses: int = 0
    """Times CTB paused this task (`max_pauses_per_task`)."""
    paused_on: Optional[int] = None
    """PAUSED: the rank it ran on (its context may be cached there); None if that rank left."""
    paused_at: float = 0.0
    releasing_on: set = field(default_factory=set)
    """Ranks that still hold the task's tokens and row until the carrier confirms the release."""

    @property
    def footprint(self) -> int:
        return self.context_tokens if self.context_tokens is not None else self.reserved_tokens


@dataclass(frozen=True)
class Admit:
    task: RolloutTask
    rank: int
    estimated_tokens: int


@dataclass(frozen=True)
class Pause:
    task: RolloutTask
    rank: int
    priority: float


@dataclass(frozen=True)
class Resume:
    task: RolloutTask
    rank: int
    prefix_affinity: bool
    """True when placed on a rank that holds the task's own or its group's prefixes."""


@dataclass(frozen=True)
class Requeue:
    """A task handed back by a rank leaving rollout; it is PAUSED and resumes elsewhere."""

    task: RolloutTask
    from_rank: int


@dataclass(frozen=True)
class Cancel:
    """Stop a task of a cancelled group. `rank`: where it was resident (None if it was paused:
    its runner is wherever it last ran); tasks never admitted or failed get no Cancel."""

    task: RolloutTask
    rank: Optional[int]


@dataclass(frozen=True)
class GroupCancelled:
    """A started training group can no longer be consumed within the staleness bound; its
    `Cancel`s follow. The caller books the group as wasted."""

    group_id: Hashable
    version: int
    """The policy version it was started at."""


Decision = Union[Admit, Pause, Resume, Requeue, Cancel, GroupCancelled]


@dataclass
class RankPool:
    """One rollout rank's budgets and the tasks it holds."""

    rank: int
    budget: int
    """KV token budget."""
    max_resident: Optional[int] = None
    """Most tasks held at once (resident + releasing); None: no count cap."""
    accepting: bool = True
    """False while quarantined: no new admissions or resumes."""
    residents: set = field(default_factory=set)
    releasing: dict = field(default_factory=dict)
    """Paused tasks whose tokens and row the rank still holds: task id -> tokens."""
    type_counts: Counter = field(default_factory=Counter)
    """Resident tasks per task type (diversity constraint without rescanning residents)."""
    group_counts: Counter = field(default_factory=Counter)
    """Resident tasks per group."""

    def free(self, used: int) -> int:
        return self.budget - used

    @property
    def held(self) -> int:
        return len(self.residents) + len(self.releasing)

    @property
    def idle(self) -> bool:
        return not self.residents and not self.releasing
