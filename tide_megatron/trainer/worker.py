"""What a rank does in a trainer role (ACTOR, ACTOR_REF, REF), and how it changes role (ERS).

Every rank of the job can hold a `TrainerWorker`; what it holds follows its role in the current
`TrainerAssignment`:

    ACTOR      the actor (Megatron model + DDP + optimizer) on its DP group; decoupled steps
    ACTOR_REF  the actor and the reference (kept in host memory between uses); colocated steps
    REF        the reference; serves decoupled steps of the actor DP ranks routed to it
    ROLLOUT    nothing resident (an actor or reference it held before stays parked, see below)

Rank 0 (the controller) calls the methods directly; every other rank in a trainer role runs
`serve(mailbox)`, which executes the same methods from control messages in the order they were
posted, so collectives (gradient all-reduce, TP gathers, state transfers, checkpoints) happen
on every rank in the same order. The messages (`comm/messages.py`):

    to actor ranks     OpenStep, then num_micro_batches x TrainMicroBatch -> Trained
    to reference ranks OpenRefStep, then RefMicroBatch per micro-batch of the DP ranks it serves -> RefDone
    to every rank      SetRoles -> RolesDone; PushWeights, SaveCheckpoint, LoadCheckpoint, Stop
                       (weights go to rollout ranks only)

Role changes (`apply`, at the post-update boundary): a leaving actor drops its weights, grads
and optimizer state (every remaining DP replica holds the same); a joining one restores or
builds its actor and receives the current state from a current actor over the new DP group; a
staying actor switches its DP group when the DP size changes; a reference is parked in host
memory when released (or dropped and reloaded from the initial checkpoint on disk,
`ref_release="drop"`) and restored or loaded when needed. No process group is created.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Mapping

from tide_megatron.comm.groups import GroupRegistry
from tide_megatron.comm.mailbox import CONTROLLER, Mailbox
from tide_megatron.comm.messages import (LoadCheckpoint, Message, OpenRefStep, OpenStep, PushWeights, RefDone,
                                         RefMicroBatch, RolesDone, SaveCheckpoint, SetRoles, Stop, Trained,
                                         TrainMicroBatch)
from tide_megatron.core.roles import Role
from tide_megatron.models.policy import load_hf_weights, model_config_from_checkpoint
from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
from tide_megatron.trainer import checkpoint as ckpt
from tide_megatron.trainer.actor import MegatronActor, ReferenceModel, UpdateResult
from tide_megatron.trainer.assignment import TrainerAssignment, plan_transition
from tide_megatron.trainer.config import TrainerConfig
from tide_megatron.trainer.offload import ModelOffloader, OffloadConfig
from tide_megatron.trainer.batch import BatchLayout
from tide_megatron.trainer.payload import empty_micro_batch, micro_batch_of
from tide_megatron.trainer.ra2p import (ArrivingSource, ColocatedConfig, ColocatedExecutor, CostMeter,
                                        DecoupledActorExecutor, DecoupledConfig, LogprobStream,
                                        MicroBatchSource, ReadySource, RefStreamServer, StepReport)
from tide_megatron.trainer.ra2p.source import iterate
from tide_megatron.trainer.state_transfer import recv_actor_state, send_actor_state

IDLE_WAIT_S = 300.0
"""The longest the mailbox reader waits for a message before it looks again (a wait that ends
so is logged by torch's TCP store: rare, since every post and `serve`'s end wake it)."""
REF_RELEASE = ("host", "drop")


class TrainerWorker:
    """One rank's trainer side; see the module docstring."""

    def __init__(self, cfg: TrainerConfig, model_path: str, checkpoint_root: str, registry: GroupRegistry,
                 assignment: TrainerAssignment, job_group, colocated: ColocatedConfig | None = None,
                 ref_release: str = "host", seed: int = 0, device_time=None):
        """`model_path`: the initial HF checkpoint (actor weights at start, reference weights
        always); `job_group`: a group over every rank of the job (reference log-probs travel
        on it, point to point); `ref_release`: "host" parks a released reference in host
        memory, "drop" frees it and reloads it from `model_path`; `seed`: Megatron's RNG tracker
        (set before the first model this rank builds); `device_time`: emulated device time for
        the passes (`emulation.trainer_time.TrainerDeviceTime`, `cluster.device=emulated`)."""
        if ref_release not in REF_RELEASE:
            raise ValueError(f"ref_release must be one of {REF_RELEASE}, got {ref_release!r}")
        if assignment.layout != registry.layout:
            raise ValueError("the assignment and the group registry must share one layout")
        self.cfg = cfg
        self.model_path = model_path
        self.checkpoint_root = checkpoint_root
        self.registry = registry
        self.rank = registry.rank
        self.job_group = job_group
        self.colocated_cfg = colocated or ColocatedConfig()
        self.ref_release = ref_release
        self.seed = seed
        self.device_time = device_time
        self._megatron_ready = False
        self.model_cfg = model_config_from_checkpoint(model_path)
        self.model_cfg.check_tensor_parallel(len(registry.layout.home_tp_ranks(self.rank)))
        self.images = TrajectoryImages.for_model(self.model_cfg, model_path)
        self.meter = CostMeter()
        self.assignment = assignment
        self.actor: MegatronActor | None = None
        self.ref: ReferenceModel | None = None
        self._actor_parking: ModelOffloader | None = None
        self._ref_parking: ModelOffloader | None = None
        self._ref_on_host = False  # a parked reference's bytes are in host memory (not dropped)
        self._colocated: ColocatedExecutor | None = None
        self.last_transition: dict[str, float] = {}
        if self.role in (Role.ACTOR, Role.ACTOR_REF):
            self._build_actor(load_weights=True)
        if self.role in (Role.REF, Role.ACTOR_REF):
            self._load_ref()
        # A rank in a trainer role reads its mailbox in a thread while a step runs.
        self._commands: queue.Queue[tuple[Message, dict[int, ArrivingSource]]] = queue.Queue()
        self._resume = threading.Event()
        self._sources: dict[int, ArrivingSource] = {}

    @classmethod
    def at_startup(cls, topo, cfg: TrainerConfig, model_path: str, checkpoint_root: str, **kwargs) -> "TrainerWorker":
        """This rank's worker in the job's start-up configuration (`comm.topology.Topology`); a
        rank that starts as rollout holds nothing until it joins the trainer."""
        assignment = TrainerAssignment.at_startup(topo.groups.layout, topo.trainer_ranks, topo.ref_ranks)
        return cls(cfg, model_path, checkpoint_root, topo.groups, assignment, topo.job_group, seed=topo.seed, **kwargs)

    # ---- state ---------------------------------------------------------------------------

    @property
    def role(self) -> Role:
        return self.assignment.role_of(self.rank)

    @property
    def needs_ref(self) -> bool:
        return self.cfg.kl_coef != 0.0

    def _require_actor(self) -> MegatronActor:
        if self.role not in (Role.ACTOR, Role.ACTOR_REF):
            raise RuntimeError(f"rank {self.rank} is {self.role.name}, not an actor")
        return self.actor

    def _ensure_megatron(self) -> None:
        """Megatron's per-process state, once, on the thread that runs the models (a rank that
        starts as rollout pays it when it first joins the trainer)."""
        if not self._megatron_ready:
            from tide_megatron.compat.megatron_cpu import install_megatron_cpu_shims
            from tide_megatron.models.megatron_gpt import seed_megatron

            install_megatron_cpu_shims()
            seed_megatron(self.seed, self.registry.layout.tp_position(self.rank))
            self._megatron_ready = True

    def _build_actor(self, load_weights: bool) -> None:
        self._ensure_megatron()
        groups = self.registry.actor_groups(self.assignment.actor_blocks)
        self.actor = MegatronActor(self.model_cfg, self.cfg, self.model_path if load_weights else None, groups,
                                   device_time=self.device_time)
        # Parked = dropped: the other DP replicas hold the same weights and optimizer state.
        self._actor_parking = ModelOffloader(self.actor.model, OffloadConfig(optimizer_state=True, keep_host_copy=False),
                                             optimizer=self.actor.optimizer)

    def _load_ref(self) -> dict[str, float]:
        """Make the reference resident; returns {how: seconds}."""
        if not self.needs_ref:
            return {}
        started = time.perf_counter()
        if self.ref is None:
            self._ensure_megatron()
            self.ref = ReferenceModel(self.model_cfg, self.model_path, bf16=self.cfg.bf16,
                                      groups=self.registry.model_groups(), layer_spec=self.cfg.layer_spec,
                                      device_time=self.device_time)
            # One offloader parks the reference, for role changes and colocated swaps alike.
            self._ref_parking = ModelOffloader(self.ref.model, OffloadConfig(grads=False))
            self._ref_on_host = True
            return {"ref_build_load_s": time.perf_counter() - started}
        self._ref_parking.restore()
        if self._ref_on_host:
            return {"ref_restore_host_s": time.perf_counter() - started}
        load_hf_weights(self.ref.model, self.model_path, self.model_cfg)
        self._ref_on_host = True
        return {"ref_reload_disk_s": time.perf_counter() - started}

    def _release_ref(self) -> float:
        """Park the reference (it may be parked already, between colocated steps)."""
        started = time.perf_counter()
        self._colocated = None  # it held the reference's offloader only; the actor is resident
        keep = self.ref_release == "host"
        self._ref_parking.offload(keep_host_copy=keep)
        if not keep:
            self._ref_parking.drop_host_copy()  # parked earlier by a colocated swap, with a copy
            self._ref_on_host = False
        return time.perf_counter() - started

    # ---- role changes --------------------------------------------------------------------

    def apply(self, new: TrainerAssignment) -> dict[str, float]:
        """Move this rank from the current assignment to `new` (every affected rank calls it at
        the same boundary). Returns the seconds each part took."""
        t = plan_transition(self.assignment, new)[self.rank]
        started = time.perf_counter()
        times: dict[str, float] = {}
        if t.actor == "leave":
            # Between steps the colocated executor keeps the actor resident; only the reference
            # may be parked, through the offloader shared with it.
            self._colocated = None
            times["actor_release_s"] = self._actor_parking.offload()
            self._modelled_move("actor", self.assignment.dp_size, started)
        if t.ref == "release" and self.ref is not None:
            times["ref_release_s"] = self._release_ref()
        self.assignment = new
        if t.actor == "join":
            t0 = time.perf_counter()
            if self.actor is None:
                self._build_actor(load_weights=False)
                times["actor_build_s"] = time.perf_counter() - t0
            else:
                times["actor_restore_s"] = self._actor_parking.restore()
            self._modelled_move("actor", new.dp_size, t0)
        if t.actor in ("keep", "join"):
            t0 = time.perf_counter()
            self.actor.set_data_parallel(self.registry.actor_groups(new.actor_blocks))
            times["dp_switch_s"] = time.perf_counter() - t0
            group = self.registry.dp_group(new.actor_blocks)
            for dst in t.state_targets:
                times["state_send_s"] = times.get("state_send_s", 0.0) + send_actor_state(self.actor, dst, group)
            if t.state_source is not None:
                times["state_recv_s"] = recv_actor_state(self.actor, t.state_source, group)
        # A dedicated reference serves from resident weights; an ACTOR_REF one kept it parked.
        if t.ref == "load" or (self.role is Role.REF and self.ref is not None and not self._ref_parking.resident):
            t0 = time.perf_counter()
            times.update(self._load_ref())
            self._modelled_move("ref", new.dp_size, t0)
        times["total_s"] = time.perf_counter() - started
        self.last_transition = times
        return times

    def _modelled_move(self, state: str, dp: int, since: float) -> None:
        """Emulated devices: the state just moved takes the cost model's PCIe time."""
        if self.device_time is not None:
            self.device_time.state_move(state, dp, since)

    # ---- one step: actor side ------------------------------------------------------------

    def begin_step(self, num_micro_batches: int, **source_options) -> ArrivingSource:
        """The source the step's micro-batches are put into as they become ready
        (`source_options`: `ArrivingSource`'s timeout and health check)."""
        self._require_actor()
        return ArrivingSource(num_micro_batches, **source_options)

    def run_step(self, mode: str, source: "MicroBatchSource | list") -> tuple[UpdateResult, StepReport]:
        """One optimizer step on this rank's shard, in RA2P `mode` ("colocated"/"decoupled").

        A DP rank given no micro-batch still joins the step's all-reduces, with one that trains
        nothing.
        """
        actor = self._require_actor()
        if mode not in self.assignment.modes:
            raise ValueError(f"a {mode} step needs {'actors holding the reference' if mode == 'colocated' else 'reference ranks'}"
                             f"; this assignment allows {sorted(self.assignment.modes)}")
        source = source if isinstance(source, MicroBatchSource) else ReadySource(source)
        if len(source) == 0:
            started = time.perf_counter()
            result = actor.train_step([empty_micro_batch(with_ref=self.needs_ref)])
            return result, StepReport(mode=mode, wall_s=time.perf_counter() - started)
        if mode == "decoupled":
            if not self.needs_ref:
                raise ValueError("a decoupled step needs a reference: kl_coef is 0")
            src = self.assignment.ref_source(self.rank)
            executor = DecoupledActorExecutor(actor, LogprobStream(self.job_group),
                                              DecoupledConfig(ref_rank=src, actor_ranks=(self.rank,)), self.meter)
            return executor.run_step(source)
        if not self.needs_ref:
            started = time.perf_counter()
            result = actor.train_step_iter(iterate(source), len(source))
            return result, StepReport(mode=mode, num_micro_batches=len(source), wall_s=time.perf_counter() - started)
        if self._colocated is None:
            self._colocated = ColocatedExecutor(actor, self.ref, self.colocated_cfg, self.meter,
                                                ref_offloader=self._ref_parking)
        return self._colocated.run_step(source)

    # ---- one step: reference side --------------------------------------------------------

    def begin_ref_step(self, num_micro_batches: Mapping[int, int]) -> dict[int, ArrivingSource]:
        """Sources for the served actor DP ranks' micro-batches (DP rank -> count)."""
        if self.role is not Role.REF:
            raise RuntimeError(f"rank {self.rank} is {self.role.name}, not a reference rank")
        served = set(self.assignment.served_dp_ranks(self.rank))
        if set(num_micro_batches) - served:
            raise ValueError(f"reference rank {self.rank} serves DP ranks {sorted(served)}, "
                             f"asked for {sorted(num_micro_batches)}")
        return {dp: ArrivingSource(n) for dp, n in num_micro_batches.items()}

    def serve_ref_step(self, sources: Mapping[int, MicroBatchSource]) -> StepReport:
        """Compute and stream the reference log-probs of one step (blocks on arrivals)."""
        if not self.needs_ref:
            raise ValueError("a decoupled step needs a reference: kl_coef is 0")
        destinations = self.assignment.ref_destinations(self.rank)
        actors = tuple(r for ranks in destinations.values() for r in ranks)
        server = RefStreamServer(self.ref, LogprobStream(self.job_group),
                                 DecoupledConfig(ref_rank=self.rank, actor_ranks=actors), self.meter)
        return server.serve_step(sources, destinations)

    # ---- weights and checkpoints ---------------------------------------------------------

    def push_weights(self, version: int, send=None, mailbox: Mailbox | None = None) -> float:
        """Gather HF weights on actor DP rank 0 (collective over its TP group); rank 0 hands them
        to `send(named)`, the controller's push to the rollout ranks it names
        (`controller/weight_push.py`), as a lazy gather it must iterate to the end (the
        broadcast path streams it, overlapping each gather with the previous bucket's send).
        Rank 0 passes `mailbox` to have its TP peers join the gather (`PushWeights`). Returns
        the seconds `send` took."""
        if self.role not in (Role.ACTOR, Role.ACTOR_REF) or self.assignment.dp_rank(self.rank) != 0:
            return 0.0
        if mailbox is not None:
            for peer in self.assignment.dp_members(0):
                if peer != self.rank:
                    mailbox.post(peer, PushWeights(version))
        named = self.actor.hf_weights()
        if self.rank != 0:
            for _ in named:  # rank 0 alone sends; its TP peers take part in each gather
                pass
            return 0.0
        started = time.perf_counter()
        send(named)
        return time.perf_counter() - started

    def save(self, run_state: dict[str, Any] | None = None) -> str | None:
        """Checkpoint the actor (collective over the actor ranks; rank 0 passes the controller's
        run state); None on other roles."""
        if self.role not in (Role.ACTOR, Role.ACTOR_REF):
            return None
        return ckpt.save_checkpoint(self.actor, self.checkpoint_root, run_state=run_state)

    def load(self, path: str | None) -> int:
        """Load `path`, or the latest checkpoint under the root (collective over the actors)."""
        actor = self._require_actor()
        if path is None:
            return ckpt.load_latest_checkpoint(actor, self.checkpoint_root)
        return ckpt.load_checkpoint(actor, path)

    # ---- the message loop of ranks other than 0 -------------------------------------------

    def serve(self, mailbox: Mailbox, pending: list | None = None) -> Role | None:
        """Run the controller's commands until told to stop (returns None) or until `SetRoles`
        makes this rank ROLLOUT (returns Role.ROLLOUT, the mailbox read no further).
        `pending`: messages read already, handled first (a rollout rank joining the trainer
        hands over the `SetRoles` message and what came with it)."""
        stop = threading.Event()
        self._resume.set()
        reader = threading.Thread(target=self._read_mailbox, args=(mailbox, stop, list(pending or ())), daemon=True,
                                  name=f"trainer-mailbox-{self.rank}")
        reader.start()
        try:
            while True:
                msg, sources = self._commands.get()
                handler = _COMMANDS.get(type(msg))
                if handler is None:
                    raise ValueError(f"trainer rank {self.rank}: no handler for {type(msg).__name__}")
                outcome = handler(self, msg, sources, mailbox)
                if outcome is not None:
                    return None if outcome == "stop" else Role.ROLLOUT
                if isinstance(msg, SetRoles):
                    self._resume.set()  # still a trainer rank: read on
        finally:
            stop.set()
            self._resume.set()
            mailbox.wake()  # out of its wait for the next message
            reader.join(timeout=5)

    # The main thread's handlers, one per command (`_COMMANDS`): each returns None to go on,
    # "stop" or "rollout" to leave `serve`. `sources`: the open step's micro-batch sources.
    def _on_step(self, msg: OpenStep, sources, mailbox: Mailbox) -> str | None:
        result, report = self.run_step(msg.mode, sources[0])
        mailbox.post(CONTROLLER, Trained(result.step, dataclasses.asdict(result), report.as_dict()))
        return None

    def _on_ref_step(self, msg: OpenRefStep, sources, mailbox: Mailbox) -> str | None:
        report = self.serve_ref_step(sources)
        mailbox.post(CONTROLLER, RefDone(report.as_dict(), dict(self.meter.values)))
        return None

    def set_roles(self, msg: SetRoles) -> dict[str, float]:
        """`apply` the configuration rank 0 announced, planned from the one it replaces (this rank
        may have rolled out through changes it took no part in)."""
        layout = self.registry.layout
        self.assignment = self.assignment.catch_up(TrainerAssignment.replaced_by(layout, msg), self.rank)
        return self.apply(TrainerAssignment.from_message(layout, msg))

    def _on_roles(self, msg: SetRoles, sources, mailbox: Mailbox) -> str | None:
        times = self.set_roles(msg)
        mailbox.post(CONTROLLER, RolesDone(self.role.value, times))
        return "rollout" if self.role is Role.ROLLOUT else None

    def _on_push_weights(self, msg: PushWeights, sources, mailbox: Mailbox) -> str | None:
        self.push_weights(msg.version)
        return None

    def _on_save(self, msg: SaveCheckpoint, sources, mailbox: Mailbox) -> str | None:
        self.save()
        return None

    def _on_load(self, msg: LoadCheckpoint, sources, mailbox: Mailbox) -> str | None:
        self.load(msg.path)
        return None

    def _read_mailbox(self, mailbox: Mailbox, stop: threading.Event, pending: list) -> None:
        """Micro-batches go straight into the running step's sources; everything else to the
        main thread, in order (`pending` first). After `SetRoles` or `Stop` the reader waits until
        the main thread has acted on it: if the rank leaves the trainer, what follows is the
        rollout loop's to read."""
        while not stop.is_set():
            self._resume.wait()
            if stop.is_set():
                return
            if pending:
                self._route(pending.pop(0))
                continue
            msgs = mailbox.poll(limit=1)
            if not msgs:
                mailbox.wait(IDLE_WAIT_S)  # until a post (or `serve`'s end) wakes it
                continue
            self._route(msgs[0])

    def _route(self, msg: Message) -> None:
        """On the reader thread: a step's opening makes its sources (the main thread trains from
        them while its micro-batches still arrive), a micro-batch goes into its source, anything
        else to the main thread in order."""
        layout = BatchLayout.of(self.cfg)
        if isinstance(msg, OpenStep):
            self._sources = {0: self.begin_step(msg.num_micro_batches)}
        elif isinstance(msg, TrainMicroBatch):
            self._sources[0].put(micro_batch_of(msg.trajectories, layout, self.images, self.device_time))
            return
        elif isinstance(msg, OpenRefStep):
            self._sources = self.begin_ref_step(msg.num_micro_batches)
        elif isinstance(msg, RefMicroBatch):
            self._sources[msg.dp].put(micro_batch_of(msg.trajectories, layout, self.images, self.device_time))
            return
        elif isinstance(msg, (SetRoles, Stop)):
            self._resume.clear()  # what follows may be the rollout loop's to read
        self._commands.put((msg, self._sources))


def _on_stop(worker: TrainerWorker, msg: Stop, sources, mailbox: Mailbox) -> str:
    return "stop"


_COMMANDS = {OpenStep: TrainerWorker._on_step, OpenRefStep: TrainerWorker._on_ref_step,
             SetRoles: TrainerWorker._on_roles, PushWeights: TrainerWorker._on_push_weights,
             SaveCheckpoint: TrainerWorker._on_save, LoadCheckpoint: TrainerWorker._on_load, Stop: _on_stop}
"""What the main thread of `serve` does with each command (micro-batches never reach it)."""
