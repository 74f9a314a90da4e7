"""Trainer processes of the scheduling modes: generators the event loop drives (`Simulator.run`).

Each yields delays (compute, swaps, syncs) and `WaitUntil` predicates (data, evaluation) and
reads the simulator's O(1) counters. Decisions come from the core: micro-batches from
`plan_microbatches` (via `trainer_model`), the feed pace from `should_feed`, the layout from
`trainer_layout` / the ERS plan, staleness from the buffer.
"""

from __future__ import annotations

from tide_megatron.core.ra2p import should_feed
from tide_megatron.core.roles import RA2PMode
from tide_megatron.sim.events import WaitUntil
from tide_megatron.sim.metrics import StepRecord, record_rank_roles, step_figures
from tide_megatron.sim.trainer_model import (
    DecoupledPipeline, aggregated_round, colocated_rounds, per_microbatch_alternation, sequence_lengths)
from tide_megatron.sim.verl_elastic import VerlElasticPolicy


def process_for(sim):
    """The trainer generator of `sim`'s mode."""
    return {"sync": run_sync, "sync_split": run_sync_split, "async_static": run_barrier, "stream": run_stream, "tide": run_stream,
            "elastic": run_elastic}[sim.mode](sim)


def wait_batch(sim, enough):
    """Wait until `enough()` holds and the buffer hands over a batch; returns (wait, batch). The
    buffer may hold ready groups back to keep room for groups still running on their last
    chance: then the trainer waits for the next group to become ready."""
    wait = 0.0
    while True:
        wait += yield from sim.wait_for(enough, "batch")
        batch = sim.take_batch()
        if batch is not None:
            return wait, batch
        seen = sim.ready_changes
        wait += yield from sim.wait_for(lambda: sim.ready_changes != seen, "last-chance groups")


def run_sync(sim):
    """VeRL-like: rollout on every rank, barrier, swap, train on every rank, swap back."""
    sim.set_rollout(list(range(sim.n_ranks)), 0.0)
    sim.trainer_ranks = 0
    sim.record_roles(mode="sync-rollout")
    wl = sim.cfg.workload
    for step in range(sim.cfg.steps):
        start = sim.loop.now
        sim.begin_step(start)
        groups = sim.new_groups(wl.batch_groups)
        if sim.workload.is_eval_step(step) and step > 0:
            sim.start_eval_phase()
        sim.submit(groups)
        yield WaitUntil(lambda: sim.ready_trajectories >= sim.B and sim.eval_outstanding == 0)
        sim.eval_pending_phase = False
        rollout_end = sim.loop.now
        batch = sim.take_batch()
        switch = sim.hw.colocate_switch_s(sim.n_ranks)
        train = aggregated_round(sim.costs, sequence_lengths(batch.groups), sim.n_ranks, sim.ra2p_cfg,
                                 swaps=2 if sim.offload else 0)
        # engines sleep (KV released) through switch + train + local reshard + switch back
        busy = 2 * switch + train + sim.sync_s
        sim.cluster.flush_all(sim.loop.now, busy)
        sim.trainer_ranks = sim.n_ranks
        sim.record_roles(mode="sync-train")
        yield busy
        figures = step_figures(sim)
        sim.trainer_ranks = 0
        sim.buffer.end_step(sim.loop.now)
        sim.version += 1
        sim.cluster.version = sim.version
        sim.record_roles(mode="sync-rollout")
        sim.metrics.steps.append(StepRecord(
            step=step, start=start, end=sim.loop.now, trajectories=batch.num_trajectories,
            tokens=batch.generated_tokens, rollout_ranks=sim.n_ranks, trainer_ranks=sim.n_ranks,
            ras=0.0, tprm_s=0.0, eval_wait_s=0.0, rollout_s=rollout_end - start, train_s=busy,
            ra2p_mode="colocated", **figures))


