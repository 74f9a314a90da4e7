"""Control messages between the rank-0 controller and the other ranks.

Messages are typed (`messages.py`), each one small JSON document (task assignments, finished
trajectories, commands) kept in torch.distributed's key-value store, the one torchrun already
hosts for rendezvous. Nothing blocks a sender, which is what lets rollout ranks stream
trajectories while the trainer trains. Weights never travel this way: they go over a process
group (see `weight_sync.py`).

The store's layout for the mailbox of rank `d`, written so that no request carries more than a
message (torch's libuv store closes the connection of a request over 8 MiB: one queue of every
sender's lines, cleared by a `compare_set` that sent back what it read, passed that at 64 ranks
when rank 0 fell behind):
- each sending mailbox writes its n-th message to `d` into a slot of its own,
  `q/<d>/<sender>.<g>/<n mod SLOTS>`, then appends the slot's name to the bell, `q/<d>/bell`,
  so the bell lists the messages in the order the store took them;
- the owner reads the bell, `multi_get`s the slots it names, and in one `multi_set` empties them
  and records, per sender, how many of its messages it has read (`q/<d>/<sender>/read`); it
  hands the messages out in the bell's order, so a reply caused by one message never comes out
  before it, even from another sender;
- a sender reuses a slot only once the owner has recorded reading the slot's last message (it
  reads that record once every so many messages, when its copy no longer covers the slot); a
  sender the owner is `SLOTS` messages behind moves to a fresh generation g of slots.

A post is two writes that do not wait for an answer (and a read of the owner's record about
once every `SLOTS` messages): nothing blocks a sender, which is what lets rollout ranks stream
trajectories while the trainer trains. Nothing blocks the owner either: it reads the bell with
`compare_set` (a store `get` of a key nobody has written yet would wait up to the store's
timeout, and rank 0 with it) and fetches only slots the bell names, which are written; a sender
stopped in the middle of `post` leaves nothing half written (a slot the bell does not name is
never read). A poll costs the owner one store round trip when nothing came and four when
messages came, however many and from however many senders.

The bell holds ~20 bytes a message, so the owner may fall ~400,000 messages behind before its
clear of the bell nears the 8 MiB limit. Emptied slots stay in the store (~50 bytes each, at
most `SLOTS` per sender and destination, more only for a sender moved to a new generation).

A message over `INLINE_BYTES` is stored under keys of its own, in pieces of at most
`PIECE_BYTES`, and its slot only names them; the owner fetches every named message of a poll in
one `multi_get` and deletes the keys.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import uuid
from collections import deque
from typing import Any

from torch.distributed import DistStoreError

from tide_megatron.comm.messages import Message, decode

CONTROLLER = 0
INLINE_BYTES = 64 << 10
"""A larger message goes under keys of its own; its slot names them."""
PIECE_BYTES = 4 << 20
"""The most bytes one store value of a large message holds (the store refuses requests over 8 MiB)."""
SLOTS = 2048
"""Slots of one sender's messages to one destination, reused once the owner has read them."""
_REF = b'{"ref":'  # a line naming a large message (a message's own line starts with {"kind":)


@dataclasses.dataclass
class _Sent:
    """A sender's messages to one destination: how many, the generation of slots they go to, and
    what it last knew of the owner's record of them."""

    count: int = 0
    generation: int = 0
    generation_start: int = 0
    """The first message of this generation of slots (earlier ones went to other slots)."""
    read: int = 0
    """How many of them the owner had read, as of the sender's last look at its record."""

    def free(self, n: int) -> bool:
        """Whether message `n`'s slot holds no unread message: new in this generation, or its last
        message (n - SLOTS) was read."""
        return n - SLOTS < self.generation_start or n - SLOTS < self.read


