"""Simulator behaviour: determinism, accounting, each mode's defining mechanism, the ideal bound."""

import pytest

from tide_megatron.sim import run_simulation
from tide_megatron.sim.simulator import Simulator

MODES = [("sync",), ("sync_split",), ("async_static",), ("stream",), ("elastic",), ("tide",),
         ("tide", "scheduler.ers=false", "scheduler.ctb=false")]


def _summary(cfg):
    s = run_simulation(cfg).summary()
    s.pop("wall_s")
    return s


def test_same_seed_same_run(small_config):
    assert _summary(small_config("mode=tide")) == _summary(small_config("mode=tide"))


def test_seed_changes_the_task_stream(small_config):
    assert _summary(small_config("mode=tide", "seed=1")) != _summary(small_config("mode=tide", "seed=2"))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "+".join(m))
def test_ledger_balances_and_goodput_is_consumed_over_time(small_config, mode):
    sim = Simulator(small_config(*[f"mode={mode[0]}", *mode[1:]]))
    m = sim.run()  # raises if the buffer audit fails
    ledger = sim.buffer.ledger
    assert ledger.balanced
    assert m.consumed_tokens == ledger.consumed > 0
    assert m.goodput == pytest.approx(ledger.consumed / m.sim_time_s)
    assert len(m.steps) == sim.cfg.steps
    # consumed tokens are exactly the generated tokens of the trajectories the trainer took
    assert sum(t.generated_tokens for t in sim.consumed_trajs) == ledger.consumed
    # every consumed trajectory respected the staleness bound
    eta = sim.cfg.workload.staleness_bound
    for rec in sim.buffer.records.values():
        if rec.fate.value == "consumed":
            assert rec.consumer_version - rec.policy_version <= eta


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "+".join(m))
def test_no_mode_beats_either_bound(small_config, mode):
    m = run_simulation(small_config(*[f"mode={mode[0]}", *mode[1:]]))
    assert 0 < m.goodput <= m.ideal_attainable_goodput <= m.ideal_hardware_goodput


def test_sync_has_a_global_barrier(small_config):
    sim = Simulator(small_config("mode=sync"))
    m = sim.run()
    B = sim.B
    for step in m.steps:
        assert step.trajectories == B  # the whole global batch, never a part of it
        assert step.rollout_s > 0 and step.train_s > 0
    # every trajectory of step k finished before step k's training began and none is left over
    starts = [s.start + s.rollout_s for s in m.steps]
    for t in sim.consumed_trajs:
        assert any(t.end_time <= s for s in starts)
    phases = [r[4] for r in m.roles]
    assert phases[1:: 2] == ["sync-train"] * len(m.steps)


def test_sync_split_takes_turns_on_a_fixed_split(small_config):
    """sync_split: the rollout ranks roll out the global batch, then the trainer ranks train it;
    no rank changes side, and no trajectory of a step runs past that step's rollout phase."""
    sim = Simulator(small_config("mode=sync_split", "scheduler.rollout_share=0.375"))
    m = sim.run()
    assert len(m.roles) == 1 and m.role_changes == 0
    assert all(s.trajectories == sim.B and s.rollout_ranks == 3 and s.trainer_ranks == 5 for s in m.steps)
    assert all(s.rollout_s > 0 and s.train_s > 0 for s in m.steps)
    ends = [s.start + s.rollout_s for s in m.steps]
    for t in sim.consumed_trajs:
        assert any(t.end_time <= e for e in ends)


def test_verl_like_peer_lends_trainer_ranks_and_takes_them_back(small_config):
    sim = Simulator(small_config("mode=elastic", "scheduler.rollout_share=0.25", "workload.eval_every=0"))
    m = sim.run()
    lent = [r for r in m.roles if r[4] == "hybrid-rollout"]
    assert lent and all(r[1] == sim.n_ranks for r in lent)  # every trainer rank rolled out
    assert m.roles[-1][1] == 2 and all(s.trainer_ranks == 6 for s in m.steps)  # and trained again


def test_static_partition_never_changes(small_config):
    for mode in ("async_static", "stream"):
        m = run_simulation(small_config(f"mode={mode}", "scheduler.rollout_share=0.375"))
        assert len(m.roles) == 1 and m.role_changes == 0
        assert {s.rollout_ranks for s in m.steps} == {3}


def test_static_trainer_waits_for_the_full_batch(small_config):
    sim = Simulator(small_config("mode=async_static"))
    m = sim.run()
    assert all(s.trajectories == sim.B for s in m.steps)


@pytest.mark.parametrize("share,direction", [(0.125, +1), (0.875, -1)])
def test_ers_moves_the_split_away_from_a_lopsided_start(small_config, share, direction):
    """From a starved trainer (1/8 rollout) ERS grows rollout; from a starved rollout (7/8) it
    grows the trainer, through the core controller's measurements of the sim's pipeline."""
    sim = Simulator(small_config("mode=tide", "steps=10", "workload.eval_every=0", "scheduler.ers_preemptive=false",
                                 f"scheduler.initial_rollout_share={share}",
                                 "scheduler.min_rollout_share=0.125", "scheduler.max_rollout_share=0.875"))
    m = sim.run()
    start = round(share * sim.n_ranks)
    assert m.role_changes > 0
    assert (m.steps[-1].rollout_ranks - start) * direction > 0
    assert all(len(e) == 7 for e in m.ers_log)


