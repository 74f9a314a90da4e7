"""The scheduler-side half of CTB: hooks that run inside SGLang's scheduler process.

Each hook is small and only acts on requests that carry a CTB task tag (see `task_tag`);
untagged (vanilla, request-level) requests keep SGLang's behaviour exactly.

- intake (`Scheduler.handle_generate_request`, BEFORE): read the tag from the rid, remember
  the request's task and session; a task whose next turn arrives is no longer "waiting pinned".
- admission (`SchedulePolicy.calc_priority`, AFTER; `PrefillAdder.add_one_req`, AROUND): the
  waiting queue is ordered resident-task turns first (highest CTB priority first), then untagged
  requests, then first turns of newly admitted tasks. A new task's first turn is prefilled only
  while the engine's free KV (`rem_total_tokens`, which already excludes KV locked by open
  sessions) minus the growth reserved for tasks that wait pinned between turns still holds the
  task's footprint; otherwise it stays queued (never dropped).
- memory pressure (`ScheduleBatch._get_decode_retraction_order`, AROUND): when
  `retract_decode` must free KV, it retracts the lowest CTB priority first instead of SGLang's
  length-based `retraction_key`.
- sessions (`Scheduler.close_session`, BEFORE): closing a task's session is how the dispatcher
  pauses it (its KV becomes evictable, and stays in the radix tree until evicted); the pinned
  record and its reserve go away with it. Keeping a prefix pinned = keeping the session open.
- reporting (`SchedulerOutputStreamer.stream_output`, BEFORE, and
  `is_request_level_customized_info_key`, AROUND): every finished tagged request carries
  `meta_info["tide_ctb"] = [report]` with the task's context and the engine's KV state, so the
  dispatcher learns footprints and cache state every turn; the report is also the proof that the
  plugin runs inside the scheduler process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_patches.task_tag import ADMIT, TaskTag, parse_rid

REPORT_KEY = "tide_ctb"
"""meta_info key of the per-request CTB report."""


@dataclass
class SchedulerCTBState:
    """What the plugin tracks inside one scheduler process."""

    tags: dict[str, TaskTag] = field(default_factory=dict)
    """Tag of every live tagged request, by rid."""
    session_task: dict[str, str] = field(default_factory=dict)
    """Task id of each open session that carried a tagged request."""
    pinned: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Tasks waiting between turns with an open session: task id -> (context tokens, turn reserve)."""
    admitted: int = 0
    """First turns of new tasks that passed the admission check."""
    deferred: int = 0
    """Admission checks that kept a new task's first turn queued for lack of KV."""
    ctb_retractions: int = 0
    """Retraction orders computed by CTB priority."""
    hooks_called: dict[str, int] = field(default_factory=dict)

    def pinned_reserve(self) -> int:
        return sum(reserve for _ctx, reserve in self.pinned.values())

    def count(self, hook: str) -> None:
        self.hooks_called[hook] = self.hooks_called.get(hook, 0) + 1


STATE = SchedulerCTBState()


def _tag(req: Any) -> Optional[TaskTag]:
    return STATE.tags.get(getattr(req, "rid", None))


# -- intake -------------------------------------------------------------------------------
def on_generate_request(scheduler, recv_req, *args, **kwargs):
    """BEFORE Scheduler.handle_generate_request."""
    tag = parse_rid(getattr(recv_req, "rid", None))
    if tag is None:
        return None
    STATE.count("intake")
    STATE.tags[recv_req.rid] = tag
    STATE.pinned.pop(tag.task_id, None)  # its turn is here: SGLang now accounts for it as running
    session_params = getattr(recv_req, "session_params", None)
    if session_params is not None and getattr(session_params, "id", None):
        STATE.session_task[session_params.id] = tag.task_id
    return None


def on_close_session(scheduler, recv_req, *args, **kwargs):
    """BEFORE Scheduler.close_session: a closed session no longer pins its task's prefix."""
    task_id = STATE.session_task.pop(getattr(recv_req, "session_id", None), None)
    if task_id is not None:
        STATE.count("close_session")
        STATE.pinned.pop(task_id, None)
    return None


# -- admission ----------------------------------------------------------------------------
def _queue_key(req: Any) -> tuple[int, float]:
    tag = _tag(req)
    if tag is None:
        return (1, 0.0)
    return (2 if tag.kind == ADMIT else 0, -tag.priority)


