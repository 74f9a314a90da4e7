"""Resource-Aware Ref-Actor Pipelining (RA2P): cost models, mode choice, micro-batch plans.

Paper rules ("Resource-Aware Ref-Actor Collaboration"):

- Two strategies. DECOUPLED: Ref on dedicated ranks streams reference log-probs to the actor
  ranks; the actor's loss (KL included) is evaluated in its backward pass, so the actor's
  forward never waits for the Ref. No model swaps, but a pipeline-fill cost and extra ranks.
  COLOCATED: Ref and Actor share the actor ranks; ready micro-batches are aggregated so one
  Ref load processes all of them before swapping back to the Actor.
- Analytical mode selection from RAS (work ready at start) and TPRM (interval of later ready
  micro-batches): compare C_dec and C_col. The break-even RAS is the backlog above which
  decoupled is cheaper; ERS uses it as a consumption-deficit threshold.
- Micro-batch dispatching, same formation in both modes: early micro-batches carry enough
  tokens to saturate every DP rank (`tokens_per_rank` each), the final one is deliberately
  as small as possible to shrink the end-of-step flush bubble. Allocation differs:
  colocated runs purely sequentially and only per-rank totals matter, so sequences sorted by
  length are dealt zig-zag (snake) across ranks over the whole step; decoupled is a pipeline
  whose completion is set by the last micro-batch, so micro-batches go largest first, each is
  dealt zig-zag on its own (its duration is its largest shard), shards are fed longest first,
  and the smallest micro-batch (holding the globally smallest sequence) goes last.

Cost model (documented here because ERS and the simulator both rely on it). Inputs per
micro-batch, measured on the D actor ranks: ref forward f_r, actor forward f_a, actor
backward b_a; the model swap cost s (one PCIe load / context switch); the decoupled pipeline
fill p; F dedicated Ref ranks in decoupled mode. Let N be the step's micro-batches and
R = min(floor(RAS), N) the ready ones; the other N - R arrive every TPRM.

  Decoupled latency. The Ref stage takes t_r = f_r * D / F (the same FLOPs on F ranks instead
  of D), the actor stage t_a = f_a + b_a; the actor's forward overlaps the Ref, so the first
  backward waits only max(t_r - f_a, 0) + p (the fill). Two lower bounds, take the larger:
    compute-bound  fill + N * max(t_r, t_a)
    arrival-bound  (N - R) * TPRM + max(t_r, f_a) + b_a + p     (only when R < N)
  Colocated latency. Aggregation rounds: at time t the micro-batches that have arrived and
  are not yet processed, at most `aggregation_limit` of them, form one round costing
  2s + k (f_r + f_a + b_a) (Ref in, k Ref forwards, Actor back, k actor passes); a round
  starts once `min_round` of them wait (or the rest of the step), else the ranks idle until
  the next arrival. A fast stream (short TPRM) or a backlog larger than the aggregate (high
  RAS) therefore multiplies swaps; a sparse stream costs one round per arrival but keeps no
  Ref rank idle. `colocated_round_size` picks the `min_round` the model finds fastest: it is
  what the executor waits for before it loads the Ref (rounds sized by the cost model).
  Costs are GPU-seconds, latency x ranks held: C_dec = (D + F) L_dec, C_col = D L_col. Pure
  latency would always favour decoupled (it never swaps); what the paper trades is a Ref rank
  that sits idle on a sparse stream and could be generating on Rollout instead.

Units. Readiness is measured in tokens (`core.signals`) and so are the executors' costs
(seconds per token, `trainer.ra2p.timing.CostMeter`). Every decision (`choose_mode_for_tokens`
for a fixed trainer, `trainer_layout` for ERS and the simulator) converts both with the
micro-batch of the trainer it evaluates, D x tokens_per_rank (`in_micro_batches`), so RAS,
TPRM, N and the per-micro-batch times always count the same micro-batch. A real run once
passed its group count as N and its costs per executed micro-batch: off by about D at DP > 1.

Model error, learned online (`LatencyCorrection`). Both latencies are models; where they come
close, which mode wins depends on what they leave out (how the pipeline actually fills, how
arrivals cluster), and a mode chosen on a near-tie can run slower than the other would have
(seen in the simulator: decoupled chosen on a 2-4% predicted lead, realized 10% slower). So
each step's measured latency is compared with the chosen mode's prediction, and each mode's
prediction is scaled by its smoothed measured/predicted ratio before the comparison. A mode
never run keeps the factor 1; a mode whose predictions ran long stops winning near-ties.
The ratio of single steps strays from its smoothed value (steps alternate between backlog-fed
and arrival-fed), so a lead within that spread is a tie too: decoupled is compared at the top
of its band (factor plus smoothed deviation) and colocated at the bottom of its own. A mode
never run borrows the widest band measured. In the simulator's paper workloads this stopped
decoupled choices on sub-percent leads that ran 20-60% long (one step cost 30 s of an 80 s step).

Just-in-time feeding (`should_feed`): a running step is fed ready work in saturating
micro-batches. Decoupled: one micro-batch as soon as D x tokens_per_rank tokens are ready, or
whatever is ready when the actor would otherwise idle (a trickle of a few sequences over many
actor ranks leaves most of them idle); colocated: a round once `round_micro_batches` are ready.
Either way the last of the step goes as soon as it is all there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence, Union

from tide_megatron.core.roles import RA2PMode


@dataclass
class RA2PConfig:
    """RA2P cost-model and micro-batch planning configuration."""

    tokens_per_rank: int = 8192
    """Tokens per DP rank that saturate its compute; an early micro-batch carries D times this."""
    final_sequences_per_rank: int = 1
    """Upper bound on sequences per rank in the small final micro-batch (smallest sequences)."""
    swap_cost_s: float = 2.0
    """Seconds of one Ref<->Actor model swap in colocated mode (PCIe load + context switch)."""
    pipeline_fill_s: float = 0.5
    """Extra decoupled start-up latency (log-prob transfer, stream set-up) beyond the first Ref pass."""
    actors_per_ref: int = 3
    """Actor ranks one dedicated Ref rank serves (a forward is about 1/3 of forward+backward)."""
    aggregation_limit: Optional[int] = 4
    """Most ready micro-batches one colocated Ref load serves (their inputs and ref log-probs
    stay on GPU for the zero-copy hand-off to the Actor, which bounds the aggregate); None:
    every ready one. The executor must use the same value: the simulator's colocated rounds
    read it from here, the real colocated executor takes it as
    `ColocatedConfig(aggregation_limit=...)`."""

    def __post_init__(self) -> None:
        if min(self.tokens_per_rank, self.final_sequences_per_rank, self.actors_per_ref) <= 0:
            raise ValueError("tokens_per_rank, final_sequences_per_rank and actors_per_ref must be positive")
        if self.aggregation_limit is not None and self.aggregation_limit <= 0:
            raise ValueError("aggregation_limit must be positive or None")
        if self.swap_cost_s < 0 or self.pipeline_fill_s < 0:
            raise ValueError("costs must be >= 0")

    def ref_ranks_for(self, dp_size: int) -> int:
        """Dedicated Ref ranks for `dp_size` actor ranks in decoupled mode (nearest ratio, >= 1)."""
        return max(1, int(dp_size / self.actors_per_ref + 0.5))

    def micro_batch_tokens(self, dp_size: int) -> int:
        """Tokens of one saturating micro-batch on `dp_size` actor ranks."""
        return self.tokens_per_rank * dp_size


@dataclass(frozen=True)
class MicroBatchTimes:
    """Per-micro-batch compute times on the D actor ranks (measured or modelled)."""

    ref_fwd_s: float
    """Reference forward of one micro-batch spread over the D actor ranks."""
    actor_fwd_s: float
    """Actor forward of one micro-batch."""
    actor_bwd_s: float
    """Actor backward (loss included) of one micro-batch."""


def _ready_count(ras: float, n: int) -> int:
    return max(0, min(n, math.floor(ras + 1e-9)))


def decoupled_latency(ras: float, tprm_s: float, n: int, times: MicroBatchTimes, cfg: RA2PConfig,
                      dp_size: int, ref_ranks: Optional[int] = None) -> float:
    """L_dec: step latency of the streaming Ref->Actor pipeline (see module docstring)."""
    if n <= 0:
        return 0.0
    f = ref_ranks or cfg.ref_ranks_for(dp_size)
    r = _ready_count(ras, n)
    t_ref = times.ref_fwd_s * dp_size / f
    t_actor = times.actor_fwd_s + times.actor_bwd_s
    fill = max(t_ref - times.actor_fwd_s, 0.0) + cfg.pipeline_fill_s
    compute_bound = fill + n * max(t_ref, t_actor)
    arrival_bound = 0.0
    if r < n:
        arrival_bound = (n - r) * tprm_s + max(t_ref, times.actor_fwd_s) + times.actor_bwd_s + cfg.pipeline_fill_s
    return max(compute_bound, arrival_bound)


def colocated_latency(ras: float, tprm_s: float, n: int, times: MicroBatchTimes, cfg: RA2PConfig,
                      min_round: int = 1) -> float:
    """L_col: step latency with ready-batch aggregation on shared ranks (see module docstring).

    A round starts once `min_round` micro-batches wait (or every one the step still lacks).
    """
    if n <= 0:
        return 0.0
    if min_round < 1:
        raise ValueError("min_round must be >= 1")
    r = _ready_count(ras, n)
    per_mb = times.ref_fwd_s + times.actor_fwd_s + times.actor_bwd_s
    limit = cfg.aggregation_limit or n

    def arrived(t: float) -> int:
        if tprm_s <= 0:
            return n
        if math.isinf(tprm_s):
            return r
        return min(n, r + math.floor(t / tprm_s + 1e-9))

    t, done = 0.0, 0
    while done < n:
        waiting = arrived(t) - done
        if waiting < min(min_round, n - done):
            if math.isinf(tprm_s):
                return math.inf  # the rest never arrives
            # idle until enough micro-batches are ready
            t = max(t, (done + min(min_round, n - done) - r) * tprm_s)
            continue
        k = min(waiting, limit)
        t += 2 * cfg.swap_cost_s + k * per_mb
        done += k
    return t


def colocated_round_size(ras: float, tprm_s: float, n: int, times: MicroBatchTimes, cfg: RA2PConfig) -> int:
    """The `min_round` (micro-batches a colocated round waits for) with the lowest modelled
    step latency; ties go to the smaller round (less waiting)."""
    if n <= 0:
        return 1
    best, best_t = 1, math.inf
    for k in range(1, min(n, cfg.aggregation_limit or n) + 1):
        t = colocated_latency(ras, tprm_s, n, times, cfg, min_round=k)
        if t < best_t - 1e-9:
            best, best_t = k, t
    return best


@dataclass
class LatencyCorrection:
    """Each mode's measured over predicted step latency, smoothed, and how far single steps
    stray from it (module docstring, "Model error, learned online"): the factor its predicted
    latency (and cost) is scaled by, and the band within which two modes count as tied."""

    alpha: float = 0.5
    """Weight of the newest step in the smoothed ratio and deviation (as ERS's rates: steps
    alternate between backlog-fed and arrival-fed, so single steps mislead)."""
    ratios: dict = dataclasses.field(default_factory=dict)
    """RA2PMode -> smoothed measured/predicted latency."""
    deviations: dict = dataclasses.field(default_factory=dict)
    """RA2PMode -> smoothed |ratio - the smoothed ratio before it| (the first step's: |ratio - 1|,
    its distance from the model alone), as TCP's round-trip variance is kept."""

    def observe(self, mode: RA2PMode, predicted_s: float, measured_s: float) -> None:
        """A step ran in `mode`: it was predicted to take `predicted_s` and took `measured_s`."""
        if not (predicted_s > 0 and math.isfinite(predicted_s)) or measured_s <= 0:
            return
        ratio = measured_s / predicted_s
        old = self.ratios.get(mode)
        error = abs(ratio - (1.0 if old is None else old))
        dev = self.deviations.get(mode)
        self.deviations[mode] = error if dev is None else dev + self.alpha * (error - dev)
        self.ratios[mode] = ratio if old is None else old + self.alpha * (ratio - old)

    def factor(self, mode: RA2PMode) -> float:
        return self.ratios.get(mode, 1.0)

    def deviation(self, mode: RA2PMode) -> float:
        """A mode never run is taken to stray as far as the most erratic mode measured: one
        latency model predicts both, and an unmeasured mode is no better known."""
        return self.deviations.get(mode, max(self.deviations.values(), default=0.0))


