"""The per-step metrics record, the same keys in every mode.

Time is booked where it went: the trainer's waiting time (TWT) is the wait for the step's data
before it starts, plus the waits for groups still arriving during a streamed step, plus the
wait for an evaluation that gates the weight sync (and, decoupled, the actor's waits for the
reference's log-probs); the rollout ranks' waiting time (RWT) is their idle time since the
previous step (in rollout service with no task running; time a rank spends training or parked
is not counted, `rollout.worker.ServiceClock`), averaged over ranks. Goodput is reported per step (consumed
generated tokens / step wall time, checkpoint included) and for the run so far (all consumed
tokens / wall time since the first dispatch).

The same step, with every rank's role, also goes to the run's timeline (`timeline_log.py`:
`timeline.json` and `timeline.png` next to `metrics.jsonl`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Optional

from tide_megatron.controller.timeline_log import TimelineLog, trainer_side_roles
from tide_megatron.core.roles import RA2PMode, Role
from tide_megatron.utils.metrics import MetricsLogger
from tide_megatron.utils.timeline import TimelineStep


logger = logging.getLogger(__name__)


class StepLog:
    def __init__(self, cfg, rollout, trainer, metrics: MetricsLogger):
        self.cfg, self.rollout, self.trainer, self.metrics = cfg, rollout, trainer, metrics
        self._run_start: Optional[float] = None
        self._consumed_total = 0
        self._idle: dict[int, float] = {}
        self._dispatched: Counter[int] = Counter()
        self._generated_before = 0
        self.timeline = TimelineLog(metrics.output_dir, rollout.mode.name, enabled=cfg.metrics.timeline,
                                    every=cfg.metrics.timeline_every, resume_step=metrics.resume_step,
                                    on_png=lambda path, step: metrics.image("timeline", path, step))
        """Every rank's role over time and each step's waits: `timeline.set_role` records a move."""
        rollout.set_event_sink(metrics.event)  # quarantines, rejoins, engine restarts (rollout thread)
        self._retries_before: Optional[int] = None

    def start_run(self) -> None:
        """The first dispatch: the run's wall clock starts here, for every mode at the same point
        (after the start-up rollout engines are up; standby engines still starting count)."""
        self._run_start = time.monotonic()
        self._retries_before = self.rollout.counters.get("retries", 0)  # (restored counters of a resumed run)
        self.metrics.mark_run_start()
        self.timeline.start_run(self._trainer_roles(None))

    def roles_moved(self) -> None:
        """Ranks changed role within a step (a loan began or ended): the timeline shows it
        now, not from the step's start, where it books the roles of a boundary's move."""
        for rank, role in sorted(self._trainer_roles(None).items()):
            self.timeline.set_role(rank, role)

    def end_run(self) -> None:
        snapshot = self.rollout.call(self.rollout.ledger_snapshot)
        fates = self.rollout.call(lambda: Counter(
            (r.fate.value, r.policy_version, r.consumer_version) for r in self.rollout.buffer.records.values()))
        logger.info("group fates (fate, policy version, consumer version): %s", dict(sorted(fates.items())))
        self.metrics.write("tokens: " + ", ".join(f"{k} {v}" for k, v in snapshot.items() if v or k == "consumed"))

    def close(self) -> None:
        """The run ends, cleanly or not: the timeline's last write (it never raises)."""
        self.timeline.write(closing=True)
        if self.timeline.written_png:
            self.metrics.outputs["timeline"] = (f"{self.timeline.png_path}  (every rank's role over time; TWT, RWT, "
                                                f"RA2P mode and staleness per step; data in timeline.json)")

    def _trainer_roles(self, mode, assignment=None) -> dict[int, str]:
        """Every rank's role: the trainer side's per `assignment`, rollout for the others (ERS
        moves ranks between the two)."""
        a = assignment or self.trainer.assignment
        roles = {r: Role.ROLLOUT.value for r in range(self.trainer.topo.world_size)}
        roles.update(trainer_side_roles(list(a.actor_ranks), list(a.ref_ranks), mode, self.trainer.worker.needs_ref))
        return roles

    def step(self, step: int, version: int, outcome, *, ras: float, hol: float, readiness, twt_s: float,
             train_s: float, sync_s: float, checkpoint_s: float, step_s: float,
             extra: Optional[dict[str, float | str]] = None) -> None:
        trajs = [t for g in outcome.consumed for t in g.trajectories]
        generated = sum(t.generated_tokens for t in trajs)
        self._consumed_total += generated
        elapsed = time.monotonic() - (self._run_start or time.monotonic())
        prompt = sum(t.engine_prompt_tokens for t in trajs)
        cached = sum(t.cached_tokens for t in trajs)
        idle_now, ledger, counters, placement, dispatched = self.rollout.call(
            lambda: (self.rollout.health.rank_idle_s(), self.rollout.ledger_snapshot(),
                     {**self.rollout.counters, **self.rollout.quarantine_counts()}, dict(self.rollout.placement.stats),
                     Counter(self.rollout.placement.dispatched_to)))
        idle = [idle_now[r] - self._idle.get(r, 0.0) for r in idle_now]
        self._idle = idle_now
        fed = dispatched - self._dispatched  # tasks each rank was sent during the step
        self._dispatched = dispatched
        staleness = [version - 1 - t.policy_version for t in trajs]
        report = outcome.report
        record: dict[str, Any] = {
            "version": version,
            "mode": self.rollout.mode.name,
            "ra2p/mode": outcome.mode.value,
            "trainer/dp_size": outcome.dp_size,
            "ras": ras,
            "tprm_s": readiness.tprm_s,
            "hol_latency_s": hol,
            "groups": len(outcome.consumed),
            "consumed_tokens": generated,
            "consumed_total_tokens": sum(t.total_tokens for t in trajs),
            "goodput_tok_s": generated / step_s,
            "run_goodput_tok_s": self._consumed_total / elapsed if elapsed > 0 else 0.0,
            "generation_tok_s": (ledger["generated"] - self._generated_before) / step_s,
            "time/step_s": step_s,
            "time/train_s": train_s,
            "time/sync_s": sync_s,
            "time/checkpoint_s": checkpoint_s,
            "twt_s": twt_s + report.ref_wait_s,
            "rwt_s": sum(idle) / len(idle) if idle else 0.0,
            "micro_batches": report.num_micro_batches,
            "ra2p/arrival_wait_s": outcome.arrival_wait_s,
            **{f"ra2p/{k}": v for k, v in report.as_dict().items() if isinstance(v, (int, float))},
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
            "prefix_cache/cached_tokens": cached,
            "prefix_cache/prompt_tokens": prompt,
            "image_tokens": sum(t.image_tokens for t in trajs),
            "reward/mean": sum(t.reward for t in trajs) / len(trajs),
            "reward/max": max(t.reward for t in trajs),
            "reward/min": min(t.reward for t in trajs),
            "turns/mean": sum(t.turns for t in trajs) / len(trajs),
            "truncated_frac": sum(t.truncated for t in trajs) / len(trajs),
            "env_wait_s/mean": sum(t.env_wait_s for t in trajs) / len(trajs),
            "staleness/max": max(staleness),
            "staleness/mean": sum(staleness) / len(staleness),
            "versions/mixed_frac": sum(len(t.versions) > 1 for t in trajs) / len(trajs),
            "loss": outcome.result.loss, "pg_loss": outcome.result.pg_loss, "kl": outcome.result.kl,
            "clip_frac": outcome.result.clip_frac, "grad_norm": outcome.result.grad_norm,
            # Trainer vs rollout log-probs of the consumed tokens (`trainer.tis_mode`, README "Metrics").
            "mismatch/abs_logprob": outcome.result.mismatch_abs, "mismatch/kl": outcome.result.mismatch_kl,
            "mismatch/tis_clip_frac": outcome.result.tis_clip_frac,
            **{f"ledger/{k}": v for k, v in ledger.items()},
            "ledger/wasted_frac": ledger["wasted"] / ledger["generated"] if ledger["generated"] else 0.0,
            **{f"rollout/{k}": v for k, v in counters.items()},
            **{f"placement/{k}": v for k, v in placement.items()},
            # how evenly the step's tasks spread over the rollout ranks
            "placement/ranks_fed": len(fed),
            "placement/busiest_rank_share": max(fed.values()) / sum(fed.values()) if fed else 0.0,
        }
        self._generated_before = ledger["generated"]
        if outcome.choice is not None:
            record.update({"ra2p/cost_decoupled": outcome.choice.cost_decoupled,
                           "ra2p/cost_colocated": outcome.choice.cost_colocated,
                           "ra2p/break_even_ras": outcome.choice.break_even_ras,
                           # `ras` above counts the log's unit; these count the decision's micro-batch
                           "ra2p/ras": outcome.choice.ras, "ra2p/micro_batches": outcome.choice.micro_batches,
                           **{f"ra2p/latency_factor_{m.value}": f
                              for m, f in self.trainer.selector.correction.ratios.items()},
                           **{f"ra2p/latency_deviation_{m.value}": d
                              for m, d in self.trainer.selector.correction.deviations.items()}})
        topo, end = self.trainer.topo, self.timeline.now()
        decoupled = outcome.mode is RA2PMode.DECOUPLED
        self.timeline.step(TimelineStep(
            step=step, start=end - step_s, end=end, twt_s=record["twt_s"], rwt_s=record["rwt_s"],
            ra2p_mode=outcome.mode.value, staleness_mean=record["staleness/mean"],
            staleness_max=record["staleness/max"],
            rollout_ranks=topo.world_size - len(outcome.assignment.trainer_ranks),
            trainer_ranks=len(outcome.assignment.actor_ranks),
            ref_ranks=len(outcome.assignment.ref_ranks) if decoupled else 0),
            self._trainer_roles(outcome.mode, outcome.assignment), checkpointed=checkpoint_s > 0)
        record.update(extra or {})
        retries = int(counters.get("retries", 0))
        if self._retries_before is not None and retries > self._retries_before:
            self.metrics.event("retry_burst", f"{retries - self._retries_before} task attempt(s) retried during "
                               f"step {step}", step=step)
        self._retries_before = retries
        self.metrics.log(step, record)  # last: a test's fault injection may end the process here
