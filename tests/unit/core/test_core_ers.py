import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core import (
    CTBConfig,
    CTBScheduler,
    ERSConfig,
    ERSController,
    ERSMeasurements,
    MicroBatchTimes,
    RA2PConfig,
    RA2PMode,
    Role,
    RolePlan,
    RolloutTask,
    TaskState,
)

R, A, F, AR = Role.ROLLOUT, Role.ACTOR, Role.REF, Role.ACTOR_REF
TIMES = MicroBatchTimes(ref_fwd_s=1.0, actor_fwd_s=1.0, actor_bwd_s=2.0)
RA2P = RA2PConfig(tokens_per_rank=1000, swap_cost_s=2.0, pipeline_fill_s=0.5)


def plan_of(roles, mode=RA2PMode.COLOCATED):
    return RolePlan(dict(enumerate(roles)), mode)


def measure(*, trainer, rollout, trained=10_000, busy=10.0, starved=0.0, fresh=10_000, eval_tokens=0,
            slots_full=0.0, kv=0.2, window=10.0, ras=0.0, rate=0.0, slowdown=1.0, decode_seq=0.0, tasks=0.0,
            rollout_busy=0.0, rollout_resized=False):
    return ERSMeasurements(window_s=window, trainer_ranks=trainer, trainer_busy_s=busy, trainer_starved_s=starved,
                           trained_tokens=trained, rollout_ranks=rollout, fresh_tokens=fresh, eval_tokens=eval_tokens,
                           slots_full_s=slots_full, kv_used_fraction=kv, ras_tokens=ras, arrival_tokens_per_s=rate,
                           decode_iteration_s=0.01 * slowdown, decode_floor_s=0.01, decode_seq_s=decode_seq,
                           tasks_in_flight_s=tasks, rollout_busy_s=rollout_busy, rollout_resized=rollout_resized)


def controller(world, **kw):
    return ERSController(ERSConfig(**kw), world, RA2P)


def test_initial_plan_is_the_given_share_colocated():
    p = controller(8).initial_plan(0.5)
    assert p.mode is RA2PMode.COLOCATED and p.rollout_ranks == [4, 5, 6, 7] and p.trainer_ranks == [0, 1, 2, 3]


def test_rate_balance_moves_one_rank_toward_the_target():
    ers = controller(8)
    cur = plan_of([AR, AR, AR, AR, R, R, R, R])
    # trainer: 10k tokens per 4 ranks x 10 s = 250/rank-s; rollout: 10k per 4 x 10 = 250 -> R* = 4
    same = ers.plan(cur, measure(trainer=4, rollout=4), TIMES, step=0)
    assert not same.changed and same.extras["target_rollout_ranks"] == pytest.approx(4.0)
    ers = controller(8)
    # rollout three times faster per rank than the trainer: R* = 8 * 250 / (250 + 750) = 2
    nxt = ers.plan(cur, measure(trainer=4, rollout=4, fresh=30_000), TIMES, step=0)
    assert nxt.changed and len(nxt.rollout_ranks) == 3  # one rank per step
    assert nxt.extras["target_rollout_ranks"] == pytest.approx(2.0)
    assert nxt.ranks_leaving_rollout(cur) == [7]  # least loaded (all 0) -> highest id


def test_a_window_opened_by_a_rollout_resize_measures_the_trainer_only_and_holds_the_split():
    """After the cold-start loan ends, the groups its lent ranks rolled out complete on the two
    rollout ranks left (31k tokens), and the admission slots they filled stay full (10 s of 10)
    while the trainer works off its backlog unstarved: the window-full rule reads that as a
    rollout with a rank to spare and, as from a clean window, would move 2 -> 1. The window is
    read for the trainer's rate only, and the split held."""
    ers = controller(8, cooldown_steps=0)
    cur = plan_of([AR] * 6 + [R] * 2)
    after_loan = measure(trainer=6, rollout=2, trained=15_000, fresh=30_000, eval_tokens=1_000, slots_full=10.0)
    assert len(controller(8).plan(cur, after_loan, TIMES, step=1).rollout_ranks) == 1  # as a clean window
    held = ers.plan(cur, dataclasses.replace(after_loan, rollout_resized=True), TIMES, step=1)
    assert not held.changed and held.reason.startswith("split held: the rollout ranks changed")
    assert ers.trainer_rate == pytest.approx(250.0) and ers.rollout_rate is None and ers.shares is None
    # a clean window measures the rest: r_r = 10k / (2 x 10 s) = 500 -> R* = 8 * 250 / 750 = 2.7
    clean = ers.plan(cur, measure(trainer=6, rollout=2, trained=15_000, fresh=10_000), TIMES, step=2)
    assert ers.rollout_rate == pytest.approx(500.0) and clean.extras["target_rollout_ranks"] == pytest.approx(2.67, abs=0.01)
    assert len(clean.rollout_ranks) == 3
    # the window after that move: what it reads of rollout is not kept, and no second move
    # follows on the evidence the first one acted on (no cooldown here to hold it)
    shares = dict(ers.shares)
    after_move = ers.plan(clean, measure(trainer=5, rollout=3, trained=12_500, fresh=90_000, slots_full=10.0,
                                         rollout_resized=True), TIMES, step=3)
    assert not after_move.changed and ers.rollout_rate == pytest.approx(500.0) and ers.shares == shares