@dataclass(frozen=True)
class ModeChoice:
    """RA2P's decision for one step, with the numbers behind it."""

    mode: RA2PMode
    cost_decoupled: float
    """C_dec, GPU-seconds."""
    cost_colocated: float
    """C_col, GPU-seconds."""
    latency_decoupled: float
    latency_colocated: float
    break_even_ras: float
    """Smallest RAS from which decoupled stays cheaper (inf if never within N)."""
    ras: float = math.nan
    """The RAS the choice was made for, in the same micro-batches as `break_even_ras`."""
    micro_batches: int = 0
    """N: the step's micro-batches in that unit."""


def in_micro_batches(dp_size: int, *, ras_tokens: float, arrival_tokens_per_s: float, step_tokens: float,
                     cfg: RA2PConfig) -> tuple[float, float, int]:
    """Readiness in tokens as the cost model counts it for `dp_size` actor ranks: (RAS, TPRM, N)
    in micro-batches of D x tokens_per_rank tokens. No arrivals (rate 0): TPRM is infinite."""
    mb = cfg.micro_batch_tokens(dp_size)
    tprm = mb / arrival_tokens_per_s if arrival_tokens_per_s > 0 else math.inf
    return ras_tokens / mb, tprm, max(1, math.ceil(step_tokens / mb))


