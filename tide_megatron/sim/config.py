"""Typed configs of the simulator.

Every number that describes the world (the GPU, the model, the workload) lives in a YAML file
under `recipes/sim/` with its source cited next to it; the dataclasses below only give each
field a meaning. Fields without a default (`MISSING`) must come from those files, so there is
one source of truth for every constant. The library receives these plain dataclasses, never an
OmegaConf `DictConfig`: `launch/simulate.py` and `tide_megatron.sim.load_config` convert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from tide_megatron.core.modes import SCHEDULER_MODES, SIM_ONLY_MODES

MISSING = "???"
"""OmegaConf's marker of a value a YAML file must give (`omegaconf.MISSING`), spelled out here so
that the simulator's configs import no OmegaConf."""

MODES = SCHEDULER_MODES + SIM_ONLY_MODES
STALENESS_RULES = ("cancel", "drop")
STREAM_EXECUTORS = ("vso", "vs", "colocated")


@dataclass
class HardwareConfig:
    """One GPU type and the links around it."""

    name: str = MISSING
    """Human-readable name, e.g. "H100 SXM5 80GB"."""
    peak_bf16_tflops: float = MISSING
    """Dense BF16 tensor-core peak of one GPU, TFLOP/s."""
    hbm_capacity_gb: float = MISSING
    """HBM capacity of one GPU, GB (1e9 bytes)."""
    hbm_bandwidth_tbps: float = MISSING
    """HBM bandwidth of one GPU, TB/s."""
    nvlink_bandwidth_gbps: float = MISSING
    """NVLink bandwidth of one GPU, GB/s per direction."""
    pcie_bandwidth_gbps: float = MISSING
    """Host<->device PCIe bandwidth of one GPU, GB/s per direction (theoretical)."""
    internode_bandwidth_gbps: float = MISSING
    """Network bandwidth per GPU between nodes, GB/s per direction."""
    gpus_per_node: int = MISSING
    """GPUs that share one NVLink domain."""
    pcie_efficiency: float = MISSING
    """Fraction of the PCIe bandwidth that pinned host<->device copies achieve."""
    network_efficiency: float = MISSING
    """Fraction of NVLink / network bandwidth that a weight broadcast achieves."""
    decode_hbm_efficiency: float = MISSING
    """Fraction of HBM bandwidth a decode iteration achieves (memory-bandwidth utilisation)."""
    decode_compute_efficiency: float = MISSING
    """Fraction of peak FLOP/s a decode iteration achieves when it is compute bound."""
    prefill_mfu: float = MISSING
    """Model FLOP utilisation of prefill (compute bound)."""
    train_mfu: float = MISSING
    """Model FLOP utilisation of Megatron forward+backward on RL micro-batches."""
    rollout_mem_fraction: float = MISSING
    """Fraction of HBM the inference engine claims for weights + KV cache."""
    rollout_reserved_gb: float = MISSING
    """HBM the engine keeps out of the KV pool (activations, CUDA graphs), GB per GPU."""