@given(st.integers(3, 12), st.lists(st.sampled_from(["up", "down"]), min_size=1, max_size=12))
def test_reclaim_lowest_keeps_the_trainer_a_prefix(world, moves):
    """With reclaim="lowest" the trainer ranks are always 0..T-1, whichever way the split moves,
    and Ref ranks are the highest of them (the real system's process groups need this)."""
    ers = controller(world, reclaim="lowest", cooldown_steps=0)
    plan = ers.initial_plan(0.5)
    for step, move in enumerate(moves):
        r = len(plan.rollout_ranks)
        # rollout far faster per rank than the trainer pulls ranks to the trainer, and vice versa
        fresh, trained = (90_000, 1_000) if move == "up" else (1_000, 90_000)
        plan = ers.plan(plan, measure(trainer=world - r, rollout=r, fresh=fresh, trained=trained), TIMES,
                        step=step, rollout_load={k: float(world - k) for k in plan.rollout_ranks})
        trainer = plan.trainer_ranks
        assert trainer == list(range(len(trainer))), plan.roles
        if plan.mode is RA2PMode.DECOUPLED:
            assert plan.ref_ranks == trainer[len(trainer) - len(plan.ref_ranks):]


@settings(max_examples=60, deadline=None)
@given(block=st.sampled_from([2, 4]), blocks=st.integers(2, 6), spare=st.integers(0, 3),
       moves=st.lists(st.sampled_from(["up", "down", "full", "eval"]), min_size=1, max_size=12))
def test_tp_blocks_move_whole_and_the_trainer_stays_a_prefix_of_blocks(block, blocks, spare, moves):
    """With rank_block = the trainer's TP size, every split ERS plans (rate balance, a throttled
    window, an evaluation loan) moves whole blocks, one per step, and keeps the trainer a
    prefix of whole blocks, never below one block."""
    world = block * blocks + spare  # spare ranks past the last whole block only roll out
    ers = controller(world, reclaim="lowest", cooldown_steps=0, rank_block=block, min_trainer_ranks=block)
    plan = plan_of([AR] * block + [R] * (world - block))
    for step, move in enumerate(moves):
        r = len(plan.rollout_ranks)
        fresh, trained, full = {"up": (90_000, 1_000, 0.0), "down": (1_000, 90_000, 0.0),
                                "full": (10_000, 10_000, 9.5), "eval": (10_000, 10_000, 0.0)}[move]
        nxt = ers.plan(plan, measure(trainer=world - r, rollout=r, fresh=fresh, trained=trained, slots_full=full,
                                     kv=0.05, ras=40_000 if move == "up" else 0.0, rate=5_000), TIMES, step=step)
        assert abs(len(nxt.rollout_ranks) - r) in (0, block)
        for p in (nxt, ers.preemptive_plan(nxt, keep_trainer_ranks=ers.eval_trainer_ranks(3.0), reason="eval")):
            trainer = p.trainer_ranks
            assert trainer == list(range(len(trainer))) and len(trainer) % block == 0 and len(trainer) >= block
            assert len(p.ref_ranks) % block == 0  # a reference rank runs the model at the trainer's TP size
        plan = nxt


def test_rank_blocks_need_the_prefix_layout_and_whole_minimum_blocks():
    with pytest.raises(ValueError, match="reclaim='lowest'"):
        ERSConfig(rank_block=2, min_trainer_ranks=2)
    with pytest.raises(ValueError, match="divide"):
        ERSConfig(rank_block=2, min_trainer_ranks=3, reclaim="lowest")