def mode_costs(ras: float, tprm_s: float, n: int, times: MicroBatchTimes, cfg: RA2PConfig,
               dp_size: int, ref_ranks: Optional[int] = None) -> tuple[float, float, float, float]:
    """(C_dec, C_col, L_dec, L_col) for `dp_size` actor ranks (and `ref_ranks` Ref ranks when
    decoupled; default `cfg.ref_ranks_for(dp_size)`)."""
    f = ref_ranks or cfg.ref_ranks_for(dp_size)
    l_dec = decoupled_latency(ras, tprm_s, n, times, cfg, dp_size, f)
    l_col = colocated_latency(ras, tprm_s, n, times, cfg)
    return (dp_size + f) * l_dec, dp_size * l_col, l_dec, l_col


def _factors(correction: Optional[LatencyCorrection]) -> tuple[float, float]:
    """(decoupled, colocated) factors a comparison scales the model's latencies or costs by:
    decoupled at the top of its measured band, colocated at the bottom of its own, so that
    decoupled (the mode that takes a rank from the actors) wins only a lead larger than the
    model's measured error ("Model error, learned online")."""
    if correction is None:
        return 1.0, 1.0
    dec, col = RA2PMode.DECOUPLED, RA2PMode.COLOCATED
    return correction.factor(dec) + correction.deviation(dec), \
        max(0.0, correction.factor(col) - correction.deviation(col))


