"""The KV pool of one simulated engine: SGLang's radix prefix cache with LRU eviction.

One model for both schedulers; the only difference between them is `pinned` (CTB keeps the KV
of the tasks resident on its rank; request-level scheduling lets LRU evict it like any cached
prefix). What it follows, in the SGLang the real engine runs (sglang 0.5.23,
`sglang/srt/mem_cache/radix_cache.py` and `mem_cache/common.py`):

- The tree: a GRPO group's shared prompt is one node (stored once, whatever the number of
  members), each trajectory's context after it is a chain of child nodes, one per insertion
  (`_insert_helper` splits/extends the path a request inserts).
- Insertion: a request's input goes into the tree right after its prefill, locked while it runs
  (`checkpoint_kv_cache` -> `RadixCache.checkpoint` -> `lock`), so siblings can already match the
  prompt; when the request ends its whole sequence (input + output) is inserted and unlocked
  (`release_kv_cache` -> `checkpoint`, `unlock`). A finished request's KV stays in the tree,
  unreferenced, until evicted; that is what a request-level engine reuses on a task's next turn
  (the next request's `match_prefix` hits it) while it stays resident.
- Tokens already in the tree are not stored twice (`_insert_helper` frees the duplicate).
- Eviction (`RadixCache.evict`): a heap of evictable leaves (lock_ref 0, no children) ordered by
  `last_access_time` (the "lru" strategy, the default); pop the least recent leaf, free its
  tokens, and push its parent once that has become an unreferenced leaf. Node-granular: a
  trajectory's chain goes tail first (its newest turn first), so a partly evicted prefix still
  hits for what is left. `match_prefix` and `insert` refresh `last_access_time` along the path.
- A request's own matched prefix is locked before its new tokens are allocated
  (`PrefillAdder.add_one_req` -> `inc_lock_ref`), so room is never made by evicting it.
- Waiting-prefix refresh (`SchedulePolicy._touch_waiting_prefixes`, on by default with the
  default "fcfs" policy and the "lru" eviction strategy): the prefixes of the first 128 queued
  requests are touched, head last, so LRU evicts in reverse admission order.

Under CTB (`pinned=True`) a live trajectory's chain (resident on the rank, not finished) is not
evictable; an engine with nothing running evicts even those (`force`), or it would deadlock.
Ledger: `used` = tokens in the tree + tokens held privately by running requests (their
reserved generation, and after a weight sync their whole context); never below 0, and never
above `capacity` as long as the caller makes room before `start` (RolloutRank does).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Dict, Iterable, List, Optional, Tuple

WAITING_PREFIX_REFRESH = 128
"""sglang.srt.managers.schedule_policy.WAITING_QUEUE_PREFIX_MATCH_MAX: queued requests whose
prefixes the scheduler refreshes."""


class _Node:
    __slots__ = ("kind", "key", "group", "segments", "tokens", "lock", "stamp", "children", "live")

    def __init__(self, kind: str, key: int, group: int, stamp: int):
        self.kind = kind  # "p": a group's prompt, "t": a trajectory's chain below it
        self.key = key
        self.group = group
        self.segments: List[int] = []  # tokens of each node of the chain, oldest first ("t")
        self.tokens = 0
        self.lock = 0  # running requests whose path holds this node (lock_ref)
        self.stamp = stamp  # last access (last_access_time), a global counter
        self.children = 0  # cached trajectory chains below this prompt ("p")
        self.live = True  # "t": its trajectory is still resident on the rank (pinned under CTB)


class _Running:
    __slots__ = ("group", "prompt", "context", "gen", "private", "locked")

    def __init__(self, group: int, prompt: int, context: int, gen: int):
        self.group, self.prompt, self.context, self.gen = group, prompt, context, gen
        self.private = gen  # tokens this request holds outside the tree
        self.locked = True  # its input's path in the tree is locked


class RadixPrefixCache:
    """The KV pool of one engine: a two-level radix tree (group prompt -> trajectory chain)."""

    def __init__(self, capacity: int, pinned: bool, refresh_waiting: int = WAITING_PREFIX_REFRESH):
        self.capacity = capacity
        self.pinned = pinned
        self.refresh_window = refresh_waiting
        self.prompts: Dict[int, _Node] = {}
        self.chains: Dict[int, _Node] = {}
        self.running: Dict[int, _Running] = {}
        self.tree_tokens = 0
        self.private_tokens = 0
        self.evictions = 0
        """Evictions of a live trajectory's cached prefix (each trajectory once per evict call)."""
        self.evicted_tokens = 0
        self._clock = 0
        self._heap: List[Tuple[int, str, int]] = []

    # ------------------------------------------------------------------------------ queries
    @property
    def used(self) -> int:
        return self.tree_tokens + self.private_tokens

    def match(self, traj_id: int, group_id: int) -> int:
        """Tokens of this trajectory's next input already in the tree (`match_prefix`)."""
        p = self.prompts.get(group_id)
        if p is None:
            return 0
        t = self.chains.get(traj_id)
        return p.tokens + (t.tokens if t is not None else 0)

    def cached(self, traj_id: int) -> int:
        """Tokens of this trajectory's own chain in the tree (below its group's prompt)."""
        t = self.chains.get(traj_id)
        return t.tokens if t is not None else 0

    # ---------------------------------------------------------------------------- requests
    def start(self, traj_id: int, group_id: int, prompt: int, context: int, gen: int) -> int:
        """A request starts: match its prefix (the hit, returned), lock it, and put the rest of
        its input into the tree after prefill; `gen` tokens are reserved for its output."""
        hit = self.match(traj_id, group_id)
        p = self.prompts.get(group_id)
        if p is None:
            p = self.prompts[group_id] = _Node("p", group_id, group_id, 0)
            p.tokens = min(prompt, context)
            self.tree_tokens += p.tokens
        self._touch(p)
        p.lock += 1
        t = self._extend_chain(traj_id, p, context)
        t.lock += 1
        self.running[traj_id] = _Running(group_id, p.tokens, context, gen)
        self.private_tokens += gen
        return hit

    def finish_turn(self, traj_id: int, total: int) -> None:
        """The request ends: its whole sequence (`total` tokens) goes into the tree, unlocked."""
        r = self.running.pop(traj_id)
        self.private_tokens -= r.private
        p = self.prompts.get(r.group)
        if p is None:  # the tree was flushed while it ran: insert afresh
            p = self.prompts[r.group] = _Node("p", r.group, r.group, 0)
            p.tokens = min(r.prompt, total)
            self.tree_tokens += p.tokens
        elif r.locked:
            p.lock -= 1
        t = self.chains.get(traj_id)
        if r.locked and t is not None:
            t.lock -= 1
        self._touch(p)
        self._extend_chain(traj_id, p, total)

    def abort(self, traj_id: int) -> None:
        """The request stops before its end (pause, cancel): its reservation is freed and its
        path unlocked; the input it put into the tree stays (until `drop`)."""
        r = self.running.pop(traj_id, None)
        if r is None:
            return
        self.private_tokens -= r.private
        if r.locked:
            p = self.prompts[r.group]
            p.lock -= 1
            self._push(p)
            t = self.chains.get(traj_id)
            if t is not None:
                t.lock -= 1
                self._push(t)

    def finish_task(self, traj_id: int) -> None:
        """The trajectory is over: its chain stays cached, unpinned, until LRU evicts it."""
        t = self.chains.get(traj_id)
        if t is not None:
            t.live = False
            self._push(t)

    def drop(self, traj_id: int) -> int:
        """Free the trajectory's chain now (paused, migrated or cancelled); returns its tokens."""
        t = self.chains.pop(traj_id, None)
        if t is None:
            return 0
        assert t.lock == 0, "drop of a running trajectory's KV"
        self.tree_tokens -= t.tokens
        self._child_gone(t.group)
        return t.tokens

    def flush(self) -> None:
        """Weight sync: the tree is dropped; running requests recompute their context under the
        new weights and hold it privately until they end. A group's prompt stays shared: its
        first running member holds it, the others only their own tail, so the pool never holds
        more than before the flush (counting the prompt once per member overflowed it)."""
        self.prompts.clear()
        self.chains.clear()
        self._heap.clear()
        self.tree_tokens = 0
        holding_prompt = set()
        for r in self.running.values():
            if r.locked:
                held = r.context if r.group not in holding_prompt else max(0, r.context - r.prompt)
                holding_prompt.add(r.group)
                self.private_tokens += held
                r.private += held
                r.locked = False

    def refresh_waiting(self, queued: Iterable[Tuple[int, int]]) -> None:
        """Touch the prefixes of the first `refresh_waiting` queued (traj_id, group_id), head last."""
        head = list(itertools.islice(queued, self.refresh_window))
        for traj_id, group_id in reversed(head):
            p = self.prompts.get(group_id)
            if p is None:
                continue
            self._touch(p)
            t = self.chains.get(traj_id)
            if t is not None:
                self._touch(t)

    # ---------------------------------------------------------------------------- eviction
    def evict(self, tokens: int, protect: Tuple[int, int] = (-1, -1), force: bool = False) -> int:
        """Free at least `tokens` tokens if possible by LRU over evictable leaves; `protect` =
        (traj_id, group_id) of the request being admitted (its prefix is locked first); `force`
        evicts pinned chains too. Returns the tokens freed."""
        if force and self.pinned:
            for t in self.chains.values():
                if t.live and t.lock == 0:
                    self._push(t, always=True)
        freed = 0
        counted = set()
        held = []
        heap = self._heap
        while freed < tokens and heap:
            entry = heapq.heappop(heap)
            stamp, kind, key = entry
            node = (self.prompts if kind == "p" else self.chains).get(key)
            if node is None or node.stamp != stamp or node.lock:
                continue
            if (kind == "t" and key == protect[0]) or (kind == "p" and key == protect[1]):
                held.append(entry)
                continue
            if kind == "p":
                if node.children:
                    continue
                del self.prompts[key]
                self.tree_tokens -= node.tokens
                freed += node.tokens
                continue
            if node.live and self.pinned and not force:
                continue
            if node.segments:
                seg = node.segments.pop()
                node.tokens -= seg
                self.tree_tokens -= seg
                freed += seg
                if node.live and key not in counted:
                    counted.add(key)
                    self.evictions += 1
            if node.segments:
                heapq.heappush(heap, entry)  # its parent in the chain: same access time
            else:
                del self.chains[key]
                self._child_gone(node.group)
        for entry in held:
            heapq.heappush(heap, entry)
        self.evicted_tokens += freed
        return freed

    # ----------------------------------------------------------------------------- helpers
    def _extend_chain(self, traj_id: int, p: _Node, total: int) -> _Node:
        t = self.chains.get(traj_id)
        if t is None:
            t = self.chains[traj_id] = _Node("t", traj_id, p.key, 0)
            p.children += 1
        extra = total - p.tokens - t.tokens
        if extra > 0:
            t.segments.append(extra)
            t.tokens += extra
            self.tree_tokens += extra
        self._touch(t)
        return t

    def _child_gone(self, group_id: int) -> None:
        p = self.prompts[group_id]
        p.children -= 1
        if not p.children:
            self._push(p)

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.stamp = self._clock
        self._push(node)

    def _push(self, node: _Node, always: bool = False) -> None:
        """Give `node` a heap entry at its access time if it is evictable now (every change that
        makes a node evictable calls this; entries of nodes that changed since are skipped)."""
        if not always and (node.lock or (node.children if node.kind == "p" else node.live and self.pinned)):
            return
        heap = self._heap
        heapq.heappush(heap, (node.stamp, node.kind, node.key))
        if len(heap) > 4 * (len(self.prompts) + len(self.chains)) + 1024:
            self._rebuild()  # drop stale entries (lazy deletion): memory stays bounded

    def _rebuild(self) -> None:
        # in place: evict() holds the list while it pops
        self._heap[:] = [(n.stamp, n.kind, n.key) for n in (*self.prompts.values(), *self.chains.values())]
        heapq.heapify(self._heap)

    def check(self) -> Optional[str]:
        """Consistency of the ledger (for tests): None, or what is wrong."""
        tree = sum(p.tokens for p in self.prompts.values()) + sum(t.tokens for t in self.chains.values())
        if tree != self.tree_tokens:
            return f"tree tokens {self.tree_tokens} != nodes' {tree}"
        if self.private_tokens != sum(r.private for r in self.running.values()):
            return "private tokens do not match the running requests"
        if not 0 <= self.used <= self.capacity:
            return f"used {self.used} outside [0, {self.capacity}]"
        for t in self.chains.values():
            if t.group not in self.prompts or t.tokens != sum(t.segments) or t.lock < 0:
                return f"chain {t.key} inconsistent"
        for g, p in self.prompts.items():
            if p.children != sum(1 for t in self.chains.values() if t.group == g) or p.lock < 0:
                return f"prompt {g} inconsistent"
        return None