def test_reclaim_must_be_known():
    with pytest.raises(ValueError, match="reclaim"):
        ERSConfig(reclaim="random")


def test_deadband_holds_a_near_balance():
    ers = controller(8, deadband=0.02)
    cur = plan_of([AR] * 4 + [R] * 4)
    # R* = 8 * 250 / (250 + 270) = 3.85; 3 rollout ranks would predict min(810, 1250) < min(1080, 1000)
    p = ers.plan(cur, measure(trainer=4, rollout=4, fresh=10_800), TIMES, step=0)
    assert not p.changed and p.extras["target_rollout_ranks"] == pytest.approx(3.85, abs=0.01)


def test_throttled_rollout_with_small_batches_and_busy_trainer_is_over_provisioned():
    cur = plan_of([AR] * 4 + [R] * 4)
    p = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, kv=0.1, slowdown=1.1), TIMES, step=0)
    assert len(p.rollout_ranks) == 3 and "over-provisioned" in p.reason
    # the same throttle with a full KV pool: the rollout has no room to absorb a rank
    p = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, kv=0.8), TIMES, step=0)
    assert not p.changed
    # or with decode already slowed by its batches: a rank less would slow every trajectory
    p = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, kv=0.1, slowdown=1.6), TIMES, step=0)
    assert not p.changed


def test_idle_engines_under_a_busy_trainer_give_a_block_whatever_the_decode_batches():
    """Engines that computed half their time had nothing to run the other half: with the
    trainer never starved, a block leaves rollout, throttled or not, even with decode slowed
    by its batches (the window-full rule's small-batch test would keep it)."""
    cur = plan_of([AR] * 4 + [R] * 4)
    for slots_full in (0.0, 8.0):
        p = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=slots_full, slowdown=1.6,
                                            rollout_busy=20.0), TIMES, step=0)
        assert len(p.rollout_ranks) == 3 and "engines busy 50%" in p.reason
    # busy 70%: the three left would compute 93% of their time, above the 90% headroom
    p = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, slowdown=1.6, rollout_busy=28.0),
                           TIMES, step=0)
    assert not p.changed and "staleness bound" in p.reason
    # a starved trainer keeps its demand on rollout: idle engines are no reason to shrink it
    p = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, starved=5.0, busy=5.0, slowdown=1.01,
                                        rollout_busy=20.0), TIMES, step=0)
    assert not p.changed


def test_a_rollout_idle_for_want_of_work_is_not_grown_by_the_rates():
    """Rollout three times slower per rank than the trainer asks for more ranks by the rates
    (R* = 6 of 8); but its engines computed 60% of the time: the work, not the ranks, limited
    its delivery, so a rank more is predicted to deliver no more and the split is held."""
    cur = plan_of([AR] * 4 + [R] * 4)
    starved = dict(trainer=4, rollout=4, fresh=3_333, trained=3_333, busy=3.3, starved=6.7)
    grown = controller(8).plan(cur, measure(**starved), TIMES, step=0)
    assert len(grown.rollout_ranks) == 5  # not measured: read as always busy, as before
    held = controller(8).plan(cur, measure(**starved, rollout_busy=24.0), TIMES, step=0)
    assert not held.changed and "engines busy 60%" in held.reason
    assert held.extras["target_rollout_ranks"] == pytest.approx(6.0, abs=0.05)


def test_busy_share_is_read_from_the_rollout_ranks_time():
    assert measure(trainer=4, rollout=4).rollout_busy_share == 1.0  # not measured
    assert measure(trainer=4, rollout=4, rollout_busy=10.0).rollout_busy_share == pytest.approx(0.25)
    assert measure(trainer=4, rollout=4, rollout_busy=50.0).rollout_busy_share == 1.0
    with pytest.raises(ValueError):
        measure(trainer=4, rollout=4, rollout_busy=-1.0)
    with pytest.raises(ValueError):
        ERSConfig(busy_headroom=0.0)


def test_throttled_and_starved_grows_rollout_only_when_batching_slows_the_trajectories():
    cur = plan_of([AR] * 4 + [R] * 4)
    slow = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, starved=5.0, busy=5.0,
                                           slowdown=1.6), TIMES, step=0)
    assert len(slow.rollout_ranks) == 5 and "decode batching" in slow.reason
    fast = controller(8).plan(cur, measure(trainer=4, rollout=4, slots_full=8.0, starved=5.0, busy=5.0,
                                           slowdown=1.01), TIMES, step=0)
    assert not fast.changed and "staleness bound" in fast.reason


