"""The scheduler-side half of CTB: hooks that run inside SGLang's scheduler process.

Each hook is small and only acts on requests that carry a CTB task tag (see `task_tag`);
untagged (vanilla, request-level) requests keep SGLang's behaviour exactly.

- intake (`Scheduler.handle_generate_request`, BEFORE): read the tag from the rid, remember
  the request's task and session; a task whose next turn arrives is no longer "waiting pinned".
- admission (`SchedulePolicy.calc_priority`, AFTER; `PrefillAdder.add_one_req`, AROUND): the
  waiting queue is ordered resident-task turns first (highest CTB priority first), then untagged
  requests, then first turns of newly admitted tasks. Which tasks run is decided in ONE place,
  the dispatcher (its per-rank token budget, below the KV pool); the engine does not second-guess
  it with a reserve of its own (that double bookkeeping kept first turns queued here while the
  dispatcher counted them as running). A first turn is only held back by SGLang's own check,
  i.e. when the KV it needs physically is not there; the hook counts admissions for the report.
- memory pressure (`ScheduleBatch._get_decode_retraction_order`, AROUND): when
  `retract_decode` must free KV, it retracts the lowest CTB priority first instead of SGLang's
  length-based `retraction_key`.
- sessions (`Scheduler.close_session`, BEFORE): closing a task's session is how the dispatcher
  pauses it; the pinned record and its reserve go away with it. Keeping a prefix pinned =
  keeping the session open.
- cache on release (`SessionController._close`, BEFORE): SGLang's streaming session publishes
  only its *first* prompt into the radix tree and, on close, frees every later turn's KV
  (`StreamingSession.release_session` frees `[cache_protected_len, kv_allocated_len)`). For a
  CTB task's session the hook first inserts the whole committed context (all turns) into the
  tree and moves `cache_protected_len` up to it, so release frees only the uncommitted tail and
  the paused task's context stays as evictable cache that its resume can hit.
- decode timing (`Scheduler.process_batch_result`, AFTER): cumulative counters of decode
  iterations, their seconds and batch sizes, and of batch-of-one iterations (the floor), for
  ERS's decode slowdown (see `after_process_batch_result` for what the time covers). These
  count every decode batch, tagged or not: the slowdown is the engine's, not a task's.
- reporting (`SchedulerOutputStreamer.stream_output`, BEFORE, and
  `is_request_level_customized_info_key`, AROUND): every finished tagged request carries
  `meta_info["tide_ctb"] = [report]` with the task's context and the engine's KV state, so the
  dispatcher learns footprints and cache state every turn; the report is also the proof that the
  plugin runs inside the scheduler process. It also carries the decode counters
  (`DECODE_COUNTERS`), which reach rank 0 with the turn (`TurnEvent.report`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_patches.task_tag import ADMIT, TaskTag, parse_rid

REPORT_KEY = "tide_ctb"
"""meta_info key of the per-request CTB report."""

DECODE_COUNTERS = ("decode_iterations", "decode_s", "decode_seqs", "decode_seq_s", "decode_floor_iterations",
                   "decode_floor_s", "batch_s")
"""The report's cumulative batch counters (rank 0's rollout service takes their differences)."""


@dataclass
class SchedulerCTBState:
    """What the plugin tracks inside one scheduler process."""

    tags: dict[str, TaskTag] = field(default_factory=dict)
    """Tag of every live tagged request, by rid."""
    session_task: dict[str, str] = field(default_factory=dict)
    """Task id of each open session that carried a tagged request."""
    pinned: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Tasks waiting between turns with an open session: task id -> (context tokens, turn reserve).
    Reported only (the dispatcher's budget decides admission)."""
    admitted: int = 0
    """First turns of new tasks that SGLang's PrefillAdder took into a prefill batch."""
    ctb_retractions: int = 0
    """Retraction orders computed by CTB priority."""
    ctb_sessions: set = field(default_factory=set)
    """Open sessions that carried a tagged request (cached into the tree on close)."""
    released_cached_tokens: int = 0
    """Tokens of closed CTB sessions inserted into the radix tree on release (beyond the prompt)."""
    released_sessions: int = 0
    decode_iterations: int = 0
    """Decode batches whose results were processed since the scheduler started."""
    decode_s: float = 0.0
    """Their seconds (see `after_process_batch_result`)."""
    decode_seqs: int = 0
    """Sum of their batch sizes (sequences)."""
    decode_seq_s: float = 0.0
    """Sum of batch size x seconds (a time-weighted mean batch is decode_seq_s / decode_s)."""
    decode_floor_iterations: int = 0
    """Of the decode iterations, those with a batch of one."""
    decode_floor_s: float = 0.0
    batch_s: float = 0.0
    """Seconds of every batch (prefill, decode, mixed) whose result was processed: the time the
    engine computed, the rest it had nothing to run (ERS's `rollout_busy_s`)."""
    last_result_done: Optional[float] = None
    """`time.monotonic()` when the previous batch's result processing ended (any mode)."""
    hooks_called: dict[str, int] = field(default_factory=dict)

    def pinned_reserve(self) -> int:
        return sum(reserve for _ctx, reserve in self.pinned.values())

    def count(self, hook: str) -> None:
        self.hooks_called[hook] = self.hooks_called.get(hook, 0) + 1

    def record_batch(self, seconds: float) -> None:
        """A batch of any kind (prefill, decode, mixed) ran for `seconds`."""
        self.batch_s += seconds

    def record_decode(self, batch_size: int, seconds: float, iterations: int = 1) -> None:
        """`iterations` decode iterations of `batch_size` sequences, `seconds` in all."""
        self.decode_iterations += iterations
        self.decode_s += seconds
        self.decode_seqs += batch_size * iterations
        self.decode_seq_s += batch_size * seconds
        if batch_size == 1:
            self.decode_floor_iterations += iterations
            self.decode_floor_s += seconds

    def report(self, tag: TaskTag, context_tokens: int, retraction_count: int, kv_state: dict[str, Any]) -> dict:
        """The report a finished tagged request carries (`meta_info["tide_ctb"]`)."""
        return {
            "plugin": "tide_ctb",
            "pid": os.getpid(),
            "task_id": tag.task_id,
            "kind": tag.kind,
            "context_tokens": context_tokens,
            "retraction_count": retraction_count,
            "pinned_tasks": len(self.pinned),
            "pinned_reserve": self.pinned_reserve(),
            "admitted": self.admitted,
            "ctb_retractions": self.ctb_retractions,
            "released_sessions": self.released_sessions,
            "released_cached_tokens": self.released_cached_tokens,
            "hooks_called": dict(self.hooks_called),
            **self.decode_counters(),
            **kv_state,
        }

    def decode_counters(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in DECODE_COUNTERS}


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
        STATE.ctb_sessions.add(session_params.id)
    return None


