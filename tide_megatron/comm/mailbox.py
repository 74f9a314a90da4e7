"""Control messages between the rank-0 controller and the other ranks.

Messages are typed (`messages.py`), each one small JSON document (task assignments, finished
trajectories, commands) kept in torch.distributed's key-value store, the one torchrun already
hosts for rendezvous. A mailbox is an append-only queue per destination: `post` takes a slot
number with the store's atomic `add` and writes the message under it; the owner reads
slots in order and deletes them. Nothing blocks a sender, which is what lets rollout
ranks stream trajectories while the trainer trains. Weights never travel this way:
they go over a process group (see `weight_sync.py`).

Nothing blocks the owner either. A slot can be reserved and not yet written: a sender is
between its `add` and its `set`, and one that hangs there (a stopped process) may stay so for
good. The owner therefore never waits on a slot (a store `get` would wait for it up to the
store's timeout, and rank 0 with it): an unwritten slot stays pending and is read once it is
written. Messages of one sender still come out in order: a sender writes a slot before it
reserves its next, so when a later slot is found written, every earlier slot of the same
sender is written too, and pending slots are re-checked before it is returned.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from tide_megatron.comm.messages import Message, decode

CONTROLLER = 0


class Mailbox:
    """The queue of messages addressed to `owner`, readable only by `owner`."""

    def __init__(self, store: Any, owner: int, namespace: str = "tide/mb"):
        self._store = store
        self._prefix = namespace
        self.owner = owner
        self._next = 0  # next slot this owner has not yet seen reserved
        self._pending: list[int] = []  # reserved slots not read yet, in order (unwritten ones included)
        # The controller posts from its dispatch thread and its training thread.
        self._lock = threading.Lock()
        self.posted = 0
        """Messages this mailbox's owner has posted (to any rank)."""
        self.received = 0
        """Messages read from this mailbox."""

    def _count_key(self, dest: int) -> str:
        return f"{self._prefix}/{dest}/n"

    def post(self, dest: int, message: Message) -> None:
        """Append a typed message (`messages.py`) to `dest`'s queue. Never blocks on the receiver."""
        if not isinstance(message, Message) or not message.KIND:
            raise TypeError(f"post a typed message of comm/messages.py, not {message!r}")
        payload, kind = message.to_wire(), message.KIND
        body = json.dumps({"kind": kind, "src": self.owner, **payload}, separators=(",", ":"), allow_nan=False)
        with self._lock:
            slot = self._store.add(self._count_key(dest), 1) - 1
            self._store.set(f"{self._prefix}/{dest}/{slot}", body)
            self.posted += 1

    def poll(self, limit: int = 1 << 30) -> list[Message]:
        """Read the messages posted to this owner since the last poll, in order."""
        with self._lock:
            available = self._store.add(self._count_key(self.owner), 0)
            self._pending.extend(range(self._next, available))
            self._next = available
            if not self._pending:
                return []
            out: list = []
            if self._store.check([self._key(s) for s in self._pending]):  # the usual case: all written
                slots = self._pending[:max(0, limit)]
                self._read(slots, out)
                del self._pending[:len(slots)]  # after the read: a failed read leaves them pending
                return out
            holes: list[int] = []
            while self._pending and len(out) < limit:
                slot = self._pending.pop(0)
                if not self._store.check([self._key(slot)]):
                    holes.append(slot)  # reserved, not written yet: never wait for it
                    continue
                # Written: a hole of the same sender before it is written by now; read those first.
                for hole in [h for h in holes if self._store.check([self._key(h)])]:
                    if len(out) < limit:
                        holes.remove(hole)
                        self._read([hole], out)
                if len(out) < limit:
                    self._read([slot], out)
                else:
                    holes.append(slot)
            self._pending = sorted(holes + self._pending)
            return out

    def _key(self, slot: int) -> str:
        return f"{self._prefix}/{self.owner}/{slot}"

    def _read(self, slots: list[int], out: list) -> None:
        """Append the messages of written `slots` to `out`, in order, and free their keys. One
        store round trip reads them all (the rollout thread reads thousands a step); each key is
        deleted on its own (a store has no multi-delete)."""
        keys = [self._key(slot) for slot in slots]
        for data in self._store.multi_get(keys):
            out.append(decode(json.loads(data)))
        for key in keys:
            self._store.delete_key(key)
        self.received += len(keys)