def test_trajectory_slowdown_stretches_only_the_decode_share_of_the_tasks():
    # decode 2x its floor over all of the task time: the tasks are 2x slower too
    assert measure(trainer=1, rollout=1, slowdown=2.0, decode_seq=10.0, tasks=10.0).trajectory_slowdown == \
        pytest.approx(2.0)
    # a fifth of the task time in decode at 2x: 10 s of task time, 1 s of it batching's -> 10/9
    assert measure(trainer=1, rollout=1, slowdown=2.0, decode_seq=2.0, tasks=10.0).trajectory_slowdown == \
        pytest.approx(10 / 9)
    # task time not measured: the tasks are taken as all decode
    assert measure(trainer=1, rollout=1, slowdown=1.6).trajectory_slowdown == pytest.approx(1.6)
    # decode at its floor (or faster, by noise) slows nothing
    assert measure(trainer=1, rollout=1, slowdown=0.9, decode_seq=5.0, tasks=10.0).trajectory_slowdown == \
        pytest.approx(0.9)
    with pytest.raises(ValueError):
        measure(trainer=1, rollout=1, tasks=-1.0)


def test_a_starved_trainer_gives_a_rank_only_with_slack_and_only_to_trajectories_batching_slows():
    """The window is full and the trainer starves in every case; decode runs 1.6x its floor."""
    cur = plan_of([AR] * 2 + [R] * 2)

    def plan(busy, starved, decode_seq):
        return controller(4).plan(cur, measure(trainer=2, rollout=2, slots_full=8.0, starved=starved, busy=busy,
                                               slowdown=1.6, decode_seq=decode_seq, tasks=40.0), TIMES, step=0)

    # The long-tailed env case: busy 80% of its time on 2 ranks, the trainer would keep up with
    # only 0.5 / 0.8 of the throughput on one, and decode is a tenth of the tasks' time (they
    # run 1.04x their floor): the rank would wait on the env with the others. Held.
    long_tail = plan(busy=8.0, starved=2.0, decode_seq=4.0)
    assert not long_tail.changed and "staleness bound" in long_tail.reason
    assert long_tail.extras["trajectory_slowdown"] == pytest.approx(40 / (40 - 4 * 0.375))
    # decode-bound trajectories do not change that: the trainer has no rank to spare
    assert not plan(busy=8.0, starved=2.0, decode_seq=40.0).changed
    # a trainer busy 40% of its time keeps up on one rank (1.25x): decode-bound trajectories
    # (1.6x their floor) get the rank...
    grown = plan(busy=4.0, starved=6.0, decode_seq=40.0)
    assert len(grown.rollout_ranks) == 3 and "decode batching" in grown.reason
    # ...trajectories that batching slows by under the deadband (1.9%) do not
    assert not plan(busy=4.0, starved=6.0, decode_seq=2.0).changed


def test_cooldown_holds_the_split_for_a_step_after_a_move():
    ers = controller(8, cooldown_steps=1)
    cur = plan_of([AR] * 4 + [R] * 4)
    over = measure(trainer=4, rollout=4, slots_full=8.0, kv=0.1)
    cur = ers.plan(cur, over, TIMES, step=0)
    assert len(cur.rollout_ranks) == 3
    held = ers.plan(cur, measure(trainer=5, rollout=3, slots_full=8.0, kv=0.1), TIMES, step=1)
    assert not held.changed and "cooldown" in held.reason
    assert len(ers.plan(held, measure(trainer=5, rollout=3, slots_full=8.0, kv=0.1), TIMES, step=2).rollout_ranks) == 2


def test_limits_are_respected():
    cur = plan_of([AR, R, R, R])
    ers = controller(4, min_trainer_ranks=1, min_rollout_ranks=3)
    # wants more trainer, but rollout is at its minimum
    assert not ers.plan(cur, measure(trainer=1, rollout=3, slots_full=9.0, kv=0.1), TIMES, step=0).changed
    ers = controller(4, max_moves_per_step=2, rate_ewma_alpha=1.0)
    p = ers.plan(plan_of([AR, AR, AR, R]), measure(trainer=3, rollout=1, fresh=1_000), TIMES, step=0)
    assert len(p.rollout_ranks) == 3  # two moves at once when allowed
    ers = controller(4, enabled=False)
    assert not ers.plan(cur, measure(trainer=1, rollout=3, fresh=1), TIMES, step=0).changed


