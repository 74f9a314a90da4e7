"""How the controller's scheduling decisions grow with the number of ranks.

    python benchmarks/decision_latency.py                      # R = 8, 16, 32, 64, 128
    python benchmarks/decision_latency.py --ranks 8,32 --events 500 --kv-tokens 60000 --out /tmp/x.json

Measures, per R, with the real policy objects in-process:

1. CTB placement: `CTBPlacement.dispatch`, the pass the controller's rollout thread runs once per
   loop turn (`rollout_service._place`), built as `controller/loop.py` builds it from the
   `text_emulated` recipe's composed JobConfig, over R rollout ranks of a 7B engine on an H100
   (KV pool from the simulator's hardware model, 256 request rows). Its mailbox is a stand-in
   that keeps the messages `MailboxCarrier` builds, so the dispatcher's whole path runs but
   nothing is serialised or sent. Synthetic ranks turn those messages into a seeded event stream
   (turns started and finished, tasks finished, releases) in virtual time; each loop turn books
   what arrived within `POLL_INTERVAL_S` (idle turns are skipped), starts the groups the window
   allows, then makes one timed pass. A stand-in trainer takes 2R complete groups per step and
   syncs `STEP_S` later. Reported: every pass; the passes that decided something (admit, pause,
   resume, cancel), also per decision (pass time / its decisions); each event-booking call.
2. ERS planning: `ERSController.plan`, built as `controller/trainer_roles.py` builds it, over R
   ranks starting half in rollout, fed `--ers-plans` windows of varied measurements.

Workload: the paper's text workload scaled with R: 2R groups of 8 per step (64 x 8 at 32), a
staleness window of 4R groups, env slots 32R (the workload's 1,024 at 32); tasks of 5-15 turns,
~1,100 prompt tokens plus ~400 per turn. The first weight sync ends the warm-up. Growth: the
log-log slope of each quantile from the smallest to the largest R (1.0 = linear). An H100's KV
pool never fills under this window, so nothing is paused (`--kv-tokens` shrinks it to measure
pausing and resumption), and the trainer waits for whole groups, so none goes stale (no cancels).

Not covered: it is in-process and single-threaded: no mailbox (no JSON, no store round trips),
no process groups, no contention with the controller's other threads; no eval groups, failures
or rank moves; turn times do not depend on a rank's batch. The real control plane at 8-32 ranks
is measured separately by the emulated runs. Writes benchmarks/results/decision_latency.json.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import random
import sys
import time

import bench_record

sys.path.insert(0, os.path.join(bench_record.REPO, "launch"))
import hydra_schema  # noqa: E402

from tide_megatron.comm.messages import (CancelTask, PauseTask, ResumeTask, RunTask,  # noqa: E402
                                         TaskAssignment, TurnEvent)
from tide_megatron.controller.control_meter import quantile  # noqa: E402
from tide_megatron.controller.ctb_placement import CTBPlacement  # noqa: E402
from tide_megatron.controller.rollout_service import POLL_INTERVAL_S  # noqa: E402
from tide_megatron.core.ctb_deadline import TrainerClock  # noqa: E402
from tide_megatron.core.ers import ERSConfig, ERSController, ERSMeasurements  # noqa: E402
from tide_megatron.core.ra2p import LatencyCorrection, MicroBatchTimes  # noqa: E402
from tide_megatron.sim.loader import load_hardware_model  # noqa: E402

G = 8
STEP_S = 20.0  # below a typical task's ~26 s: the trainer also waits for complete groups, not only rollout
MSG_S = 0.002  # a decision's way to its rank and the answer's back
DECODE_S_PER_TOKEN = 0.02  # a batched 7B decode iteration on an H100 (the floor is ~6.5 ms)
HW = load_hardware_model("h100_sxm", "qwen2_5_7b")


def job_config(ranks: int, kv_tokens: int):
    return hydra_schema.compose_job_config([
        "+recipe=text_emulated", f"scheduler.groups_per_step={2 * ranks}",
        f"rollout.engine.max_total_tokens={kv_tokens}", f"ctb.policy.env_concurrency={32 * ranks}"])


class RecordingMailbox:
    """Rank 0's mailbox as `MailboxCarrier` sees it; the synthetic ranks read what was posted."""

    def __init__(self) -> None:
        self.posted: list = []

    def post(self, dest: int, message) -> None:
        self.posted.append((dest, message))


class Task:
    """A task on its synthetic rank."""

    def __init__(self, rank: int, ctx: int, turns: int):
        self.rank, self.ctx, self.turns_left = rank, ctx, turns
        # release_due: paused with a turn in flight, its session closes when the turn ends
        self.epoch, self.paused, self.phase, self.release_due = 0, False, "reset", False


