"""The token ledger kept per account (`TokenAudit`): legal histories verify, and a token booked
twice, consumed twice, lost, or moved from the wrong bucket fails with `LedgerError` naming its
account (issue 36, item 4: a ledger check that can fail)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tide_megatron.core import (
    BufferConfig,
    GlobalBuffer,
    LedgerError,
    SignalsConfig,
    TokenAudit,
    TokenLedger,
    Trajectory,
)


def audited(remember_steps: int = 2) -> TokenLedger:
    return TokenLedger(audit=TokenAudit(remember_steps=remember_steps))


def traj(gid, i, *, version=0, gen=10, reward=0.0, is_eval=False):
    return Trajectory(gid, i, "t", version, 5, gen, reward, is_eval=is_eval)


def buffer(**kw) -> GlobalBuffer:
    cfg = dict(group_size=2, b_min=2, b_ideal=4, max_staleness=1)
    cfg.update(kw)
    return GlobalBuffer(BufferConfig(**cfg), SignalsConfig(micro_batch_tokens=30))


# -- legal histories verify ------------------------------------------------------------------------
# One account's legal life: booked in flight (maybe in several reports), then either closed from
# in flight, or completed and then closed from ready (or left open); or booked closed at once.
FROM_IN_FLIGHT = ("fail", "cancel", "evaluate", "drop_stale", None)
FROM_READY = ("consume", "drop_stale", "cancel", None)


@st.composite
def histories(draw):
    """A random interleaving of legal account lives, with step ends (`verify`) among them."""
    events = []
    for k in range(draw(st.integers(0, 25))):
        key = f"a{k}"
        if draw(st.booleans()):  # an attempt that ended without a trajectory, or lost tokens
            events.append([("book", key, draw(st.sampled_from(["failed", "cancelled", "lost"])),
                            draw(st.integers(0, 50)))])
            continue
        life = [("produce", key, n) for n in draw(st.lists(st.integers(0, 50), min_size=1, max_size=3))]
        end = draw(st.sampled_from(FROM_IN_FLIGHT + ("complete",)))
        if end == "complete":
            life.append(("complete", key))
            then = draw(st.sampled_from(FROM_READY))
            if then is not None:
                life.append((then, key, True))
        elif end is not None:
            life.append((end, key, False))
        events.append(life)
    # interleave the lives (each in order) and sprinkle step ends
    order = []
    pending = [list(life) for life in events]
    while any(pending):
        i = draw(st.sampled_from([j for j, life in enumerate(pending) if life]))
        order.append(pending[i].pop(0))
        if draw(st.integers(0, 4)) == 0:
            order.append(("verify",))
    return order


def replay(ledger: TokenLedger, history) -> dict[str, tuple[str, int]]:
    """Run `history` on `ledger`, verifying at each step end with the accounts a holder would
    hold (in flight and ready ones). Returns those at the end."""
    held: dict[str, tuple[str, int]] = {}
    for event in history:
        op, *args = event
        if op == "verify":
            ledger.verify(dict(held))
            continue
        key = args[0]
        if op == "book":
            bucket, n = args[1], args[2]
            (ledger.lose(n, key=key) if bucket == "lost" else ledger.book_attempt(n, fate=bucket, key=key))
        elif op == "produce":
            ledger.produce(args[1], key=key)
            held[key] = ("in_flight", held.get(key, ("in_flight", 0))[1] + args[1])
        elif op == "complete":
            ledger.complete(held[key][1], key=key)
            held[key] = ("ready", held[key][1])
        else:
            from_ready = args[1]
            n = held.pop(key)[1]
            if op == "consume":
                ledger.consume(n, key=key)
            elif op == "fail":
                ledger.fail(n, key=key)
            elif op == "evaluate":
                ledger.evaluate(n, key=key)
            elif op == "drop_stale":
                ledger.drop_stale(n, from_ready=from_ready, key=key)
            else:
                ledger.cancel(n, from_ready=from_ready, key=key)
    return held


@settings(max_examples=150, deadline=None)
@given(histories(), st.integers(0, 3))
def test_random_legal_histories_verify_at_every_step(history, remember_steps):
    ledger = audited(remember_steps)
    held = replay(ledger, history)
    ledger.verify(held)
    assert ledger.balanced
    # only the open accounts are kept after a step's check; the closed ones live on as totals
    assert set(ledger.audit.accounts) == set(held)
    assert sum(ledger.audit.closed.values()) + sum(n for _, n in held.values()) == ledger.generated


class BufferMachine(RuleBasedStateMachine):
    """The buffer's own moves (live reports, aborts, completions, eval groups, fetches, drops,
    cancels, failures) keep the per-account ledger right; each step's end verifies it."""

    def __init__(self):
        super().__init__()
        self.buf = buffer(group_size=2, b_min=2, b_ideal=4, max_staleness=1)
        self.now, self.version, self.next_gid = 0.0, 0, 0
        self.running: dict[str, dict[int, int]] = {}  # pending group -> index -> tokens reported live

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    @rule(is_eval=st.booleans())
    def open_group(self, is_eval):
        gid = f"g{self.next_gid}"
        self.next_gid += 1
        self.buf.open_group(gid, "t", self._tick(), is_eval=is_eval, admitted_version=self.version)
        self.running[gid] = {}

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tokens=st.integers(0, 20))
    def report_live(self, data, tokens):
        gid = data.draw(st.sampled_from(sorted(self.running)))
        left = [i for i in range(2) if i not in self.buf._pending[gid].done]
        if left:
            i = data.draw(st.sampled_from(left))
            self.buf.record_tokens(gid, i, tokens, policy_version=self.version)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        gid = data.draw(st.sampled_from(sorted(self.running)))
        left = [i for i in range(2) if i not in self.buf._pending[gid].done]
        if left:
            self.buf.abort_trajectory(gid, data.draw(st.sampled_from(left)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.integers(0, 20), reward=st.floats(0, 1))
    def finish(self, data, extra, reward):
        gid = data.draw(st.sampled_from(sorted(self.running)))
        group = self.buf._pending[gid]
        left = [i for i in range(2) if i not in group.done]
        i = data.draw(st.sampled_from(left))
        gen = group.recorded_tokens.get(i, 0) + extra
        self.buf.add_trajectory(traj(gid, i, version=self.version, gen=gen, reward=reward, is_eval=group.is_eval),
                                self._tick(), consumer_version=self.version)
        if not self.buf.is_pending(gid):
            del self.running[gid]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), stale=st.booleans())
    def give_up(self, data, stale):
        gid = data.draw(st.sampled_from(sorted(self.running)))
        self.buf.abandon_group(gid, self._tick(), stale=stale, consumer_version=self.version)
        del self.running[gid]

    @rule(max_trajectories=st.integers(0, 4))
    def train_step(self, max_trajectories):
        self.buf.begin_step(self._tick())
        self.buf.fetch(self.version, self.now, max_trajectories)
        self.buf.end_step(self._tick())  # verifies the ledger per account
        self.version += 1

    @invariant()
    def accounts_match_the_buffer(self):
        assert self.buf.audit() == []


BufferMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBufferLedgerPerAccount = BufferMachine.TestCase


def test_closed_accounts_are_folded_away_at_each_step_and_memory_stays_bounded():
    b = buffer()
    for step in range(50):
        gid = f"g{step}"
        b.add_trajectory(traj(gid, 0, version=step), float(step))
        b.add_trajectory(traj(gid, 1, version=step), float(step))
        b.begin_step(float(step))
        assert [g.group_id for g in b.fetch(step, float(step), 2)] == [gid]
        b.end_step(float(step))
    audit = b.ledger.audit
    assert audit.accounts == {} and len(audit._recent) == audit.remember_steps
    assert audit.closed["consumed"] == b.ledger.consumed == 50 * 20
    b.ledger.consumed += 1  # a counter moved around the accounts
    b.begin_step(60.0)
    with pytest.raises(LedgerError, match="ledger.consumed counts 1001 tokens, its accounts hold 1000"):
        b.end_step(60.0)


def test_a_retried_attempt_is_a_new_account():
    b = buffer()
    b.open_group("g", "t", 0.0)
    b.record_tokens("g", 0, 4)
    b.abort_trajectory("g", 0)
    b.record_tokens("g", 0, 3)
    assert b.ledger.audit.accounts["g/0"].bucket == "failed" and b.ledger.audit.accounts["g/0#1"].tokens == 3
    b.add_trajectory(traj("g", 0, gen=5), 1.0)
    b.add_trajectory(traj("g", 1, gen=6), 1.0)
    b.begin_step(2.0)
    b.end_step(2.0)
    assert set(b.ledger.audit.accounts) == {"g/0#1", "g/1"}  # ready; the aborted one is folded away


def test_restore_takes_closed_tokens_only():
    led = audited()
    counts = {**dict.fromkeys(TokenLedger.BUCKETS, 0), "consumed": 7, "failed": 3, "generated": 10}
    led.restore(counts)
    led.verify({})
    assert led.audit.closed["consumed"] == 7
    with pytest.raises(LedgerError, match="open tokens without their accounts"):
        audited().restore({**counts, "in_flight": 2, "generated": 12})
    with pytest.raises(LedgerError, match="do not balance"):
        audited().restore({**counts, "generated": 11})


