import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core import (
    MicroBatchTimes,
    RA2PConfig,
    RA2PMode,
    break_even_ras,
    choose_mode,
    colocated_latency,
    colocated_round_size,
    decoupled_latency,
    plan_microbatches,
    should_feed,
    trainer_layout,
)

TIMES = MicroBatchTimes(ref_fwd_s=1.0, actor_fwd_s=1.0, actor_bwd_s=2.0)
CFG = RA2PConfig(swap_cost_s=2.0, pipeline_fill_s=0.5, actors_per_ref=3, aggregation_limit=2)


def test_colocated_latency_all_ready_is_aggregated_rounds():
    # 8 ready, at most 2 per Ref load: 4 rounds x (2 swaps + 2 x 4 s).
    assert colocated_latency(8, 1.0, 8, TIMES, CFG) == pytest.approx(4 * (2 * 2.0 + 2 * 4.0))


def test_colocated_latency_sparse_stream_is_one_round_per_arrival():
    # Nothing ready, one micro-batch every 100 s: each arrives alone; the last at 300 s.
    assert colocated_latency(0, 100.0, 3, TIMES, CFG) == pytest.approx(300 + 2 * 2.0 + 4.0)


def test_decoupled_latency_bounds():
    # D=3 actors, F=1 ref: t_ref = 3 s, t_actor = 3 s, fill = (3 - 1) + 0.5.
    assert decoupled_latency(8, 0.0, 8, TIMES, CFG, dp_size=3) == pytest.approx(2.5 + 8 * 3.0)
    # Arrival-bound: last micro-batch at 7 * 50 s, then Ref (3 s) + backward (2 s) + fill.
    assert decoupled_latency(1, 50.0, 8, TIMES, CFG, dp_size=3) == pytest.approx(350 + 3 + 2 + 0.5)


def test_empty_step_costs_nothing():
    assert decoupled_latency(0, 1.0, 0, TIMES, CFG, 3) == 0.0 == colocated_latency(0, 1.0, 0, TIMES, CFG)


@pytest.mark.parametrize("ras,tprm,expected", [
    (8, 1.0, RA2PMode.DECOUPLED),    # large backlog: swaps dominate colocation
    (0, 0.5, RA2PMode.DECOUPLED),    # fast stream keeps the pipeline fed
    (0, 30.0, RA2PMode.COLOCATED),   # sparse stream would idle a dedicated Ref rank
    (1, 10.0, RA2PMode.COLOCATED),
])
def test_mode_choice_follows_the_paper_regimes(ras, tprm, expected):
    assert choose_mode(ras, tprm, 8, TIMES, CFG, dp_size=4).mode is expected


def test_no_ref_rank_means_colocated():
    assert choose_mode(8, 1.0, 8, TIMES, CFG, dp_size=4, ref_rank_available=False).mode is RA2PMode.COLOCATED


def test_break_even_ras_separates_the_modes():
    be = break_even_ras(10.0, 8, TIMES, CFG, dp_size=4)
    assert 0 < be <= 8
    assert choose_mode(be, 10.0, 8, TIMES, CFG, 4).mode is RA2PMode.DECOUPLED
    assert choose_mode(be - 1, 10.0, 8, TIMES, CFG, 4).mode is RA2PMode.COLOCATED
    assert break_even_ras(0.1, 8, TIMES, CFG, 4) == 0.0
    free_swaps = RA2PConfig(swap_cost_s=0.0, aggregation_limit=100)
    assert break_even_ras(1.0, 8, TIMES, free_swaps, 4) == math.inf


def test_break_even_grows_with_tprm():
    values = [break_even_ras(t, 8, TIMES, CFG, 4) for t in (0.5, 5.0, 10.0, 30.0)]
    assert values == sorted(values)


def test_plan_early_micro_batches_saturate_every_rank_and_final_is_small():
    cfg = RA2PConfig(tokens_per_rank=1000)
    lengths = [900, 800, 700, 600, 500, 400, 300, 200, 100, 50, 40, 30]
    plan = plan_microbatches(lengths, 2, RA2PMode.DECOUPLED, cfg)
    *early, final = plan.micro_batches
    assert early and all(mb.tokens >= 2000 and all(mb.shards) for mb in early)
    assert final.num_sequences == 2 and final.tokens == 70
    assert sorted(i for mb in plan.micro_batches for s in mb.shards for i in s) == list(range(len(lengths)))


def test_plan_with_too_little_work_is_one_micro_batch():
    plan = plan_microbatches([10, 9, 9, 9, 9], 4, RA2PMode.DECOUPLED, RA2PConfig(tokens_per_rank=100))
    assert len(plan.micro_batches) == 1 and plan.micro_batches[0].tokens == 46


