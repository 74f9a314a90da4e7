"""The KV pool of an emulated engine: token accounting with page-granular prefix reuse.

What it keeps of SGLang's radix cache (`sglang/srt/mem_cache/radix_cache.py`, 0.5.23):
- a prefix that some request computed stays in the pool after the request ends, and a later
  request whose tokens start with it skips that much prefill (`match_prefix`);
- tokens two holders share (a GRPO group's prompt) are stored once;
- what a running request or an open streaming session holds is locked (`lock_ref`), the rest is
  evicted least-recently-used first when room is needed (`evict`, "lru").

How: a context is cut into pages of `page_tokens`; page i is named by a hash chained over pages
0..i (vLLM's automatic prefix caching names blocks the same way), so a match walks the pages
of the new context until one is missing. A holder's partial last page is private to it. This is
coarser than SGLang's token-granular tree (a shared prefix ending mid-page is matched only up to
the page before), which the engine's report shows as a hit rate a little below SGLang's.
Pure Python: the engine stand-in calls it on its own event loop, never from two threads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Holding:
    """What one holder (a running request or an open session) has in the pool."""

    pages: list[int] = field(default_factory=list)
    """Hashes of its full pages, in order (each holds one ref)."""
    private: int = 0
    """Tokens past its last full page, and reserved tokens not yet written."""


class KVPool:
    """Tokens of KV the engine holds, shared by prefix where the contexts agree."""

    def __init__(self, capacity_tokens: int, page_tokens: int = 64):
        if capacity_tokens < page_tokens or page_tokens < 1:
            raise ValueError(f"a KV pool of {capacity_tokens} tokens in pages of {page_tokens}: need at least one page")
        self.capacity = capacity_tokens
        self.page = page_tokens
        self._refs: dict[int, int] = {}
        """Every page in the pool: its holders (running requests, open sessions)."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """The pages no one holds, least recently released first (the eviction order)."""
        self._private = 0

    # -- state -----------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self._refs) * self.page + self._private

    @property
    def available(self) -> int:
        return self.capacity - self.used

    @property
    def evictable(self) -> int:
        return len(self._free) * self.page

    @property
    def protected(self) -> int:
        return (len(self._refs) - len(self._free)) * self.page

    def hashes(self, tokens: Sequence[int], start_hashes: Sequence[int] = ()) -> list[int]:
        """Chained page hashes of `tokens`' full pages; `start_hashes` are those of a prefix
        already hashed (a session's), so only the new pages are hashed again."""
        out = list(start_hashes)
        prev = out[-1] if out else 0
        for i in range(len(out), len(tokens) // self.page):
            prev = hash((prev, tuple(tokens[i * self.page:(i + 1) * self.page])))
            out.append(prev)
        return out

    def match(self, hashes: Sequence[int]) -> int:
        """Tokens of the longest cached prefix of a context with these page hashes."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n * self.page

    # -- holders ---------------------------------------------------------------------
    def room_for(self, hashes: Sequence[int], tokens: int, held: Holding | None = None) -> int:
        """Tokens the pool must still free for a holder to hold a context of `tokens` tokens
        with these page hashes (0: it fits now); counts what `held` already holds."""
        have = set(held.pages) if held else set()
        new_pages = sum(1 for h in hashes if h not in self._refs and h not in have)
        need = new_pages * self.page + (tokens - len(hashes) * self.page) - (held.private if held else 0)
        return max(0, need - self.available)

    def hold(self, hashes: Sequence[int], tokens: int, held: Holding | None = None) -> Holding:
        """Hold a context of `tokens` tokens (pages `hashes` plus a private tail), releasing what
        `held` held before (a holder that grew). The caller made room (`room_for`, `evict`)."""
        for h in hashes:
            refs = self._refs.get(h, 0)
            if refs == 0:
                self._free.pop(h, None)
            self._refs[h] = refs + 1
        out = Holding(list(hashes), tokens - len(hashes) * self.page)
        self._private += out.private
        if held is not None:
            self.release(held)
        return out

    def reserve(self, holding: Holding, tokens: int) -> None:
        """Tokens a holder writes beyond its context (decode), private until it is held again."""
        holding.private += tokens
        self._private += tokens

    def release(self, holding: Holding) -> None:
        """The holder is done: its pages stay cached (evictable once no one holds them), its
        private tokens are freed."""
        for h in reversed(holding.pages):  # a context's tail goes before its prefix (SGLang's leaves first)
            refs = self._refs.get(h)
            if refs is None:  # gone with a flush
                continue
            self._refs[h] = refs - 1
            if refs == 1:
                self._free[h] = None
        self._private -= holding.private
        holding.pages, holding.private = [], 0

    def forget(self, hashes: Sequence[int]) -> None:
        """Free these pages now where no one holds them (what SGLang frees on release instead
        of caching)."""
        for h in hashes:
            if h in self._free:
                del self._free[h]
                del self._refs[h]

    def evict(self, tokens: int, keep: Sequence[int] = ()) -> int:
        """Free at least `tokens` tokens of unheld pages, least recently released first, never
        those in `keep` (the prefix a request is about to hold: SGLang locks it before it makes
        room); returns the tokens freed (less when not enough is evictable)."""
        freed = 0
        if not keep:
            while freed < tokens and self._free:
                h, _ = self._free.popitem(last=False)
                del self._refs[h]
                freed += self.page
            return freed
        keep = set(keep)
        for h in list(self._free):
            if freed >= tokens:
                break
            if h not in keep:
                del self._free[h]
                del self._refs[h]
                freed += self.page
        return freed

    def flush(self) -> None:
        """Drop every cached page (new weights make them stale); held pages must be released
        first (the engine flushes only with no request running and no session open)."""
        held = len(self._refs) - len(self._free)
        if held or self._private:
            raise RuntimeError(f"flush with {held} held pages and {self._private} private tokens still held")
        self._refs.clear()
        self._free.clear()