def test_layout_decouples_a_backlog_and_colocates_a_sparse_stream_when_swaps_are_cheap():
    cur = plan_of([AR] * 4 + [R] * 4)
    # balanced rates keep 4 trainer ranks; 8 micro-batches ready at start, fast arrivals
    backlog = controller(8).plan(cur, measure(trainer=4, rollout=4, ras=32_000, rate=40_000), TIMES, step=0)
    assert backlog.mode is RA2PMode.DECOUPLED and backlog.ranks_with(F) == [3] and backlog.ranks_with(A) == [0, 1, 2]
    assert backlog.extras["latency_decoupled_s"] < backlog.extras["latency_colocated_s"]
    # a sparse stream is arrival-bound either way; a swap cheaper than the pipeline fill and the
    # actor rank a Ref would take make colocation the faster layout
    cheap = ERSController(ERSConfig(), 8, RA2PConfig(tokens_per_rank=1000, swap_cost_s=0.1, pipeline_fill_s=0.5))
    sparse = cheap.plan(cur, measure(trainer=4, rollout=4, ras=0, rate=100), TIMES, step=0)
    assert sparse.mode is RA2PMode.COLOCATED and sparse.trainer_ranks == [0, 1, 2, 3]
    # the caller's measured cost model wins over the one given at construction: with swaps
    # measured at 20 s, the same controller decouples the same sparse stream
    measured = RA2PConfig(tokens_per_rank=1000, swap_cost_s=20.0, pipeline_fill_s=0.5)
    dear = cheap.plan(cur, measure(trainer=4, rollout=4, ras=0, rate=100), TIMES, step=1, ra2p=measured)
    assert dear.mode is RA2PMode.DECOUPLED


def test_preemptive_plan_lends_trainer_ranks_and_eval_keeps_what_the_step_needs():
    ers = controller(8, min_trainer_ranks=1)
    base = plan_of([A, A, F, R, R, R, R, R], RA2PMode.DECOUPLED)
    cold = ers.preemptive_plan(base, keep_trainer_ranks=1, reason="cold start")
    assert cold.trainer_ranks == [0] and cold.roles[0] is AR and cold.mode is RA2PMode.COLOCATED
    assert "preemptive" in cold.reason
    assert ers.eval_trainer_ranks(10.0) == 8  # nothing measured: no loan
    ers.plan(base, measure(trainer=3, rollout=5, trained=30_000, busy=10.0, fresh=30_000), TIMES, step=0)
    # 1000 tokens per trainer rank-s; a 30k-token step within a 20 s evaluation needs 2 ranks
    assert ers.eval_trainer_ranks(20.0) == 2


def test_measurement_validation():
    with pytest.raises(ValueError):
        measure(trainer=1, rollout=1, window=0.0)
    with pytest.raises(ValueError):
        measure(trainer=1, rollout=1, slots_full=-1.0)
    with pytest.raises(ValueError):
        ERSConfig(slots_full_fraction=0.0)
    with pytest.raises(ValueError):
        controller(2, min_rollout_ranks=2, min_trainer_ranks=1)


class Plant:
    """A pipeline whose best split is known: rollout delivers r_r tokens/s per rank, the trainer
    consumes r_t per rank; the slower side sets the throughput. When rollout is faster its
    admission slots fill (the throttle) in proportion to the surplus and its KV stays light;
    when the trainer is faster it starves in proportion to the shortfall."""

    def __init__(self, world, r_t, r_r, window=10.0):
        self.world, self.r_t, self.r_r, self.window = world, r_t, r_r, window

    def best_rollout(self):
        return min(range(1, self.world), key=lambda r: -min(r * self.r_r, (self.world - r) * self.r_t))

    def measure(self, n_roll):
        t = self.world - n_roll
        supply, demand = n_roll * self.r_r, t * self.r_t
        x = min(supply, demand)
        w = self.window
        # a busier rollout runs bigger decode batches: more KV, slower iterations
        return measure(trainer=t, rollout=n_roll, trained=round(x * w), busy=w * x / demand,
                       starved=w * (1 - x / demand), fresh=round(x * w), slots_full=w * (1 - x / supply),
                       kv=0.3 * x / supply, window=w, slowdown=1 + 0.6 * x / supply)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(12, 32), ratio=st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]), start=st.floats(0.05, 0.95))
