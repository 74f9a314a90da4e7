"""The carrier protocol: how the CTB dispatcher's decisions reach rollout ranks, and their events come back.

The dispatcher (`ctb_dispatcher.CTBDispatcher`, rank 0) owns the policy, the assignments and
the stats; a carrier only transports. Two carriers exist: the in-process one
(`ctb_rollout.LocalCarrier`, acting on `TaskHandle`s on one asyncio loop) and the mailbox one
of the multi-process system (the controller's). Both follow this contract.

Dispatcher -> carrier (one call per decision, in decision order):

- `admit(rank, assignment, tag)`: start the task on `rank`. `tag` is None in the vanilla,
  request-level mode (untagged requests, no session, never paused).
- `pause(rank, task_id)`: the task must not start another turn; its SGLang session is closed
  once no turn of it is in flight (its KV becomes evictable cache). Then the rank reports
  `task_released`. A pause may reach the rank before the task has started (its admit not yet
  acted on, or before its first turn): the rank still keeps it from running until a resume,
  and reports `task_released` at once (it holds nothing yet).
- `resume(rank, task_id, tag)`: the paused task may run again, on `rank`. Unless the carrier
  `can_move_tasks`, `rank` is the rank it was paused on. If the rank has not finished
  releasing it yet, it resumes right after the release.
- `cancel(rank, task_id)`: the task is dropped wherever it is in its life on `rank` (not yet
  started, running, paused): its turn is abandoned, its session and environment are closed,
  and the rank reports `task_released`. No finish or failure of it counts afterwards.

Per task the decisions form the sequence admit (pause resume)* [pause] [cancel]; a carrier
must deliver one task's decisions in that order (a FIFO per rank and one rank per task, or one
loop, both do). Decisions of different tasks may interleave freely.

Rank -> dispatcher, the same methods for both carriers (`rank`: where the event happened):

- `turn_started(rank, task_id, context_tokens)`: a turn is sent, with this much context.
- `turn_finished(rank, task_id, context_tokens, report)`: it ended; `report` is the
  `tide_ctb` plugin's `meta_info` report (None: the plugin is not running there).
- `task_finished(rank, task_id, context_tokens)`: the trajectory is complete (the runner has
  closed its session: finishing implies release).
- `task_failed(rank, task_id, error)`: the runner raised (env or engine error); it has closed
  its session (failing implies release). The caller decides on a retry.
- `task_released(rank, task_id)`: the rank holds nothing more of a paused or cancelled task.

Tag fields (`TagFields`) are what a rank needs to tag the task's requests for the SGLang
plugin; a rank keeps the latest fields it received with an admit or resume.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol

from sglang_patches.task_tag import TaskTag
from tide_megatron.comm.messages import TaskAssignment


@dataclass(frozen=True)
class TagFields:
    """The dispatcher's part of a task's request tag (`sglang_patches.task_tag.TaskTag`)."""

    priority: float
    """CTB priority P(t) when the decision was made; the engine retracts lowest first."""
    footprint_tokens: int
    """Tokens the dispatcher has booked for the task (probed estimate or last context)."""
    turn_reserve_tokens: int
    """Tokens one more turn may add while the task waits between turns."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TagFields":
        return cls(float(data["priority"]), int(data["footprint_tokens"]), int(data["turn_reserve_tokens"]))

    def task_tag(self, kind: str, assignment: TaskAssignment, context_tokens: int) -> TaskTag:
        """The tag of one request of the task (`kind`: admit, turn or resume)."""
        return TaskTag(kind=kind, task_id=assignment.trajectory_id, group_id=str(assignment.group_id),
                       is_eval=assignment.is_eval, priority=self.priority,
                       footprint_tokens=max(self.footprint_tokens, context_tokens),
                       turn_reserve_tokens=self.turn_reserve_tokens)


class Carrier(Protocol):
    """Carries CTB decisions to rollout ranks (see the module docstring for the contract)."""

    can_move_tasks: bool
    """True: a paused task may resume on another rank (its runner's state is reachable from
    every rank, e.g. one process). False: it resumes where it was paused, and a task whose rank
    leaves rollout is handed over (`CTBDispatcher.hand_off_rank`) or, when that rank is gone,
    restarts from scratch elsewhere."""

    def admit(self, rank: int, assignment: TaskAssignment, tag: Optional[TagFields],
              carry: Optional[dict] = None) -> None:
        """Start the task on `rank`; `carry`: go on from the state another rank handed over
        (only carriers that cannot move tasks are given one)."""

    def pause(self, rank: int, task_id: str) -> None: ...

    def resume(self, rank: int, task_id: str, tag: TagFields) -> None: ...

    def cancel(self, rank: int, task_id: str) -> None: ...

    def release(self, rank: int, carry: dict) -> None:
        """A handed-over task will not go on: `rank` closes the env session its `carry` holds.
        Only carriers that cannot move tasks hand tasks over, so only they are called."""
