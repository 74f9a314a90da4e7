"""All core components wired together in a toy clocked loop, as the simulator will drive them."""

from tide_megatron.core import (
    Admit,
    BufferConfig,
    CTBConfig,
    CTBScheduler,
    ERSConfig,
    ERSController,
    ERSMeasurements,
    GlobalBuffer,
    MicroBatchTimes,
    RA2PConfig,
    RolloutTask,
    SignalsConfig,
    TaskState,
    Trajectory,
    choose_mode,
    plan_microbatches,
)

G, TURNS = 4, 3


def run_loop(world=6, groups=40, steps=12):
    buf = GlobalBuffer(BufferConfig(group_size=G, b_min=8, b_ideal=16, max_staleness=1),
                       SignalsConfig(micro_batch_tokens=4000, ewma_alpha=0.5))
    ra2p, times = RA2PConfig(tokens_per_rank=1000), MicroBatchTimes(0.2, 0.2, 0.4)
    ers = ERSController(ERSConfig(min_rollout_ranks=1), world, ra2p)
    roles = ers.initial_plan(0.8)
    ctb = CTBScheduler(CTBConfig(rank_token_budget=6000, trainer_batch_trajectories=16, max_staleness=1,
                                 probe_turn_reserve_tokens=300), roles.rollout_ranks)
    ctb.submit([RolloutTask(f"{g}/{i}", g, f"type{g % 3}", 200) for g in range(groups) for i in range(G)])
    version, now, log = 0, 0.0, []
    window_start, consumed_tokens, fresh, slots_full, busy = 0.0, 0, 0, 0.0, 0.0
    admitted_version, turns = {}, {}
    for step in range(steps):
        for _tick in range(30):  # rollout between two trainer steps
            now += 0.1
            decisions = ctb.schedule(now, unconsumed_trajectories=buf.unconsumed_trajectories())
            if ctb.tasks_in(TaskState.QUEUED) and not any(isinstance(d, Admit) for d in decisions):
                slots_full += 0.1  # work waits but the staleness throttle admits nothing
            for d in decisions:
                if isinstance(d, Admit):
                    admitted_version[d.task.task_id] = version
                    buf.open_group(d.task.group_id, d.task.group_id, now)
            for tid in ctb.tasks_in(TaskState.RUNNING):
                st = ctb.status(tid)
                t = turns.get(tid, 0) + 1
                turns[tid] = t
                context = 200 + 250 * t + (sum(map(ord, str(tid))) % 7) * 10
                ctb.on_turn_started(tid, context)
                if t < TURNS:
                    ctb.on_turn_finished(tid, context)
                    continue
                ctb.on_task_finished(tid, context)
                gid, idx = st.task.group_id, int(str(tid).split("/")[1])
                done = buf.add_trajectory(Trajectory(gid, idx, gid, admitted_version[tid], 200, context - 200,
                                                     reward=float(idx % 2), finished_at=now), now)
                fresh += done.total_tokens if done is not None else 0
        ras = buf.begin_step(now)
        batch = buf.fetch_batch(version, now)
        if batch:
            dp = len(roles.actor_ranks)
            choice = choose_mode(ras, buf.estimate().tprm_s or 1.0, 4, times, ra2p, dp)
            consumed_tokens = batch.total_tokens
            plan = plan_microbatches({(t.group_id, t.index): t.total_tokens for t in batch.trajectories},
                                     dp, roles.mode, ra2p)
            assert sorted(i for mb in plan.micro_batches for s in mb.shards for i in s) == \
                sorted((t.group_id, t.index) for t in batch.trajectories)
            assert batch.max_staleness <= 1
            busy = batch.total_tokens / (1000.0 * dp)  # the trainer's compute time
            now += busy
            version += 1
            log.append((step, batch.num_trajectories, choice.mode.name))
        buf.end_step(now)
        est = buf.estimate()
        m = ERSMeasurements(window_s=now - window_start, trainer_ranks=len(roles.trainer_ranks),
                            trainer_busy_s=busy if batch else 0.0, trainer_starved_s=0.0 if batch else 3.0,
                            trained_tokens=consumed_tokens if batch else 0, rollout_ranks=len(roles.rollout_ranks),
                            fresh_tokens=fresh, eval_tokens=0, slots_full_s=slots_full,
                            kv_used_fraction=0.2, ras_tokens=est.ras_tokens,
                            arrival_tokens_per_s=est.arrival_tokens_per_s)
        window_start, fresh, slots_full = now, 0, 0.0
        old = roles
        roles = ers.plan(old, m, times, step=step, rollout_load={r: ctb.rank_usage(r)[0] for r in old.rollout_ranks})
        for r in roles.ranks_leaving_rollout(old):
            ctb.remove_rank(r)
        for r in roles.ranks_joining_rollout(old):
            ctb.add_rank(r)
        buf.notify_rollout_scaled(len(roles.rollout_ranks) - len(old.rollout_ranks))
        ctb.on_weight_sync()
        log.append((step, tuple(r.name for r in roles.roles.values()), roles.mode.name))
        assert buf.ledger.balanced and buf.audit() == [] and ctb.audit() == []
    return log, buf, ctb


def test_core_components_drive_a_training_loop_together():
    log, buf, ctb = run_loop()
    trained = [e for e in log if isinstance(e[1], int)]
    assert len(trained) >= 5 and all(8 <= n <= 16 for _, n, _ in trained)
    assert buf.ledger.consumed > 0
    role_plans = {e[1] for e in log if isinstance(e[1], tuple)}
    assert len(role_plans) > 1  # ERS moved ranks at least once
    assert sum(ctb.counts().values()) == 40 * G


def test_the_loop_is_deterministic():
    assert run_loop()[0] == run_loop()[0]