class Mailbox:
    """The messages addressed to `owner`, readable only by `owner`; and what this process posts
    to the other ranks' mailboxes."""

    _ABSENT = b"\0"  # what `compare_set` answers for a key nobody has written yet

    def __init__(self, store: Any, owner: int, namespace: str = "tide/mb"):
        self._store = store
        self._prefix = namespace
        self.owner = owner
        # unique to this mailbox: two mailboxes of one rank (a restarted one) never share a slot
        self._name = f"{owner}-{uuid.uuid4().hex[:6]}"
        self._ref_prefix = f"{namespace}/big/{self._name}"
        self._refs = 0
        self._sent: dict[int, _Sent] = {}  # per destination
        self._unreturned: deque[Message] = deque()  # read from the store, beyond a poll's limit
        self._waiter: Any = None  # a connection of its own for `wait`, which holds it while it waits
        # The controller posts from its dispatch thread and its training thread.
        self._lock = threading.Lock()
        self.posted = 0
        """Messages this mailbox's owner has posted (to any rank)."""
        self.received = 0
        """Messages read from this mailbox."""

    def _bell_key(self, dest: int) -> str:
        return f"{self._prefix}/q/{dest}/bell"

    def _slot_key(self, dest: int, slot: str) -> str:
        return f"{self._prefix}/q/{dest}/{slot}"

    def _wake_key(self, dest: int) -> str:
        return f"{self._prefix}/q/{dest}/wake"

    def _read_key(self, dest: int, sender: str) -> str:
        return f"{self._prefix}/q/{dest}/{sender}/read"

    def post(self, dest: int, message: Message) -> None:
        """Write a typed message (`messages.py`) into `dest`'s mailbox. Never waits for the receiver."""
        if not isinstance(message, Message) or not message.KIND:
            raise TypeError(f"post a typed message of comm/messages.py, not {message!r}")
        payload, kind = message.to_wire(), message.KIND
        # compact JSON escapes newlines inside strings: one message is one line
        body = json.dumps({"kind": kind, "src": self.owner, **payload}, separators=(",", ":"), allow_nan=False)
        with self._lock:
            if len(body) > INLINE_BYTES:
                body = self._store_large(body.encode())
            sent = self._sent.setdefault(dest, _Sent())
            n = sent.count
            if not sent.free(n):  # the slot's last message may be unread: ask the owner's record
                value = self._store.compare_set(self._read_key(dest, self._name), self._ABSENT, self._ABSENT)
                sent.read = max(sent.read, 0 if value == self._ABSENT else int(value))
                if not sent.free(n):  # the owner is SLOTS messages behind: never overwrite, move on
                    sent.generation, sent.generation_start = sent.generation + 1, n
            slot = f"{self._name}.{sent.generation}/{n % SLOTS}"
            self._store.set(self._slot_key(dest, slot), f"{n} {body}")  # the count: the owner's record
            self._store.append(self._bell_key(dest), slot + "\n")  # after the slot: it announces it
            self._store.set(self._wake_key(dest), b"1")  # after the bell: `wait` returns, `poll` finds it
            sent.count += 1
            self.posted += 1

    def _store_large(self, data: bytes) -> str:
        """Store a large message's bytes under keys of its own; returns the queue line naming them."""
        self._refs += 1
        ref = f"{self._ref_prefix}/{self._refs}"
        pieces = range(0, len(data), PIECE_BYTES)
        for i, start in enumerate(pieces):
            self._store.set(f"{ref}/{i}", data[start:start + PIECE_BYTES])
        return json.dumps({"ref": ref, "pieces": len(pieces)}, separators=(",", ":"))

    def poll(self, limit: int = 1 << 30) -> list[Message]:
        """Read the messages posted to this owner since the last poll, in order (at most `limit`;
        the rest come with the next polls)."""
        limit = max(0, limit)
        with self._lock:
            if len(self._unreturned) < limit:
                self._read()
            return [self._unreturned.popleft() for _ in range(min(limit, len(self._unreturned)))]

    def wait(self, timeout_s: float) -> bool:
        """Block until a message may have come (then `poll`), or `timeout_s` passes (False).
        A reader with nothing else to do waits here rather than poll the store: a trainer rank
        that polled every 5 ms sent the store 200 requests a second while it trained. Each post
        sets the owner's wake key after its bell line, and `wait` deletes the key before the
        poll that follows it reads the bell, so no message is left unannounced by a wake."""
        if self._unreturned:
            return True
        if self._waiter is None:
            self._waiter = self._store.clone()
        key = self._wake_key(self.owner)
        try:
            self._waiter.wait([key], datetime.timedelta(seconds=timeout_s))
        except DistStoreError:  # the timeout (torch's TCP store logs a line for it)
            return False
        self._waiter.delete_key(key)
        return True

    def wake(self) -> None:
        """End a `wait` of this mailbox's owner now (from another thread of the owner)."""
        self._store.set(self._wake_key(self.owner), b"1")

    def _read(self) -> None:
        """Move every message the bell announces to `_unreturned`, in the bell's order."""
        bell = self._bell_key(self.owner)
        rung = self._store.compare_set(bell, self._ABSENT, self._ABSENT)  # a read that never waits
        if rung == self._ABSENT or not rung:
            return
        while True:  # clear the bell if it still holds what was read; else take the longer value
            now = self._store.compare_set(bell, rung, b"")
            if not now:
                break
            rung = now
        slots = [slot.decode() for slot in rung.split(b"\n") if slot]
        keys = [self._slot_key(self.owner, slot) for slot in slots]
        counted = [line.partition(b" ") for line in self._store.multi_get(keys)]
        read = {slot.partition(".")[0]: int(n) + 1 for slot, (n, _, _) in zip(slots, counted)}  # bell order: the last wins
        # one request empties the slots and records what was read: a sender cannot reuse a slot
        # between the two, since it reuses one only after reading this record
        self._store.multi_set(keys + [self._read_key(self.owner, s) for s in read],
                              [b""] * len(keys) + [str(n).encode() for n in read.values()])
        self._deliver(self._fetch_large([line for _, _, line in counted]))

    def _fetch_large(self, lines: list[bytes]) -> list[bytes | Exception]:
        """The lines with each large message's reference replaced by its bytes (one round trip for
        all of them; their keys are deleted), or by the error that made it unreadable."""
        refs: list[tuple[int, str, int]] = []
        out: list[bytes | Exception] = list(lines)
        for i, line in enumerate(lines):
            if line.startswith(_REF):
                try:
                    ref = json.loads(line)
                    refs.append((i, str(ref["ref"]), int(ref["pieces"])))
                except (ValueError, TypeError, LookupError) as exc:
                    out[i] = exc
        if refs:
            keys = [f"{ref}/{p}" for _, ref, pieces in refs for p in range(pieces)]
            values = iter(self._store.multi_get(keys))
            for i, _, pieces in refs:
                out[i] = b"".join(next(values) for _ in range(pieces))
            for key in keys:
                self._store.delete_key(key)
        return out

    def _deliver(self, lines: list[bytes | Exception]) -> None:
        unreadable = []
        for line in lines:
            try:
                if isinstance(line, Exception):
                    raise line
                self._unreturned.append(decode(json.loads(line)))
            except (ValueError, TypeError, LookupError) as exc:  # the rest still comes out
                unreadable.append(f"{type(exc).__name__}: {exc}")
                continue
            self.received += 1
        if unreadable:
            raise ValueError(f"rank {self.owner}: {len(unreadable)} unreadable control message(s), the first: "
                             f"{unreadable[0]}")
