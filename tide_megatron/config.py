"""The job configuration: one typed dataclass per component, composed into `JobConfig`.

The library only ever receives these plain dataclasses. Hydra is confined to `launch/`:
`register_configs()` puts `JobConfig` in Hydra's ConfigStore as the schema that
`recipes/config.yaml` extends, so an unknown key or a wrongly typed value fails at
compose time with a message naming the key. The dataclass defaults are the tiny CPU
recipe, so `launch/train.py` with no recipe trains a tiny model end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tide_megatron.core.modes import SCHEDULER_MODES
from tide_megatron.core.ra2p import RA2PConfig
from tide_megatron.emulation.config import DEVICES, EmulationConfig
from tide_megatron.envs.config import EnvClientConfig, EnvConfig, EnvServerConfig
from tide_megatron.rollout.config import RolloutEngineConfig, TaskRunnerConfig
from tide_megatron.rollout.ctb_config import CTBDispatchConfig, check_ctb_resources
from tide_megatron.trainer.config import TrainerConfig

RESUME_MODES = ("auto", "true", "false")
TASK_ORDERS = ("random", "sequential")
METRIC_LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
WANDB_MODES = ("", "online", "offline", "disabled")
RA2P_EXECUTORS = ("auto", "colocated", "decoupled", "vs", "vso")
WEIGHT_SYNC_PATHS = ("host", "broadcast")


@dataclass
class RunConfig:
    """The training run as a whole."""

    name: str = "tiny_cpu"
    """Run name; outputs go to `output_dir`."""
    steps: int = 6
    """Training steps (policy updates) to run."""
    seed: int = 0
    """Seeds the model init, task sampling and the engines."""
    output_dir: str = "outputs/${run.name}"
    """Metrics, checkpoints and the resolved config. Written by rank 0 only."""
    max_wall_minutes: float = 0.0
    """Stop after the step during which this much wall time has passed since the first dispatch
    (a checkpoint is written as at the last step); 0: no limit. For batch-system time limits
    and soak runs."""
    stop_file: str = "STOP"
    """Creating this file ends the run after the current step, with a checkpoint as at the last
    step (`touch <output_dir>/STOP`: a clean stop from outside, such as a batch system's warning
    before its time limit). A relative path is under `output_dir`; "" turns it off. One left by
    an earlier run is removed when the run starts, with a line saying so."""
    checkpoint_interval: int = 0
    """Save a Megatron dist checkpoint every this many steps (0: only at the end)."""
    resume: str = "false"
    """`auto`: continue from the newest good checkpoint under `output_dir/checkpoints` if there
    is one, else start fresh (else from `resume_from`, if set): the setting for restartable jobs
    (`torchrun --max-restarts N ... run.resume=auto`). `true`: continue from it, an error if
    there is none. `false`: start fresh. A corrupt newest checkpoint (its files differ from its
    manifest, or its run state is bad) falls back to the one before, with a line saying why."""
    resume_from: str = ""
    """Continue from this checkpoint directory (a `step_NNNNNN` directory; an error if it is
    missing or corrupt). With `resume=auto` it is used only while the run has no checkpoint of
    its own, so a restarted job continues from its own progress."""
    verbose: bool = False
    """Show library logs (Megatron, SGLang, warnings) and every rank's output on the console.
    Off: they go to `output_dir/logs/rank<N>.log` and the console shows progress and a summary."""

    @property
    def resume_mode(self) -> str:
        """`resume` normalised: `auto`, `true` or `false` (Hydra hands `run.resume=true` over as "True")."""
        return str(self.resume).strip().lower()


@dataclass
class RandomModelConfig:
    """Architecture of a random-init model written at start-up (no `model.path`)."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    ffn_hidden_size: int = 128
    """SwiGLU inner width."""
    max_position_embeddings: int = 2048
    """Longest sequence."""
    tie_word_embeddings: bool = False
    """Share input and output embeddings."""


MODEL_ARCHITECTURES = ("qwen2", "qwen3_vl")


