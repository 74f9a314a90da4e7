"""CTB across remote rollout ranks: rank 0's policy decides, the mailbox carries.

The policy is the in-process dispatcher's (`HysteresisCTBScheduler`: core's P(t), probing,
constraints and resume-before-admit, with hysteresis), fed with the same events; only the
transport differs. Rank 0 turns its decisions into messages:

- Admit(task, rank)  -> `task` with the assignment and the task's CTB tag fields;
- Pause(task, rank)  -> `pause`: the rank stops the task before its next turn and releases
  its SGLang session (the plugin keeps the whole context in the radix tree as evictable);
- Resume(task, rank) -> `resume`: the task continues where it stopped, on that rank.

Rollout ranks report each turn (`turn`: started / finished, context tokens, the plugin's KV
report), which keeps the policy's footprints equal to the real contexts. A paused task
resumes on the rank it ran on (`move_after_s` is infinite here): moving a suspended task to
another process would mean shipping its state, which this version does not do.
"""

from __future__ import annotations

from typing import Any, Iterable

from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.core.ctb import Admit, Pause, Resume, RolloutTask, TaskState
from tide_megatron.rollout.ctb_dispatcher import CTBDispatchConfig, HysteresisCTBScheduler
from tide_megatron.rollout.task_runner import TaskAssignment


class RemoteCTB:
    """The CTB dispatcher of rank 0 for rollout ranks in other processes."""

    def __init__(self, cfg: CTBDispatchConfig, mailbox: Mailbox, rank_budgets: dict[int, int]):
        self.cfg = cfg
        self.mailbox = mailbox
        self.policy = HysteresisCTBScheduler(
            cfg.policy, low_water=cfg.low_water, hard_water=cfg.hard_water,
            max_pauses_per_task=cfg.max_pauses_per_task, task_max_turns=cfg.task_max_turns,
            protect_final_turns=cfg.protect_final_turns, move_after_s=float("inf"))
        for rank, budget in sorted(rank_budgets.items()):
            self.policy.add_rank(rank, budget)
        self.assignments: dict[str, TaskAssignment] = {}
        self.stats = {"admits": 0, "pauses": 0, "resumes": 0}

    def submit(self, assignments: Iterable[TaskAssignment]) -> None:
        tasks = []
        for a in assignments:
            self.assignments[a.trajectory_id] = a
            tasks.append(RolloutTask(task_id=a.trajectory_id, group_id=a.group_id,
                                     task_type=str(a.task.get("task_type", a.task.get("env", ""))),
                                     prompt_tokens=self.cfg.prompt_tokens_estimate, is_eval=a.is_eval))
        self.policy.submit(tasks)

    def tag_fields(self, task_id: str) -> dict[str, Any]:
        """What the rank needs to tag the task's requests (see `sglang_patches.task_tag`)."""
        st = self.policy.status(task_id)
        return {"priority": self.policy.priority(task_id), "footprint_tokens": st.footprint,
                "turn_reserve_tokens": self.cfg.turn_reserve_tokens}

    def schedule(self, now: float, unconsumed_trajectories: int) -> None:
        """One scheduling pass; every decision becomes a message to its rank."""
        for rank in self.policy.ranks:
            self.policy.set_accepting(rank, len(self.policy.residents(rank)) < self.cfg.max_resident_tasks_per_rank)
        decisions = self.policy.schedule(now, unconsumed_trajectories=unconsumed_trajectories)
        counts = self.policy.counts()
        if not decisions and counts["queued"] and not counts["running"] and not counts["paused"] \
                and not unconsumed_trajectories:
            # Nothing runs, nothing waits for the trainer, and the queue cannot start: no rank's
            # budget fits a task's probe. Say so instead of idling forever.
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
                a = self.assignments[tid]
                self.mailbox.post(d.rank, "task", assignment=a.__dict__, ctb=self.tag_fields(tid))
            elif isinstance(d, Pause):
                self.stats["pauses"] += 1
                self.mailbox.post(d.rank, "pause", task_id=tid)
            elif isinstance(d, Resume):
                self.stats["resumes"] += 1
                self.mailbox.post(d.rank, "resume", task_id=tid, ctb=self.tag_fields(tid))

    def on_turn(self, msg: dict[str, Any]) -> None:
        tid, ctx = msg["task_id"], int(msg["context_tokens"])
        if self.policy.status(tid).state is not TaskState.RUNNING:
            return  # paused mid-turn: the pause already booked it
        if msg["phase"] == "started":
            self.policy.on_turn_started(tid, ctx)
        else:
            report = msg.get("report") or {}
            self.policy.on_turn_finished(tid, max(ctx, int(report.get("context_tokens", ctx))))

    def on_finished(self, task_id: str, context_tokens: int) -> None:
        self.policy.on_task_finished(task_id, context_tokens)
        self.assignments.pop(task_id, None)

    def forget_group(self, group_id: str) -> None:
        self.policy.forget(group_id)

    def on_weight_sync(self) -> None:
        self.policy.on_weight_sync()
