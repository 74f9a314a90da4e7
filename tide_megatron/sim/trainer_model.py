"""Execution time of the trainer under each Ref/Actor strategy.

The trainer consumes whole GRPO groups; how long a set of sequences takes depends on how Ref
and Actor share GPUs:

- `aggregated_round`: Ref and Actor on the same ranks; load Ref, run every given micro-batch's
  Ref forward, swap to Actor, run their forward+backward (the barrier baselines, whose "round"
  is the whole global batch).
- `colocated_rounds`: RA2P colocated with ready-batch aggregation: the same, in rounds of at
  most `RA2PConfig.aggregation_limit` micro-batches (the limit the cost model assumes).
- `per_microbatch_alternation`: the same ranks alternate R1 -> A1 -> R2 -> A2, with a swap pair
  per micro-batch (StreamRL-like vanilla streaming with offload, VSO) or both models resident (VS).

Whether a colocated trainer swaps at all is `SimSchedulerConfig.offload_idle_model` (the real
`ra2p.offload_idle_model`): off, both models stay resident and a round pays no swap.
- `DecoupledPipeline`: Ref on dedicated ranks streams log-probs; the actor's forward overlaps
  the Ref, only its backward (where the loss now lives) waits (RA2P decoupled).

Micro-batch formation and allocation come from the core RA2P planner (`plan_microbatches`);
a micro-batch lasts as long as its most loaded DP rank (ranks synchronise at its end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from tide_megatron.core.ra2p import MicroBatchPlan, MicroBatchTimes, RA2PConfig, plan_microbatches
from tide_megatron.core.roles import RA2PMode
from tide_megatron.sim.hardware import HardwareModel


@dataclass
class TrainerCosts:
    """Per-token costs of the trainer on one DP slot."""

    hw: HardwareModel
    gpus_per_rank: int
    mean_seq_len: float

    def ref_s(self, tokens: float) -> float:
        return self.hw.train_s(tokens, self.mean_seq_len, backward=False, gpus=self.gpus_per_rank)

    def actor_fwd_s(self, tokens: float) -> float:
        return self.hw.train_s(tokens, self.mean_seq_len, backward=False, gpus=self.gpus_per_rank)

    def actor_s(self, tokens: float) -> float:
        """Forward + backward (backward = 2x forward)."""
        return self.hw.train_s(tokens, self.mean_seq_len, backward=True, gpus=self.gpus_per_rank)

    def swap_s(self, dp: int) -> float:
        return self.hw.ref_actor_swap_s(dp)

    def microbatch_times(self, tokens_per_rank: float) -> MicroBatchTimes:
        """What RA2P's cost model needs, for a saturating micro-batch."""
        return MicroBatchTimes(
            ref_fwd_s=self.ref_s(tokens_per_rank),
            actor_fwd_s=self.actor_fwd_s(tokens_per_rank),
            actor_bwd_s=self.actor_s(tokens_per_rank) - self.actor_fwd_s(tokens_per_rank),
        )


def plan(lengths: Sequence[int], dp: int, mode: RA2PMode, cfg: RA2PConfig) -> MicroBatchPlan:
    return plan_microbatches(list(lengths), dp, mode, cfg)


def aggregated_round(costs: TrainerCosts, lengths: Sequence[int], dp: int, cfg: RA2PConfig,
                     swaps: int = 2) -> float:
    """One colocated aggregation round over `lengths` on `dp` ranks: Ref all, swap, Actor all.

    Execution on a rank is sequential and gradients reduce once, so the round lasts as long
    as the most loaded rank (zig-zag keeps the loads even). `swaps`: model loads paid.
    """
    if not lengths:
        return 0.0
    p = plan(lengths, dp, RA2PMode.COLOCATED, cfg)
    busiest = max(p.rank_tokens)
    return swaps * costs.swap_s(dp) + costs.ref_s(busiest) + costs.actor_s(busiest)


def colocated_rounds(costs: TrainerCosts, lengths: Sequence[int], dp: int, cfg: RA2PConfig,
                     offload: bool = True) -> float:
    """RA2P colocated: the fed micro-batches in rounds of at most `cfg.aggregation_limit`, each
    round one Ref load, its Ref forwards, a swap back and its Actor passes (`offload`; with both
    models resident no swap)."""
    if not lengths:
        return 0.0
    p = plan(lengths, dp, RA2PMode.COLOCATED, cfg)
    limit = cfg.aggregation_limit or len(p.micro_batches)
    t = 0.0
    for i in range(0, len(p.micro_batches), limit):
        rnd = p.micro_batches[i:i + limit]
        busiest = max(sum(mb.shard_tokens[r] for mb in rnd) for r in range(dp))
        t += (2 * costs.swap_s(dp) if offload else 0.0) + costs.ref_s(busiest) + costs.actor_s(busiest)
    return t


def per_microbatch_alternation(costs: TrainerCosts, lengths: Sequence[int], dp: int, cfg: RA2PConfig,
                               offload: bool = True) -> float:
    """Vanilla streaming: every micro-batch runs Ref, then Actor; with `offload` (VSO) each loads
    its model first, without (VS) both stay resident."""
    if not lengths:
        return 0.0
    p = plan(lengths, dp, RA2PMode.COLOCATED, cfg)
    t = 0.0
    for mb in p.micro_batches:
        busiest = max(mb.shard_tokens)
        t += (2 * costs.swap_s(dp) if offload else 0.0) + costs.ref_s(busiest) + costs.actor_s(busiest)
    return t


class DecoupledPipeline:
    """Ref ranks -> Actor ranks streaming pipeline with the loss in the actor's backward."""

    def __init__(self, costs: TrainerCosts, dp: int, ref_ranks: int, cfg: RA2PConfig, fill_s: float):
        self.costs = costs
        self.dp = dp
        self.ref_ranks = max(1, ref_ranks)
        self.cfg = cfg
        self.fill_s = fill_s
        self.ref_free = 0.0
        self.actor_free = 0.0
        self.started = False

    def submit(self, now: float, lengths: Sequence[int]) -> float:
        """Feed ready sequences at `now`; returns when the actor finishes their backward."""
        if not lengths:
            return max(now, self.actor_free)
        p = plan(lengths, self.dp, RA2PMode.DECOUPLED, self.cfg)
        if not self.started:
            self.started = True
            self.ref_free = self.actor_free = now + self.fill_s
        for mb in p.micro_batches:
            busiest = max(mb.shard_tokens)
            # the Ref stage runs the whole micro-batch on fewer ranks
            ref_t = self.costs.ref_s(mb.tokens / self.ref_ranks)
            ref_done = max(now, self.ref_free) + ref_t
            self.ref_free = ref_done
            fwd_done = max(now, self.actor_free) + self.costs.actor_fwd_s(busiest)
            bwd_t = self.costs.actor_s(busiest) - self.costs.actor_fwd_s(busiest)
            self.actor_free = max(fwd_done, ref_done) + bwd_t
        return self.actor_free


def sequence_lengths(groups) -> List[int]:
    """Trainer tokens of every trajectory in the given core `CompletedGroup`s."""
    return [t.total_tokens for g in groups for t in g.trajectories]