def break_even_ras(tprm_s: float, n: int, times: MicroBatchTimes, cfg: RA2PConfig, dp_size: int,
                   ref_ranks: Optional[int] = None) -> float:
    """Smallest integer RAS r such that C_dec <= C_col for every RAS in [r, N]; inf if none.

    "For every larger RAS" makes the threshold usable as a one-sided test (RAS above it means
    decoupled) even where the two cost curves cross more than once.
    """
    best = math.inf
    for r in range(n, -1, -1):
        c_dec, c_col, _, _ = mode_costs(r, tprm_s, n, times, cfg, dp_size, ref_ranks)
        if c_dec > c_col:
            break
        best = float(r)
    return best


def choose_mode(ras: float, tprm_s: float, n: int, times: MicroBatchTimes, cfg: RA2PConfig,
                dp_size: int, *, ref_rank_available: bool = True, ref_ranks: Optional[int] = None,
                correction: Optional[LatencyCorrection] = None) -> ModeChoice:
    """DECOUPLED iff C_dec < C_col and a Ref rank can be had; ties go to COLOCATED (fewer ranks).
    RAS, TPRM, N and `times` count micro-batches of D x tokens_per_rank tokens. The costs are
    compared as scaled by `correction`; the choice reports the model's own (unscaled) figures,
    which is what the next step's measured latency is compared with."""
    c_dec, c_col, l_dec, l_col = mode_costs(ras, tprm_s, n, times, cfg, dp_size, ref_ranks)
    f_dec, f_col = _factors(correction)
    mode = RA2PMode.DECOUPLED if ref_rank_available and c_dec * f_dec < c_col * f_col else RA2PMode.COLOCATED
    return ModeChoice(mode, c_dec, c_col, l_dec, l_col,
                      break_even_ras(tprm_s, n, times, cfg, dp_size, ref_ranks), ras=ras, micro_batches=n)


