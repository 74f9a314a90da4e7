"""The scheduler-side hooks, driven with stand-in SGLang objects (no engine)."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_patches import scheduler_hooks as h
from sglang_patches.task_tag import ADMIT, RESUME, TURN, TaskTag


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(h, "STATE", h.SchedulerCTBState())


def _req(tag, session=None):
    rid = tag.to_rid() if tag else "plain-rid"
    h.on_generate_request(None, SimpleNamespace(rid=rid, session_params=SimpleNamespace(id=session) if session else None))
    return SimpleNamespace(rid=rid)


def _tag(kind, task, prio, footprint=100, eval_=False):
    return TaskTag(kind, task, task.split("/")[0], eval_, prio, footprint, 50)


class _Adder:
    """PrefillAdder stand-in: admits while its token budget lasts, like rem_total_tokens does."""

    def __init__(self, rem):
        self.rem_total_tokens = rem
        self.admitted = []

    def add_one_req(self, req, has_chunked_req, truncation_align_size):
        self.admitted.append(req)
        return "CONTINUE"


class _FullAdder(_Adder):
    """SGLang's own KV check says no."""

    def add_one_req(self, req, has_chunked_req, truncation_align_size):
        return "NO_TOKEN"


@settings(max_examples=40, deadline=None)
@given(rem=st.integers(0, 4000), pinned=st.lists(st.integers(0, 200), max_size=10),
       footprints=st.lists(st.integers(1, 1500), min_size=1, max_size=12))
def test_engine_never_second_guesses_the_dispatchers_admission(rem, pinned, footprints):
    """One source of truth: a first turn the dispatcher admitted goes to SGLang's own check
    unchanged, whatever the pinned tasks' reserve; only what SGLang takes in is counted."""
    h.STATE = h.SchedulerCTBState()
    for i, reserve in enumerate(pinned):
        h.STATE.pinned[f"w{i}/0"] = (300, reserve)
    adder = _Adder(rem)
    for i, fp in enumerate(footprints):
        req = _req(_tag(ADMIT, f"g{i}/0", 1.0, fp))
        assert h.around_add_one_req(_Adder.add_one_req, adder, req, False, None) == "CONTINUE"
    assert adder.admitted and h.STATE.admitted == len(footprints)
    full = _FullAdder(0)
    req = _req(_tag(ADMIT, "late/0", 1.0, 10))
    assert h.around_add_one_req(_FullAdder.add_one_req, full, req, False, None) == "NO_TOKEN"
    assert h.STATE.admitted == len(footprints)
    assert not hasattr(h.STATE, "deferred")


def test_turns_of_resident_tasks_and_untagged_requests_are_never_deferred():
    h.STATE.pinned["w/0"] = (300, 10_000)
    adder = _Adder(0)
    for req in (_req(_tag(TURN, "a/0", 1.0)), _req(_tag(RESUME, "b/0", 1.0)), _req(None)):
        assert h.around_add_one_req(_Adder.add_one_req, adder, req, False, None) == "CONTINUE"


def test_waiting_queue_puts_resident_turns_first_and_new_tasks_last_by_priority():
    new_lo = _req(_tag(ADMIT, "n/0", 1.0))
    new_hi = _req(_tag(ADMIT, "e/0", 1000.0, eval_=True))
    turn_lo = _req(_tag(TURN, "t/0", 5.0))
    plain = _req(None)
    turn_hi = _req(_tag(RESUME, "r/0", 150.0))
    queue = [new_lo, new_hi, turn_lo, plain, turn_hi]
    h.after_calc_priority(None, None, queue)
    assert queue == [turn_hi, turn_lo, plain, new_hi, new_lo]


def test_retraction_retracts_lowest_ctb_priority_first_and_untagged_before_tagged():
    reqs = [_req(_tag(TURN, "a/0", 10.0)), _req(None), _req(_tag(TURN, "e/0", 1001.0, eval_=True)),
            _req(_tag(TURN, "c/0", 110.0))]
    default = lambda rs: list(range(len(rs)))  # noqa: E731  SGLang's keep-order (length based)
    order = h.around_retraction_order(default, reqs)
    assert order == [2, 3, 0, 1]  # retract_decode pops from the end: untagged, then P=10, ...
    assert h.STATE.ctb_retractions == 1


def test_closing_a_session_releases_its_pinned_reserve():
    req = _req(_tag(ADMIT, "a/0", 1.0), session="s1")
    h.STATE.pinned["a/0"] = (120, 50)
    assert h.STATE.pinned_reserve() == 50
    h.on_close_session(None, SimpleNamespace(session_id="s1"))
    assert h.STATE.pinned_reserve() == 0
    assert req.rid in h.STATE.tags


