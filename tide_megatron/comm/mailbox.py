"""Control messages between the rank-0 controller and the other ranks.

Messages are typed (`messages.py`), each one small JSON document (task assignments, finished
trajectories, commands) kept in torch.distributed's key-value store, the one torchrun already
hosts for rendezvous. A mailbox is one store value per destination, a queue of lines: `post`
appends one line with the store's atomic `append`; the owner reads the whole value and clears
what it read with `compare_set`. Nothing blocks a sender, which is what lets rollout ranks stream
trajectories while the trainer trains. Weights never travel this way: they go over a process
group (see `weight_sync.py`).

Nothing blocks the owner either: it reads with `compare_set` (a store `get` of a key nobody has
written yet would wait up to the store's timeout, and rank 0 with it), and a sender stopped in
the middle of `post` leaves nothing half written, since its line is one atomic append. A poll
costs the owner two store round trips however many messages it reads, and a post one: rank 0
reads thousands of messages a step (an earlier design of one key per message cost it a
deletion each).

A queue is one store value, and the owner's clear sends the value it read back to the store:
torch's store refuses a request over 8 MiB, which a few hundred queued trajectories reach when
rank 0 falls behind (it did at 64 ranks). So a message over `INLINE_BYTES` is stored under keys
of its own, in pieces of at most `PIECE_BYTES`, and its queue line only names them; the owner
fetches every named message of a poll in one `multi_get` and deletes the keys.

Messages of one sender come out in the order it posted them; between senders, in the order the
store appended them.
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
"""A larger message goes under keys of its own; its queue line names them."""
PIECE_BYTES = 4 << 20
"""The most bytes one store value of a large message holds (the store refuses requests over 8 MiB)."""
_REF = b'{"ref":'  # a queue line naming a large message (a message's own line starts with {"kind":)


class Mailbox:
    """The queue of messages addressed to `owner`, readable only by `owner`."""

    _ABSENT = b"\0"  # what `compare_set` answers for a queue nobody has posted to yet

    def __init__(self, store: Any, owner: int, namespace: str = "tide/mb"):
        self._store = store
        self._prefix = namespace
        self.owner = owner
        self._unreturned: deque[Message] = deque()  # read from the store, beyond a poll's limit
        # The controller posts from its dispatch thread and its training thread.
        self._lock = threading.Lock()
        self._ref_prefix = f"{namespace}/big/{owner}/{uuid.uuid4().hex[:8]}"  # unique to this mailbox
        self._refs = 0
        self.posted = 0
        """Messages this mailbox's owner has posted (to any rank)."""
        self.received = 0
        """Messages read from this mailbox."""

    def _queue_key(self, dest: int) -> str:
        return f"{self._prefix}/{dest}/q"

    def post(self, dest: int, message: Message) -> None:
        """Append a typed message (`messages.py`) to `dest`'s queue. Never blocks on the receiver."""
        if not isinstance(message, Message) or not message.KIND:
            raise TypeError(f"post a typed message of comm/messages.py, not {message!r}")
        payload, kind = message.to_wire(), message.KIND
        # compact JSON escapes newlines inside strings: one message is one line
        body = json.dumps({"kind": kind, "src": self.owner, **payload}, separators=(",", ":"), allow_nan=False)
        with self._lock:
            if len(body) > INLINE_BYTES:
                body = self._store_large(body.encode())
            self._store.append(self._queue_key(dest), body + "\n")
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
        """Move everything queued in the store to `_unreturned`: read the value, then clear it if
        it is still what was read; a sender that appended in between makes the clear answer the
        longer value, which is read in turn."""
        key = self._queue_key(self.owner)
        data = self._store.compare_set(key, self._ABSENT, self._ABSENT)  # a read that never waits
        if data == self._ABSENT or not data:
            return
        while True:
            now = self._store.compare_set(key, data, b"")
            if not now:  # cleared: exactly `data` was taken
                break
            data = now
        lines = [line for line in data.split(b"\n") if line]
        refs = [json.loads(line) for line in lines if line.startswith(_REF)]
        if refs:
            keys = [f"{r['ref']}/{i}" for r in refs for i in range(r["pieces"])]
            values = iter(self._store.multi_get(keys))  # one round trip for the poll's large messages
            large = iter([b"".join(next(values) for _ in range(r["pieces"])) for r in refs])
            for key in keys:
                self._store.delete_key(key)
            lines = [next(large) if line.startswith(_REF) else line for line in lines]
        unreadable = []
        for line in lines:
            try:
                self._unreturned.append(decode(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:  # the rest still comes out
                unreadable.append(f"{type(exc).__name__}: {exc}")
                continue
            self.received += 1
        if unreadable:
            raise ValueError(f"rank {self.owner}: {len(unreadable)} unreadable control message(s), the first: "
                             f"{unreadable[0]}")
