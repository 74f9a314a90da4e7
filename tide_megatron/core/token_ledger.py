"""The token ledger: where every generated token is, by bucket and (with `TokenAudit`) by account.

`TokenLedger` keeps one counter per bucket (in flight, ready, consumed, dropped as stale,
cancelled, failed, lost, evaluated); the buffer and the controller move tokens between them as
they learn what happened. The counters add up by construction; `TokenAudit` keeps every token
per account id (a trajectory attempt, a task-end message, a carry) so that a token booked twice,
moved from the wrong bucket or never arriving is a `LedgerError` naming its account, checked at
each step's end (`GlobalBuffer.end_step`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional


class LedgerError(RuntimeError):
    """Tokens booked or moved in a way that cannot be right (a bucket would go negative, an
    account is booked twice, moved from a bucket it is not in, or lost): a bookkeeping bug
    upstream. The message names the account where there is one."""


OPEN_BUCKETS = ("in_flight", "ready")
"""Buckets whose tokens can still move (an account there is held by someone: a pending or a ready group)."""
CLOSED_BUCKETS = ("consumed", "dropped_stale", "cancelled", "failed", "lost", "evaluated")
"""Buckets that are a token's last: an account here never moves again."""


class _Account:
    """One account of `TokenAudit`: the bucket its tokens are in, and how many."""

    __slots__ = ("bucket", "tokens")

    def __init__(self, bucket: str, tokens: int):
        self.bucket, self.tokens = bucket, tokens