def test_report_is_attached_once_to_finished_tagged_requests_only():
    class Req(SimpleNamespace):
        def finished(self):
            return self.done

    tagged = _req(_tag(TURN, "a/0", 1.0), session="s")
    r1 = Req(rid=tagged.rid, done=True, origin_input_ids=[1] * 40, output_ids=[2] * 8, customized_info=None)
    r2 = Req(rid="plain", done=True, origin_input_ids=[1], output_ids=[2], customized_info=None)
    tree = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 900, size=1024),
                           evictable_size=lambda: 10, protected_size=lambda: 48)
    h.before_stream_output(SimpleNamespace(tree_cache=tree), [r1, r2], False)
    (report,) = r1.customized_info[h.REPORT_KEY]
    assert report["context_tokens"] == 48 and report["kv_total"] == 1024 and report["plugin"] == "tide_ctb"
    assert r2.customized_info is None
    assert h.STATE.pinned["a/0"] == (48, 50)  # waits pinned in its session until the next turn
    assert h.around_is_request_level_key(lambda s, k: False, None, h.REPORT_KEY)
    assert not h.around_is_request_level_key(lambda s, k: False, None, "other")


def test_session_release_caches_only_finished_ctb_sessions(monkeypatch):
    calls = []
    monkeypatch.setattr(h, "cache_session_context", lambda cache, kv, req: calls.append(req.rid) or 42)
    _req(_tag(ADMIT, "a/0", 1.0), session="s-a")
    done = SimpleNamespace(rid="r-a", finished=lambda: True)
    busy = SimpleNamespace(rid="r-b", finished=lambda: False)
    slot = SimpleNamespace(kv=SimpleNamespace(holds_kv=True))
    cache = SimpleNamespace(session=SimpleNamespace(slots={"s-a": slot, "s-b": slot, "s-u": slot}))

    def session(req, inflight=False):
        return SimpleNamespace(streaming=True, _inflight=inflight, req_nodes={req.rid: SimpleNamespace(req=req)})

    _req(_tag(TURN, "b/0", 1.0), session="s-b")
    controller = SimpleNamespace(tree_cache=cache, sessions={"s-a": session(done), "s-b": session(busy),
                                                             "s-u": session(done)})
    h.before_session_release(controller, "s-b")  # a turn in flight: SGLang defers, so do we
    h.before_session_release(controller, "s-u")  # untagged session: SGLang's behaviour
    assert calls == [] and "s-b" in h.STATE.ctb_sessions
    h.before_session_release(controller, "s-a")
    assert calls == ["r-a"] and h.STATE.released_cached_tokens == 42 and "s-a" not in h.STATE.ctb_sessions
    h.before_session_release(controller, "s-a")  # once per session
    assert calls == ["r-a"]


class _Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode


def _batch(decode, size, launched):
    return SimpleNamespace(forward_mode=_Mode(decode), reqs=[object()] * size, launch_ts=launched)


def test_decode_timing_counts_decode_batches_only_from_launch_or_the_previous_result(monkeypatch):
    clock = iter([10.0, 10.5, 11.25, 11.5, 13.0])
    monkeypatch.setattr(h.time, "monotonic", lambda: next(clock))
    h.after_process_batch_result(None, None, _batch(False, 3, 9.0))  # prefill ends at 10.0: not counted
    h.after_process_batch_result(None, None, _batch(True, 1, 10.1))  # launched after it: 10.1 -> 10.5
    # Overlapped: launched (10.2) before the previous result was processed (10.5) -> 10.5 -> 11.25.
    h.after_process_batch_result(None, None, _batch(True, 2, 10.2))
    h.after_process_batch_result(None, None, _batch(True, 0, 11.3))  # nothing decoded
    h.after_process_batch_result(None, None, _batch(True, 1, 12.0))  # after an idle spell: 12.0 -> 13.0
    s = h.STATE
    assert (s.decode_iterations, s.decode_seqs) == (3, 4)
    assert s.decode_s == pytest.approx(0.4 + 0.75 + 1.0)
    assert s.decode_seq_s == pytest.approx(0.4 + 2 * 0.75 + 1.0)
    assert (s.decode_floor_iterations, s.decode_floor_s) == (2, pytest.approx(1.4))
    # every batch is busy time: the prefill (9.0 -> 10.0) and the empty one (11.3 -> 11.5) too
    assert s.batch_s == pytest.approx(1.0 + 0.4 + 0.75 + 0.2 + 1.0)


def test_the_report_carries_the_cumulative_decode_counters():
    class Req(SimpleNamespace):
        def finished(self):
            return True

    h.STATE.record_decode(1, 0.02)
    h.STATE.record_decode(4, 0.05)
    h.STATE.batch_s = 0.1
    tagged = _req(_tag(TURN, "a/0", 1.0))
    r = Req(rid=tagged.rid, origin_input_ids=[1] * 4, output_ids=[2], customized_info=None)
    h.before_stream_output(SimpleNamespace(tree_cache=None), [r], False)
    (report,) = r.customized_info[h.REPORT_KEY]
    assert {k: report[k] for k in h.DECODE_COUNTERS} == pytest.approx(
        {"decode_iterations": 2, "decode_s": 0.07, "decode_seqs": 5, "decode_seq_s": 0.22,
         "decode_floor_iterations": 1, "decode_floor_s": 0.02, "batch_s": 0.1})
