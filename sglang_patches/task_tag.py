"""The task tag that rides on a request's `rid` from the dispatcher to SGLang's scheduler.

Why the rid: it is the one field that survives unchanged from `Engine.async_generate` through
the tokenizer manager (`GenerateReqInput.rid` -> `TokenizedGenerateReqInput.rid`) to the
scheduler's `Req.rid`, for plain requests and for streaming-session requests alike (the
session builds its `Req` from the same `recv_req`). `custom_labels` reaches the scheduler only
when metrics are on, and `session_params` exists only for session requests. A rid must be
unique per request, so the tag ends with a random suffix.

Format: ``tide-ctb:<kind>:<task_id>:<group_id>:<eval>:<priority>:<footprint>:<reserve>:<nonce>``
with every field percent-quoted, so task ids may contain any character. Pure Python: both the
dispatcher and the scheduler-side plugin import it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional
from urllib.parse import quote, unquote

PREFIX = "tide-ctb"

ADMIT = "admit"
"""First request of a task that the dispatcher has just admitted onto this engine."""
TURN = "turn"
"""A later turn of a resident task (its session holds the earlier context)."""
RESUME = "resume"
"""First request after a pause: the whole context is sent again (it may hit the radix cache)."""
KINDS = (ADMIT, TURN, RESUME)


@dataclass(frozen=True)
class TaskTag:
    """What the scheduler needs to know about the task behind a request."""

    kind: str
    """ADMIT, TURN or RESUME."""
    task_id: str
    """Trajectory-task id (`group/index`)."""
    group_id: str
    """GRPO group id."""
    is_eval: bool
    """Evaluation task (top priority, I_eval)."""
    priority: float
    """CTB priority P(t) at the time the turn was sent; the engine retracts lowest first."""
    footprint_tokens: int
    """Tokens the dispatcher reserved for the task (probed estimate or last context)."""
    turn_reserve_tokens: int
    """Tokens one more turn of this task may add while it waits pinned (observation + action)."""

    def to_rid(self) -> str:
        fields = (self.kind, self.task_id, self.group_id, "1" if self.is_eval else "0",
                  repr(float(self.priority)), str(int(self.footprint_tokens)),
                  str(int(self.turn_reserve_tokens)), uuid.uuid4().hex[:12])
        return PREFIX + ":" + ":".join(quote(f, safe="") for f in fields)


def parse_rid(rid: object) -> Optional[TaskTag]:
    """The tag carried by `rid`, or None for an untagged (vanilla) request."""
    if not isinstance(rid, str) or not rid.startswith(PREFIX + ":"):
        return None
    parts = rid.split(":")
    if len(parts) != 9:
        return None
    kind, task_id, group_id, is_eval, priority, footprint, reserve, _nonce = (unquote(p) for p in parts[1:])
    if kind not in KINDS:
        return None
    try:
        return TaskTag(kind, task_id, group_id, is_eval == "1", float(priority), int(footprint), int(reserve))
    except ValueError:
        return None