def choose_mode_for_tokens(dp_size: int, *, ras_tokens: float, arrival_tokens_per_s: float, step_tokens: float,
                           times: MicroBatchTimes, cfg: RA2PConfig, ref_ranks: int = 0,
                           correction: Optional[LatencyCorrection] = None) -> ModeChoice:
    """`choose_mode` for a trainer whose ranks are fixed (no ERS), from readiness in tokens:
    `dp_size` actor ranks, `ref_ranks` dedicated Ref ranks (0: none, colocated only)."""
    ras, tprm, n = in_micro_batches(dp_size, ras_tokens=ras_tokens, arrival_tokens_per_s=arrival_tokens_per_s,
                                    step_tokens=step_tokens, cfg=cfg)
    return choose_mode(ras, tprm, n, times, cfg, dp_size, ref_rank_available=ref_ranks > 0,
                       ref_ranks=ref_ranks or None, correction=correction)


@dataclass(frozen=True)
class TrainerLayout:
    """How `trainer_ranks` ranks run the next step: RA2P mode, actor and dedicated Ref ranks."""

    mode: RA2PMode
    actor_ranks: int
    """D: actor DP ranks (ACTOR, or ACTOR_REF when colocated)."""
    ref_ranks: int
    """F: dedicated Ref ranks (0 when colocated)."""
    latency_colocated_s: float
    latency_decoupled_s: float
    """inf when `trainer_ranks` cannot host a decoupled pipeline (fewer than two ranks)."""
    round_micro_batches: int
    """Colocated: micro-batches a round waits for (`colocated_round_size`)."""