@dataclass
class RandomVisionConfig:
    """Vision side of a random Qwen3-VL checkpoint (`model.architecture=qwen3_vl`)."""

    depth: int = 2
    """Vision transformer blocks."""
    hidden_size: int = 32
    """Width of the vision transformer."""
    intermediate_size: int = 64
    """Inner width of its MLP."""
    num_heads: int = 2
    """Vision attention heads."""
    patch_size: int = 16
    """Pixels per patch side."""
    spatial_merge_size: int = 2
    """Each merge x merge block of patches becomes one image token."""
    num_position_embeddings: int = 64
    """Rows of the learned (square) position table."""
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [0])
    """Vision blocks whose output is added to the first language-model layers (DeepStack)."""
    mrope_section: list[int] = field(default_factory=lambda: [4, 2, 2])
    """Rotary frequencies of the language model given to the t, h, w axes; sums to
    `random_init.hidden_size / random_init.num_attention_heads / 2`."""
    min_pixels: int = 32 * 32
    """The image processor resizes every image to at least this many pixels..."""
    max_pixels: int = 128 * 128
    """... and at most this many (a 224x160 screenshot becomes 128x96: 12 image tokens)."""


@dataclass
class ModelSourceConfig:
    """Where the policy's weights and tokenizer come from."""

    path: str = ""
    """A local Hugging Face checkpoint directory (config.json, safetensors, tokenizer).
    Empty: write a random checkpoint of `random_init` with `tokenizer` at start-up."""
    tokenizer: str = "tiny_bpe"
    """Tokenizer of a random checkpoint: `tiny_bpe` (committed, small vocab) or `qwen2_5`."""
    architecture: str = "qwen2"
    """Family of a random checkpoint: `qwen2` (text) or `qwen3_vl` (vision-language: the
    tokenizer gains the vision special tokens, the checkpoint an image processor)."""
    random_init: RandomModelConfig = field(default_factory=RandomModelConfig)
    """Architecture of the random checkpoint (its language model, for `qwen3_vl`)."""
    random_vision: RandomVisionConfig = field(default_factory=RandomVisionConfig)
    """Vision side of a random `qwen3_vl` checkpoint."""


@dataclass
class ClusterConfig:
    """How the torchrun ranks are split between roles."""

    rollout_ranks: int = 1
    """Ranks that start as rollout (the last ones); the others train. Rank 0 always
    trains and runs the controller."""
    rollout_share: float = 0.0
    """When > 0, overrides `rollout_ranks`: this share of the world starts as rollout, rounded
    to the nearest count of whole engines that leaves the trainer whole TP x PP units (the rank
    plan, `core/rank_plan.py`), so one recipe fits 8 GPUs and 32. `--dry-run` shows the count."""
    ref_ranks: int = 0
    """Dedicated reference ranks for decoupled RA2P (`scheduler.mode=tide`), placed right
    after the actor ranks. 0: the reference always runs colocated with the actor."""
    device: str = "real"
    """`real`: engines and trainers run on the configured devices. `emulated`: every rank runs
    its real code, and device work takes the simulator's cost-model time instead: engine
    stand-ins (`emulation/engine.py`), trainer passes over trimmed trajectories charged for the
    whole ones (`emulation/trainer_time.py`); see docs/emulation.md."""
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    """The emulated device (`device=emulated`)."""


