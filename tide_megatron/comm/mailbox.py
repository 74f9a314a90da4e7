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
- each sending mailbox writes a message into a slot of its own, `q/<d>/<sender>.<g>/<i>` for its
  i-th message to `d` (modulo `SLOTS`), with `compare_set(slot, b"", line)`, which writes only
  into an empty slot; a slot still full (the owner is `SLOTS` messages behind that sender) moves
  the sender to the next generation g of slots;
- then it appends the slot's name to the bell, `q/<d>/bell`, so the bell lists the messages in
  the order the store took them;
- the owner reads the bell, `multi_get`s the slots it names and empties them with one
  `multi_set`, and hands the messages out in the bell's order: a reply caused by one message
  never comes out before it, even from another sender.

Nothing blocks the owner either: it reads the bell with `compare_set` (a store `get` of a key
nobody has written yet would wait up to the store's timeout, and rank 0 with it) and fetches only
slots the bell names, which are written; a sender stopped in the middle of `post` leaves nothing
half written (a slot the bell does not name is never read). A poll costs the owner one store
round trip when nothing came and four when messages came, however many and from however many
senders; a post costs the sender one round trip and one append, which does not wait.

The bell holds ~20 bytes a message, so the owner may fall ~400,000 messages behind before its
clear of the bell nears the 8 MiB limit. Empty slots stay in the store (~50 bytes each, at most
`SLOTS` per sender and destination, more only for a sender moved to a new generation).

A message over `INLINE_BYTES` is stored under keys of its own, in pieces of at most
`PIECE_BYTES`, and its slot only names them; the owner fetches every named message of a poll in
one `multi_get` and deletes the keys.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from typing import Any

from tide_megatron.comm.messages import Message, decode

CONTROLLER = 0
INLINE_BYTES = 64 << 10
"""A larger message goes under keys of its own; its slot names them."""
PIECE_BYTES = 4 << 20
"""The most bytes one store value of a large message holds (the store refuses requests over 8 MiB)."""
SLOTS = 2048
"""Slots of one sender's messages to one destination, reused once the owner has read them."""
_REF = b'{"ref":'  # a line naming a large message (a message's own line starts with {"kind":)


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
        self._sent: dict[int, list[int]] = {}  # dest -> [messages posted to it, slot generation]
        self._unreturned: deque[Message] = deque()  # read from the store, beyond a poll's limit
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
            sent = self._sent.setdefault(dest, [0, 0])
            # the count makes every value this mailbox writes unique: a full slot never answers
            # with the line that was offered
            line = f"{sent[0]} {body}".encode()
            while True:
                slot = f"{self._name}.{sent[1]}/{sent[0] % SLOTS}"
                if self._store.compare_set(self._slot_key(dest, slot), b"", line) == line:
                    break
                sent[1] += 1  # the owner has not read that slot yet: a fresh generation of slots
            sent[0] += 1
            self._store.append(self._bell_key(dest), slot + "\n")  # after the slot: it announces it
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
        keys = [self._slot_key(self.owner, slot.decode()) for slot in rung.split(b"\n") if slot]
        lines = self._store.multi_get(keys)
        self._store.multi_set(keys, [b""] * len(keys))  # the slots are free for their senders again
        self._deliver(self._fetch_large([line.partition(b" ")[2] for line in lines]))

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
