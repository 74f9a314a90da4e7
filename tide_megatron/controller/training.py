"""How rank 0 runs one training step: the executor the mode asks for, fed whole or streamed.

The mode (`modes.py`) says which executor runs and whether the step's micro-batches are all
ready at its start or arrive while it runs; RA2P's `ModeSelector` picks colocated or decoupled
each step in `tide` mode with `ra2p.executor=auto`, from RAS and TPRM and the costs the
executors measured. Micro-batches are formed by the core planner (`core/ra2p.py`): the ready
backlog is planned as a whole (the smallest micro-batch last when decoupled); every group that
completes during the step is one more micro-batch.

With more than one trainer rank (sync mode; the other modes run one actor rank in this
version) each rank trains its shard of the batch (`TrainerRank.train`), the others driven
through their mailbox.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.topology import Topology
from tide_megatron.controller.modes import ModePolicy
from tide_megatron.controller.trainer_rank import TrainerRank, micro_batch_of
from tide_megatron.core.buffer import CompletedGroup, Trajectory
from tide_megatron.core.ra2p import MicroBatchTimes, ModeChoice, RA2PMode, plan_microbatches
from tide_megatron.trainer.ra2p import (
    ArrivingSource,
    ColocatedConfig,
    ColocatedExecutor,
    CostMeter,
    DecoupledActorExecutor,
    DecoupledConfig,
    LogprobStream,
    ModeSelector,
    ModeSelectorConfig,
    ReadySource,
    StepReport,
)

logger = logging.getLogger(__name__)

COLD_START_TPRM_S = 60.0  # no arrival history yet: assume sparse arrivals (the paper's cold start)


class TrainingError(RuntimeError):
    """A trainer-side rank did not answer in time."""


@dataclass
class StepOutcome:
    """What one training step did, for the log."""

    result: Any
    """The actor's `StepResult` (loss terms, grad norm)."""
    report: StepReport
    mode: RA2PMode
    choice: Optional[ModeChoice]
    consumed: list[CompletedGroup] = field(default_factory=list)
    arrival_wait_s: float = 0.0
    """Seconds the executor blocked for groups still arriving (trainer waiting, not compute)."""


def _trajectory_json(t: Trajectory) -> dict[str, Any]:
    return {"token_ids": t.token_ids, "loss_mask": t.loss_mask, "logprobs": t.logprobs, "advantage": t.advantage}


def _executor_config(name: str) -> ColocatedConfig:
    return {"vs": ColocatedConfig.vanilla_streaming(offload=False),
            "vso": ColocatedConfig.vanilla_streaming(offload=True),
            "resident": ColocatedConfig(offload=False, name="colocated_resident")}.get(name, ColocatedConfig())