@dataclass
class SchedulerConfig:
    """What is rolled out and when it is trained on."""

    mode: str = "sync_split"
    """`sync`: every rank time-shares: all roll out a global batch (trainer ranks but rank 0's
    TP block are lent to rollout), then all train it, then the weights go to every engine (the
    VeRL-like baseline). `sync_split`: the same turns on a fixed split (`cluster.rollout_ranks`
    roll out, the others train). `async_static`: rollout never stops on its fixed ranks, the
    trainer takes whole global batches (AReaL-like). `stream`: like async_static, but
    micro-batches are trained as they arrive with a Ref/Actor swap each (StreamRL-like).
    `tide`: streaming with CTB and RA2P's colocated/decoupled choice from RAS and TPRM. See
    `controller/modes.py`."""
    groups_per_step: int = 4
    """GRPO groups in one global batch."""
    min_groups_per_step: int = 0
    """B_min in groups (`tide` only): after ERS scales rollout down, the next steps' size goes
    toward it, leaving a micro-batch reservoir in the buffer for the step after, so a smaller
    rollout is not drained every step (adaptive data retention, `core/buffer.py`). 0: the
    steps keep `groups_per_step`."""
    group_size: int = 4
    """Trajectories per group (G)."""
    task_order: str = "random"
    """How the controller draws each training group's task from the env's list: `random`
    (uniformly, with the run's seed) or `sequential` (the list in order, cycling). Sequential
    is the simulator's order on the replayed workload (group k is task k), so an emulated run
    and its simulation train on the same groups."""
    max_staleness: int = 1
    """Largest policy-version lag of a consumed trajectory (0 is strictly on-policy)."""
    max_tasks_per_rank: int = 16
    """Concurrent tasks on one rollout rank (each holds a session and a request slot)."""
    max_task_retries: int = 1
    """A failed trajectory is re-run this many times; past that its whole GRPO group is given up
    (its tokens booked as failed; a partial group is never trained on) and another starts."""
    max_failed_groups: int = 8
    """The run stops when this many groups in a row fail past their retries (a systemic fault:
    the env, the engine or the model is broken, not one task)."""
    stall_timeout_s: float = 0.0
    """The run stops when no token is generated, no env step answered and no task finishes for
    this long while work is outstanding. 0: 3 x (env call + connect timeout) + 60 s, a bound
    that scales with the env's own timeouts."""
    heartbeat_interval_s: float = 2.0
    """How often each rollout rank reports its health and its own token counts."""
    heartbeat_timeout_s: float = 60.0
    """A rollout rank silent this long (no heartbeat, no message) is quarantined: no new tasks,
    its tasks retried on other ranks, left out of weight syncs; it rejoins at a later weight
    sync once it is heard from again (README, "Faults")."""
    weight_sync_timeout_s: float = 300.0
    """A rollout rank that has not loaded the weights it was sent this long after the send is
    quarantined (a transfer and an engine load, on a rank that still sends heartbeats)."""
    weight_bucket_mb: int = 512
    """Weights go to the engines in buckets of at most this many MiB, one SGLang update each
    (shared-memory buckets on the host path, broadcast buckets on the broadcast path)."""
    weight_sync_path: str = "host"
    """How the weights reach the engines (`controller/weight_push.py`). "host": gathered on
    rank 0, copied once into shared memory that its node's engines map (a relay per other
    node). "broadcast": streamed from the trainer's device through a process group with every
    steady engine (SGLang's `update_weights_from_distributed`; NCCL on GPU, gloo on CPU), no
    host copy; ranks joining rollout that sync take the host path once."""
    weight_broadcast_timeout_s: float = 60.0
    """Broadcast path: rank 0 and each engine give up on the update group (forming it, or one
    broadcast) after this long; a stuck engine is replaced, the group re-formed at the next sync."""
    min_rollout_ranks: int = 1
    """The run stops, naming the silent rank, when fewer rollout ranks than this are in service."""
    ready_timeout_s: float = 600.0
    """How long rank 0 waits for every rollout rank's engine to start."""
    control_poll_s: float = 0.02
    """While messages keep coming, rank 0's rollout service reads its mailbox, books what came and
    runs one placement pass at most this often (idle, it backs off to 40 ms; a request of the
    step loop wakes it at once). A pass costs rank 0 CPU time however little it read, so a longer
    interval books more messages per pass (`benchmarks/control_plane.py`). It also delays a
    placement by up to this long: 20 ms is about one decode iteration of a full 7B batch in the
    cost model, and a turn runs tens to hundreds of them."""
    eval_every: int = 0
    """`tide` mode: evaluate the model of every N-th step on eval tasks that run during the
    next step, ahead of training tasks; their metrics are gathered before that step's weight
    sync and logged under the evaluated step (`eval/*`). 0 turns evaluation off."""
    eval_groups: int = 2
    """Eval task groups per evaluation (each of `group_size` samples: best-of-N, pass@N)."""
    eval_pass_threshold: float = 1.0
    """An eval trajectory passes when its reward is at least this."""


@dataclass
class EnvsConfig:
    """The environments of the run and how to reach them."""

    train_env: str = "door_game"
    """Served env name that training tasks come from."""
    server: EnvServerConfig = field(default_factory=lambda: EnvServerConfig(envs=[EnvConfig()]))
    """The env server the run starts itself (unless `external`)."""
    external: bool = False
    """Use an env server that is already running at `client.host:client.port`."""
    client: EnvClientConfig = field(default_factory=EnvClientConfig)
    """How rollout ranks reach the env server."""


@dataclass
class RolloutConfig:
    """Rollout ranks: their engine and their task loop."""

    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    """The SGLang engine each rollout rank runs."""
    runner: TaskRunnerConfig = field(default_factory=TaskRunnerConfig)
    """Turn limits and sampling of each task."""


