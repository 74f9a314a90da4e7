"""How rank 0 runs one training step over every actor DP rank and reference rank.

The mode (`modes.py`) says which executor runs and whether the step's micro-batches are all
ready at its start or arrive while it runs; RA2P's `ModeSelector` picks colocated or decoupled
each step in `tide` mode with `ra2p.executor=auto`, from the step's readiness in tokens (ready
at its start, the arrival rate, the step's size) and the per-token costs the executors
measured, both converted to the cost model's micro-batch of the current trainer by the core.
Micro-batches are formed by the core planner (`core/ra2p.py`) over the current DP size: the
ready backlog is planned as a whole (the smallest micro-batch last when decoupled); every group
that completes during the step is one more micro-batch, for the DP rank with the fewest tokens
among those with a late slot left.

Every mode runs the same way: a `trainer.step_feed.StepFeed` opens the step on every actor and
reference rank of the current `TrainerAssignment` and routes each micro-batch to its DP rank
(rank 0 trains DP rank 0's share itself, `TrainerWorker.run_step`), then the replies of the
other ranks are collected with a timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import Message, RefDone
from tide_megatron.comm.topology import Topology
from tide_megatron.controller.modes import ModePolicy
from tide_megatron.core.buffer import CompletedGroup, Trajectory
from tide_megatron.core.ra2p import MicroBatchTimes, ModeChoice, RA2PMode, plan_microbatches
from tide_megatron.trainer.batch import BatchLayout
from tide_megatron.trainer.ra2p import ArrivingSource, ModeSelector, ModeSelectorConfig, StepReport
from tide_megatron.trainer.step_feed import StepFeed
from tide_megatron.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

COLD_START_TPRM_S = 60.0
"""No arrival history yet: assume one cost-model micro-batch per this many seconds (sparse
arrivals, the paper's cold start)."""
REPLY_TIMEOUT_S = 3600.0
"""How long rank 0 waits for the other trainer ranks once its own share is done; their health
is checked meanwhile (a dead rank ends the torchrun job sooner)."""


class TrainingError(RuntimeError):
    """A trainer-side rank did not answer in time."""


@dataclass
class StepOutcome:
    """What one training step did, for the log."""

    result: Any
    """The actor's `UpdateResult` (loss terms, grad norm)."""
    report: StepReport
    mode: RA2PMode
    choice: Optional[ModeChoice]
    consumed: list[CompletedGroup] = field(default_factory=list)
    arrival_wait_s: float = 0.0
    """Seconds the executor blocked for groups still arriving (trainer waiting, not compute)."""
    assignment: Any = None
    """The `TrainerAssignment` the step ran on (ERS may move to another after it)."""

    @property
    def dp_size(self) -> int:
        return self.assignment.dp_size if self.assignment is not None else 1


class _OpenStep:
    """One step's feed and where its late groups go (DP rank -> late slots left, tokens)."""

    def __init__(self, feed: StepFeed, late: dict[int, int], tokens: dict[int, int]):
        self.feed, self.late, self.tokens = feed, late, tokens

    def put_late(self, trajectories: list[Trajectory]) -> None:
        dp = min((d for d, n in self.late.items() if n > 0), key=lambda d: (self.tokens[d], d))
        self.late[dp] -= 1
        self.tokens[dp] += sum(len(t.token_ids) for t in trajectories)
        self.feed.put(dp, trajectories)


class TrainerDriver:
    """Rank 0's side of every trainer rank: RA2P's choice, the step feed, the replies."""

    def __init__(self, cfg, topo: Topology, mailbox: Mailbox, worker: TrainerWorker, mode: ModePolicy,
                 inbox: "queue.Queue[Any]", health: Callable[[], None]):
        self.cfg, self.topo, self.mailbox, self.worker, self.mode = cfg, topo, mailbox, worker, mode
        self._inbox = inbox
        self._stash: list[Any] = []
        self._health = health
        self.layout = BatchLayout.of(cfg.trainer)
        self.meter = worker.meter  # rank 0's measured costs; reference ranks add theirs per step
        prior = MicroBatchTimes(cfg.ra2p.prior_ref_fwd_s, cfg.ra2p.prior_actor_fwd_s, cfg.ra2p.prior_actor_bwd_s)
        cost_model = cfg.ra2p.cost_model
        if not cfg.ra2p.offload_idle_model:
            cost_model = dataclasses.replace(cost_model, swap_cost_s=0.0)  # colocated rounds swap nothing
        self.selector = ModeSelector(ModeSelectorConfig(ra2p=cost_model, prior_times=prior), self.meter)
        self._group_tokens: Optional[float] = None  # a group's tokens, as the last step's groups held

    @property
    def assignment(self):
        """The trainer configuration the next step runs on (rank 0's worker owns it)."""
        return self.worker.assignment

    # -- the mode of this step ------------------------------------------------------------
    def choose(self, ras_tokens: int, step_tokens: float, arrival_tokens_per_s: Optional[float]
               ) -> tuple[RA2PMode, Optional[ModeChoice]]:
        """The step's mode from its readiness in tokens (`arrival_tokens_per_s` None: no history)."""
        forced = self.mode.executor
        if forced != "auto":  # every executor but `decoupled` runs Ref and Actor on the actor ranks
            return (RA2PMode.DECOUPLED if forced == "decoupled" else RA2PMode.COLOCATED), None
        if len(self.assignment.modes) == 1:  # ERS's layout left one (its plan chose the mode)
            return RA2PMode(next(iter(self.assignment.modes))), None
        dp = self.assignment.dp_size
        if arrival_tokens_per_s is None:
            arrival_tokens_per_s = self.cfg.ra2p.cost_model.micro_batch_tokens(dp) / COLD_START_TPRM_S
        choice = self.selector.choose(dp, ras_tokens=ras_tokens, arrival_tokens_per_s=arrival_tokens_per_s,
                                      step_tokens=step_tokens, ref_ranks=len(self.assignment.ref_units))
        return choice.mode, choice

    def _step_tokens(self, ready_tokens: int, ready_groups: int, late_groups: int) -> float:
        """The step's tokens: the ready ones, and the late groups at the mean group size seen
        (this step's ready groups, else the last step's; none yet: `tokens_per_rank` each)."""
        if ready_groups:
            per_group = ready_tokens / ready_groups
        elif self._group_tokens is not None:
            per_group = self._group_tokens
        else:
            per_group = self.cfg.ra2p.cost_model.tokens_per_rank
        return ready_tokens + late_groups * per_group

    def _note_groups(self, groups: list[CompletedGroup]) -> None:
        if groups:
            self._group_tokens = sum(_tokens(g.trajectories) for g in groups) / len(groups)

    # -- one step ---------------------------------------------------------------------------
    def train_batch(self, groups: list[CompletedGroup], arrival_tokens_per_s: Optional[float]) -> StepOutcome:
        """Train on a whole ready batch."""
        tokens = sum(_tokens(g.trajectories) for g in groups)
        mode, choice = self.choose(tokens, tokens, arrival_tokens_per_s)
        step = self._open(mode, [t for g in groups for t in g.trajectories], late=0)
        result, report, waited = self._run(mode, step)
        self._learn(mode, choice, report)
        self._note_groups(groups)
        return StepOutcome(result, report, mode, choice, list(groups), arrival_wait_s=waited,
                           assignment=self.assignment)

    def train_stream(self, ready: list[CompletedGroup], groups_in_step: int, arrival_tokens_per_s: Optional[float],
                     stream_into: Callable[[ArrivingSource, int, Callable[[CompletedGroup], None]], None],
                     arrival_timeout_s: float) -> StepOutcome:
        """Train on the ready groups and on each group that completes until `groups_in_step`."""
        late = groups_in_step - len(ready)
        ready_tokens = sum(_tokens(g.trajectories) for g in ready)
        mode, choice = self.choose(ready_tokens, self._step_tokens(ready_tokens, len(ready), late),
                                   arrival_tokens_per_s)
        step = self._open(mode, [t for g in ready for t in g.trajectories], late, arrival_timeout_s)
        consumed = list(ready)

        def on_group(group: CompletedGroup) -> None:  # the rollout thread, as each group completes
            consumed.append(group)
            step.put_late(group.trajectories)

        if late > 0:
            stream_into(step.feed.local_source, late, on_group)
        result, report, waited = self._run(mode, step)
        self._learn(mode, choice, report)
        self._note_groups(consumed)
        return StepOutcome(result, report, mode, choice, consumed, arrival_wait_s=waited,
                           assignment=self.assignment)

    def _learn(self, mode: RA2PMode, choice: Optional[ModeChoice], report) -> None:
        """A step RA2P chose: its measured latency against the prediction it was chosen on."""
        if choice is not None:
            self.selector.observe(mode, report.wall_s)

    def _open(self, mode: RA2PMode, trajs: list[Trajectory], late: int,
              arrival_timeout_s: float = REPLY_TIMEOUT_S) -> _OpenStep:
        """Plan the ready backlog over the DP ranks, open the step on every trainer-side rank
        and route the backlog; `late` more micro-batches (one per group) are to come."""
        dp_size = self.assignment.dp_size
        by_id = {t.trajectory_id: t for t in trajs}
        lengths = {tid: len(t.token_ids) for tid, t in by_id.items()}
        plan = plan_microbatches(lengths, dp_size, mode, self.cfg.ra2p.cost_model)
        per_dp = [[[by_id[k] for k in mb.shards[d]] for mb in plan.micro_batches if mb.shards[d]]
                  for d in range(dp_size)]
        late_slots = {d: late // dp_size + (d < late % dp_size) for d in range(dp_size)}
        feed = StepFeed(self.mailbox, self.assignment, mode.value,
                        {d: len(per_dp[d]) + late_slots[d] for d in range(dp_size)}, local=self.worker,
                        layout=self.layout,
                        source_options=dict(timeout_s=arrival_timeout_s, health=self._health))
        for d, micro_batches in enumerate(per_dp):
            for mb in micro_batches:
                feed.put(d, mb)
        tokens = {d: sum(_tokens(mb) for mb in per_dp[d]) for d in range(dp_size)}
        return _OpenStep(feed, late_slots, tokens)

    def _run(self, mode: RA2PMode, step: _OpenStep):
        """Rank 0's share, then the other ranks' replies. Returns (result, report, arrival wait)."""
        result, report = self.worker.run_step(mode.value, step.feed.local_source)
        for kind, ranks in step.feed.replies_expected().items():
            replies = self.take(kind, len(ranks), timeout_s=REPLY_TIMEOUT_S)
            if kind is RefDone:
                for done in replies:
                    self.meter.merge({k: v for k, v in done.costs.items() if k == "ref_fwd"})
        return result, report, step.feed.local_source.waited_s

    # -- replies of the other trainer-side ranks --------------------------------------------
    def take(self, kind: type[M], count: int, timeout_s: float) -> list[M]:
        """`count` messages of type `kind`, from the trainer-side ranks."""
        got: list[M] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            for msg in list(self._stash):
                if isinstance(msg, kind) and len(got) < count:
                    self._stash.remove(msg)
                    got.append(msg)
            if len(got) >= count:
                break
            try:
                msg = self._inbox.get(timeout=0.5)
            except queue.Empty:
                self._health()
                if time.monotonic() > deadline:
                    raise TrainingError(f"timed out after {timeout_s:.0f} s waiting for {count} {kind.__name__} "
                                        f"message(s), got {len(got)}") from None
                continue
            self._stash.append(msg)
        return got


def _tokens(trajectories: list[Trajectory]) -> int:
    return sum(len(t.token_ids) for t in trajectories)
