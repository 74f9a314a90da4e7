"""Task-level placement by CTB across remote rollout ranks: rank 0's policy decides, the
mailbox carries.

The policy is CTB's (token-budget admission with probing, env concurrency, staleness and
diversity constraints, P(t) pausing, resume before admit); this module only turns its
decisions into typed messages and feeds it the ranks' events:

- Admit(task, rank)  -> `RunTask` with the task's CTB tag fields;
- Pause(task, rank)  -> `PauseTask`: the rank stops the task before its next turn and releases
  its SGLang session (the plugin keeps the whole context in the radix tree as evictable);
- Resume(task, rank) -> `ResumeTask` on the rank that holds the task (paused tasks resume there).

Rollout ranks report each turn (`TurnEvent`), which keeps the policy's footprints equal to the
real contexts. Same interface as `RequestPlacement`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.messages import CancelTask, PauseTask, ResumeTask, RunTask, TaskAssignment, TurnEvent
from tide_megatron.core.ctb import Admit, CTBScheduler, Pause, Resume, RolloutTask, TaskState


class CTBPlacement:
    def __init__(self, cfg, mailbox: Mailbox, ranks: Iterable[int],
                 on_group_started: Optional[Callable[[str], None]] = None):
        ctb, sched = cfg.ctb, cfg.scheduler
        pool, rows = cfg.rollout.engine.max_total_tokens, cfg.rollout.engine.max_running_requests
        budget, cap = ctb.rank_limits(pool, rows)  # the job's validate() checked the rest
        self.cfg = ctb
        self.mailbox = mailbox
        ranks = sorted(ranks)
        # Each resident task's open session holds one of SGLang's request rows between turns, and a
        # turn needs a row of its own: keep half the rows for turns so residents never wait on
        # each other for rows. One scheduling pass may admit many tasks, so the bound is enforced
        # through the policy's own env-slot constraint (paused tasks hold no session, no row).
        self.max_residents = min(cap, rows // 2)
        policy_cfg = type(ctb.policy)(**{**ctb.policy.__dict__, "max_staleness": sched.max_staleness,
                                         "trainer_batch_trajectories": sched.groups_per_step * sched.group_size,
                                         "env_concurrency": min(ctb.policy.env_concurrency,
                                                                self.max_residents * len(ranks)),
                                         "task_max_turns": cfg.rollout.runner.max_turns, "move_after_s": float("inf")})
        self.policy = CTBScheduler(policy_cfg)
        for rank in ranks:
            self.policy.add_rank(rank, budget)
        self.assignments: dict[str, TaskAssignment] = {}
        self._home: dict[str, int] = {}  # task -> the rank that holds it (running or paused there)
        self._started_groups: set[str] = set()
        self.on_group_started = on_group_started or (lambda group_id: None)
        """Called when CTB admits a group's first task (its admission, for staleness)."""
        self.stats = {"admits": 0, "pauses": 0, "resumes": 0}

    def submit(self, assignments: Iterable[TaskAssignment], *, front: bool = False) -> None:
        del front  # P(t) orders tasks: evaluation tasks first through I_eval
        tasks = []
        for a in assignments:
            if a.attempt:
                raise RuntimeError(f"CTB placement cannot retry task {a.trajectory_id} yet")
            self.assignments[a.trajectory_id] = a
            tasks.append(RolloutTask(task_id=a.trajectory_id, group_id=a.group_id,
                                     task_type=str(a.task.get("task_type", a.task.get("env", ""))),
                                     prompt_tokens=self.cfg.prompt_tokens_estimate, is_eval=a.is_eval))
        self.policy.submit(tasks)

    def _tag(self, task_id: str) -> dict[str, Any]:
        st = self.policy.status(task_id)
        return {"priority": self.policy.priority(task_id), "footprint_tokens": st.footprint,
                "turn_reserve_tokens": self.cfg.turn_reserve_tokens}

    def dispatch(self, now: float, unconsumed_trajectories: int = 0) -> None:
        for rank in self.policy.ranks:
            self.policy.set_accepting(rank, len(self.policy.residents(rank)) < self.max_residents)
        decisions = self.policy.schedule(now, unconsumed_trajectories=unconsumed_trajectories)
        counts = self.policy.counts()
        if not decisions and counts["queued"] and not counts["running"] and not counts["paused"] \
                and not unconsumed_trajectories:
            cfg = self.policy.config
            raise RuntimeError(
                f"CTB cannot admit any task: a probe needs about {self.cfg.prompt_tokens_estimate} + "
                f"{cfg.probe_turn_reserve_tokens} tokens (ctb.prompt_tokens_estimate + "
                f"ctb.policy.probe_turn_reserve_tokens) but the rank budgets are "
                f"{ {r: self.policy.rank_usage(r)[1] for r in self.policy.ranks} } "
                f"(ctb.kv_budget_fraction x rollout.engine.max_total_tokens)")
        for d in decisions:
            tid = d.task.task_id
            if isinstance(d, Admit):
                self.stats["admits"] += 1
                self._home[tid] = d.rank
                gid = self.assignments[tid].group_id
                if gid not in self._started_groups:
                    self._started_groups.add(gid)
                    self.on_group_started(gid)
                self.mailbox.post(d.rank, RunTask(self.assignments[tid], self._tag(tid)))
            elif isinstance(d, Pause):
                self.stats["pauses"] += 1
                self.mailbox.post(d.rank, PauseTask(tid))
            elif isinstance(d, Resume):
                self.stats["resumes"] += 1
                self.mailbox.post(self._home[tid], ResumeTask(tid, self._tag(tid)))

    def on_turn(self, event: TurnEvent) -> None:
        tid = event.task_id
        if tid not in self.assignments or self.policy.status(tid).state is not TaskState.RUNNING:
            return  # paused mid-turn (the pause already booked it) or already ended
        if event.phase == "started":
            self.policy.on_turn_started(tid, event.context_tokens)
        else:
            report = event.report or {}
            self.policy.on_turn_finished(tid, max(event.context_tokens, int(report.get("context_tokens", 0))))

    def release(self, task_id: str, context_tokens: Optional[int] = None) -> None:
        if task_id not in self.assignments:
            return
        self.policy.on_task_finished(task_id, context_tokens)
        self._home.pop(task_id, None)

    def cancel(self, task_id: str, reason: str) -> bool:
        rank = self._home.get(task_id)
        if rank is None:
            return False
        self.mailbox.post(rank, CancelTask(task_id, reason))
        return True

    def running_on(self, task_id: str) -> Optional[int]:
        return self._home.get(task_id)

    def on_weight_sync(self) -> None:
        self.policy.on_weight_sync()

    def forget_group(self, group_id: str) -> None:
        members = [tid for tid, a in self.assignments.items() if a.group_id == group_id]
        if all(self.policy.status(t).state is TaskState.FINISHED for t in members):
            self.policy.forget(group_id)
            self._started_groups.discard(group_id)
            for tid in members:
                del self.assignments[tid]

    def remove_rank(self, rank: int) -> list[str]:
        return [r.task.task_id for r in self.policy.remove_rank(rank)]

    def add_rank(self, rank: int, budget: Optional[int] = None) -> None:
        self.policy.add_rank(rank, budget)

    def queued(self) -> int:
        return self.policy.counts()["queued"]

    def running(self) -> int:
        counts = self.policy.counts()
        return counts["running"] + counts["paused"]