def test_ers_converges_to_the_best_split_from_either_side(world, ratio, start):
    plant = Plant(world, r_t=1000.0, r_r=1000.0 * ratio)
    best = plant.best_rollout()
    ers = controller(world)
    cur = ers.initial_plan(start)
    seen = []
    for step in range(6 * world):
        cur = ers.plan(cur, plant.measure(len(cur.rollout_ranks)), TIMES, step=step)
        seen.append(len(cur.rollout_ranks))
    # settles within one rank of the best split and stays there
    assert all(abs(r - best) <= 1 for r in seen[-world:]), (best, seen)
    gp = [min(r * plant.r_r, (world - r) * plant.r_t) for r in seen[-world:]]
    assert min(gp) >= 0.8 * min(best * plant.r_r, (world - best) * plant.r_t)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 12), seq=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)), max_size=30),
       moves=st.integers(1, 2), min_roll=st.integers(0, 2), min_train=st.integers(1, 2))
def test_random_measurements_give_legal_bounded_plans(world, seq, moves, min_roll, min_train):
    if world < max(1, min_roll) + min_train:
        return
    ers = controller(world, max_moves_per_step=moves, min_rollout_ranks=min_roll, min_trainer_ranks=min_train)
    cur = ers.initial_plan(0.5)
    for step, (full, starve, kv) in enumerate(seq):
        t, r = len(cur.trainer_ranks), len(cur.rollout_ranks)
        m = measure(trainer=t, rollout=r, slots_full=10 * full, starved=10 * starve, busy=10 * (1 - starve),
                    kv=kv, fresh=int(20_000 * kv) + 1)
        nxt = ers.plan(cur, m, TIMES, step=step)
        assert set(nxt.roles) == set(range(world))
        assert abs(len(nxt.rollout_ranks) - r) <= moves
        assert len(nxt.actor_ranks) >= min_train and len(nxt.rollout_ranks) >= max(1, min_roll)
        cur = nxt


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), world=st.integers(3, 8))
def test_role_changes_never_lose_a_rollout_task(seed, world):
    """ERS plans drive CTB rank membership: every task stays queued, running, paused or finished."""
    rng = random.Random(seed)
    ers = controller(world, min_rollout_ranks=1)
    plan = ers.initial_plan(0.5)
    ctb = CTBScheduler(CTBConfig(rank_token_budget=8000, env_concurrency=64, trainer_batch_trajectories=64,
                                 probe_turn_reserve_tokens=300), plan.rollout_ranks)
    tasks = [RolloutTask(f"{g}/{i}", g, "t", 200) for g in range(12) for i in range(4)]
    ctb.submit(tasks)
    finished = set()
    for step in range(30):
        for _ in range(rng.randint(1, 8)):
            ctb.schedule(float(step))
            running = ctb.tasks_in(TaskState.RUNNING)
            if running:
                tid = rng.choice(running)
                if rng.random() < 0.3:
                    ctb.on_task_finished(tid)
                    finished.add(tid)
                else:
                    ctb.on_turn_finished(tid, rng.randint(200, 2500))
        t, r = len(plan.trainer_ranks), len(plan.rollout_ranks)
        m = measure(trainer=t, rollout=r, fresh=rng.choice([1_000, 10_000, 100_000]),
                    slots_full=rng.choice([0.0, 9.0]), kv=rng.random())
        nxt = ers.plan(plan, m, TIMES, step=step, rollout_load={k: ctb.rank_usage(k)[0] for k in plan.rollout_ranks})
        for k in nxt.ranks_leaving_rollout(plan):
            held = set(ctb.residents(k))
            back = {q.task.task_id for q in ctb.remove_rank(k)}
            assert back == held and all(ctb.status(x).state is TaskState.PAUSED for x in held)
        for k in nxt.ranks_joining_rollout(plan):
            ctb.add_rank(k)
        ctb.on_weight_sync()
        plan = nxt
        assert ctb.ranks == plan.rollout_ranks
        states = {s: set(ctb.tasks_in(s)) for s in TaskState}
        assert sum(map(len, states.values())) == len(tasks)
        assert states[TaskState.FINISHED] == finished
        assert ctb.audit() == []