def after_calc_priority(result, policy, waiting_queue, *args, **kwargs):
    """AFTER SchedulePolicy.calc_priority: resident tasks' turns first, new tasks last."""
    if any(getattr(r, "rid", None) in STATE.tags for r in waiting_queue):
        STATE.count("calc_priority")
        waiting_queue.sort(key=_queue_key)  # stable: SGLang's order is kept within a class
    return result


def around_add_one_req(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req: token-aware admission of a new task's first turn."""
    tag = _tag(req)
    if tag is not None and tag.kind == ADMIT:
        STATE.count("add_one_req")
        headroom = int(adder.rem_total_tokens) - STATE.pinned_reserve()
        if headroom < tag.footprint_tokens:
            STATE.deferred += 1
            from sglang.srt.managers.schedule_policy import AddReqResult

            # OTHER stops this prefill round without marking the running batch full; the request
            # stays at the back of the waiting queue and is tried again next round.
            return AddReqResult.OTHER
        STATE.admitted += 1
    return original(adder, req, *args, **kwargs)


# -- memory pressure ----------------------------------------------------------------------
def around_retraction_order(original, reqs, *args, **kwargs):
    """AROUND ScheduleBatch._get_decode_retraction_order (the home of `retraction_key`).

    Returns indices from most- to least-preferred to keep; retract_decode pops from the end.
    Tagged requests are ordered by CTB priority (eval > group completion > active > context);
    untagged ones go last, in SGLang's own order, so they are retracted first.
    """
    order = original(reqs, *args, **kwargs)
    if not any(getattr(r, "rid", None) in STATE.tags for r in reqs):
        return order
    STATE.count("retraction_order")
    STATE.ctb_retractions += 1
    rank_in_default = {idx: pos for pos, idx in enumerate(order)}

    def keep_key(i: int) -> tuple[int, float, int]:
        tag = _tag(reqs[i])
        return (0, -tag.priority, rank_in_default[i]) if tag is not None else (1, 0.0, rank_in_default[i])

    return sorted(order, key=keep_key)


# -- reporting ----------------------------------------------------------------------------
def _kv_state(tree_cache: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        allocator = tree_cache.token_to_kv_pool_allocator
        out["kv_available"] = int(allocator.available_size())
        out["kv_total"] = int(getattr(allocator, "size", 0) or getattr(allocator, "size_full", 0))
        out["kv_evictable"] = int(tree_cache.evictable_size())
        out["kv_protected"] = int(tree_cache.protected_size())
    except Exception as exc:  # a report without KV numbers beats a crashed scheduler
        out["kv_error"] = f"{type(exc).__name__}: {exc}"
    return out


def before_stream_output(streamer, reqs, *args, **kwargs):
    """BEFORE SchedulerOutputStreamer.stream_output: attach the CTB report to finished requests."""
    for req in reqs:
        tag = _tag(req)
        if tag is None or not req.finished():
            continue
        STATE.count("report")
        context = len(req.origin_input_ids) + len(req.output_ids)
        in_session = getattr(req, "session", None) is not None or tag.task_id in STATE.session_task.values()
        if in_session:
            STATE.pinned[tag.task_id] = (context, tag.turn_reserve_tokens)
        report = {
            "plugin": "tide_ctb",
            "pid": os.getpid(),
            "task_id": tag.task_id,
            "kind": tag.kind,
            "context_tokens": context,
            "retraction_count": int(getattr(req, "retraction_count", 0) or 0),
            "pinned_tasks": len(STATE.pinned),
            "pinned_reserve": STATE.pinned_reserve(),
            "admitted": STATE.admitted,
            "deferred": STATE.deferred,
            "ctb_retractions": STATE.ctb_retractions,
            "hooks_called": dict(STATE.hooks_called),
            **_kv_state(streamer.tree_cache),
        }
        req.customized_info = dict(req.customized_info or {})
        req.customized_info[REPORT_KEY] = [report]
        STATE.tags.pop(req.rid, None)
    return None


def around_is_request_level_key(original, streamer, key, *args, **kwargs):
    """AROUND is_request_level_customized_info_key: the report is sent once, not per token."""
    return key == REPORT_KEY or original(streamer, key, *args, **kwargs)