@dataclass
class SimModelConfig:
    """The policy model: its size, attention shape and how it is parallelised."""

    name: str = MISSING
    """Model name, e.g. "Qwen2.5-7B-Instruct"."""
    params_b: float = MISSING
    """Parameters, billions (all of them: embedding, vision tower)."""
    n_layers: int = MISSING
    """Transformer layers of the language model."""
    hidden_size: int = MISSING
    """Hidden size of the language model."""
    n_kv_heads: int = MISSING
    """Key/value heads (GQA)."""
    head_dim: int = MISSING
    """Dimension of one attention head."""
    bytes_per_param: int = 2
    """Bytes per weight in BF16."""
    rollout_tp: int = MISSING
    """Tensor parallel size of one inference engine (GPUs per rollout rank)."""
    train_gpus_per_rank: int = MISSING
    """GPUs in one trainer DP slot (TP x PP of the Megatron model)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, BF16."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 2

    @property
    def params(self) -> float:
        return self.params_b * 1e9


@dataclass
class TaskTypeConfig:
    """One kind of agentic task (an environment): how long its trajectories are and how slow."""

    name: str = MISSING
    """Task family, e.g. "webshop"."""
    weight: float = 1.0
    """Relative share of this type in the task stream."""
    prompt_tokens: List[float] = field(default_factory=lambda: [0.0, 0.0])
    """Initial prompt tokens: [median, log-normal sigma]."""
    base_turns: List[float] = field(default_factory=lambda: [0.0, 0.0])
    """Turns a trajectory needs without mistakes: [median, log-normal sigma]."""
    max_turns: int = MISSING
    """Environment step limit (a trajectory is cut there)."""
    wrong_action_prob: float = MISSING
    """Probability that a turn is a wrong/invalid action that costs one extra turn."""
    gen_tokens_per_turn: List[float] = field(default_factory=lambda: [0.0, 0.0])
    """Tokens the policy generates per turn: [median, log-normal sigma]."""
    obs_tokens_per_turn: List[float] = field(default_factory=lambda: [0.0, 0.0])
    """Observation tokens the env returns per turn: [median, log-normal sigma]."""
    env_step_s: List[float] = field(default_factory=lambda: [0.0, 0.0])
    """Env step latency, seconds: [median, log-normal sigma]."""
    env_reset_s: List[float] = field(default_factory=lambda: [0.0, 0.0])
    """Env reset latency before the first turn, seconds: [median, log-normal sigma]."""
    max_context_tokens: int = MISSING
    """Context limit of the policy; a trajectory stops when it would exceed it."""


@dataclass
class WorkloadConfig:
    """The task stream and the RL batch geometry."""

    name: str = MISSING
    """Workload name, e.g. "text_webshop_alfworld"."""
    task_types: List[TaskTypeConfig] = field(default_factory=list)
    """Mix of task families."""
    group_size: int = MISSING
    """GRPO group size G (trajectories sampled per task)."""
    batch_groups: int = MISSING
    """Groups in one global batch (B_ideal)."""
    min_batch_groups: int = MISSING
    """B_min: the step size (in groups) ERS's adaptive data retention paces steps toward after a
    rollout scale-down (`GlobalBuffer.open_stream`), with `scheduler.ers_retention`."""
    eval_every: int = MISSING
    """An evaluation phase runs after every `eval_every` steps (0: never)."""
    eval_tasks: int = MISSING
    """Evaluation tasks per phase (one trajectory each, no training)."""
    env_concurrency: int = MISSING
    """Trajectories the external env cluster can run at once."""
    staleness_bound: int = MISSING
    """Maximum policy-version lag of a consumed trajectory (eta)."""


@dataclass
class SimSchedulerConfig:
    """Knobs of the scheduling modes (the mode itself is `SimConfig.mode`)."""

    rollout_share: float = 0.25
    """Fraction of ranks doing rollout in async_static / stream, and the standalone rollout
    share of `elastic` (the verl-like peer); swept by the benchmark."""
    initial_rollout_share: float = 0.5
    """TIDE's starting split: a fixed prior (half the ranks roll out) that no sweep informs;
    ERS moves from here."""
    staleness_rule: str = "cancel"
    """How the staleness bound is enforced (every mode). "cancel" (the real system's rule): a
    group admitted at version v must be consumed by the step that trains version v + bound;
    its trajectories run across weight updates (next turn re-prefilled under the new weights,
    each turn's version recorded), and a group that can no longer make its deadline is
    cancelled at once, its tokens booked as wasted. "drop" (the earlier rule, kept for
    comparison): each trajectory's version is its own admission version; groups run to the
    end and are dropped when found stale at completion or fetch."""
    ra2p: bool = True
    """TIDE: RA2P mode selection (otherwise streaming with `stream_executor`)."""
    stream_executor: str = "vso"
    """How `stream` (and TIDE without RA2P) runs Ref and Actor, as the real `ra2p.executor` in
    stream mode: "vso" (alternate per micro-batch, swapping models), "vs" (alternate, both
    resident) or "colocated" (RA2P's aggregated rounds); sim_paper runs each and reports
    stream at its best."""
    offload_idle_model: bool = False
    """Colocated trainers (RA2P's colocated rounds, the barrier baselines' round, sync's training)
    park the idle model in host memory, a swap pair per round, as the real
    `ra2p.offload_idle_model`. False: both resident, no swap (VSO swaps regardless)."""
    ers: bool = True
    """TIDE: elastic role changes between steps (otherwise the shares stay fixed)."""
    ctb: bool = True
    """TIDE: continuous task batching (otherwise request-level scheduling in the engine)."""
    ctb_deadline_admission: bool = False
    """TIDE with CTB: the core's `CTBConfig.deadline_admission` (admit only groups predicted to
    finish by their staleness deadline); off by default, as in the real system."""
    ctb_throttle_from_consumption: bool = False
    """TIDE with CTB: the core's `CTBConfig.throttle_from_consumption` (staleness window from the
    measured consumption rate instead of (bound + 1) x batch); off by default, as in the real system."""
    microbatch_tokens: int = 8192
    """Tokens per actor DP rank in one micro-batch."""
    ref_actor_ratio: int = 3
    """Actor ranks served by one dedicated REF rank in decoupled mode (ref fwd = 1/3 of actor)."""
    ers_max_moves: int = 1
    """ERS: ranks moved per step at most (the paper bounds trainer scale-up to one per step)."""
    ers_failed_move_hold_steps: int = 10
    """ERS's payoff check: a move that cost goodput over the next `ers_payoff_windows` steps is
    undone and its direction held this many steps (`ERSConfig.failed_move_hold_steps`; 0: no check)."""
    ers_payoff_windows: int = 3
    """Steps after a move that its payoff is measured over (`ERSConfig.payoff_windows`)."""
    ers_streaks: bool = False
    """A next block in the same direction before the check ends (`ERSConfig.streaks`)."""
    ers_preemptive: bool = True
    """ERS: preemptive maximal rollout at cold start and during evaluation phases (loans)."""
    ers_retention: bool = False
    """ERS: adaptive data retention, steps paced toward B_min (`workload.min_batch_groups`) after
    a rollout scale-down; off by default, as in the real system (`scheduler.min_groups_per_step=0`)."""
    min_rollout_share: float = 0.125
    """Lowest rollout share ERS may reach."""
    max_rollout_share: float = 0.875
    """Highest rollout share ERS may reach."""

    def __post_init__(self) -> None:
        if self.stream_executor not in STREAM_EXECUTORS:
            raise ValueError(f"scheduler.stream_executor must be one of {STREAM_EXECUTORS}, got {self.stream_executor!r}")
        if self.staleness_rule not in STALENESS_RULES:
            raise ValueError(f"scheduler.staleness_rule must be one of {STALENESS_RULES}, got {self.staleness_rule!r}")
        for name in ("rollout_share", "initial_rollout_share", "min_rollout_share", "max_rollout_share"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"scheduler.{name} must be in (0, 1), got {getattr(self, name)}")


@dataclass
class SimConfig:
    """One simulation run."""

    mode: str = "tide"
    """Scheduling mode: sync | async_static | stream | elastic (verl-like dynamic scaling) | tide."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """The GPU model."""
    model: SimModelConfig = field(default_factory=SimModelConfig)
    """The policy model."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """The task stream."""
    scheduler: SimSchedulerConfig = field(default_factory=SimSchedulerConfig)
    """Scheduling mode."""
    n_gpus: int = 32
    """GPUs in the cluster."""
    steps: int = 100
    """Training steps to simulate."""
    seed: int = 0
    """Seed of the task stream (the same for every mode, so modes see the same tasks)."""
    max_sim_time_s: float = 1e7
    """Stop the simulation at this simulated time even if steps remain."""
    out_dir: str = ""
    """Where metrics JSON and plots go; empty: no files."""
    plot: bool = True
    """Write the PNG timeline when out_dir is set."""
    record_timeline: bool = True
    """Keep per-step and per-rank timelines (off for the very large speed runs)."""