def trainer_layout(trainer_ranks: int, *, ras_tokens: float, arrival_tokens_per_s: float, step_tokens: float,
                   times: MicroBatchTimes, cfg: RA2PConfig,
                   correction: Optional[LatencyCorrection] = None) -> TrainerLayout:
    """The RA2P mode for a trainer of `trainer_ranks` ranks, from readiness measured in tokens.

    Both candidates hold the same ranks (ERS fixed the trainer's size), so their step latencies
    compare directly: colocated on all of them, or decoupled with F = round(T / (actors_per_ref
    + 1)) of them as Ref ranks. Each candidate's micro-batch is D x tokens_per_rank, and RAS,
    TPRM and the step's micro-batch count are converted with it. The latencies are compared as
    scaled by `correction` (their measured error) and reported unscaled. Ties go to colocated.
    """
    if trainer_ranks < 1:
        raise ValueError("trainer_ranks must be >= 1")

    def signals(dp: int) -> tuple[float, float, int]:
        return in_micro_batches(dp, ras_tokens=ras_tokens, arrival_tokens_per_s=arrival_tokens_per_s,
                                step_tokens=step_tokens, cfg=cfg)

    ras_c, tprm_c, n_c = signals(trainer_ranks)
    k = colocated_round_size(ras_c, tprm_c, n_c, times, cfg)
    l_col = colocated_latency(ras_c, tprm_c, n_c, times, cfg, min_round=k)
    l_dec, f = math.inf, 0
    if trainer_ranks >= 2:
        f = min(trainer_ranks - 1, max(1, round(trainer_ranks / (cfg.actors_per_ref + 1))))
        ras_d, tprm_d, n_d = signals(trainer_ranks - f)
        l_dec = decoupled_latency(ras_d, tprm_d, n_d, times, cfg, trainer_ranks - f, f)
    f_dec, f_col = _factors(correction)
    if l_dec * f_dec < l_col * f_col:
        return TrainerLayout(RA2PMode.DECOUPLED, trainer_ranks - f, f, l_col, l_dec, k)
    return TrainerLayout(RA2PMode.COLOCATED, trainer_ranks, 0, l_col, l_dec, k)


def should_feed(mode: RA2PMode, ready_tokens: int, dp_size: int, cfg: RA2PConfig, *, trainer_idle: bool,
                completes_step: bool, round_micro_batches: int = 1) -> bool:
    """Just-in-time feeding of a running step (module docstring): True when the ready work
    should go to the trainer now, False to let it accumulate into a fuller micro-batch/round.

    `trainer_idle`: the trainer has nothing left to compute. `completes_step`: what is ready is
    all the step still needs. `round_micro_batches`: the colocated round size.
    """
    if ready_tokens <= 0:
        return False
    if completes_step:
        return True
    mb = cfg.micro_batch_tokens(dp_size)
    if mode is RA2PMode.DECOUPLED:
        return ready_tokens >= mb or trainer_idle
    return ready_tokens >= round_micro_batches * mb


# ---------------------------------------------------------------------- micro-batch planning
@dataclass(frozen=True)
class PlannedMicroBatch:
    """One micro-batch: per-DP-rank shards of sequence ids, each in feed order."""

    shards: tuple[tuple[Hashable, ...], ...]
    shard_tokens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.shard_tokens)

    @property
    def num_sequences(self) -> int:
        return sum(len(s) for s in self.shards)


@dataclass(frozen=True)
class MicroBatchPlan:
    mode: RA2PMode
    dp_size: int
    micro_batches: tuple[PlannedMicroBatch, ...]

    @property
    def rank_tokens(self) -> tuple[int, ...]:
        """Total tokens each DP rank processes in the step."""
        return tuple(sum(mb.shard_tokens[i] for mb in self.micro_batches) for i in range(self.dp_size))

    @property
    def imbalance(self) -> int:
        """max - min of the per-rank token totals."""
        totals = self.rank_tokens
        return max(totals) - min(totals) if totals else 0

    def feed_order(self, rank: int) -> list[Hashable]:
        """Sequence ids in the order `rank` processes them."""
        return [sid for mb in self.micro_batches for sid in mb.shards[rank]]