def on_close_session(scheduler, recv_req, *args, **kwargs):
    """BEFORE Scheduler.close_session: a closed session no longer pins its task's prefix."""
    task_id = STATE.session_task.pop(getattr(recv_req, "session_id", None), None)
    if task_id is not None:
        STATE.count("close_session")
        STATE.pinned.pop(task_id, None)
    return None


def before_session_release(controller, session_id, *args, **kwargs):
    """BEFORE SessionController._close: cache a CTB session's whole context in the radix tree.

    Runs for an immediate close and for a deferred one (`maybe_reap` calls `_close` again once
    the in-flight turn finished); while a turn is still in flight it does nothing (SGLang defers).
    """
    if session_id not in STATE.ctb_sessions:
        return None
    session = controller.sessions.get(session_id)
    if session is None or not session.streaming:
        STATE.ctb_sessions.discard(session_id)
        return None
    if session._inflight or any(not n.req.finished() for n in session.req_nodes.values()):
        return None  # SGLang defers this close; the hook runs again when it is carried out
    STATE.ctb_sessions.discard(session_id)
    if len(session.req_nodes) != 1:
        return None
    (node,) = session.req_nodes.values()
    cache = controller.tree_cache
    slot = getattr(getattr(cache, "session", None), "slots", {}).get(session_id)
    if slot is None or not slot.kv.holds_kv:
        return None
    try:
        inserted = cache_session_context(cache, slot.kv, node.req)
    except Exception:  # never break a close: without the insert, release frees the tail as before
        import logging

        logging.getLogger(__name__).exception("tide_ctb: caching session %s on release failed", session_id)
        return None
    STATE.count("release_cached")
    STATE.released_sessions += 1
    STATE.released_cached_tokens += inserted
    return None