def _payoff_run(trained_after: int, hold: int = 5, ras_after: float = 0.0, streaks: bool = False):
    """A move from 4 to 3 rollout ranks (rate balance), then clean windows training
    `trained_after` tokens each with `ras_after` ready tokens at their start; returns the rollout
    ranks planned at each step and the plans."""
    ers = controller(8, failed_move_hold_steps=hold, payoff_windows=2, cooldown_steps=0, streaks=streaks)
    cur = plan_of([AR, AR, AR, AR, R, R, R, R])
    cur = ers.plan(cur, measure(trainer=4, rollout=4, trained=10_000, ras=5_000), TIMES, step=0)  # before: 1000/s
    plans = []
    for step in range(1, 5):
        first = step == 1
        cur = ers.plan(cur, measure(trainer=len(cur.trainer_ranks), rollout=len(cur.rollout_ranks), fresh=30_000,
                                    trained=10_000 if first else trained_after, ras=5_000 if first else ras_after),
                       TIMES, step=step)
        plans.append(cur)
    return [len(p.rollout_ranks) for p in plans], plans


def test_a_move_that_costs_goodput_is_undone_and_its_direction_held():
    """The payoff check: the windows after a move train 20% fewer tokens per second than before
    it: the move is undone, and the rates that asked for it do not ask again while it is held."""
    splits, plans = _payoff_run(trained_after=8_000)
    assert splits == [3, 3, 4, 4]  # moved, measured for two windows, undone, held
    assert plans[1].reason == "split held: measuring what the last move gained"
    assert plans[2].reason.startswith("undone: the move to 3 rollout ranks did not pay (800 tokens/s")
    assert plans[3].reason.startswith("held: a move to the trainer did not pay before")


def test_a_move_that_pays_is_kept_and_the_control_law_goes_on():
    """Without streaks the split is held for the whole check, however well the move did."""
    splits, plans = _payoff_run(trained_after=12_000, ras_after=5_000)
    assert splits == [3, 3, 2, 2]
    assert plans[1].reason == "split held: measuring what the last move gained"
    assert plans[2].reason.startswith("balance")  # the check ended, paid: the control law goes on


def test_with_streaks_a_move_that_pays_lets_the_next_block_follow_before_its_check_ends():
    """A streak: the first clean window after a move to the trainer trained faster than before it
    with the ready backlog kept, so the next block the control law asks for in the same direction
    moves at once, judged against the rate before the streak (1000/s)."""
    splits, plans = _payoff_run(trained_after=12_000, ras_after=5_000, streaks=True)
    assert splits == [3, 2, 2, 1]
    assert plans[1].reason.endswith("the last move paid so far (1200 tokens/s trained after it, 1000 before)")
    assert plans[2].reason == "split held: measuring what the last move gained"  # the law asks for no block
    assert plans[3].reason.startswith("balance")  # the second move's check ended, paid


def test_a_faster_window_that_drained_the_ready_backlog_does_not_extend_a_streak():
    """A larger trainer trains faster at first by eating the ready backlog: no evidence of what
    rollout sustains, so the move waits for its whole check."""
    splits, plans = _payoff_run(trained_after=12_000, ras_after=1_000, streaks=True)
    assert splits[:2] == [3, 3] and plans[1].reason == "split held: measuring what the last move gained"


def test_a_streak_never_turns_back_before_the_check_ends():
    """While a move to the trainer is measured, a window that asks for rollout (the trainer
    starved) waits for the check, however well the move did."""
    ers = controller(8, failed_move_hold_steps=5, payoff_windows=2, cooldown_steps=0, streaks=True)
    cur = plan_of([AR, AR, AR, AR, R, R, R, R])
    cur = ers.plan(cur, measure(trainer=4, rollout=4, trained=10_000), TIMES, step=0)
    cur = ers.plan(cur, measure(trainer=4, rollout=4, trained=10_000, fresh=30_000), TIMES, step=1)
    assert len(cur.rollout_ranks) == 3
    nxt = ers.plan(cur, measure(trainer=5, rollout=3, trained=12_000, fresh=1_000, starved=5.0, busy=5.0),
                   TIMES, step=2)
    assert len(nxt.rollout_ranks) == 3 and nxt.reason == "split held: measuring what the last move gained"


def test_payoff_settings_are_validated():
    with pytest.raises(ValueError, match="payoff_windows"):
        ERSConfig(payoff_windows=0)
