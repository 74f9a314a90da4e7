"""Readiness-aware scheduling core of tide-megatron: CTB, RA2P and ERS as pure Python.

Everything here is standard-library only (no torch, megatron, sglang, transformers), clock-free
(callers pass `now`), thread-free and deterministic given its inputs, so the same objects drive
the discrete-event simulator (`tide_megatron.sim`) and the real controller.

- `signals`: RAS, TPRM, head-of-line latency, generation/consumption deficits.
- `buffer`: GRPO groups, advantages, staleness bound, elastic batches, token ledger.
- `ctb`: Continuous Task Batching (token-budget admission, pause/resume, re-dispatch).
- `ra2p`: Ref-Actor cost models, mode choice and micro-batch planning.
- `ers`: Elastic Resource Scaling role plans.
- `roles`: rank roles, RA2P modes and the role plan.
"""

from tide_megatron.core.buffer import (
    BufferConfig,
    CompletedGroup,
    GlobalBuffer,
    GroupFate,
    GroupRecord,
    LedgerError,
    TokenLedger,
    TrainingBatch,
    Trajectory,
    group_advantages,
)
from tide_megatron.core.ctb import (
    Admit,
    CTBConfig,
    CTBScheduler,
    Decision,
    Pause,
    RankPool,
    Requeue,
    Resume,
    RolloutTask,
    TaskState,
    TaskStatus,
)
from tide_megatron.core.ers import ERSConfig, ERSPlanner
from tide_megatron.core.ra2p import (
    MicroBatch,
    MicroBatchPlan,
    MicroBatchTimes,
    ModeChoice,
    RA2PConfig,
    break_even_ras,
    choose_mode,
    colocated_latency,
    decoupled_latency,
    mode_costs,
    plan_microbatches,
)
from tide_megatron.core.roles import RA2PMode, Role, RolePlan, trainer_roles_for
from tide_megatron.core.signals import (
    Deficits,
    ReadinessEstimate,
    ReadinessEstimator,
    ReadinessMeter,
    SignalsConfig,
    StepReadiness,
    detect_deficits,
    median_interval,
)

__all__ = [
    "Admit", "BufferConfig", "CTBConfig", "CTBScheduler", "CompletedGroup", "Decision", "Deficits",
    "ERSConfig", "ERSPlanner", "GlobalBuffer", "GroupFate", "GroupRecord", "LedgerError", "MicroBatch",
    "MicroBatchPlan", "MicroBatchTimes", "ModeChoice", "Pause", "RA2PConfig", "RA2PMode", "RankPool",
    "ReadinessEstimate", "ReadinessEstimator", "ReadinessMeter", "Requeue", "Resume", "Role", "RolePlan",
    "RolloutTask", "SignalsConfig", "StepReadiness", "TaskState", "TaskStatus", "TokenLedger",
    "TrainingBatch", "Trajectory", "break_even_ras", "choose_mode", "colocated_latency",
    "decoupled_latency", "detect_deficits", "group_advantages", "median_interval", "mode_costs",
    "plan_microbatches", "trainer_roles_for",
]