@dataclass
class RA2PJobConfig:
    """How the trainer runs Ref and Actor in `scheduler.mode=tide` (and `stream`)."""

    executor: str = "auto"
    """`auto`: choose colocated or decoupled each step from RAS and TPRM with measured costs;
    or force one: `colocated`, `decoupled`, and the baselines `vs` (vanilla streaming, both
    models resident) and `vso` (vanilla streaming with model offloading). In `stream` mode it
    picks the baseline's executor (`vs`, `vso`, `colocated`; `auto`: vso)."""
    offload_idle_model: bool = False
    """Colocated mode parks the idle model (Ref or Actor) in host memory between rounds, the
    paper's CM. False keeps both resident, as the baselines' executors do (VS, sync,
    async_static): no swap is paid, and the dry run's memory plan already counts the reference
    on the GPU. Set True where that plan does not fit; the dry run then leaves the reference
    out. The VSO baseline always offloads."""
    cost_model: RA2PConfig = field(default_factory=RA2PConfig)
    """Constants of the C_dec / C_col comparison; its swap cost is replaced by measurement (and
    is 0 while colocated mode keeps both models resident)."""
    prior_ref_fwd_s: float = 0.05
    """Reference forward of one cost-model micro-batch (`ra2p.cost_model.tokens_per_rank` tokens per
    actor rank) assumed until measured."""
    prior_actor_fwd_s: float = 0.05
    """Actor forward of one cost-model micro-batch (`ra2p.cost_model.tokens_per_rank` tokens per
    actor rank) assumed until measured."""
    prior_actor_bwd_s: float = 0.1
    """Actor backward of one cost-model micro-batch (`ra2p.cost_model.tokens_per_rank` tokens per
    actor rank) assumed until measured."""


@dataclass
class ERSJobConfig:
    """Elastic Resource Scaling in the real system (`controller/trainer_roles.py`)."""

    enabled: bool = False
    """After each actor update, core's ERS plans the next step's roles and rank 0 moves the
    ranks before the weight sync: ranks between rollout and the trainer (`move_ranks`), and the
    trainer's RA2P layout (colocated over every trainer rank, or decoupled with the highest
    ones as reference ranks). False: the start-up roles all run."""
    move_ranks: bool = True
    """ERS may move ranks between rollout and the trainer (one TP block of `trainer.tp_size`
    ranks per step; the trainer stays a prefix of whole blocks). False: only the trainer's
    layout changes."""
    standby_engines: bool = True
    """With `move_ranks`, every rank ERS may move into rollout (the trainer ranks but rank 0's
    TP block) starts its SGLang engine at start-up, so a move into rollout costs a weight load, not an
    engine start (on CPU a start takes tens of seconds of both cores). On GPU this needs SGLang's
    memory saver (`rollout.engine.extra_args.enable_memory_saver=true`), which frees the
    engine's memory while the rank trains. False: a rank's engine starts when it first rolls out."""
    hand_over_tasks: bool = True
    """With `move_ranks` and CTB, a rank leaving rollout hands its running tasks over: each goes on
    on another rollout rank from where it was (its env session moves with it, which needs an env
    server with the `detach`/`attach` calls; `rollout/task_carry.py`). False: they start afresh
    elsewhere and their tokens so far are wasted."""
    failed_move_hold_steps: int = 10
    """ERS's payoff check (`core/ers.py`): a move is judged by the tokens per second the trainer
    consumed over the `payoff_windows` steps after it, against the steps before; one that cost
    goodput is undone and its direction held this many steps. 0: no check."""
    payoff_windows: int = 3
    """Steps after a move that its payoff is measured over (the split is held meanwhile)."""
    streaks: bool = False
    """While a move's payoff is measured, the next block in the same direction may move once a
    step under the new split trained faster than before it (`core/ers.py`, docs/ers.md). Off by
    default: not shown to pay on workloads it was not developed on."""
    preemptive_cold_start: bool = True
    """With `move_ranks`, before the first step every trainer rank but rank 0's TP block rolls out
    (nothing is ready to train yet: the paper's preemptive maximal rollout); they come back to
    the trainer when the first step's data is ready, before it trains. Not with a drill."""
    preemptive_eval: bool = True
    """With `move_ranks`, a step during which the previous model is evaluated lends to rollout
    every trainer rank it does not need to finish its batch within the expected evaluation time
    (core's `ERSController.eval_trainer_ranks`, from the last evaluation's measured duration and
    the measured trainer rate): the paper's preemptive maximal rollout for evaluation phases.
    The next boundary returns to ERS's plan. The first evaluation is measured, not lent for;
    not with a drill."""
    drill_every: int = 0
    """A drill, not a policy: every this many steps move to the next configuration of `drill`
    whatever the measurements say, to exercise role changes under load (tests, soaks). 0: off."""
    drill: str = "layout"
    """What the drill cycles through. "layout": the trainer's two layouts (colocated,
    decoupled). "split": the lowest rollout rank joins the trainer as an actor (colocated),
    becomes its reference rank (decoupled), then returns to rollout."""


