"""The emulated engine's KV pool: shared prefixes stored once, held pages never evicted, LRU order,
and its token ledger (used = pages x page + private) under any sequence of operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.emulation.kv_pool import KVPool


def test_a_shared_prompt_is_stored_once_and_matched_by_page():
    pool = KVPool(1000, page_tokens=4)
    prompt = list(range(10))  # two full pages and a private tail of 2
    a = pool.hold(pool.hashes(prompt), len(prompt))
    assert pool.used == 10
    b = pool.hold(pool.hashes(prompt + [99, 98]), 12)  # the same two pages, three with its own tail
    assert pool.used == 3 * 4 + 2 + 0  # pages {p0, p1, p2'} once each, a's tail 2, b's tail 0
    assert pool.match(pool.hashes(prompt + [99, 98, 0, 0])) == 12
    assert pool.match(pool.hashes([1] + prompt)) == 0
    pool.release(a)
    pool.release(b)
    assert pool.used == pool.evictable == 12 and pool.protected == 0


def test_held_pages_are_never_evicted_and_lru_goes_first():
    pool = KVPool(16, page_tokens=4)
    old = pool.hold(pool.hashes([1, 1, 1, 1]), 4)
    new = pool.hold(pool.hashes([2, 2, 2, 2]), 4)
    kept = pool.hold(pool.hashes([3, 3, 3, 3]), 4)
    pool.release(old)
    pool.release(new)
    assert pool.evict(4) == 4
    assert pool.match(pool.hashes([1, 1, 1, 1])) == 0 and pool.match(pool.hashes([2, 2, 2, 2])) == 4
    assert pool.evict(4, keep=pool.hashes([2, 2, 2, 2])) == 0  # the prefix about to be held stays
    assert pool.evict(100) == 4  # only the unheld page; the held one stays
    assert pool.match(pool.hashes([3, 3, 3, 3])) == 4 and pool.used == 4
    with pytest.raises(RuntimeError, match="still held"):
        pool.flush()
    pool.release(kept)
    pool.flush()
    assert pool.used == 0


def test_a_holder_that_grows_keeps_its_pages_and_frees_its_old_tail():
    pool = KVPool(100, page_tokens=4)
    tokens = [5, 6, 7, 8, 9]
    held = pool.hold(pool.hashes(tokens), 5)
    pool.reserve(held, 3)  # decode writes 3 tokens
    assert pool.used == 4 + 1 + 3
    grown = tokens + [0, 0, 0]
    assert pool.room_for(pool.hashes(grown, held.pages), 8, held) == 0
    held = pool.hold(pool.hashes(grown, held.pages), 8, held)
    assert pool.used == 8 and held.private == 0 and len(held.pages) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "release", "evict", "forget"]), st.integers(0, 5),
                          st.integers(1, 30)), max_size=40))
def test_the_ledger_adds_up_under_any_operations(ops):
    pool = KVPool(10_000, page_tokens=4)
    holders = []
    for op, which, n in ops:
        if op == "hold":
            tokens = [which] * n  # holders of the same `which` share their prefix
            holders.append(pool.hold(pool.hashes(tokens), n))
        elif op == "release" and holders:
            pool.release(holders.pop(which % len(holders)))
        elif op == "evict":
            pool.evict(n)
        elif op == "forget":
            pool.forget(pool.hashes([which] * n))
        held_pages = {h for x in holders for h in x.pages}
        assert pool.protected == 4 * len(held_pages)
        assert pool.used == pool.protected + pool.evictable + sum(x.private for x in holders)
        assert pool.available == pool.capacity - pool.used
    for x in holders:
        pool.release(x)
    pool.evict(pool.capacity)
    assert pool.used == 0