def test_plan_shrinks_a_tail_that_outweighs_an_early_micro_batch():
    cfg = RA2PConfig(tokens_per_rank=100)
    plan = plan_microbatches([1000, 900, 900, 900], 2, RA2PMode.DECOUPLED, cfg)
    assert plan.micro_batches[-1].tokens == min(mb.tokens for mb in plan.micro_batches)


def test_colocated_zigzag_balances_rank_totals():
    plan = plan_microbatches({f"s{i}": n for i, n in enumerate([8, 7, 6, 5, 4, 3, 2, 1])}, 2,
                             RA2PMode.COLOCATED, RA2PConfig(tokens_per_rank=10**6))
    # Snake: ranks get 8+5+4+1 and 7+6+3+2.
    assert plan.rank_tokens == (18, 18)
    assert plan.feed_order(0) == ["s0", "s3", "s4", "s7"]


def test_decoupled_feeds_the_globally_smallest_sequence_last():
    lengths = {f"s{i}": n for i, n in enumerate([300, 50, 700, 20, 900, 400, 10, 800])}
    plan = plan_microbatches(lengths, 2, RA2PMode.DECOUPLED, RA2PConfig(tokens_per_rank=500))
    last = plan.micro_batches[-1]
    assert "s6" in {s[-1] for s in last.shards if s}
    assert [mb.tokens for mb in plan.micro_batches[:-1]] == sorted((mb.tokens for mb in plan.micro_batches[:-1]), reverse=True)


def test_plan_is_deterministic_and_validates():
    a = plan_microbatches([5, 5, 5, 5, 5], 2, RA2PMode.COLOCATED, RA2PConfig(tokens_per_rank=5))
    b = plan_microbatches([5, 5, 5, 5, 5], 2, RA2PMode.COLOCATED, RA2PConfig(tokens_per_rank=5))
    assert a == b
    assert plan_microbatches([], 2, RA2PMode.COLOCATED, RA2PConfig()).micro_batches == ()
    with pytest.raises(ValueError):
        plan_microbatches([1], 0, RA2PMode.COLOCATED, RA2PConfig())
    with pytest.raises(ValueError):
        RA2PConfig(aggregation_limit=0)


lengths_st = st.lists(st.integers(1, 4096), min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, dp=st.integers(1, 8), per_rank=st.integers(64, 8192), final_per_rank=st.integers(1, 3))
def test_zigzag_balance_bound(lengths, dp, per_rank, final_per_rank):
    cfg = RA2PConfig(tokens_per_rank=per_rank, final_sequences_per_rank=final_per_rank)
    col = plan_microbatches(lengths, dp, RA2PMode.COLOCATED, cfg)
    assert col.imbalance <= max(lengths)
    if len(lengths) % dp == 0 and len(col.micro_batches) == 1:
        assert col.imbalance <= max(lengths) - min(lengths)
    dec = plan_microbatches(lengths, dp, RA2PMode.DECOUPLED, cfg)
    for mb in dec.micro_batches:
        own = [lengths[i] for s in mb.shards for i in s]
        assert max(mb.shard_tokens) - min(mb.shard_tokens) <= max(own)
    for plan in (col, dec):  # every sequence exactly once, tokens preserved
        ids = [i for mb in plan.micro_batches for s in mb.shards for i in s]
        assert sorted(ids) == list(range(len(lengths)))
        assert sum(plan.rank_tokens) == sum(lengths)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, dp=st.integers(1, 8), per_rank=st.integers(64, 8192))
def test_zigzag_also_balances_attention_cost(lengths, dp, per_rank):
    """Packed micro-batches attend per trajectory, so a rank's attention work is the sum of its
    squared lengths. The snake deals by position over the length-descending order, and the
    balance argument holds for any non-increasing weights: squared lengths differ by at most the
    largest square, as tokens do by the largest length."""
    plan = plan_microbatches(lengths, dp, RA2PMode.COLOCATED, RA2PConfig(tokens_per_rank=per_rank))
    squares = [sum(lengths[i] ** 2 for mb in plan.micro_batches for i in mb.shards[r]) for r in range(dp)]
    assert max(squares) - min(squares) <= max(lengths) ** 2


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, dp=st.integers(1, 8), per_rank=st.integers(64, 8192), final_per_rank=st.integers(1, 3))
def test_decoupled_last_micro_batch_is_the_smallest(lengths, dp, per_rank, final_per_rank):
    cfg = RA2PConfig(tokens_per_rank=per_rank, final_sequences_per_rank=final_per_rank)
    plan = plan_microbatches(lengths, dp, RA2PMode.DECOUPLED, cfg)
    tokens = [mb.tokens for mb in plan.micro_batches]
    assert tokens[-1] == min(tokens)
    # The globally smallest sequence is the last one fed on its rank.
    smallest = min(range(len(lengths)), key=lambda i: (lengths[i], -i))
    assert any(s and lengths[s[-1]] == lengths[smallest] for s in plan.micro_batches[-1].shards)
    # Early micro-batches give every rank work whenever there is more than one micro-batch.
    for mb in plan.micro_batches[:-1]:
        assert all(mb.shards) and mb.tokens >= per_rank * dp
    # Each rank's shard is fed longest first.
    for mb in plan.micro_batches:
        for s in mb.shards:
            assert [lengths[i] for i in s] == sorted((lengths[i] for i in s), reverse=True)