# -- faults: each fails, naming the account ------------------------------------------------------
def test_a_token_booked_twice_fails():
    led = audited()
    led.book_attempt(5, fate="failed", key="g0v0/1: TaskFailed from rank 2 (end #7)")
    with pytest.raises(LedgerError, match=r"'g0v0/1: TaskFailed from rank 2 \(end #7\)' booked twice"):
        led.book_attempt(5, fate="failed", key="g0v0/1: TaskFailed from rank 2 (end #7)")
    # in the buffer: more tokens reported for a trajectory that was consumed already
    b = buffer()
    b.add_trajectory(traj("g", 0), 0.0)
    b.add_trajectory(traj("g", 1), 0.0)
    b.begin_step(1.0)
    b.fetch(0, 1.0, 2)
    with pytest.raises(LedgerError, match="'g/0' booked twice: 3 more tokens in flight, but it is consumed"):
        b.ledger.produce(3, key="g/0")
    b.end_step(2.0)  # folded away: still named for `remember_steps` steps
    with pytest.raises(LedgerError, match="'g/1' booked twice: into failed, but it was closed as consumed"):
        b.ledger.book_attempt(3, fate="failed", key="g/1")
    assert b.ledger.generated == 20  # nothing changed by the refused bookings


def test_an_account_consumed_twice_fails():
    led = audited()
    led.produce(5, key="a")
    led.complete(5, key="a")
    led.produce(4, key="b")
    led.complete(4, key="b")
    led.consume(5, key="a")
    with pytest.raises(LedgerError, match=r"'a' moved from ready to consumed, but it is consumed \(consumed twice\)"):
        led.consume(5, key="a")  # named before the counters are looked at
    led.verify({"b": ("ready", 4)})
    with pytest.raises(LedgerError, match=r"'a' .* closed as consumed already \(twice\)"):
        led.consume(4, key="a")  # b's 4 tokens would cover it in the counters
    assert (led.ready, led.consumed) == (4, 5)


def test_a_lost_account_fails_the_step():
    led = audited()
    led.produce(6, key="a")
    led.complete(6, key="a")
    with pytest.raises(LedgerError, match="'a' holds 6 ready tokens that nothing holds"):
        led.verify({})  # the step claims nothing is open any more
    # in the buffer: a pending group vanishes without its tokens being booked anywhere
    b = buffer()
    b.open_group("g", "t", 0.0)
    b.record_tokens("g", 0, 5)
    b.record_tokens("g", 1, 2)
    del b._pending["g"]  # the bug: dropped, neither cancelled nor failed
    assert b.ledger.balanced  # the counters still add up
    b.begin_step(1.0)
    with pytest.raises(LedgerError, match=r"'g/0' holds 5 in_flight tokens that nothing holds.*\(and 1 more"):
        b.end_step(1.0)


def test_a_move_from_the_wrong_bucket_fails():
    led = audited()
    led.produce(5, key="a")
    led.produce(5, key="b")
    led.complete(5, key="b")  # ready holds 5 tokens: the counters would allow the move below
    with pytest.raises(LedgerError, match="'a' moved from ready to consumed, but it is in_flight"):
        led.consume(5, key="a")
    with pytest.raises(LedgerError, match="'b' moved from in_flight to failed, but it is ready"):
        led.fail(5, key="b")
    with pytest.raises(LedgerError, match="'a' holds 5 tokens, but a move from in_flight to ready claims 4"):
        led.complete(4, key="a")
    with pytest.raises(LedgerError, match="'c' moved from in_flight to failed, but it was never booked"):
        led.fail(0, key="c")
    assert (led.in_flight, led.ready) == (5, 5)
    led.verify({"a": ("in_flight", 5), "b": ("ready", 5)})


def test_an_audited_ledger_refuses_unnamed_movements():
    led = audited()
    with pytest.raises(LedgerError, match="booking 3 tokens into in_flight names no token account"):
        led.produce(3)
    led.produce(3, key="a")
    with pytest.raises(LedgerError, match="moving 3 tokens from in_flight to ready names no token account"):
        led.complete(3)
    plain = TokenLedger()  # without an audit: the counters only, as before
    plain.produce(3)
    plain.complete(3)
    plain.verify()


def test_held_accounts_the_audit_does_not_know_fail():
    led = audited()
    led.produce(2, key="a")
    with pytest.raises(LedgerError, match="'a' is in_flight with 2 tokens, but its holder has it in_flight with 3"):
        led.verify({"a": ("in_flight", 3)})
    with pytest.raises(LedgerError, match="'z' is held as ready with 1 tokens, but it is never booked"):
        led.verify({"a": ("in_flight", 2), "z": ("ready", 1)})