@dataclass
class TokenAudit:
    """Every generated token by the id of the account it was booked to: a ledger check that can fail.

    `TokenLedger`'s counters alone balance by construction (`generated` is their sum). With an
    audit each booking names its account (a trajectory attempt; on the controller, the task end
    or the write-off that books it) and each move names the account it moves, whole. A move of
    an account that is in another bucket (moved twice: consumed twice, say), that was never
    booked, or of a token count other than the account holds, and a second booking of an id,
    raise `LedgerError` naming the account at once, before anything changes. `verify` (once per
    step) recomputes every bucket from the accounts and compares it with the ledger's counters
    and, given the accounts their holders still hold (`live`: the buffer's pending and ready
    trajectories), names every open account nobody holds (tokens lost: never completed, consumed
    or ended) and every held one that is not open here.

    Cost: O(1) per booking or move, O(accounts) per `verify`. Memory stays bounded in long runs:
    `verify` folds the accounts that can no longer move (`CLOSED_BUCKETS`) into per-bucket totals
    of closed tokens, which later checks keep comparing with the counters; their ids are kept
    `remember_steps` more steps, so a late second booking or move of one is still named (after
    that it shows only as a count that is off, or not at all).
    """

    remember_steps: int = 2
    """Steps for which the ids folded away by a `verify` are remembered (0: not at all)."""
    accounts: dict[Hashable, _Account] = field(default_factory=dict)
    """Account id -> its bucket and tokens: every open account, and the closed ones since the last `verify`."""
    closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLOSED_BUCKETS, 0))
    """Tokens of the accounts folded away by `verify`, per closed bucket."""
    _recent: deque = field(init=False, repr=False)
    """One dict per `verify` (newest last) of the ids it folded away -> their bucket."""

    def __post_init__(self) -> None:
        if self.remember_steps < 0:
            raise ValueError("remember_steps must be >= 0")
        self._recent = deque(maxlen=self.remember_steps)

    # -- bookings and moves (each raises before it changes anything) -----------------------------
    def produce(self, key: Hashable, n: int) -> None:
        """`n` tokens into account `key`, in flight: a new account, or more of one in flight
        (a trajectory reported live, then finished)."""
        acc = self.accounts.get(key)
        if acc is None:
            self._require_unknown(key, "in_flight")
            self.accounts[key] = _Account("in_flight", n)
        elif acc.bucket == "in_flight":
            acc.tokens += n
        else:
            raise LedgerError(f"token account {key!r} booked twice: {n} more tokens in flight, but it is "
                              f"{acc.bucket} already")

    def book(self, key: Hashable, bucket: str, n: int) -> None:
        """A new account `key` of `n` tokens straight into `bucket` (an attempt that ended
        without a trajectory, tokens found lost)."""
        acc = self.accounts.get(key)
        if acc is not None:
            raise LedgerError(f"token account {key!r} booked twice: {n} tokens into {bucket}, but it is "
                              f"{acc.bucket} already with {acc.tokens}")
        self._require_unknown(key, bucket)
        self.accounts[key] = _Account(bucket, n)

    def move(self, key: Hashable, src: str, dst: str, n: int) -> None:
        """Account `key`, all `n` of its tokens, from `src` to `dst`."""
        acc = self.accounts.get(key)
        if acc is None:
            for folded in reversed(self._recent):
                if key in folded:
                    raise LedgerError(f"token account {key!r} moved from {src} to {dst}, but it was closed as "
                                      f"{folded[key]} already" + (" (twice)" if folded[key] == dst else ""))
            raise LedgerError(f"token account {key!r} moved from {src} to {dst}, but it was never booked "
                              f"(or closed more than {self.remember_steps} steps ago)")
        if acc.bucket != src:
            twice = f" ({dst} twice)" if acc.bucket == dst else ""
            raise LedgerError(f"token account {key!r} moved from {src} to {dst}, but it is {acc.bucket}{twice}")
        if acc.tokens != n:
            raise LedgerError(f"token account {key!r} holds {acc.tokens} tokens, but a move from {src} to {dst} "
                              f"claims {n}")
        acc.bucket = dst

    def _require_unknown(self, key: Hashable, bucket: str) -> None:
        for folded in reversed(self._recent):  # at most `remember_steps` dicts
            if key in folded:
                raise LedgerError(f"token account {key!r} booked twice: into {bucket}, but it was closed as "
                                  f"{folded[key]} already")

    # -- the step's check ---------------------------------------------------------------------
    def problems(self, counts: Mapping[str, int],
                 live: Optional[Mapping[Hashable, tuple[str, int]]] = None) -> list[str]:
        """What is wrong (empty when nothing is), without changing anything. `counts`: the
        ledger's counters (every bucket and `generated`); `live`: account id -> (bucket, tokens)
        for every account its holder still holds in an open bucket (None: not checked)."""
        out = []
        totals = dict.fromkeys(TokenLedger.BUCKETS, 0)
        totals.update(self.closed)
        for key, acc in self.accounts.items():
            totals[acc.bucket] += acc.tokens
            if live is None or acc.bucket not in OPEN_BUCKETS:
                continue
            held = live.get(key)
            if held is None:
                out.append(f"token account {key!r} holds {acc.tokens} {acc.bucket} tokens that nothing holds "
                           f"(lost: never completed, consumed or ended)")
            elif held != (acc.bucket, acc.tokens):
                out.append(f"token account {key!r} is {acc.bucket} with {acc.tokens} tokens, but its holder has "
                           f"it {held[0]} with {held[1]}")
        for key, (bucket, n) in (live or {}).items():
            acc = self.accounts.get(key)
            if acc is None or acc.bucket not in OPEN_BUCKETS:
                out.append(f"token account {key!r} is held as {bucket} with {n} tokens, but it is "
                           f"{'never booked' if acc is None else acc.bucket}")
        for b in TokenLedger.BUCKETS:
            if totals[b] != counts[b]:
                out.append(f"ledger.{b} counts {counts[b]} tokens, its accounts hold {totals[b]}")
        if counts["generated"] != sum(totals.values()):
            out.append(f"ledger.generated counts {counts['generated']} tokens, the accounts hold "
                       f"{sum(totals.values())}")
        return out

    def verify(self, counts: Mapping[str, int],
               live: Optional[Mapping[Hashable, tuple[str, int]]] = None) -> None:
        """Raise `LedgerError` with the first problem (`problems`); else fold the closed accounts
        away (class docstring). Once per step."""
        found = self.problems(counts, live)
        if found:
            more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
            raise LedgerError(found[0] + more)
        folded: dict[Hashable, str] = {}
        still_open: dict[Hashable, _Account] = {}
        for key, acc in self.accounts.items():
            if acc.bucket in OPEN_BUCKETS:
                still_open[key] = acc
            else:
                self.closed[acc.bucket] += acc.tokens
                folded[key] = acc.bucket
        self.accounts = still_open
        if self.remember_steps:
            self._recent.append(folded)

    def restore(self, counts: Mapping[str, int]) -> None:
        """Start from a saved ledger's counters (a resumed run): their ids are gone, so only
        closed tokens can be restored; they become the closed totals."""
        if self.accounts or any(self.closed.values()):
            raise LedgerError("restoring token counts into an audit that holds accounts already")
        stray = {b: counts[b] for b in OPEN_BUCKETS if counts[b]}
        if stray:
            raise LedgerError(f"cannot restore open tokens without their accounts: {stray}")
        self.closed = {b: counts[b] for b in CLOSED_BUCKETS}