def test_unlimited_aggregation_serves_the_whole_backlog_in_one_round():
    unlimited = RA2PConfig(swap_cost_s=2.0, aggregation_limit=None)
    assert colocated_latency(8, 1.0, 8, TIMES, unlimited) == pytest.approx(2 * 2.0 + 8 * 4.0)
    with pytest.raises(ValueError):
        RA2PConfig(aggregation_limit=0)


def test_colocated_round_size_trades_swaps_against_waiting():
    cfg = RA2PConfig(swap_cost_s=2.0, aggregation_limit=None)
    # a stream slower than compute: waiting for a fuller round only delays the end of the step
    assert colocated_round_size(0, 20.0, 6, TIMES, cfg) == 1
    # a fast stream and dear swaps: a round started on the first arrival costs a swap pair the
    # backlog would have amortised; waiting for the whole step is fastest
    dear = RA2PConfig(swap_cost_s=5.0, aggregation_limit=None)
    k = colocated_round_size(0, 1.0, 8, TIMES, dear)
    assert k == 8
    assert colocated_latency(0, 1.0, 8, TIMES, dear, min_round=k) < colocated_latency(0, 1.0, 8, TIMES, dear)
    with pytest.raises(ValueError):
        colocated_latency(0, 4.0, 12, TIMES, cfg, min_round=0)


def test_trainer_layout_converts_tokens_with_its_own_micro_batch():
    cfg = RA2PConfig(tokens_per_rank=1000, swap_cost_s=2.0, pipeline_fill_s=0.5)
    # 8 ranks: colocated micro-batch 8000 tokens, decoupled (6 actors + 2 refs) 6000
    lay = trainer_layout(8, ras_tokens=48_000, arrival_tokens_per_s=0.0, step_tokens=48_000, times=TIMES, cfg=cfg)
    assert lay.mode is RA2PMode.DECOUPLED and (lay.actor_ranks, lay.ref_ranks) == (6, 2)
    assert lay.latency_colocated_s == pytest.approx(colocated_latency(6, math.inf, 6, TIMES, cfg))
    assert lay.latency_decoupled_s == pytest.approx(decoupled_latency(8, math.inf, 8, TIMES, cfg, 6, 2))
    one = trainer_layout(1, ras_tokens=0, arrival_tokens_per_s=100.0, step_tokens=4000, times=TIMES, cfg=cfg)
    assert one.mode is RA2PMode.COLOCATED and one.latency_decoupled_s == math.inf


@pytest.mark.parametrize("mode,ready,idle,last,k,expected", [
    (RA2PMode.DECOUPLED, 3999, False, False, 1, False),   # accumulate: the actor is still busy
    (RA2PMode.DECOUPLED, 4000, False, False, 1, True),    # one saturating micro-batch (4 x 1000)
    (RA2PMode.DECOUPLED, 500, True, False, 1, True),      # the actor would idle: feed what is there
    (RA2PMode.DECOUPLED, 500, False, True, 1, True),      # the rest of the step
    (RA2PMode.COLOCATED, 4000, True, False, 2, False),    # a round waits for its size...
    (RA2PMode.COLOCATED, 8000, True, False, 2, True),
    (RA2PMode.COLOCATED, 100, True, True, 2, True),       # ...or for the end of the step
    (RA2PMode.COLOCATED, 0, True, True, 1, False),
])
def test_should_feed_paces_a_step_just_in_time(mode, ready, idle, last, k, expected):
    cfg = RA2PConfig(tokens_per_rank=1000)
    assert should_feed(mode, ready, 4, cfg, trainer_idle=idle, completes_step=last, round_micro_batches=k) is expected