def run_sync_split(sim):
    """Synchronous on a fixed split (`sync_split`): the rollout ranks roll out the step's global
    batch, then the trainer ranks train it (Ref over the batch, then Actor) while
    rollout idles; the weights go out; no rank changes side."""
    rollout, sim.trainer_ranks = sim.static_split()
    sim.set_rollout(rollout, 0.0)
    sim.record_roles(mode="colocated")
    for step in range(sim.cfg.steps):
        start = sim.loop.now
        sim.begin_step(start)
        sim.submit(sim.new_groups(sim.cfg.workload.batch_groups))
        wait, batch = yield from wait_batch(sim, lambda: sim.ready_trajectories >= sim.B)
        rollout_end = sim.loop.now
        dur = aggregated_round(sim.costs, sequence_lengths(batch.groups), sim.trainer_ranks, sim.ra2p_cfg,
                               swaps=2 if sim.offload else 0)
        yield dur
        yield from sim.finish_step(step, start, batch.num_trajectories, batch.generated_tokens,
                                   dict(rollout_s=rollout_end - start, train_s=dur, wait_s=wait,
                                        ra2p_mode="colocated"))


def run_barrier(sim):
    """AReaL-like: fixed split; wait for the whole global batch, Ref over it, swap, Actor."""
    rollout, sim.trainer_ranks = sim.static_split()
    sim.set_rollout(rollout, 0.0)
    sim.record_roles(mode="colocated")
    sim.feed()
    for step in range(sim.cfg.steps):
        start = sim.loop.now
        sim.begin_step(start)
        wait, batch = yield from wait_batch(sim, lambda: sim.ready_trajectories >= sim.B)
        dur = aggregated_round(sim.costs, sequence_lengths(batch.groups), sim.trainer_ranks, sim.ra2p_cfg,
                               swaps=2 if sim.offload else 0)
        yield dur
        yield from sim.finish_step(step, start, batch.num_trajectories, batch.generated_tokens,
                                   dict(rollout_s=0.0, train_s=dur, wait_s=wait, ra2p_mode="colocated"))


def run_elastic(sim):
    """verl-like dynamic scaling (`verl_elastic`): a fixed standalone rollout share; after each
    weight sync the trainer's own (hybrid) ranks roll out when the policy finds it worth it,
    until the policy's share of the step's samples is queued, then return and train the
    barrier way (Ref over the batch, swap, Actor)."""
    policy = VerlElasticPolicy()
    standalone, sim.trainer_ranks = sim.static_split()
    hybrid = [r for r in range(sim.n_ranks) if r not in standalone]
    sim.set_rollout(standalone, 0.0)
    sim.record_roles(mode="colocated")
    switch = sim.hw.colocate_switch_s(len(hybrid))  # training state out / engine in, or back
    for step in range(sim.cfg.steps):
        start = sim.loop.now
        sim.begin_step(start)
        ready_at_start = sim.ready_trajectories
        switch_s = 0.0
        if policy.should_activate(sim.B, ready_at_start):
            # hybrid engines wake with the current weights and take requests; the trainer lends
            # its ranks until the policy's share of the batch is queued
            trainer_ranks, sim.trainer_ranks = sim.trainer_ranks, 0
            sim.set_rollout(standalone + hybrid, switch)
            sim.record_roles(mode="hybrid-rollout")
            threshold = min(sim.B, policy.deactivate_threshold(sim.B))
            yield WaitUntil(lambda: sim.ready_trajectories >= threshold, "hybrid rollout")
            sim.set_rollout(standalone, 0.0)  # in-flight requests are retried on standalone ranks
            sim.trainer_ranks = trainer_ranks
            yield switch
            sim.record_roles(mode="colocated")
            switch_s = 2 * switch
        t0 = sim.loop.now
        ready_before = sim.ready_trajectories
        wait, batch = yield from wait_batch(sim, lambda: sim.ready_trajectories >= sim.B)
        waited_samples = max(0, sim.B - ready_before) if wait > 0 else 0
        dur = aggregated_round(sim.costs, sequence_lengths(batch.groups), sim.trainer_ranks, sim.ra2p_cfg,
                               swaps=2 if sim.offload else 0)
        yield dur
        policy.after_step(sim.B, sim.loop.now - dur - t0 if waited_samples else 0.0, waited_samples, switch_s)
        yield from sim.finish_step(step, start, batch.num_trajectories, batch.generated_tokens,
                                   dict(rollout_s=0.0, train_s=dur, wait_s=wait, ra2p_mode="colocated"))