def cache_session_context(cache: Any, kv: Any, req: Any) -> int:
    """Insert `[kv.cache_protected_len, committed)` of a session record into the radix tree.

    `req` is the session's last finished turn: its origin_input_ids + output_ids are the token
    ids of the record's row. Afterwards the tree owns `[0, committed)` (`cache_protected_len`
    is moved there), so `release_session` frees only the rest. Returns the tokens the tree took
    over beyond the previously protected prefix (0 when the cache layout is not the plain one).
    """
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    if getattr(cache, "disable", False):
        return 0
    components = getattr(cache, "_components_tuple", ())
    if len(components) != 1 or getattr(components[0], "component_type", None) is None:
        return 0
    from sglang.srt.mem_cache.unified_cache.component_type import BASE_COMPONENT_TYPE

    if components[0].component_type != BASE_COMPONENT_TYPE or cache.tree_core.is_eagle:
        return 0
    finished_len = req.finished_len if req.finished_len is not None else len(req.output_ids)
    tokens = list(req.origin_input_ids) + list(req.output_ids[:finished_len])
    end = min(kv.kv_committed_len, kv.kv_allocated_len, len(tokens))
    protected = kv.cache_protected_len
    if end <= protected:
        return 0
    key = RadixKey(array("q", tokens[:end]), req.extra_key, cache_salt=req.cache_salt).page_aligned(cache.page_size)
    if len(key) <= protected:
        return 0
    values = cache.req_to_token_pool.req_to_token[kv.req_pool_idx, : len(key)].to(dtype=torch.int64, copy=True)
    result = cache.insert(InsertParams(key=key, value=values, prev_prefix_len=protected,
                                       inserted_len=kv.cache_inserted_len, priority=req.priority or 0))
    if result.rotation_tail_declined:
        return 0
    # The tree owns [0, len(key)) now (new nodes, or duplicates it freed); release frees the rest.
    kv.cache_protected_len = len(key)
    kv.cache_inserted_len = max(kv.cache_inserted_len, len(key))
    return len(key) - protected


# -- admission ----------------------------------------------------------------------------
def queue_key(tag: Optional[TaskTag]) -> tuple[int, float]:
    """Waiting-queue order: resident tasks' turns (highest CTB priority first), then untagged
    requests, then first turns of newly admitted tasks. Sort stably by it."""
    if tag is None:
        return (1, 0.0)
    return (2 if tag.kind == ADMIT else 0, -tag.priority)


def keep_key(tag: Optional[TaskTag]) -> tuple[int, float]:
    """Retraction order under memory pressure: the running request with the largest key goes
    first, i.e. untagged ones, then tagged ones from the lowest CTB priority up."""
    return (0, -tag.priority) if tag is not None else (1, 0.0)


def _queue_key(req: Any) -> tuple[int, float]:
    return queue_key(_tag(req))


def after_calc_priority(result, policy, waiting_queue, *args, **kwargs):
    """AFTER SchedulePolicy.calc_priority: resident tasks' turns first, new tasks last."""
    if any(getattr(r, "rid", None) in STATE.tags for r in waiting_queue):
        STATE.count("calc_priority")
        waiting_queue.sort(key=_queue_key)  # stable: SGLang's order is kept within a class
    return result