@dataclass
class MetricsConfig:
    """Where step metrics go."""

    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """The metric sinks, any of `jsonl` (`output_dir/metrics.jsonl`), `tensorboard`
    (`output_dir/tensorboard`), `wandb` (Weights & Biases, `pip install wandb`) and `mlflow`
    (`pip install mlflow-skinny`): `metrics.loggers=[jsonl,tensorboard,wandb]`. W&B and MLflow
    get the same numeric metrics as TensorBoard, the resolved config and git commit, the role
    timeline image and the run's faults as `events/<kind>` (README, "Metrics")."""
    jsonl: bool = True
    """False turns `metrics.jsonl` off even when `loggers` names it (the older switch)."""
    tensorboard: bool = True
    """False turns TensorBoard off even when `loggers` names it (the older switch:
    `metrics.tensorboard=false` still works)."""
    run_name: str = ""
    """The run's name in W&B and MLflow; empty: `run.name`."""
    wandb_project: str = "tide-megatron"
    """W&B project of the run (`wandb` in `loggers`)."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty: the logged-in user's default."""
    wandb_mode: str = ""
    """`online`, `offline` or `disabled`; empty: the `WANDB_MODE` environment variable if set,
    else `offline` (the run is written under `output_dir/wandb`; `wandb sync` uploads it), so
    nothing leaves the machine unless asked. A resumed job continues the same W&B run (its id
    is kept in `output_dir/wandb_run_id.txt`)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store (`mlflow` in `loggers`); empty: `file:<output_dir>/mlruns`
    (`mlflow ui --backend-store-uri file:<output_dir>/mlruns` shows it). A resumed job continues
    the same MLflow run (its id is kept in `output_dir/mlflow_run_id.txt`)."""
    mlflow_experiment: str = "tide-megatron"
    """MLflow experiment the run goes into (made if missing)."""
    progress: bool = True
    """Show a progress bar on rank 0's console."""
    timeline: bool = True
    """Write `output_dir/timeline.json` and `timeline.png`: every rank's role over time, each
    step's TWT, RWT, RA2P mode and staleness (the simulator's schema and plot)."""
    timeline_every: int = 10
    """Rewrite the timeline every this many steps (and at every checkpoint and the run's end),
    so a crashed run leaves one; 0: at checkpoints and the end only."""

    @property
    def active_loggers(self) -> list[str]:
        """`loggers` without duplicates and without those their switch turns off."""
        off = {name for name, on in (("jsonl", self.jsonl), ("tensorboard", self.tensorboard)) if not on}
        return [name for name in dict.fromkeys(self.loggers) if name not in off]