def test_ers_reads_the_task_time_that_holds_the_decode_it_reads(small_config):
    """ERS's trajectory slowdown compares decode's sequence-seconds with the task-seconds of the
    live trajectories: every decoding sequence belongs to a live trajectory, which also waits
    on its env, so each window's task time exceeds its decode time, and the trajectories are
    slowed less than their decode."""
    sim = Simulator(small_config("mode=tide", "steps=6", "workload.eval_every=0"))
    seen = []
    measure = sim._measurements

    def record():
        m = measure()
        seen.append(m)
        return m

    sim._measurements = record
    sim.run()
    measured = [m for m in seen if m.decode_seq_s > 0]
    assert measured
    for m in measured:
        assert m.decode_seq_s < m.tasks_in_flight_s <= m.window_s * sim.cluster.env_concurrency
        assert m.trajectory_slowdown <= m.decode_slowdown


def test_windows_opened_by_a_rollout_resize_are_marked(small_config):
    """ERS reads no rollout rate from a window that opened as the rollout ranks changed (core's
    `ERSMeasurements.rollout_resized`): the first, opened by the cold-start loan's end, and each
    one whose rollout ranks differ from the previous window's (an evaluation loan, a move)."""
    sim = Simulator(small_config("mode=tide", "steps=8"))
    seen = []  # (marked resized, the rollout ranks during the window)
    measure = sim._measurements

    def record():
        m = measure()
        seen.append((m.rollout_resized, tuple(sorted(sim.cluster.active))))
        return m

    sim._measurements = record
    m = sim.run()
    assert m.roles[0][1] > len(seen[0][1]) and seen[0][0]  # lent ranks came back as it opened
    for (resized, ranks), (_, before) in zip(seen[1:], seen):
        assert resized == (ranks != before)
    assert any(resized for resized, _ in seen[1:])  # the evaluation loans
    assert not all(resized for resized, _ in seen[1:])


@pytest.mark.parametrize("share", [0.875, 0.125])
def test_steps_shrink_toward_b_min_only_after_a_rollout_scale_down(small_config, share):
    """Adaptive data retention as on the real stack: a step's size is fixed when it opens
    (`GlobalBuffer.open_stream`); after ERS shrinks rollout (surely from 7/8) some steps train
    fewer than B trajectories, never fewer than B_min; before any scale-down (from 1/8 ERS first
    grows rollout) every step trains B. Retention off (the default), every step trains B."""
    sim = Simulator(small_config("mode=tide", "steps=10", "workload.eval_every=0", "scheduler.ers_preemptive=false",
                                 "scheduler.ers_retention=true", f"scheduler.initial_rollout_share={share}",
                                 "scheduler.min_rollout_share=0.125", "scheduler.max_rollout_share=0.875"))
    m = sim.run()
    sizes = [s.trajectories for s in m.steps]
    b_min = sim.buffer.config.b_min
    assert b_min < sim.B and all(b_min <= n <= sim.B for n in sizes)
    rollout = [round(share * 8)] + [entry[4] for entry in m.ers_log]  # rollout ranks before each step
    first_shrink = next((i for i in range(1, len(rollout)) if rollout[i] < rollout[i - 1]), len(sizes))
    assert all(n == sim.B for n in sizes[:first_shrink]), (sizes, rollout)
    assert any(n < sim.B for n in sizes) == (first_shrink < len(sizes)), (sizes, rollout)
    if share == 0.875:
        assert first_shrink < len(sizes)
    assert m.wasted_tokens == 0  # admission follows the shorter steps: nothing admitted misses
    off = run_simulation(small_config("mode=tide", "steps=10", "workload.eval_every=0", "scheduler.ers_preemptive=false",
                                      f"scheduler.initial_rollout_share={share}"))
    assert all(s.trajectories == sim.B for s in off.steps)


def test_ers_cold_start_lends_trainer_ranks_to_rollout(small_config):
    m = run_simulation(small_config("mode=tide", "steps=2"))
    first, second = m.roles[0], m.roles[1]
    assert first[1] > second[1]  # more rollout ranks during the cold start than after it


def test_without_ers_tide_keeps_its_shares(small_config):
    m = run_simulation(small_config("mode=tide", "scheduler.ers=false"))
    assert m.role_changes == 0 and len(m.roles) == 1


def test_consumption_wakes_the_ctb_dispatcher(small_config):
    # CTB's staleness throttle reads the unconsumed volume, which only the trainer lowers; a
    # fetch must make the dispatcher look again, or a rollout whose tasks all finished while
    # admissions were throttled idles until an unrelated event (or forever).
    from tide_megatron.sim.simulator import Simulator

    sim = Simulator(small_config("mode=tide", "scheduler.ers=false", "workload.eval_every=0"))
    fetch_times, kick_times = [], []
    fetch, kick = sim.buffer.fetch, sim.cluster.kick

    def spy_fetch(*a, **kw):
        fetch_times.append(sim.loop.now)
        return fetch(*a, **kw)

    def spy_kick():
        kick_times.append(sim.loop.now)
        kick()

    sim.buffer.fetch, sim.cluster.kick = spy_fetch, spy_kick
    m = sim.run()
    assert len(m.steps) == 4 and fetch_times
    assert set(fetch_times) <= set(kick_times)