def run_ctb(ranks: int, events_per_rank: int, rng: random.Random, kv_tokens: int) -> dict:
    cfg = job_config(ranks, kv_tokens)
    mailbox, version, started_at = RecordingMailbox(), 0, {}  # started_at: group -> version at its admission
    place = CTBPlacement(cfg, mailbox, range(ranks),
                         on_group_started=lambda gid: started_at.setdefault(gid, version))
    groups_per_step, window = 2 * ranks, 2 * 2 * ranks  # (max_staleness + 1) x groups per step
    heap, seq = [], itertools.count()
    tasks: dict[str, Task] = {}
    spec: dict[str, tuple[int, list[int]]] = {}  # group -> (prompt tokens, turns of each member)
    live, finished, ready = set(), {}, []  # live: started, not consumed or given up
    unconsumed, consumed_this_step, training_until, step_time = 0, 0, None, None
    book_s, all_s, deciding_s, per_decision_s, batch_sizes = [], [], [], [], []

    def push(at: float, kind: str, tid: str, epoch: int = 0) -> None:
        heapq.heappush(heap, (at, next(seq), kind, tid, epoch))

    def timed(fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        if version >= 1:
            book_s.append(time.perf_counter() - t0)
        return out

    def turn(tid: str, phase: str, ctx: int, rank: int) -> None:
        event = TurnEvent(tid, phase, ctx, {"context_tokens": ctx} if phase == "finished" else None)
        event.src = rank  # the mailbox stamps it on receipt
        timed(place.on_turn, event)

    def start_group() -> None:
        gid = f"g{len(spec)}"
        task = {"env": "workload", "task_type": rng.choice(("webshop", "alfworld")), "task_id": gid}
        spec[gid] = (int(rng.lognormvariate(math.log(1100), 0.2)), [rng.randint(5, 15) for _ in range(G)])
        live.add(gid)
        finished[gid] = 0
        place.submit([TaskAssignment(task, gid, i) for i in range(G)])

    def give_up(gid: str) -> None:  # as the controller's GroupManager: cancel, then forget once released
        nonlocal unconsumed
        live.discard(gid)
        unconsumed -= finished.pop(gid, 0)
        place.cancel_group(gid, "past its staleness deadline")
        place.forget_group(gid)

    def deliver(now: float) -> None:
        for rank, msg in mailbox.posted:
            if isinstance(msg, RunTask):
                a, (prompt, turns) = msg.assignment, spec[msg.assignment.group_id]
                tasks[a.trajectory_id] = Task(rank, prompt, turns[a.index])
                push(now + MSG_S + rng.lognormvariate(0.0, 0.3), "turn", a.trajectory_id)  # env reset
                continue
            t = tasks[msg.task_id]
            if isinstance(msg, PauseTask):
                t.paused = True
                if t.phase == "gen":
                    t.release_due = True
                else:  # no turn in flight: the session closes at once
                    push(now + MSG_S, "released", msg.task_id, t.epoch)
            elif isinstance(msg, ResumeTask):
                t.paused = False
                if t.phase == "held":
                    push(now + MSG_S, "turn", msg.task_id, t.epoch)
            elif isinstance(msg, CancelTask):
                t.epoch += 1  # its pending events are dropped with it
                t.phase = "cancelled"
                push(now + MSG_S, "released", msg.task_id, t.epoch)
        mailbox.posted.clear()

    def book(now: float, kind: str, tid: str) -> None:
        nonlocal unconsumed
        t = tasks[tid]
        if kind == "released":
            timed(place.released, tid, t.rank)
            if t.phase == "cancelled":
                del tasks[tid]
        elif kind == "turn":
            if t.paused:
                t.phase = "held"
                return
            t.phase = "gen"
            turn(tid, "started", t.ctx, t.rank)
            push(now + DECODE_S_PER_TOKEN * rng.lognormvariate(math.log(100), 0.5), "gen_done", tid, t.epoch)
        elif kind == "gen_done":
            t.ctx += int(rng.lognormvariate(math.log(100), 0.5))
            t.turns_left -= 1
            turn(tid, "finished", t.ctx, t.rank)
            if t.release_due:  # also when resumed meanwhile: the rank resumes it after the release
                t.release_due = False
                push(now, "released", tid, t.epoch)
            t.phase = "env"
            push(now + rng.lognormvariate(math.log(0.5), 0.6), "env_done", tid, t.epoch)
        elif kind == "env_done":
            if t.turns_left == 0:
                gid = tid.split("/")[0]
                fresh = timed(place.finished, tid, t.rank, t.ctx)
                del tasks[tid]
                if fresh and gid in finished:
                    finished[gid] += 1
                    unconsumed += 1
                    if finished[gid] == G:  # complete: the controller forgets it, the buffer keeps it
                        ready.append(gid)
                        place.forget_group(gid)
                return
            t.ctx += int(rng.lognormvariate(math.log(300), 0.6))
            push(now, "turn", tid, t.epoch)

    now, booked, n, synced, target = 0.0, 0, 0, False, ranks * events_per_rank
    while True:
        if training_until is None and len(ready) >= groups_per_step:  # a step takes a whole batch
            for g in ready[:groups_per_step]:
                unconsumed -= finished.pop(g)
                live.discard(g)
            del ready[:groups_per_step]
            consumed_this_step, step_time = groups_per_step, STEP_S
            training_until = now + STEP_S
            push(training_until, "sync", "")
        for _ in range(max(0, window - consumed_this_step - len(live))):
            start_group()
        clock = None if step_time is None else TrainerClock(version, step_time, training_until or now + step_time)
        posted_before = len(mailbox.posted)
        t0 = time.perf_counter()
        cancelled = place.dispatch(now, unconsumed, clock=clock)
        dt = time.perf_counter() - t0
        if version >= 1 and (n or synced):
            booked += n
            all_s.append(dt)
            batch_sizes.append(n)
            decided = len(mailbox.posted) - posted_before + len(cancelled)
            if decided:
                deciding_s.append(dt)
                per_decision_s.append(dt / decided)
        for gid in cancelled:
            give_up(gid)
        deliver(now)
        if booked >= target or not heap:
            break
        # the next loop turn: what arrived within one poll interval (or, idle, the next arrival)
        now, n, synced = max(now + POLL_INTERVAL_S, heap[0][0]), 0, False
        while heap and heap[0][0] <= now:
            at, _, kind, tid, epoch = heapq.heappop(heap)
            if kind == "sync":  # the step ended: new weights reach the ranks
                version += 1
                training_until, consumed_this_step, synced = None, 0, True
                place.on_weight_sync()
                for g in [g for g in ready if version - started_at[g] > 1]:  # no step may consume it now
                    ready.remove(g)
                    live.discard(g)
                    unconsumed -= finished.pop(g)
                continue
            t = tasks.get(tid)
            if t is not None and t.epoch == epoch:
                book(at, kind, tid)
                n += 1
    if place.dispatcher.policy.audit():  # the stand-in ranks broke a carrier contract: the figures mean nothing
        raise RuntimeError(f"R={ranks}: CTB's books drifted: {place.dispatcher.policy.audit()[:3]}")
    stats = place.stats
    return {"ranks": ranks, "virtual_s": now, "steps": version, "events_booked": booked,
            "mean_events_per_pass": sum(batch_sizes) / max(1, len(batch_sizes)),
            "pass_all_us": summary(all_s), "pass_deciding_us": summary(deciding_s),
            "pass_deciding_per_decision_us": summary(per_decision_s), "booking_us": summary(book_s),
            "decisions": {k: stats[k] for k in ("admits", "pauses", "resumes", "cancels", "groups_cancelled")},
            "rank_budget_tokens": place.dispatcher.policy.rank_usage(0)[1]}


def run_ers(ranks: int, plans: int, rng: random.Random) -> dict:
    cfg = job_config(ranks, HW.kv_capacity_tokens)
    ers = ERSController(ERSConfig(enabled=True, max_moves_per_step=1, reclaim="lowest",
                                  min_rollout_ranks=cfg.scheduler.min_rollout_ranks, min_trainer_ranks=1,
                                  rank_block=1, failed_move_hold_steps=cfg.ers.failed_move_hold_steps,
                                  payoff_windows=cfg.ers.payoff_windows), ranks, cfg.ra2p.cost_model)
    times = MicroBatchTimes(cfg.ra2p.prior_ref_fwd_s, cfg.ra2p.prior_actor_fwd_s, cfg.ra2p.prior_actor_bwd_s)
    correction, plan, resized, seconds, moves = LatencyCorrection(), ers.initial_plan(0.5), False, [], 0
    step_tokens = 16 * ranks * 4000  # a step's trajectories x trainer-work tokens each
    for step in range(plans):
        u = rng.uniform
        roll = len(plan.rollout_ranks)
        window = STEP_S * u(0.8, 1.2)
        busy = window * u(0.5, 0.95)
        batch = u(8, 64)
        m = ERSMeasurements(
            window_s=window, trainer_ranks=ranks - roll, trainer_busy_s=busy,
            trainer_starved_s=(window - busy) * u(0.0, 1.0), trained_tokens=int(step_tokens * u(0.7, 1.3)),
            rollout_ranks=roll, fresh_tokens=int(step_tokens * u(0.5, 1.5)), eval_tokens=0,
            slots_full_s=window * rng.choice((u(0.0, 0.3), u(0.8, 1.0))),  # both branches of the control law
            kv_used_fraction=u(0.1, 0.7), ras_tokens=step_tokens * u(0.0, 0.6),
            arrival_tokens_per_s=step_tokens / window * u(0.5, 1.5),
            decode_iteration_s=HW.decode_base_s(1) * u(1.0, 3.0), decode_floor_s=HW.decode_base_s(1),
            mean_decode_batch=batch, decode_seq_s=roll * window * batch * u(0.2, 0.6),
            tasks_in_flight_s=roll * window * 32 * u(0.8, 1.2), rollout_resized=resized)
        t0 = time.perf_counter()
        new = ers.plan(plan, m, times, step=step, ra2p=cfg.ra2p.cost_model, correction=correction)
        seconds.append(time.perf_counter() - t0)
        resized = new.rollout_ranks != plan.rollout_ranks  # the next window opens on the new split
        moves += resized
        plan = new
    return {"ranks": ranks, "plans": plans, "moves": moves, "final_rollout_ranks": len(plan.rollout_ranks),
            "plan_us": summary(seconds)}


def summary(seconds: list[float]) -> dict:
    if not seconds:
        return {"n": 0}
    xs = sorted(s * 1e6 for s in seconds)
    return {"n": len(xs), "p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99), "max": xs[-1], "mean": sum(xs) / len(xs)}


def slope(rows: list[dict], key: str, q: str) -> float | None:
    lo, hi = rows[0], rows[-1]
    a, b = lo[key].get(q), hi[key].get(q)
    if not a or not b or hi["ranks"] == lo["ranks"]:
        return None
    return math.log(b / a) / math.log(hi["ranks"] / lo["ranks"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,16,32,64,128", help="comma-separated rank counts")
    ap.add_argument("--events", type=int, default=8000,
                    help="events booked after the warm-up, per rollout rank (~450 per rank make one step)")
    ap.add_argument("--ers-plans", type=int, default=200)
    ap.add_argument("--kv-tokens", type=int, default=HW.kv_capacity_tokens,
                    help="each rollout rank's KV pool (default: a 7B engine on an H100, the simulator's model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="decision_latency")
    args = ap.parse_args()
    rank_counts = sorted(int(r) for r in args.ranks.split(","))
    record = {**bench_record.header("decision_latency", config=vars(args)), "ctb": [], "ers": [],
              "workload": {"group_size": G, "groups_per_step": "2R", "window_groups": "4R", "env_slots": "32R",
                           "turns": [5, 15], "step_s": STEP_S, "decode_s_per_token": DECODE_S_PER_TOKEN,
                           "poll_interval_s": POLL_INTERVAL_S, "message_s": MSG_S}}
    started = time.perf_counter()
    for r in rank_counts:
        record["ctb"].append(run_ctb(r, args.events, random.Random(args.seed * 1000 + r), args.kv_tokens))
        record["ers"].append(run_ers(r, args.ers_plans, random.Random(args.seed * 1000 + r + 1)))
        c = record["ctb"][-1]
        print(f"R={r}: {c['events_booked']} events in {c['pass_all_us']['n']} passes "
              f"({c['mean_events_per_pass']:.1f} per pass), {c['pass_deciding_us']['n']} deciding, {c['steps']} steps, "
              f"{c['decisions']} ({time.perf_counter() - started:.0f} s)", flush=True)
    kinds = [("ctb", "pass_all_us", "CTB pass, all"), ("ctb", "pass_deciding_us", "CTB pass, deciding"),
             ("ctb", "pass_deciding_per_decision_us", "per decision"), ("ctb", "booking_us", "event booking"),
             ("ers", "plan_us", "ERS plan")]
    print(f"\n{'R':>5} " + " ".join(f"{label:>22}" for _, _, label in kinds) + "   (p50 / p99, us)")
    for i, r in enumerate(rank_counts):
        cells = [record[part][i][key] for part, key, _ in kinds]
        print(f"{r:>5} " + " ".join(f"{c.get('p50', 0):>10.1f} / {c.get('p99', 0):>9.1f}" for c in cells))
    record["growth_log_log_slope"] = {label: {q: slope(record[part], key, q) for q in ("p50", "p99")}
                                      for part, key, label in kinds}
    fmt = lambda s: "-" if s is None else f"{s:.2f}"  # noqa: E731
    print(f"{'slope':>5} " + " ".join(f"{fmt(g['p50']):>10} / {fmt(g['p99']):>9}"
                                       for g in record["growth_log_log_slope"].values())
          + "   (log-log, smallest to largest R; goal <= 1)")
    record["wall_s"] = time.perf_counter() - started
    bench_record.write(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
