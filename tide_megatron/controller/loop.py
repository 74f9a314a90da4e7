"""The rank-0 controller: builders, then one step loop for every scheduling mode.

    rollout service (thread)   buffer, task placement, retries, health, evaluation
    trainer driver             executors, RA2P's mode choice, the reference rank
    mode policy                what differs between sync, async_static, stream and tide

One step, whatever the mode:
  1. rollout: sync starts the step's groups now; the other modes keep rollout running;
  2. data: wait for the whole global batch, or (streaming) for the first ready group; ERS's
     cold-start loan, if any, ends here (its ranks come back to the trainer);
  3. train: the executor runs; in streaming modes later groups join as they complete;
  4. version += 1 (the controller is the one owner of the weight version); the running
     evaluation is gathered; with ERS on, the ranks move to the next step's roles
     (`trainer_roles.py`, with the evaluation loan when one starts now); doomed groups are
     cancelled, weights go point to point to every rollout rank in service and to quarantined
     ones ready to rejoin (sync waits until each has loaded them or was quarantined; the
     others go on), the next evaluation starts;
  5. log, and checkpoint at the interval.

Every wait is bounded and watches the rollout side's health: a stalled run, a dead rollout
thread or too few rollout ranks in service (a silent rank is quarantined, see
`quarantine.py`) ends the run with a message that says which rank and what it waited for.

At the end every rollout rank is sent `Stop` and answers `Stopped` once its tasks have ended
(within the worker's `STOP_GRACE_S`). A rank that has not answered some seconds after that is
named in one line (last heard from when) and listed in `unstopped`; the job then fails on rank
0, so torchrun stops every rank, that one included, in bounded time (README, "Faults").
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import STOP_GRACE_S, EngineStandby, SaveCheckpoint, Stop, Stopped
from tide_megatron.comm.weight_sync import WeightSender
from tide_megatron.comm.topology import Topology
from tide_megatron.config import JobConfig
from tide_megatron.controller import run_state
from tide_megatron.controller.control_meter import ControlMeter
from tide_megatron.controller.health import RolloutHealth
from tide_megatron.controller.modes import mode_policy
from tide_megatron.controller.placement import RequestPlacement
from tide_megatron.controller.rollout_service import RolloutService, RunError
from tide_megatron.controller.step_log import StepLog
from tide_megatron.controller.trainer_roles import TrainerRoles, standby_engine_ranks
from tide_megatron.controller.training import TrainerDriver
from tide_megatron.controller.weight_push import WeightPush
from tide_megatron.core.buffer import BufferConfig, GlobalBuffer
from tide_megatron.core.ers import ERSMeasurements
from tide_megatron.core.signals import SignalsConfig
from tide_megatron.trainer.worker import TrainerWorker
from tide_megatron.utils.metrics import MetricsLogger

logger = logging.getLogger(__name__)

__all__ = ["Controller", "RunError"]

STOPPED_MARGIN_S = 15.0  # after the worker's stop grace: its last heartbeat, and a loaded machine


def not_stopped(mailbox: Mailbox, ranks, timeout_s: float) -> list[int]:
    """The ranks that have not answered `Stop` with `Stopped` within `timeout_s`."""
    waiting = set(ranks)
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for msg in mailbox.poll():
            if isinstance(msg, Stopped):
                waiting.discard(msg.src)
        time.sleep(0.05)
    return sorted(waiting)


def stall_timeout_s(cfg: JobConfig) -> float:
    """`scheduler.stall_timeout_s`, or when 0, a bound that scales with the env's timeout: a
    turn may wait one env call (with its retries) and one generation before anything moves."""
    if cfg.scheduler.stall_timeout_s > 0:
        return cfg.scheduler.stall_timeout_s
    client = cfg.envs.client
    return 3 * (client.call_timeout_s + client.connect_timeout_s) + 60.0


class Controller:
    def __init__(self, cfg: JobConfig, topo: Topology, mailbox: Mailbox, trainer: TrainerWorker,
                 metrics: MetricsLogger, tasks: list[dict[str, Any]], start_step: int = 0,
                 eval_tasks: Optional[list[dict[str, Any]]] = None):
        self.cfg, self.topo, self.mailbox, self.metrics = cfg, topo, mailbox, metrics
        sched = cfg.scheduler
        self.mode = mode_policy(sched.mode, ra2p_executor=cfg.ra2p.executor, ctb_enabled=cfg.ctb.enabled)
        self.step = self.version = start_step  # the policy version is the number of updates
        self.eval_tasks = eval_tasks or []
        self._run_started = time.monotonic()
        self._time_noted = False
        stop_file = cfg.run.stop_file and Path(cfg.run.output_dir) / cfg.run.stop_file
        self._stop_file: Optional[Path] = stop_file or None
        self._stop_noted = False
        self._eval_pending: Optional[int] = None
        self._eval_s = 0.0  # the last complete evaluation's duration (0: none yet)
        batch = sched.groups_per_step * sched.group_size
        buffer = GlobalBuffer(
            BufferConfig(group_size=sched.group_size, b_min=(sched.min_groups_per_step or sched.groups_per_step)
                         * sched.group_size, b_ideal=batch, max_staleness=sched.max_staleness),
            SignalsConfig(micro_batch_tokens=cfg.ra2p.cost_model.tokens_per_rank))
        self.stall_timeout_s = stall_timeout_s(cfg)
        health = RolloutHealth([], time.monotonic(), heartbeat_timeout_s=sched.heartbeat_timeout_s,
                               stall_timeout_s=self.stall_timeout_s)
        self.rollout = RolloutService(
            mailbox=mailbox, buffer=buffer, placement=self._placement(), mode=self.mode,
            rollout_ranks=topo.rollout_ranks, tasks=tasks, group_size=sched.group_size,
            groups_per_step=sched.groups_per_step, max_staleness=sched.max_staleness,
            max_task_retries=sched.max_task_retries, max_failed_groups=sched.max_failed_groups,
            seed=cfg.run.seed, start_version=start_step, health=health,
            eval_pass_threshold=sched.eval_pass_threshold, weight_sender=WeightSender(
                topo.job_group, mailbox, node_of=lambda rank: topo.plan.slot(rank).node if topo.plan else 0),
            weight_sync_timeout_s=sched.weight_sync_timeout_s, min_rollout_ranks=sched.min_rollout_ranks,
            hand_over_tasks=cfg.ers.hand_over_tasks, task_order=sched.task_order, poll_s=sched.control_poll_s)
        self.weights = WeightPush(path=sched.weight_sync_path, rollout=self.rollout, mailbox=mailbox,
                                  bucket_bytes=sched.weight_bucket_mb << 20, engine_tp=cfg.rollout.engine.tp_size,
                                  broadcast_timeout_s=sched.weight_broadcast_timeout_s)
        self.trainer = TrainerDriver(cfg, topo, mailbox, trainer, self.mode, self.rollout.trainer_inbox,
                                     health=self.rollout.check)
        self.trainer_rank = trainer
        self.roles = TrainerRoles(cfg.ers, topo, mailbox, trainer, cfg.ra2p.cost_model, self.trainer.take,
                                  rollout=self.rollout, min_rollout_ranks=sched.min_rollout_ranks,
                                  time_share=self.mode.time_shared)
        self._ers_since = time.perf_counter()  # where the window ERS's next plan reads begins
        self.control = ControlMeter(mailbox, self.rollout, self.roles.plan_times)
        self.log = StepLog(cfg, self.rollout, self.trainer, metrics)
        self.unstopped: list[str] = []
        """Rollout ranks that did not answer `Stop` in time, one line each (see the docstring)."""

    def _placement(self):
        if self.mode.task_level:
            from tide_megatron.controller.ctb_placement import CTBPlacement

            return CTBPlacement(self.cfg, self.mailbox, self.topo.rollout_ranks)
        return RequestPlacement(self.mailbox, self.topo.rollout_ranks, self.cfg.scheduler.max_tasks_per_rank)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        if self._stop_file is not None and self._stop_file.exists():  # not this run's request
            self._stop_file.unlink()
            self.metrics.write(f"removed {self._stop_file}, left by an earlier run")
        self.rollout.start()
        try:
            n = len(self.topo.rollout_ranks)
            self.rollout.wait(self.rollout.submit(lambda: None, when=lambda: len(self.rollout.engines) >= n),
                              self.cfg.scheduler.ready_timeout_s, f"{n} rollout rank(s) to start their engines")
            # Rollout starts now (the first groups start once the start-up engines are up), and
            # so does every mode's clock: standby engines still starting and a cold-start loan's
            # weight load are the run's time, not a head start for the modes that move ranks.
            self.log.start_run()
            self._run_started = time.monotonic()
            self.control.start()  # step 1's figures leave the engines' start-up out
            # ERS's first window opens with rollout too: groups and decode of that time belong to
            # it. Opened later, it missed the first groups' decode (read as none).
            self._open_ers_window()
            standby = standby_engine_ranks(self.cfg, self.topo.trainer_ranks + self.topo.ref_ranks)
            if standby:  # the first step's trainer ranks are not still starting an engine
                self.trainer.take(EngineStandby, len(standby), timeout_s=self.cfg.scheduler.ready_timeout_s)
            loan = self.roles.cold_start()  # preemptive maximal rollout, until the first data is ready
            if loan:
                self.log.roles_moved()
            if self.version > 0 or loan:  # resumed: the engines still hold the initial weights; lent
                # ranks enter rollout service with these weights. A mode that places its whole
                # batch at once waits for them: placed before they load, every task of the first
                # step would go to the ranks that rolled out from the start.
                self._push_weights(wait=self.version > 0 or not self.mode.continuous_rollout)
            self._start_eval()
            while not self._last_step_done():
                self._one_step()
            self._finish_eval()  # the last model's eval has no next step to hide behind
            self.log.end_run()
        finally:
            self.rollout.stop()
            self.rollout.join(timeout=10)
            self.weights.close()
            self.log.close()  # also when the run fails: a crashed run still leaves its timeline
        self.shutdown()
        self._await_stopped()

    def shutdown(self) -> None:
        self.rollout.stop()
        for dest in range(1, self.topo.world_size):
            self.mailbox.post(dest, Stop())

    def _await_stopped(self) -> None:
        """Wait (bounded) for every rollout rank's `Stopped`; name each that stays silent."""
        # the rollout thread has ended: this thread reads the mailbox now
        waiting = not_stopped(self.mailbox, self.rollout.rollout_ranks, STOP_GRACE_S + STOPPED_MARGIN_S)
        now, wall = time.monotonic(), time.time()
        for rank in waiting:
            last = self.rollout.health.last_seen(rank) if rank in self.rollout.health.ranks else self._run_started
            line = (f"rollout rank {rank} did not stop: last heard from at "
                    f"{time.strftime('%H:%M:%S', time.localtime(wall - (now - last)))} ({now - last:.0f} s ago), "
                    f"{STOP_GRACE_S + STOPPED_MARGIN_S:.0f} s after Stop; rank 0 fails the job so that torchrun "
                    f"stops every rank")
            self.metrics.write(line)  # the console and rank 0's log
            self.unstopped.append(line)

    def _one_step(self) -> None:
        sched = self.cfg.scheduler
        t0 = time.perf_counter()
        if not self.mode.continuous_rollout:
            self.rollout.call(lambda: self.rollout.request_groups(sched.groups_per_step))
        arrival = self.rollout.call(self._arrival_estimate)
        if self.mode.streaming:
            ras, hol, ready, groups = self.rollout.wait(
                self.rollout.submit(lambda: self.rollout.open_step(sched.groups_per_step),
                                    when=self.rollout.step_can_open),
                self.stall_timeout_s * 4, "the first ready group of the step")
            twt = time.perf_counter() - t0
            ers_twt, loan_end = self._end_cold_start(twt)
            outcome = self.trainer.train_stream(ready, groups, arrival, self._stream_into,
                                                arrival_timeout_s=self.stall_timeout_s * 4)
        else:
            fetched = None
            while fetched is None:
                fetched = self.rollout.wait(self.rollout.submit(self.rollout.fetch_batch, when=self.rollout.batch_ready),
                                            self.stall_timeout_s * 4, "the whole global batch")
            batch, ras, hol = fetched
            twt = time.perf_counter() - t0
            ers_twt, loan_end = self._end_cold_start(twt)
            outcome = self.trainer.train_batch(list(batch.groups), arrival)
        if outcome.choice is None and self.roles.enabled:  # ERS's layout chose the mode: its model's error
            self.trainer.selector.correction.observe(outcome.mode, self.roles.predicted_step_s(outcome.mode),
                                                     outcome.report.wall_s)
        loan_s = loan_end.get("ers/cold_start_end_s", 0.0)  # the role change, not training
        train_s = time.perf_counter() - t0 - twt - loan_s
        readiness = self.rollout.call(self.rollout.close_step)
        self.version += 1
        self.step += 1
        t_sync = time.perf_counter()
        # The evaluation is gathered first: a rank ERS moves out of rollout then holds no eval task.
        eval_wait_s = self._finish_eval()
        # ERS plans after the update and before the weight sync (roles change on its boundary);
        # after the last step no step follows to use new roles.
        ers = self.roles.after_update(self.step, self._ers_measurements(outcome, ers_twt, train_s),
                                      *self.trainer.selector.cost_inputs(),
                                      expected_eval_s=self._eval_s if self._eval_due() else 0.0,
                                      correction=self.trainer.selector.correction) \
            if self.roles.enabled and not self._last_step_done() else {}
        # The weights go out before admission resumes under the new version: a rank reads its
        # LoadWeights before any task started after it.
        self._push_weights(wait=not self.mode.continuous_rollout)
        self.rollout.call(lambda: self.rollout.set_version(self.version))
        self._start_eval()
        sync_s = time.perf_counter() - t_sync
        checkpoint_s = self._maybe_checkpoint()
        self.log.step(self.step, self.version, outcome, ras=ras, hol=hol, readiness=readiness,
                      twt_s=twt + outcome.arrival_wait_s + eval_wait_s, train_s=train_s, sync_s=sync_s,
                      checkpoint_s=checkpoint_s, step_s=time.perf_counter() - t0,
                      extra={**loan_end, **ers, **self.weights.metrics(), **self.control.step_metrics()})
        if ers and self.mode.time_shared:  # lent until the next batch is complete: shown from here
            self.log.roles_moved()          # (after this step's record, which books its own roles)

    def _end_cold_start(self, twt: float) -> tuple[float, dict[str, float]]:
        """The step's data is ready: a cold-start loan ends now (`TrainerRoles.end_cold_start`),
        and ERS's window opens anew on the split that trains, as in the simulator. Returns the
        trainer's wait that falls in ERS's window (none of it, then), and the loan's metrics."""
        ended = self.roles.end_cold_start(self.step + 1, self.cfg.scheduler.weight_sync_timeout_s + 60.0)
        if not ended:
            return twt, {}
        self.log.roles_moved()
        self._open_ers_window()
        return 0.0, ended

    def _open_ers_window(self) -> None:
        self._ers_since = time.perf_counter()
        self.rollout.call(self.rollout.ers_window)

    def _ers_measurements(self, outcome, twt: float, train_s: float) -> ERSMeasurements:
        """The window since the previous plan, as ERS reads it. The decode iteration times come
        from the `tide_ctb` plugin's counters in the rollout ranks' turn reports (`ers_window`);
        without CTB, or before a batch of one was seen, they are 0 and ERS reads decode as
        unslowed (it then grows rollout for a starved trainer from the rates, not from batching)."""
        est, window, serving = self.rollout.call(lambda: (self.rollout.buffer.estimate(), self.rollout.ers_window(),
                                                          len(self.rollout.quarantine.serving)))
        tokens = sum(t.total_tokens for g in outcome.consumed for t in g.trajectories)
        now = time.perf_counter()
        window_s, self._ers_since = max(1e-9, now - self._ers_since), now
        return ERSMeasurements(
            window_s=window_s, trainer_ranks=len(self.roles.ranks),
            trainer_busy_s=max(0.0, train_s - outcome.arrival_wait_s), trainer_starved_s=twt + outcome.arrival_wait_s,
            trained_tokens=tokens, rollout_ranks=serving, fresh_tokens=int(window["fresh_tokens"]),
            eval_tokens=int(window["eval_tokens"]), slots_full_s=min(window["slots_full_s"], window_s),
            kv_used_fraction=window["kv_used_fraction"], ras_tokens=est.ras_tokens,
            arrival_tokens_per_s=est.arrival_tokens_per_s, decode_iteration_s=window["decode_iteration_s"],
            decode_floor_s=window["decode_floor_s"], mean_decode_batch=window["mean_decode_batch"],
            decode_seq_s=window["decode_seq_s"], tasks_in_flight_s=window["tasks_in_flight_s"],
            rollout_busy_s=window["rollout_busy_s"], rollout_resized=self.roles.rollout_resized)

    def _arrival_estimate(self) -> Optional[float]:
        """Trainer-work tokens made ready per second (smoothed over steps); None before any."""
        est = self.rollout.buffer.estimate()
        return est.arrival_tokens_per_s if est.steps_observed else None

    def _stream_into(self, source, groups_left: int, on_group) -> None:
        self.rollout.call(lambda: self.rollout.stream_into(source, groups_left, on_group))

    def _push_weights(self, wait: bool) -> None:
        """Weights to the rollout ranks the rollout service names (in service, or rejoining)."""
        version = self.version
        self.trainer_rank.push_weights(version, lambda named: self.weights.send(named, version), mailbox=self.mailbox)
        if wait:  # sync: the next rollout phase must run on these weights (a rank that cannot load
            # them in time is quarantined, which settles the wait too)
            self.rollout.wait(self.rollout.submit(lambda: None, when=lambda: self.rollout.weights_settled(version)),
                              self.cfg.scheduler.weight_sync_timeout_s + 60.0, f"the weights of version {version}")

    def _last_step_done(self) -> bool:
        """`run.steps` reached, `run.max_wall_minutes` passed since the first dispatch, or
        `run.stop_file` created."""
        limit = self.cfg.run.max_wall_minutes
        out_of_time = limit > 0 and time.monotonic() - self._run_started > 60.0 * limit
        if out_of_time and self.step < self.cfg.run.steps and not self._time_noted:
            self._time_noted = True
            self.metrics.write(f"run.max_wall_minutes={limit:g} reached: stopping after step {self.step}")
        if not self._stop_noted and self._stop_file is not None and self._stop_file.exists():
            self._stop_noted = True  # stays requested: the file may go before the checkpoint is written
            self.metrics.write(f"{self._stop_file} found: stopping after step {self.step}")
        return self.step >= self.cfg.run.steps or out_of_time or self._stop_noted

    def _maybe_checkpoint(self) -> float:
        interval = self.cfg.run.checkpoint_interval
        if not ((interval and self.step % interval == 0) or self._last_step_done()):
            return 0.0
        t0 = time.perf_counter()
        for rank in self.trainer_rank.assignment.actor_ranks[1:]:  # the actors now (ERS may have moved them)
            self.mailbox.post(rank, SaveCheckpoint())
        state = run_state.capture(self).to_json()  # saved with the weights, before `latest` moves
        self.metrics.write(f"checkpoint: {self.trainer_rank.save(run_state=state)}")
        return time.perf_counter() - t0

    # -- evaluation (tide-style: step i's model is evaluated during step i+1) ------------------
    def _eval_due(self) -> bool:
        """An evaluation of the current model starts at this boundary."""
        every = self.cfg.scheduler.eval_every
        return bool(every and self.eval_tasks and self.version % every == 0)

    def _start_eval(self) -> None:
        sched = self.cfg.scheduler
        if self._eval_due():
            version = self.version
            self.rollout.call(lambda: self.rollout.submit_eval(version, self.eval_tasks, sched.eval_groups))
            self._eval_pending = version

    def _finish_eval(self) -> float:
        """Wait for the running eval and log it under the step whose model it measured; returns
        the seconds waited (trainer waiting time)."""
        if self._eval_pending is None:
            return 0.0
        version, self._eval_pending = self._eval_pending, None
        t0 = time.perf_counter()
        metrics = self.rollout.wait(self.rollout.submit(lambda: self.rollout.evals.pop(version),
                                                        when=lambda: self.rollout.evals.ready(version)),
                                    self.stall_timeout_s * 4, f"the evaluation of step {version}")
        waited = time.perf_counter() - t0
        if metrics.complete:  # what ERS's evaluation loan expects of the next one
            self._eval_s = metrics.duration_s
        self.metrics.log_at(version, {**metrics.to_log(), "eval/wait_s": waited})
        self.metrics.write(f"eval of step {version}: mean reward {metrics.mean_reward:.3f}, "
                           f"best-of-{self.cfg.scheduler.group_size} {metrics.best_of_n_reward:.3f}, "
                           f"pass rate {metrics.pass_rate:.3f}")
        return waited
