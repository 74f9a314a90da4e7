"""Readiness-aware scheduling core of tide-megatron: CTB, RA2P and ERS as pure Python.

Everything here is standard-library only (no torch, megatron, sglang, transformers), clock-free
(callers pass `now`), thread-free and deterministic given its inputs, so the same objects drive
the discrete-event simulator (`tide_megatron.sim`) and the real controller.

- `signals`: RAS, TPRM, head-of-line latency, generation/consumption deficits.
- `buffer`: GRPO groups, advantages, staleness bound, elastic batches.
- `token_ledger`: where every generated token is, by bucket and by account (checked each step).
- `ctb`: Continuous Task Batching (token-budget admission, pause/resume, re-dispatch).
- `ra2p`: Ref-Actor cost models, mode choice and micro-batch planning.
- `ers`: Elastic Resource Scaling role plans.
- `roles`: rank roles, RA2P modes and the role plan.

One training step, as the controller (or simulator) drives it::

    buffer.begin_step(now)                                  # RAS (tokens), HoL measured
    batch = buffer.fetch_batch(version, now)                # elastic [B_min, B_ideal]
    plan = plan_microbatches({id: len}, dp_size, roles.mode, ra2p)
    # streaming: should_feed(mode, ready_tokens, dp_size, ra2p, ...) paces the rest of the step
    ... actor update ...
    buffer.end_step(now)                                    # arrival rate, T_step into the EWMA
    roles = ers.plan(roles, ERSMeasurements(...), times, step=step, rollout_load=...)
    for r in roles.ranks_leaving_rollout(old): ctb.remove_rank(r)   # tasks -> paused
    for r in roles.ranks_joining_rollout(old): ctb.add_rank(r)
    buffer.notify_rollout_scaled(len(roles.rollout_ranks) - len(old.rollout_ranks))
    ctb.on_weight_sync(); version += 1

Between steps, rollout events feed `ctb.on_turn_started/on_turn_finished/on_task_finished`
and `buffer.add_trajectory`, and `ctb.schedule(now, unconsumed_trajectories=...)` returns the
Admit / Pause / Resume decisions to carry out.
"""

from tide_megatron.core.trajectory import Segment, Trajectory
from tide_megatron.core.buffer import (
    BufferConfig,
    CompletedGroup,
    GlobalBuffer,
    GroupFate,
    GroupRecord,
    LedgerError,
    TokenAudit,
    TokenLedger,
    TrainingBatch,
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
from tide_megatron.core.ers import ERSConfig, ERSController, ERSMeasurements
from tide_megatron.core.ra2p import (
    LatencyCorrection,
    MicroBatchPlan,
    MicroBatchTimes,
    ModeChoice,
    PlannedMicroBatch,
    RA2PConfig,
    TrainerLayout,
    break_even_ras,
    choose_mode,
    choose_mode_for_tokens,
    colocated_latency,
    colocated_round_size,
    decoupled_latency,
    in_micro_batches,
    mode_costs,
    plan_microbatches,
    should_feed,
    trainer_layout,
)
from tide_megatron.core.roles import RA2PMode, Role, RolePlan, trainer_roles_for
from tide_megatron.core.signals import (
    ReadinessEstimate,
    ReadinessEstimator,
    ReadinessMeter,
    SignalsConfig,
    StepReadiness,
    median_interval,
    tprm_for,
)

__all__ = [
    "Admit", "BufferConfig", "CTBConfig", "CTBScheduler", "CompletedGroup", "Decision",
    "ERSConfig", "ERSController", "ERSMeasurements", "GlobalBuffer", "GroupFate", "GroupRecord", "LatencyCorrection", "LedgerError",
    "MicroBatchPlan", "MicroBatchTimes", "ModeChoice", "Pause", "PlannedMicroBatch", "RA2PConfig", "RA2PMode",
    "RankPool", "ReadinessEstimate", "ReadinessEstimator", "ReadinessMeter", "Requeue", "Resume", "Role",
    "RolePlan", "RolloutTask", "Segment", "SignalsConfig", "StepReadiness", "TaskState", "TaskStatus", "TokenAudit",
    "TokenLedger",
    "TrainerLayout", "TrainingBatch", "Trajectory", "break_even_ras", "choose_mode", "choose_mode_for_tokens",
    "colocated_latency", "colocated_round_size", "decoupled_latency", "group_advantages", "in_micro_batches",
    "median_interval", "mode_costs",
    "plan_microbatches", "should_feed", "tprm_for", "trainer_layout", "trainer_roles_for",
]
