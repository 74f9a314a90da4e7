"""Trainer assignments from role plans, decoupled routing, DP splits and role transitions."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.comm.groups import GroupLayout
from tide_megatron.core.roles import Role
from tide_megatron.trainer.assignment import TrainerAssignment, plan_transition, split_by_dp

A, AR, REF, RO = Role.ACTOR, Role.ACTOR_REF, Role.REF, Role.ROLLOUT


def test_from_roles_tp2_dp2_with_a_tp1_reference():
    layout = GroupLayout(5, 2)
    a = TrainerAssignment.from_roles(layout, {0: A, 1: A, 2: A, 3: A, 4: REF})
    assert a.dp_size == 2 and not a.actors_hold_ref and a.ref_ranks == (4,) and a.modes == {"decoupled"}
    before = TrainerAssignment.at_startup(layout, range(4), ())
    msg = a.to_message(before)
    assert TrainerAssignment.from_message(layout, msg) == a and TrainerAssignment.replaced_by(layout, msg) == before
    assert [a.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert a.dp_members(1) == (2, 3)
    # One TP=1 reference rank sends to every TP rank of both actor blocks.
    assert [a.ref_source(r) for r in range(4)] == [4, 4, 4, 4]
    assert a.ref_destinations(4) == {0: (0, 1), 1: (2, 3)}
    assert a.served_dp_ranks(4) == [0, 1]


def test_tp2_reference_units_split_the_positions_and_the_dp_ranks():
    layout = GroupLayout(12, 2)  # 6 blocks
    roles = {r: (A if r < 6 else REF if r < 10 else RO) for r in range(12)}
    a = TrainerAssignment.from_roles(layout, roles)
    assert a.ref_units == [(6, 7), (8, 9)]
    assert [a.ref_source(r) for r in range(6)] == [6, 7, 8, 9, 6, 7]  # DP 0,2 -> unit 0; DP 1 -> unit 1
    assert a.ref_destinations(6) == {0: (0,), 2: (4,)} and a.ref_destinations(9) == {1: (3,)}
    assert a.served_dp_ranks(8) == [1]


@pytest.mark.parametrize("roles,match", [
    ({0: A, 1: AR, 2: RO}, "mix ACTOR and ACTOR_REF"),
    ({0: A, 1: RO, 2: A, 3: RO}, "not the first k TP blocks"),
    ({0: A, 1: A, 2: REF, 3: RO}, "whole TP group"),
    ({0: A, 1: A, 2: RO, 3: RO}, "must live somewhere"),
])
def test_plans_the_groups_cannot_serve_are_refused(roles, match):
    with pytest.raises(ValueError, match=match):
        TrainerAssignment.from_roles(GroupLayout(4, 2), roles)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), max_size=40), st.integers(1, 8))
def test_split_by_dp_covers_the_batch_once_and_balances_counts(items, dp):
    shards = split_by_dp(items, dp)
    assert len(shards) == dp
    assert sorted(x for s in shards for x in s) == sorted(items)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_a_static_partition_may_keep_the_reference_on_actors_and_a_reference_rank():
    a = TrainerAssignment(GroupLayout(3, 1), 2, ref_ranks=(2,))
    assert a.modes == {"colocated", "decoupled"} and a.role_of(0) is AR and a.role_of(2) is REF


def test_dp_4_to_2_to_4():
    layout = GroupLayout(4, 1)
    four = TrainerAssignment(layout, 4)
    two = TrainerAssignment(layout, 2)
    down = plan_transition(four, two)
    assert [down[r].actor for r in range(4)] == ["keep", "keep", "leave", "leave"]
    assert [down[r].new_role for r in range(4)] == [AR, AR, RO, RO]
    assert all(down[r].ref == "release" for r in (2, 3)) and down[0].ref == "keep"
    up = plan_transition(two, four)
    assert [up[r].actor for r in range(4)] == ["keep", "keep", "join", "join"]
    assert up[2].state_source == 0 and up[3].state_source == 1
    assert up[0].state_targets == (2,) and up[1].state_targets == (3,)
    assert all(up[r].new_actor_blocks == 4 for r in range(4))


def test_colocated_to_decoupled_turns_the_last_actor_block_into_the_reference():
    layout = GroupLayout(6, 2)
    old = TrainerAssignment(layout, 3)
    new = TrainerAssignment(layout, 2, ref_ranks=(4, 5), actors_hold_ref=False)
    t = plan_transition(old, new)
    assert (t[4].actor, t[4].ref, t[4].new_role) == ("leave", "keep", REF)
    assert (t[0].actor, t[0].ref, t[0].new_role) == ("keep", "release", A)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6))
def test_every_joiner_gets_one_source_in_its_new_dp_group(tp, k_old, k_new):
    layout = GroupLayout(tp * 6, tp)
    t = plan_transition(TrainerAssignment(layout, k_old), TrainerAssignment(layout, k_new))
    joiners = [r for r in t.values() if r.actor == "join"]
    assert len(joiners) == max(k_new - k_old, 0) * tp
    sent = Counter(dst for r in t.values() for dst in r.state_targets)
    for j in joiners:
        src = j.state_source
        assert sent[j.rank] == 1 and t[src].actor == "keep"
        assert {src, j.rank} <= set(layout.dp_ranks(k_new, layout.tp_position(j.rank)))
    assert sum(sent.values()) == len(joiners)


def test_a_rank_that_rolled_out_through_earlier_changes_plans_the_same_transfer_as_its_sender():
    """Found by a 32-rank emulated run (`cluster.device=emulated`): the trainer went from 16
    actors to 12 actors and 4 reference ranks while rank 16 rolled out (it was not told: the
    change did not involve it); then rank 16 joined the actors. Planned from its own view (16
    actors) it waited for rank 0's state, while rank 4 (12 actors) sent it its state: both
    waited forever. Planned from the configuration the message replaces, both agree."""
    layout = GroupLayout(32, 1)
    at_start = TrainerAssignment.at_startup(layout, range(16), ())  # what rank 16 last heard
    current = TrainerAssignment(layout, 12, ref_ranks=(12, 13, 14, 15), actors_hold_ref=False)
    joined = TrainerAssignment(layout, 17, actors_hold_ref=True)
    msg = joined.to_message(current)
    senders = plan_transition(current, joined)
    assert senders[4].state_targets == (16,)
    assert plan_transition(at_start, joined)[16].state_source == 0  # the stale plan: a transfer no one sends
    caught_up = at_start.catch_up(TrainerAssignment.replaced_by(layout, msg), 16)
    assert plan_transition(caught_up, TrainerAssignment.from_message(layout, msg))[16].state_source == 4
    # A view that disagrees about the rank's own role is not caught up silently.
    with pytest.raises(RuntimeError, match="out of order"):
        at_start.catch_up(current, 12)