def run_stream(sim):
    """StreamRL-like streaming (`stream`, and TIDE without RA2P), and TIDE: micro-batches fed
    just in time into the RA2P mode of the step's layout, with ERS between steps."""
    sched = sim.cfg.scheduler
    vanilla = not (sim.tide and sched.ra2p)
    if sim.elastic:
        sim.ers_start()
    else:
        rollout, sim.trainer_ranks = sim.static_split()
        sim.set_rollout(rollout, 0.0)
        sim.record_roles(mode="colocated")
    sim.feed()
    if sim.elastic:
        # cold start: lent ranks roll out until the base trainer's first micro-batch is ready
        first_mb = sim.ra2p_cfg.micro_batch_tokens(len(sim.base_plan.actor_ranks))
        yield from sim.wait_for(lambda: sim.ready_tokens >= first_mb or sim.ready_trajectories >= sim.B,
                                "cold start")
        yield from sim.end_cold_start()
    ra2p = sim.ra2p_cfg
    for step in range(sim.cfg.steps):
        start = sim.loop.now
        sim.begin_step(start)
        mode, dp, n_ref, round_mb = sim.layout()
        record_rank_roles(sim, mode, dp, n_ref)
        pipeline = DecoupledPipeline(sim.costs, dp, n_ref, ra2p, ra2p.pipeline_fill_s) \
            if mode is RA2PMode.DECOUPLED else None
        consumed = tokens = 0
        size = sim.B  # trajectories the step trains: fixed when it opens (GlobalBuffer.open_stream)
        opened = False
        busy_until = sim.loop.now
        wait = compute = 0.0
        held = -1  # ready_changes when the buffer last held its ready groups back

        def feed_now(idle: bool) -> bool:
            if held == sim.ready_changes:
                return False  # room kept for last-chance groups: wait for the next arrival
            if vanilla:
                return sim.ready_trajectories > 0
            return should_feed(mode, sim.ready_tokens, dp, ra2p, trainer_idle=idle,
                               completes_step=sim.ready_trajectories >= size - consumed,
                               round_micro_batches=round_mb)

        while consumed < size:
            idle = sim.loop.now >= busy_until
            if not feed_now(idle):
                if idle:  # nothing to compute until enough is ready: trainer waiting time
                    wait += yield from sim.wait_for(lambda: feed_now(True), "data")
                else:  # the pipeline is still busy: wake on new data or when it drains
                    until = busy_until
                    sim.loop.at(until, sim.loop.notify)
                    yield WaitUntil(lambda: feed_now(False) or sim.loop.now >= until)
                continue
            if not opened:  # the real stack opens a step on its first ready group, as here
                opened = True
                groups, size = sim.open_stream()
                if not groups:  # all kept back as the reservoir: the step's own fetches take them
                    continue
            else:
                groups = sim.take(size - consumed)
            if not groups:
                held = sim.ready_changes
                continue
            lengths = sequence_lengths(groups)
            consumed += sum(len(g) for g in groups)
            tokens += sum(g.generated_tokens for g in groups)
            if pipeline is not None:
                busy_until = pipeline.submit(sim.loop.now, lengths)
                continue
            if vanilla and sched.stream_executor != "colocated":
                dur = per_microbatch_alternation(sim.costs, lengths, dp, ra2p, offload=sched.stream_executor == "vso")
            else:
                dur = colocated_rounds(sim.costs, lengths, dp, ra2p, offload=sim.offload)
            compute += dur
            yield dur
            busy_until = sim.loop.now
        if sim.loop.now < busy_until:
            yield busy_until - sim.loop.now
        if not vanilla:  # what the mode's predicted latency is judged against
            sim.latency_correction.observe(mode, sim.predicted_step_s, sim.loop.now - start)
        if pipeline is not None:
            compute = sim.loop.now - start - wait
        if sim.window is not None:
            sim.window.busy_s += compute
            sim.window.starved_s += wait
        yield from sim.finish_step(step, start, consumed, tokens, dict(
            rollout_s=0.0, train_s=compute, wait_s=wait, ra2p_mode=mode.value, ref_ranks=n_ref))