@dataclass
class JobConfig:
    """A whole training job."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    envs: EnvsConfig = field(default_factory=EnvsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ra2p: RA2PJobConfig = field(default_factory=RA2PJobConfig)
    ctb: CTBDispatchConfig = field(default_factory=CTBDispatchConfig)
    """Continuous Task Batching in `tide` mode (`ctb.enabled=false`: request-level scheduling)."""
    ers: ERSJobConfig = field(default_factory=ERSJobConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def validate(cfg: JobConfig, world_size: int) -> None:
    """Checks that need more than one field; raises ValueError naming the keys."""
    unknown = [name for name in cfg.metrics.loggers if name not in METRIC_LOGGERS]
    if unknown:
        raise ValueError(f"metrics.loggers={list(cfg.metrics.loggers)}: unknown logger(s) {unknown}; "
                         f"expected any of {METRIC_LOGGERS}")
    if cfg.metrics.wandb_mode not in WANDB_MODES:
        raise ValueError(f"metrics.wandb_mode={cfg.metrics.wandb_mode!r}: expected one of {WANDB_MODES} "
                         "(empty: WANDB_MODE from the environment, else offline)")
    if cfg.run.resume_mode not in RESUME_MODES:
        raise ValueError(f"run.resume={cfg.run.resume!r}: expected one of {RESUME_MODES} "
                         "(auto: continue from the newest checkpoint if there is one, else start fresh)")
    if cfg.scheduler.task_order not in TASK_ORDERS:
        raise ValueError(f"scheduler.task_order={cfg.scheduler.task_order!r}: expected one of {TASK_ORDERS}")
    if cfg.scheduler.mode not in SCHEDULER_MODES:
        raise ValueError(f"scheduler.mode={cfg.scheduler.mode!r}: expected one of {SCHEDULER_MODES}")
    if cfg.model.architecture not in MODEL_ARCHITECTURES:
        raise ValueError(f"model.architecture={cfg.model.architecture!r}: expected one of {MODEL_ARCHITECTURES}")
    trainers = world_size - cfg.cluster.rollout_ranks - cfg.cluster.ref_ranks
    if cfg.cluster.rollout_ranks < 1 or trainers < 1 or cfg.cluster.ref_ranks < 0:
        raise ValueError(
            f"cluster.rollout_ranks={cfg.cluster.rollout_ranks} and cluster.ref_ranks={cfg.cluster.ref_ranks} "
            f"with world size {world_size}: need at least one rollout rank and one actor rank"
        )
    if cfg.ra2p.executor not in RA2P_EXECUTORS:
        raise ValueError(f"ra2p.executor={cfg.ra2p.executor!r}: expected one of {RA2P_EXECUTORS}")
    if cfg.ra2p.executor != "auto" and cfg.scheduler.mode != "tide" and (
            cfg.scheduler.mode != "stream" or cfg.ra2p.executor not in ("vs", "vso", "colocated")):
        raise ValueError(f"ra2p.executor={cfg.ra2p.executor} with scheduler.mode={cfg.scheduler.mode}: the executor "
                         "is chosen in tide mode (any) and in stream mode (vs, vso or colocated: the streaming "
                         "baseline at its best); the other modes train whole batches their own way")
    if cfg.cluster.ref_ranks and cfg.scheduler.mode != "tide":
        raise ValueError(f"cluster.ref_ranks > 0 needs scheduler.mode=tide ({cfg.scheduler.mode} colocates the reference)")
    if trainers % cfg.trainer.tp_size:
        raise ValueError(f"{trainers} trainer ranks do not divide by trainer.tp_size={cfg.trainer.tp_size}")
    if cfg.scheduler.groups_per_step < 1:
        raise ValueError(f"scheduler.groups_per_step={cfg.scheduler.groups_per_step}: a step trains at least one group")
    if cfg.scheduler.group_size < 2:
        raise ValueError("scheduler.group_size must be >= 2: GRPO normalises rewards within a group")
    if cfg.run.steps < 1:
        raise ValueError("run.steps must be >= 1")
    if not cfg.scheduler.control_poll_s > 0:
        raise ValueError(f"scheduler.control_poll_s={cfg.scheduler.control_poll_s}: rank 0 reads its mailbox at "
                         "most this often while messages come; it must be > 0 (0.02 s by default)")
    if cfg.ers.drill_every < 0:
        raise ValueError("ers.drill_every must be >= 0")
    if (cfg.ers.enabled or cfg.ers.drill_every) and cfg.scheduler.mode != "tide":
        raise ValueError(f"ers.enabled / ers.drill_every need scheduler.mode=tide, got {cfg.scheduler.mode}")
    if cfg.ers.drill_every and not cfg.ers.enabled:
        raise ValueError("ers.drill_every needs ers.enabled=true")
    engine = cfg.rollout.engine
    if engine.device != "cpu" and not engine.extra_args.get("enable_memory_saver"):
        if cfg.ers.enabled and cfg.ers.move_ranks and cfg.ers.standby_engines:
            raise ValueError("ers.standby_engines=true on GPU keeps an SGLang engine on every trainer rank: it needs "
                             "rollout.engine.extra_args.enable_memory_saver=true (the engine frees its memory while "
                             "the rank trains), or ers.standby_engines=false (an engine starts when its rank first "
                             "rolls out)")
        if cfg.scheduler.mode == "sync":
            raise ValueError("scheduler.mode=sync on GPU time-shares every rank between an SGLang engine and the "
                             "trainer: it needs rollout.engine.extra_args.enable_memory_saver=true (the engine frees "
                             "its memory while the rank trains), or scheduler.mode=sync_split (a fixed split)")
    if cfg.ers.drill not in ("layout", "split"):
        raise ValueError(f"ers.drill={cfg.ers.drill!r}: expected 'layout' or 'split'")
    if cfg.ers.drill_every and cfg.ers.drill == "split" and (
            not cfg.ers.move_ranks or cfg.cluster.rollout_ranks < cfg.trainer.tp_size + 1):
        raise ValueError("ers.drill=split moves a TP block of rollout ranks into the trainer: it needs "
                         "ers.move_ranks=true and cluster.rollout_ranks >= trainer.tp_size + 1")
    if not 0 <= cfg.scheduler.min_groups_per_step <= cfg.scheduler.groups_per_step:
        raise ValueError(f"scheduler.min_groups_per_step={cfg.scheduler.min_groups_per_step}: expected 0 (off) to "
                         f"scheduler.groups_per_step={cfg.scheduler.groups_per_step}")
    if cfg.scheduler.min_groups_per_step and cfg.scheduler.mode != "tide":
        raise ValueError(f"scheduler.min_groups_per_step needs scheduler.mode=tide, got {cfg.scheduler.mode}")
    if cfg.cluster.device not in DEVICES:
        raise ValueError(f"cluster.device={cfg.cluster.device!r}: expected one of {DEVICES}")
    if cfg.cluster.device == "emulated" and cfg.scheduler.weight_sync_path != "host":
        raise ValueError("cluster.device=emulated: emulated engines take weights on the host path only; set "
                         "scheduler.weight_sync_path=host")
    if cfg.scheduler.weight_sync_path not in WEIGHT_SYNC_PATHS:
        raise ValueError(f"scheduler.weight_sync_path={cfg.scheduler.weight_sync_path!r}: expected one of "
                         f"{WEIGHT_SYNC_PATHS}")
    if cfg.scheduler.weight_broadcast_timeout_s <= 0:
        raise ValueError(f"scheduler.weight_broadcast_timeout_s={cfg.scheduler.weight_broadcast_timeout_s}: "
                         "expected a positive number of seconds")
    if not 1 <= cfg.scheduler.min_rollout_ranks <= cfg.cluster.rollout_ranks:
        raise ValueError(f"scheduler.min_rollout_ranks={cfg.scheduler.min_rollout_ranks}: expected 1 to "
                         f"cluster.rollout_ranks={cfg.cluster.rollout_ranks} (below it the run stops)")
    if cfg.scheduler.mode == "tide":
        check_ctb_resources(cfg.ctb, max_running_requests=cfg.rollout.engine.max_running_requests,
                            max_total_tokens=cfg.rollout.engine.max_total_tokens)
    if cfg.envs.train_env not in {e.key for e in cfg.envs.server.envs} and not cfg.envs.external:
        raise ValueError(
            f"envs.train_env={cfg.envs.train_env!r} is not served; envs.server.envs offers "
            f"{sorted(e.key for e in cfg.envs.server.envs)}"
        )


def check_runnable(cfg: JobConfig, world_size: int) -> None:
    """What the real system cannot run, said before any process group is made."""
    tp = cfg.trainer.tp_size
    if cfg.trainer.pp_size != 1:
        raise ValueError(f"trainer.pp_size={cfg.trainer.pp_size}: the trainer runs without pipeline parallelism "
                         "(the rank plan and --dry-run lay PP out; training with it is not built yet): set 1")
    if cfg.rollout.engine.tp_size != 1:
        raise ValueError(f"rollout.engine.tp_size={cfg.rollout.engine.tp_size}: the rollout side drives one engine per "
                         "rank on that rank's GPU (the rank plan and --dry-run lay out engines over several ranks' "
                         "GPUs; running them is not built yet): set 1")
    if cfg.cluster.ref_ranks % tp:
        raise ValueError(f"cluster.ref_ranks={cfg.cluster.ref_ranks} must be whole TP blocks of "
                         f"trainer.tp_size={tp}: a reference rank runs the model at the trainer's TP size")