def test_slot_bounds_bind_when_slots_are_scarce(small_config):
    """With few env slots, Little's law on the slots caps goodput below the hardware bound, and
    the run still stays under it."""
    m = run_simulation(small_config("mode=async_static", "workload.env_concurrency=8"))
    assert m.ideal_detail["binding"] in ("env_slots", "group_slots", "split")
    assert m.ideal_detail["t_env_slots_s"] > m.ideal_detail["t_hardware_s"]
    assert 0 < m.goodput <= m.ideal_attainable_goodput < m.ideal_hardware_goodput


def test_feed_counts_live_groups_so_dropped_groups_are_replaced(small_config):
    """The feed keeps live groups plus the current step's consumption at (bound + 1) x B: groups
    that miss the bound are replaced, so the pipeline does not shrink with every miss (under the
    default rule the buffer's last-chance room makes misses rare; the drop rule provokes them)."""
    # slow ALFWorld envs: some groups miss their bound
    sim = Simulator(small_config("mode=stream", "steps=6", "workload.eval_every=0", "scheduler.staleness_rule=drop",
                                 "workload.task_types.1.env_step_s=[2.0,0.8]"))
    cap = (sim.cfg.workload.staleness_bound + 1) * sim.cfg.workload.batch_groups
    live_at_step_start = []
    begin = sim.buffer.begin_step

    def spy(now):
        pending = len(sim.buffer.pending_group_ids())
        live_at_step_start.append(pending + len(sim.buffer.ready_groups()))
        return begin(now)

    sim.buffer.begin_step = spy
    m = sim.run()
    assert m.dropped_stale_tokens > 0  # groups missed the bound: the cap must not count them
    assert live_at_step_start[1:] == [cap] * (len(live_at_step_start) - 1)
    # every group that left (consumed, cancelled or dropped) was replaced, and none leaked
    left = len(sim.buffer.records)
    assert sim.live_groups + sim.taken_groups_this_step == cap  # the window stays full
    assert sim.workload.groups_drawn == left + sim.live_groups


@pytest.mark.parametrize("mode", ["async_static", "stream", "tide"])
def test_cancel_rule_books_missed_groups_as_wasted_and_keeps_the_bound(small_config, mode):
    sim = Simulator(small_config(f"mode={mode}", "steps=6"))
    m = sim.run()
    eta = sim.cfg.workload.staleness_bound
    records = list(sim.buffer.records.values())
    for rec in records:
        if rec.fate.value == "consumed":
            assert rec.consumer_version - rec.policy_version <= eta
    # every cancelled group stopped at once: none of its trajectories finished after its cancel
    cancelled = [r for r in records if r.fate.value == "cancelled"]
    assert len(cancelled) == m.cancelled_groups and all(r.completed_at is None for r in cancelled)
    assert m.cancelled_tokens == sum(r.generated_tokens for r in cancelled)
    assert m.wasted_tokens == m.cancelled_tokens + m.dropped_stale_tokens + m.lost_tokens
    for t in sim.consumed_trajs:  # per-segment versions: never older than the group's admission
        assert t.segment_versions and min(t.segment_versions) >= t.version


def test_drop_rule_is_kept_for_comparison(small_config):
    m = run_simulation(small_config("mode=async_static", "scheduler.staleness_rule=drop"))
    assert m.cancelled_groups == 0 and len(m.steps) == 4
    with pytest.raises(ValueError, match="staleness_rule"):
        small_config("scheduler.staleness_rule=never")


def test_the_sim_writes_the_real_runs_timeline_schema_and_plot(small_config, tmp_path):
    """ERS moves ranks and RA2P switches modes: the timeline shows both, per rank and per step,
    in the files a real run writes (`timeline.json` schema, the same plot)."""
    from tide_megatron.utils.timeline import Timeline

    m = run_simulation(small_config("mode=tide", f"out_dir={tmp_path}"))
    tl = Timeline.load(str(tmp_path / "tide_ra2p_ers_ctb_timeline.json"))
    assert tl == m.timeline and tl.source == "sim"
    assert [s.step for s in tl.steps] == [s.step for s in m.steps]
    assert all(s.ra2p_mode in ("colocated", "decoupled") and s.end > s.start for s in tl.steps)
    assert max(s.staleness_max for s in tl.steps) >= 1 and any(s.rwt_s > 0 for s in tl.steps)
    assert set(tl.ranks) == set(range(8))
    assert any(len({s.role for s in spans}) > 1 for spans in tl.ranks.values())  # roles changed
    assert all(spans[-1].end == m.sim_time_s for spans in tl.ranks.values())
    assert (tmp_path / "tide_ra2p_ers_ctb.png").read_bytes()[:4] == b"\x89PNG"
