"""Online cost measurement for RA2P: a device-aware stopwatch, per-step reports, an EWMA meter.

The core cost model (`core/ra2p.py`) compares C_dec and C_col from per-micro-batch times (Ref
forward, Actor forward, Actor backward) and the swap cost of one Ref<->Actor alternation. The
executors measure those per token while they run and feed them to `CostMeter`, so the mode chosen for the
next step rests on what this hardware and this model actually cost, not on a config constant.

Timing on CUDA synchronises the device at each mark (`torch.cuda.synchronize`): kernels are
asynchronous, and an unsynchronised wall clock would charge a forward's time to whatever
happens to wait on it next. The extra synchronisation costs a few microseconds per mark, which
is negligible against a micro-batch forward.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from tide_megatron.core.ra2p import MicroBatchTimes, RA2PConfig

COST_KINDS = ("ref_fwd", "actor_fwd", "actor_bwd", "swap")


def device_sync(device: Optional[torch.device] = None) -> None:
    """Wait for queued device work (no-op on CPU, where every op is synchronous)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def now() -> float:
    """A timestamp after all queued device work has finished. Seconds."""
    device_sync()
    return time.perf_counter()


@dataclass
class StepReport:
    """What one RA2P step did and where its time went (this rank's view)."""

    mode: str
    """Executor that ran: "colocated", "decoupled", "vanilla_streaming", "vanilla_streaming_offload"."""
    num_micro_batches: int = 0
    wall_s: float = 0.0
    """Whole step on this rank, optimizer step included."""
    ref_fwd_s: float = 0.0
    """Reference forwards run on this rank (0 on a decoupled actor rank)."""
    actor_fwd_s: float = 0.0
    actor_bwd_s: float = 0.0
    """Actor backward passes, excluding time spent waiting for streamed reference log-probs."""
    swap_s: float = 0.0
    """Model swaps (offload one model + restore the other)."""
    num_swaps: int = 0
    ref_wait_s: float = 0.0
    """Decoupled: time the actor's backward passes waited for reference log-probs."""
    optimizer_s: float = 0.0
    ref_rounds: int = 0
    """Colocated: how many times the Ref was brought in (one per aggregated round)."""
    tokens: int = 0
    """Tokens of the micro-batches this rank passed (trajectory tokens, padding excluded)."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CostMeterConfig:
    """Smoothing of the measured costs."""

    ewma_alpha: float = 0.3
    """Weight of the newest observation (1 = use only the last; small = slow to react)."""


@dataclass
class CostMeter:
    """Exponentially weighted costs, measured online by the executors.

    `observe(kind, seconds, tokens)` with kind in COST_KINDS. Ref and Actor passes are kept per
    token of this rank (a micro-batch's tokens vary with packing and with the step), so that
    `times(tokens_per_rank)` gives the per-micro-batch times of the cost model's micro-batch
    whatever the executed ones held; a swap is one Ref<->Actor alternation (offload the running
    model, restore the other), the unit of `RA2PConfig.swap_cost_s`, whatever its size.
    """

    cfg: CostMeterConfig = field(default_factory=CostMeterConfig)
    values: dict[str, float] = field(default_factory=dict)
    """Seconds per token (ref_fwd, actor_fwd, actor_bwd) or per swap (swap)."""
    counts: dict[str, int] = field(default_factory=dict)

    def observe(self, kind: str, seconds: float, tokens: int = 0) -> None:
        """`seconds` spent on `tokens` tokens (a swap: one swap, `tokens` unused)."""
        if kind not in COST_KINDS:
            raise ValueError(f"unknown cost kind {kind!r}; expected one of {COST_KINDS}")
        if kind != "swap":
            if tokens <= 0:
                raise ValueError(f"a {kind} measurement needs the tokens it covered, got {tokens}")
            seconds = seconds / tokens
        self._fold(kind, seconds)

    def _fold(self, kind: str, value: float) -> None:
        if kind in self.values:
            a = self.cfg.ewma_alpha
            self.values[kind] = a * value + (1.0 - a) * self.values[kind]
        else:
            self.values[kind] = value
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def merge(self, other: "CostMeter | dict") -> None:
        """Take in costs measured elsewhere, in this meter's units (e.g. a decoupled Ref rank's
        `ref_fwd` per token)."""
        values = other.values if isinstance(other, CostMeter) else other
        for kind, value in values.items():
            if kind not in COST_KINDS:
                raise ValueError(f"unknown cost kind {kind!r}; expected one of {COST_KINDS}")
            self._fold(kind, value)

    def has(self, *kinds: str) -> bool:
        return all(kind in self.values for kind in kinds)

    def times(self, tokens_per_rank: int, prior: Optional[MicroBatchTimes] = None) -> MicroBatchTimes:
        """Times of one cost-model micro-batch (`tokens_per_rank` tokens on each actor rank):
        measured per-token costs scaled up; unmeasured ones from `prior`, which is already per
        such micro-batch (error if none)."""
        def pick(kind: str, fallback: Optional[float]) -> float:
            if kind in self.values:
                return self.values[kind] * tokens_per_rank
            if fallback is None:
                raise ValueError(f"no measurement of {kind!r} and no prior")
            return fallback

        return MicroBatchTimes(
            ref_fwd_s=pick("ref_fwd", prior and prior.ref_fwd_s),
            actor_fwd_s=pick("actor_fwd", prior and prior.actor_fwd_s),
            actor_bwd_s=pick("actor_bwd", prior and prior.actor_bwd_s))

    def ra2p_config(self, base: RA2PConfig) -> RA2PConfig:
        """`base` with the measured swap cost, when there is one."""
        import dataclasses

        if "swap" not in self.values:
            return base
        return dataclasses.replace(base, swap_cost_s=self.values["swap"])


def finish_actor_step(actor, reports: list, report: StepReport, started: float,
                      meter: Optional[CostMeter]) -> tuple:
    """Every executor ends its step alike: the actor's optimizer step, timed into `report`
    with the step's wall time, and the actor's measured passes folded into `meter`.
    Returns (the optimizer's result, `report`)."""
    opt_started = now()
    result = actor.optimizer_step(reports)
    report.optimizer_s = now() - opt_started
    report.wall_s = now() - started
    if meter is not None and report.tokens:
        meter.observe("actor_fwd", report.actor_fwd_s, report.tokens)
        meter.observe("actor_bwd", report.actor_bwd_s, report.tokens)
    return result, report


class ActorPassTimer:
    """Splits an actor step into forward and backward time.

    Megatron's schedule runs forward(mb_i), loss, backward(mb_i), forward(mb_i+1), ... inside one
    call, so the split is read from forward hooks on the model: a forward is pre-hook to
    post-hook; a backward is from a forward's end to the next forward's start (or to the end of
    the schedule, which includes the final grad all-reduce), minus whatever the data iterator
    did in between (`exclude`: swaps and Ref forwards of the colocated executors).

    Use as a context manager around `forward_backward`.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.fwd_s = 0.0
        self.bwd_s = 0.0
        self._fwd_start = 0.0
        self._fwd_end: Optional[float] = None
        self._excluded = 0.0
        self._handles: list = []

    def exclude(self, seconds: float) -> None:
        """Time spent between two actor passes on something else (not backward)."""
        self._excluded += seconds

    def _close_backward(self, t: float) -> None:
        if self._fwd_end is not None:
            self.bwd_s += max(t - self._fwd_end - self._excluded, 0.0)
        self._fwd_end, self._excluded = None, 0.0

    def _pre(self, module, args) -> None:
        t = now()
        self._close_backward(t)
        self._fwd_start = t

    def _post(self, module, args, output) -> None:
        t = now()
        self.fwd_s += t - self._fwd_start
        self._fwd_end = t

    def __enter__(self) -> "ActorPassTimer":
        self._handles = [self.model.register_forward_pre_hook(self._pre),
                         self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> bool:
        self._close_backward(now())
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False