def around_add_one_req(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req: count first turns of admitted tasks SGLang takes in.

    No admission decision here: the dispatcher already admitted the task against its rank's
    token budget; a second, engine-side reserve check would hold the turn while the dispatcher
    books it as running. SGLang's own KV check (inside `original`) still applies."""
    result = original(adder, req, *args, **kwargs)
    tag = _tag(req)
    if tag is not None and tag.kind == ADMIT:
        STATE.count("add_one_req")
        if getattr(result, "name", result) == "CONTINUE":  # AddReqResult.CONTINUE
            STATE.admitted += 1
    return result


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

    return sorted(order, key=lambda i: (*keep_key(_tag(reqs[i])), rank_in_default[i]))


# -- decode timing -----------------------------------------------------------------------
def after_process_batch_result(_none, scheduler, batch, *args, **kwargs):
    """AFTER Scheduler.process_batch_result: time a decode iteration, sync-free.

    A decode iteration lasts from max(its launch, the end of the previous batch's result
    processing) to the end of its own result processing. Timing `run_batch` alone would not do:
    on GPU it only launches kernels (more so with the overlap scheduler), and a
    `synchronize()` to wait for them would cost the hot path the very overlap it has. The end
    of result processing is a point SGLang already waits at: `process_batch_result_decode`
    waits for the sampled tokens' copy to the host (`result.copy_done`), i.e. for the forward.
    - Without overlap (CPU here, overlap is off) the previous result was processed before
      this batch launched: the span is launch -> forward -> sampled tokens on the host -> their
      processing (streaming included), and leaves out request intake and scheduling (weight
      updates and requests are handled there, not decode).
    - With the overlap scheduler the previous result is processed after this batch launched,
      so the span is result-to-result: in steady state the iteration period, bounded by the
      GPU or the CPU, whichever is slower. The first decode after an idle spell starts at its
      own launch. Limit: a long intake step between two busy overlapped iterations (a weight
      load without pausing generation) is counted in one iteration's time.
    Only decode batches count as decode (`forward_mode.is_decode()`); every batch, prefill,
    mixed and speculative verify included, counts in `batch_s`, the engine's busy time.
    """
    done = time.monotonic()  # the clock of `batch.launch_ts` (set in `Scheduler.run_batch`)
    prev_done, STATE.last_result_done = STATE.last_result_done, done
    mode = getattr(batch, "forward_mode", None)
    launched = getattr(batch, "launch_ts", None)
    if mode is None or launched is None:
        return None
    seconds = max(0.0, done - (launched if prev_done is None else max(launched, prev_done)))
    STATE.record_batch(seconds)
    size = len(batch.reqs)
    if size and mode.is_decode():
        STATE.record_decode(size, seconds)
    return None


# -- reporting ----------------------------------------------------------------------------
def _kv_state(tree_cache: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        allocator = tree_cache.token_to_kv_pool_allocator
        out["kv_available"] = int(allocator.available_size())
        out["kv_total"] = int(getattr(allocator, "size", 0) or getattr(allocator, "size_full", 0))
        out["kv_evictable"] = int(tree_cache.evictable_size())
        out["kv_protected"] = int(tree_cache.protected_size())
        # Request rows (req_to_token_pool): each open streaming session holds one between turns.
        rows = tree_cache.req_to_token_pool
        out["rows_free"] = int(rows.available_size())
        out["rows_total"] = int(rows.size)
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
        report = STATE.report(tag, context, int(getattr(req, "retraction_count", 0) or 0),
                              _kv_state(streamer.tree_cache))
        req.customized_info = dict(req.customized_info or {})
        req.customized_info[REPORT_KEY] = [report]
        STATE.tags.pop(req.rid, None)
    return None


def around_is_request_level_key(original, streamer, key, *args, **kwargs):
    """AROUND is_request_level_customized_info_key: the report is sent once, not per token."""
    return key == REPORT_KEY or original(streamer, key, *args, **kwargs)