def _form_micro_batches(items: list[tuple[Hashable, int]], dp_size: int, cfg: RA2PConfig) -> list[list[tuple[Hashable, int]]]:
    """Contiguous chunks of the length-descending list: saturating early chunks, small final."""
    target = cfg.tokens_per_rank * dp_size
    total = sum(n for _, n in items)
    final_count = min(len(items), cfg.final_sequences_per_rank * dp_size)
    if len(items) - final_count < dp_size or total - sum(n for _, n in items[-final_count:]) < target:
        return [items]  # not enough work for one saturating micro-batch plus a separate tail
    head, final = items[:-final_count], items[-final_count:]
    chunks: list[list[tuple[Hashable, int]]] = []
    current: list[tuple[Hashable, int]] = []
    current_tokens = 0
    for item in head:
        current.append(item)
        current_tokens += item[1]
        if current_tokens >= target and len(current) >= dp_size:
            chunks.append(current)
            current, current_tokens = [], 0
    if current:
        # An under-filled chunk would leave ranks idle mid-step; fold it into the previous one.
        if chunks:
            chunks[-1].extend(current)
        else:
            chunks.append(current)

    def tokens(chunk: list[tuple[Hashable, int]]) -> int:
        return sum(n for _, n in chunk)

    # With long sequences even the smallest D can outweigh an early chunk; shrink the tail
    # (moving its largest into the last early chunk keeps the chunks contiguous) until it is
    # the smallest micro-batch. One sequence, the globally shortest, always qualifies.
    while len(final) > 1 and tokens(final) > min(tokens(c) for c in chunks):
        chunks[-1].append(final.pop(0))
    return chunks + [final]


def _zigzag(items: Sequence[tuple[Hashable, int]], dp_size: int, start: int = 0) -> list[list[tuple[Hashable, int]]]:
    """Deal length-descending items snake-wise: ranks 0..D-1, then D-1..0, ...

    Balance: for ranks i < j, a forward round gives i at most a_{kD+i} - a_{(k+1)D+i} more
    than j (j's item sits before position (k+1)D+i), a backward round gives it less; the
    forward excesses telescope, so totals differ by at most max(len) (by max(len) - min(len)
    when every round is full).
    """
    shards: list[list[tuple[Hashable, int]]] = [[] for _ in range(dp_size)]
    for pos, item in enumerate(items, start=start):
        rnd, off = divmod(pos, dp_size)
        shards[off if rnd % 2 == 0 else dp_size - 1 - off].append(item)
    return shards


def plan_microbatches(sequences: Union[Mapping[Hashable, int], Sequence[int]], dp_size: int,
                      mode: RA2PMode, cfg: RA2PConfig) -> MicroBatchPlan:
    """Form and allocate micro-batches for one step.

    `sequences`: sequence id -> token length (a plain list uses indices as ids).
    Deterministic: ties in length keep the input order.
    """
    if dp_size <= 0:
        raise ValueError("dp_size must be positive")
    pairs = list(sequences.items()) if isinstance(sequences, Mapping) else list(enumerate(sequences))
    if any(n < 0 for _, n in pairs):
        raise ValueError("sequence lengths must be >= 0")
    if not pairs:
        return MicroBatchPlan(mode, dp_size, ())
    order = sorted(range(len(pairs)), key=lambda i: (-pairs[i][1], i))
    items = [pairs[i] for i in order]
    chunks = _form_micro_batches(items, dp_size, cfg)

    def to_mb(shards: list[list[tuple[Hashable, int]]]) -> PlannedMicroBatch:
        return PlannedMicroBatch(tuple(tuple(sid for sid, _ in s) for s in shards),
                          tuple(sum(n for _, n in s) for s in shards))

    if mode is RA2PMode.COLOCATED:
        # One snake over the whole step: only per-rank totals matter when execution is
        # sequential and gradients are reduced once at the end of the step.
        mbs, pos = [], 0
        for chunk in chunks:
            mbs.append(to_mb(_zigzag(chunk, dp_size, start=pos)))
            pos += len(chunk)
        return MicroBatchPlan(mode, dp_size, tuple(mbs))

    early, final = chunks[:-1], chunks[-1]
    # Largest first; stable, so equal-size chunks keep formation order.
    early = sorted(early, key=lambda c: -sum(n for _, n in c))
    mbs = [to_mb(_zigzag(c, dp_size)) for c in early] + [to_mb(_zigzag(final, dp_size))]
    return MicroBatchPlan(mode, dp_size, tuple(mbs))