class TrainerDriver:
    """Rank 0's side of every trainer rank: executors, RA2P's choice, the reference rank."""

    def __init__(self, cfg, topo: Topology, mailbox: Mailbox, trainer: TrainerRank, mode: ModePolicy,
                 inbox: "queue.Queue[Any]", health: Callable[[], None]):
        self.cfg, self.topo, self.mailbox, self.trainer, self.mode = cfg, topo, mailbox, trainer, mode
        self._inbox = inbox
        self._stash: list[Any] = []
        self._health = health
        self.pad = cfg.trainer.pad_to_multiple_of
        self.meter = CostMeter()
        prior = MicroBatchTimes(cfg.ra2p.prior_ref_fwd_s, cfg.ra2p.prior_actor_fwd_s, cfg.ra2p.prior_actor_bwd_s)
        self.selector = ModeSelector(ModeSelectorConfig(ra2p=cfg.ra2p.cost_model, prior_times=prior), self.meter)
        # Sync is the VeRL-like baseline: both models resident, the Ref over the batch then the Actor.
        name = "resident" if mode.name == "sync" else mode.executor
        self.colocated = None  # trainer.kl_coef == 0: no reference model, the actor alone trains
        if trainer.ref is not None:
            self.colocated = ColocatedExecutor(trainer.actor, trainer.ref, _executor_config(name), self.meter)
        self.ref_rank = topo.ref_ranks[0] if topo.ref_ranks else None
        self.decoupled = None
        if self.ref_rank is not None:
            self.decoupled = DecoupledActorExecutor(
                trainer.actor, LogprobStream(topo.job_group),
                DecoupledConfig(ref_rank=self.ref_rank, actor_ranks=(topo.rank,)), self.meter)

    # -- the mode of this step ------------------------------------------------------------
    def choose(self, ras: float, tprm_s: Optional[float], n_mb: int) -> tuple[RA2PMode, Optional[ModeChoice]]:
        forced = self.mode.executor
        if forced != "auto":
            return (RA2PMode.DECOUPLED if forced == "decoupled" else RA2PMode.COLOCATED), None
        choice = self.selector.choose(ras, tprm_s if tprm_s is not None else COLD_START_TPRM_S, n_mb,
                                      dp_size=1, ref_rank_available=self.ref_rank is not None)
        return choice.mode, choice

    # -- whole batches ----------------------------------------------------------------------
    def train_batch(self, groups: list[CompletedGroup], ras: float, tprm_s: Optional[float]) -> StepOutcome:
        trajs = [t for g in groups for t in g.trajectories]
        if len(self.topo.trainer_ranks) > 1:
            return self._train_sharded(groups, trajs)
        mode, choice = self.choose(ras, tprm_s, len(groups))
        mbs, _ = self._planned(trajs, mode)
        source = ReadySource(mbs)
        result, report = self._run(mode, source)
        return StepOutcome(result, report, mode, choice, list(groups))

    def _train_sharded(self, groups: list[CompletedGroup], trajs: list[Trajectory]) -> StepOutcome:
        """Several trainer ranks: longest first onto the lightest DP shard; TP peers share one."""
        tp = self.cfg.trainer.tp_size
        trainers = self.topo.trainer_ranks
        dp = len(trainers) // tp
        shards: list[list[dict[str, Any]]] = [[] for _ in range(dp)]
        totals = [0] * dp
        for t in sorted(trajs, key=lambda t: t.total_tokens, reverse=True):
            i = min(range(dp), key=lambda k: totals[k])
            shards[i].append(_trajectory_json(t))
            totals[i] += t.total_tokens
        for rank in trainers[1:]:
            self.mailbox.post(rank, "train", trajectories=shards[rank // tp])
        started = time.perf_counter()
        result, phases = self.trainer.train(shards[0])
        self.take("trained", len(trainers) - 1, timeout_s=3600)
        report = StepReport(mode="sharded", num_micro_batches=int(phases["micro_batches"]),
                            wall_s=time.perf_counter() - started, ref_fwd_s=phases["time/ref_s"],
                            actor_fwd_s=phases["time/actor_s"])
        return StepOutcome(result, report, RA2PMode.COLOCATED, None, list(groups))

    # -- streamed steps ---------------------------------------------------------------------
    def train_stream(self, ready: list[CompletedGroup], groups_in_step: int, ras: float, tprm_s: Optional[float],
                     stream_into: Callable[[ArrivingSource, int, Callable[[CompletedGroup], None]], None],
                     arrival_timeout_s: float) -> StepOutcome:
        """Train on the ready groups and on each group that completes until `groups_in_step`."""
        trajs = [t for g in ready for t in g.trajectories]
        late = groups_in_step - len(ready)
        mode, choice = self.choose(ras, tprm_s, len(ready) + late)
        mbs, planned = self._planned(trajs, mode)
        source = ArrivingSource(len(mbs) + late, timeout_s=arrival_timeout_s, health=self._health)
        for mb in mbs:
            source.put(mb)
        consumed = list(ready)
        decoupled = mode is RA2PMode.DECOUPLED
        if decoupled:
            self.mailbox.post(self.ref_rank, "ref_step", num_micro_batches=len(source))
            for mb_trajs in planned:
                self.mailbox.post(self.ref_rank, "ref_mb", trajectories=mb_trajs)

        def on_group(group: CompletedGroup) -> None:  # the rollout thread, as each group completes
            payload = [_trajectory_json(t) for t in group.trajectories]
            consumed.append(group)
            source.put(micro_batch_of(payload, self.pad))
            if decoupled:
                self.mailbox.post(self.ref_rank, "ref_mb", trajectories=payload)

        if late > 0:
            stream_into(source, late, on_group)
        result, report = self._run(mode, source)
        return StepOutcome(result, report, mode, choice, consumed, arrival_wait_s=source.waited_s)

    def _planned(self, trajs: list[Trajectory], mode: RA2PMode) -> tuple[list, list[list[dict[str, Any]]]]:
        """The core planner's micro-batches of a ready backlog: this rank's tensors, and the
        trajectories of each (what a reference rank is sent)."""
        payload = {t.trajectory_id: _trajectory_json(t) for t in trajs}
        lengths = {tid: len(p["token_ids"]) for tid, p in payload.items()}
        plan = plan_microbatches(lengths, 1, mode, self.cfg.ra2p.cost_model)
        planned = [[payload[k] for k in mb.shards[0]] for mb in plan.micro_batches if mb.shards[0]]
        return [micro_batch_of(p, self.pad) for p in planned], planned

    def _run(self, mode: RA2PMode, source):
        if mode is RA2PMode.DECOUPLED:
            result, report = self.decoupled.run_step(source)
            done = self.take("ref_done", 1, timeout_s=600)[0]
            self.meter.merge({k: v for k, v in done["costs"].items() if k == "ref_fwd"})
            return result, report
        if self.colocated is None:
            mbs = source.take_ready(len(source))
            started = time.perf_counter()
            result = self.trainer.actor.train_step(mbs)
            return result, StepReport(mode="actor_only", num_micro_batches=len(mbs),
                                      wall_s=time.perf_counter() - started)
        return self.colocated.run_step(source)

    # -- replies of the other trainer-side ranks --------------------------------------------
    def take(self, kind: str, count: int, timeout_s: float) -> list[Any]:
        """`count` messages of `kind` (dict messages of the trainer ranks, or a typed kind)."""
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            for msg in list(self._stash):
                if _kind(msg) == kind and len(got) < count:
                    self._stash.remove(msg)
                    got.append(msg)
            if len(got) >= count:
                break
            try:
                msg = self._inbox.get(timeout=0.5)
            except queue.Empty:
                self._health()
                if time.monotonic() > deadline:
                    raise TrainingError(f"timed out after {timeout_s:.0f} s waiting for {count} '{kind}' "
                                        f"message(s), got {len(got)}") from None
                continue
            self._stash.append(msg)
        return got

    def drain(self, kind: str) -> list[Any]:
        """Every message of `kind` that has arrived, without waiting."""
        while True:
            try:
                self._stash.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        out = [m for m in self._stash if _kind(m) == kind]
        self._stash = [m for m in self._stash if _kind(m) != kind]
        return out


def _kind(msg: Any) -> str:
    return msg["kind"] if isinstance(msg, dict) else msg.KIND
