"""The request-level placement rule every baseline uses (real controller, one-process CTB
rollout with CTB off, simulator)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.core.request_placement import LeastLoadedPlacer


def test_a_group_stays_on_its_home_rank_while_it_has_room():
    p = LeastLoadedPlacer([0, 1], max_tasks_per_rank=3)
    assert [p.place("g0") for _ in range(3)] == [0, 0, 0]  # the group's prefix is on rank 0
    assert p.place("g0") == 1  # home full: the least loaded rank
    assert p.place("g1") == 1
    assert p.place("g1") == 1 and p.place("g1") is None  # every rank full
    p.release(0)
    assert p.place("g1") == 0 and p.loads() == {0: 3, 1: 3}


def test_ties_go_to_the_lowest_rank_and_a_removed_home_is_forgotten():
    p = LeastLoadedPlacer([2, 1, 3])
    assert p.place("a") == 1 and p.place("b") == 2 and p.place("c") == 3
    p.remove_rank(1)
    assert p.place("a") == 2  # its home left: least loaded again (2 and 3 tie at 1)
    assert p.is_placed("a")
    p.forget_group("a")
    assert not p.is_placed("a")
    p.release(1)  # a task of a rank gone already: nothing to book
    assert p.loads() == {2: 2, 3: 1}


def test_a_closed_rank_keeps_its_tasks_but_takes_none():
    p = LeastLoadedPlacer([0, 1])
    assert p.place("g") == 0
    p.set_accepting(0, False)
    assert p.place("g") == 1 and p.place("h") == 1  # not the home, not the least loaded
    p.set_accepting(1, False)
    assert p.place("h") is None
    p.set_accepting(0, True)
    assert p.place("h") == 0 and p.loads() == {0: 2, 1: 2}


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_tasks_per_rank"):
        LeastLoadedPlacer([0], max_tasks_per_rank=0)
    p = LeastLoadedPlacer([0])
    with pytest.raises(ValueError, match="no task placed"):
        p.release(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["place", "release", "add", "remove"]),
                          st.integers(0, 3), st.integers(0, 4)), max_size=60),
       st.one_of(st.none(), st.integers(1, 3)))
def test_loads_match_what_was_placed_and_never_pass_the_cap(ops, cap):
    p = LeastLoadedPlacer([0, 1], max_tasks_per_rank=cap)
    held: dict[int, int] = {0: 0, 1: 0}  # what a caller that releases every placement sees
    homes: dict[int, int] = {}  # group -> the rank its first placement went to
    for op, rank, group in ops:
        if op == "place":
            before = p.loads()
            r = p.place(group)
            if r is None:
                assert not held or (cap is not None and all(n >= cap for n in held.values()))
                continue
            assert before[r] == min(before.values()) or homes.get(group) == r  # least loaded, or home
            homes.setdefault(group, r)
            held[r] += 1
        elif op == "release" and held.get(rank, 0) > 0:
            p.release(rank)
            held[rank] -= 1
        elif op == "add":
            p.add_rank(rank)
            held.setdefault(rank, 0)
        elif op == "remove":
            p.remove_rank(rank)
            held.pop(rank, None)
            homes = {g: r for g, r in homes.items() if r != rank}
        assert p.loads() == held
        assert cap is None or max(held.values(), default=0) <= cap