@dataclass
class TokenLedger:
    """Where every generated token is.

    Each bucket is moved by the component that knows what happened to the tokens: the buffer
    (ready, consumed, dropped as stale, cancelled, evaluated), the dispatcher (failed and
    cancelled task attempts), and the reconciliation with the rollout ranks' own counts
    (`lose`): tokens a rank says it generated, and no longer runs, that never reached the
    controller are lost. So `lost > 0` is the ledger failing: a task or a message vanished.

    The counters add up by construction; `audit` (an option) keeps the same tokens per account
    id as well, and every booking and move must then name its account (`key`), so that
    `verify` can fail (`TokenAudit`). Without one, `key` is ignored.
    """

    generated: int = 0
    """All tokens booked so far (the sum of the buckets below)."""
    in_flight: int = 0
    """In a trajectory that finished while its group has not completed."""
    ready: int = 0
    """In a completed group waiting in the buffer."""
    consumed: int = 0
    """Handed to the trainer (goodput numerator)."""
    dropped_stale: int = 0
    """Completed, then discarded because the staleness bound was exceeded before training."""
    cancelled: int = 0
    """Of groups cancelled because they could no longer be consumed in time (wasted)."""
    failed: int = 0
    """Of task attempts that failed (the task was retried or its group given up)."""
    lost: int = 0
    """Generated on a rollout rank but never booked here (a vanished task or message)."""
    evaluated: int = 0
    """Belonging to evaluation groups: scored, not trained on."""
    audit: Optional[TokenAudit] = field(default=None, repr=False, compare=False)
    """Per-id accounts behind the counters (None: counters only)."""

    BUCKETS = ("in_flight", "ready", "consumed", "dropped_stale", "cancelled", "failed", "lost", "evaluated")

    def _named(self, key: Optional[Hashable], what: str) -> Hashable:
        if key is None:
            raise LedgerError(f"{what} names no token account, and this ledger is audited per account")
        return key

    def _move(self, src: str, dst: str, n: int, key: Optional[Hashable]) -> None:
        if n < 0:
            raise LedgerError(f"negative movement {n} from {src} to {dst}"
                              + (f" of {key!r}" if key is not None else ""))
        if self.audit is not None:  # first: its error names the account
            self.audit.move(self._named(key, f"moving {n} tokens from {src} to {dst}"), src, dst, n)
        if getattr(self, src) < n:
            raise LedgerError(f"moving {n} tokens from {src} which holds {getattr(self, src)}")
        setattr(self, src, getattr(self, src) - n)
        setattr(self, dst, getattr(self, dst) + n)

    def _book(self, bucket: str, n: int, key: Optional[Hashable]) -> None:
        if n < 0:
            raise LedgerError(f"negative booking {n} into {bucket}" + (f" of {key!r}" if key is not None else ""))
        if self.audit is not None:
            key = self._named(key, f"booking {n} tokens into {bucket}")
            if bucket == "in_flight":
                self.audit.produce(key, n)
            else:
                self.audit.book(key, bucket, n)
        self.generated += n
        setattr(self, bucket, getattr(self, bucket) + n)

    def produce(self, n: int, *, key: Optional[Hashable] = None) -> None:
        self._book("in_flight", n, key)

    def complete(self, n: int, *, key: Optional[Hashable] = None) -> None:
        self._move("in_flight", "ready", n, key)

    def consume(self, n: int, *, key: Optional[Hashable] = None) -> None:
        self._move("ready", "consumed", n, key)

    def drop_stale(self, n: int, *, from_ready: bool, key: Optional[Hashable] = None) -> None:
        self._move("ready" if from_ready else "in_flight", "dropped_stale", n, key)

    def cancel(self, n: int, *, from_ready: bool = False, key: Optional[Hashable] = None) -> None:
        self._move("ready" if from_ready else "in_flight", "cancelled", n, key)

    def fail(self, n: int, *, key: Optional[Hashable] = None) -> None:
        self._move("in_flight", "failed", n, key)

    def evaluate(self, n: int, *, key: Optional[Hashable] = None) -> None:
        self._move("in_flight", "evaluated", n, key)

    def book_attempt(self, n: int, *, fate: str, key: Optional[Hashable] = None) -> None:
        """Tokens of a task attempt that ended without a trajectory (`failed` or `cancelled`)."""
        if fate not in ("failed", "cancelled"):
            raise LedgerError(f"unknown attempt fate {fate!r}")
        self._book(fate, n, key)

    def lose(self, n: int, *, key: Optional[Hashable] = None) -> None:
        """Tokens a rollout rank generated that no booking here accounts for."""
        self._book("lost", n, key)

    def counts(self) -> dict[str, int]:
        """Every bucket and `generated`."""
        return {**{b: getattr(self, b) for b in self.BUCKETS}, "generated": self.generated}

    def restore(self, counts: Mapping[str, int]) -> None:
        """Take a saved ledger's counters (a resumed run); they must balance, and with an audit
        hold no open tokens (`TokenAudit.restore`)."""
        if self.generated:
            raise LedgerError(f"restoring token counts into a ledger that booked {self.generated} already")
        if counts["generated"] != sum(counts[b] for b in self.BUCKETS) or min(counts[b] for b in self.BUCKETS) < 0:
            raise LedgerError(f"restored token counts do not balance: {dict(counts)}")
        if self.audit is not None:
            self.audit.restore(counts)
        for key in (*self.BUCKETS, "generated"):
            setattr(self, key, counts[key])

    def problems(self, live: Optional[Mapping[Hashable, tuple[str, int]]] = None) -> list[str]:
        """What is wrong with the ledger (empty when nothing is); `live` as `TokenAudit.problems`."""
        if self.audit is not None:
            return self.audit.problems(self.counts(), live)
        return [] if self.balanced else [f"ledger does not balance: {self}"]

    def verify(self, live: Optional[Mapping[Hashable, tuple[str, int]]] = None) -> None:
        """The step's check: raise `LedgerError` naming what is wrong (with an audit, also fold
        its closed accounts away, `TokenAudit.verify`)."""
        if self.audit is not None:
            self.audit.verify(self.counts(), live)
        elif not self.balanced:
            raise LedgerError(f"ledger does not balance: {self}")

    @property
    def wasted(self) -> int:
        """Generated for training, then thrown away: dropped as stale, cancelled, failed, lost."""
        return self.dropped_stale + self.cancelled + self.failed + self.lost

    @property
    def balanced(self) -> bool:
        """The counters add up (true by construction unless a counter is set from outside;
        `verify` is the check that can fail)."""
        buckets = [getattr(self, b) for b in self.BUCKETS]
        return min(buckets) >= 0 and self.generated == sum(buckets)