def test_a_mode_whose_latency_ran_long_stops_winning_near_ties():
    from tide_megatron.core import LatencyCorrection

    cfg = RA2PConfig(tokens_per_rank=1000, swap_cost_s=1.0, pipeline_fill_s=0.0)
    kw = dict(ras_tokens=20_000, arrival_tokens_per_s=4000.0, step_tokens=80_000, times=TIMES, cfg=cfg)
    plain = trainer_layout(8, **kw)
    margin = plain.latency_colocated_s / plain.latency_decoupled_s
    assert plain.mode is RA2PMode.DECOUPLED and 1.0 < margin < 1.1  # a near-tie
    correction = LatencyCorrection()
    assert trainer_layout(8, correction=correction, **kw) == plain  # nothing measured: the model alone
    # decoupled steps ran 10% over their prediction: the near-tie goes to colocated
    correction.observe(RA2PMode.DECOUPLED, 100.0, 100.0 * margin * 1.1)
    corrected = trainer_layout(8, correction=correction, **kw)
    assert corrected.mode is RA2PMode.COLOCATED
    # reported latencies stay the model's own: what the next measurement is judged against
    assert (corrected.latency_colocated_s, corrected.latency_decoupled_s) == \
        (plain.latency_colocated_s, plain.latency_decoupled_s)
    # choose_mode compares costs scaled by the same factors
    args = (0, 0.0, 8, TIMES, CFG, 3)
    assert choose_mode(*args).mode is RA2PMode.DECOUPLED
    c = choose_mode(*args)
    slow = LatencyCorrection()
    slow.observe(RA2PMode.DECOUPLED, 1.0, 1.01 * c.cost_colocated / c.cost_decoupled)
    flipped = choose_mode(*args, correction=slow)
    assert flipped.mode is RA2PMode.COLOCATED and flipped.cost_decoupled == c.cost_decoupled


def test_decoupled_wins_only_a_lead_larger_than_the_measured_error():
    from tide_megatron.core import LatencyCorrection

    cfg = RA2PConfig(tokens_per_rank=1000, swap_cost_s=1.0, pipeline_fill_s=0.0)
    kw = dict(ras_tokens=20_000, arrival_tokens_per_s=4000.0, step_tokens=80_000, times=TIMES, cfg=cfg)
    plain = trainer_layout(8, **kw)
    lead = plain.latency_colocated_s / plain.latency_decoupled_s - 1.0
    assert plain.mode is RA2PMode.DECOUPLED and 0.0 < lead < 0.1
    # colocated steps measured on average as predicted, but single steps strayed by more than
    # decoupled's lead: decoupled, never run, is taken to be no better known, and loses
    erratic = LatencyCorrection(alpha=0.5)
    erratic.observe(RA2PMode.COLOCATED, 10.0, 10.0 * (1 + 2 * lead))
    erratic.observe(RA2PMode.COLOCATED, 10.0, 10.0 * (1 - 2 * lead))
    assert erratic.factor(RA2PMode.COLOCATED) == pytest.approx(1.0)
    assert erratic.deviation(RA2PMode.DECOUPLED) == erratic.deviation(RA2PMode.COLOCATED) > lead
    assert trainer_layout(8, correction=erratic, **kw).mode is RA2PMode.COLOCATED
    # the same average with steps that stray less than the lead: the model's choice stands
    steady = LatencyCorrection(alpha=0.5)
    steady.observe(RA2PMode.COLOCATED, 10.0, 10.0 * (1 + lead / 8))
    steady.observe(RA2PMode.COLOCATED, 10.0, 10.0 * (1 - lead / 8))
    assert trainer_layout(8, correction=steady, **kw).mode is RA2PMode.DECOUPLED


def test_latency_deviation_is_smoothed_from_the_models_own_error():
    from tide_megatron.core import LatencyCorrection

    c = LatencyCorrection(alpha=0.5)
    assert c.deviation(RA2PMode.COLOCATED) == 0.0  # nothing measured: the model alone
    c.observe(RA2PMode.COLOCATED, 10.0, 12.0)  # 0.2 from the model alone (factor 1)
    assert c.deviation(RA2PMode.COLOCATED) == pytest.approx(0.2)
    c.observe(RA2PMode.COLOCATED, 10.0, 12.0)  # on the smoothed ratio: no error
    assert c.deviation(RA2PMode.COLOCATED) == pytest.approx(0.1)
    c.observe(RA2PMode.DECOUPLED, 10.0, 10.5)
    assert c.deviation(RA2PMode.DECOUPLED) == pytest.approx(0.05)  # measured: its own


def test_latency_correction_smooths_and_ignores_what_it_cannot_judge():
    from tide_megatron.core import LatencyCorrection

    c = LatencyCorrection(alpha=0.5)
    assert c.factor(RA2PMode.COLOCATED) == 1.0
    c.observe(RA2PMode.COLOCATED, 10.0, 20.0)
    assert c.factor(RA2PMode.COLOCATED) == 2.0
    c.observe(RA2PMode.COLOCATED, 10.0, 10.0)
    assert c.factor(RA2PMode.COLOCATED) == 1.5
    for predicted, measured in ((math.nan, 5.0), (math.inf, 5.0), (0.0, 5.0), (10.0, 0.0)):
        c.observe(RA2PMode.DECOUPLED, predicted, measured)
    assert c.factor(RA2PMode.DECOUPLED) == 1.0
