"""The start-up group layout: which groups exist, how many, and that a registry creates them
without new groups afterwards (threads over one gloo HashStore stand in for ranks)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.comm.groups import (
    GroupCreatedError,
    GroupLayout,
    GroupRegistry,
    GroupSpec,
    forbid_new_groups,
)

layouts = st.builds(lambda tp, blocks, extra: GroupLayout(tp * blocks + extra, tp),
                    st.integers(1, 4), st.integers(1, 9), st.integers(0, 3))


def test_blocks_positions_and_leftover_units():
    layout = GroupLayout(5, 2)
    assert layout.num_blocks == 2
    assert [layout.block_of(r) for r in range(5)] == [0, 0, 1, 1, None]
    assert [layout.tp_position(r) for r in range(5)] == [0, 1, 0, 1, 0]
    assert layout.home_tp_ranks(3) == (2, 3) and layout.home_tp_ranks(4) == (4,)
    assert layout.actor_ranks(2) == (0, 1, 2, 3)
    assert layout.dp_ranks(2, 1) == (1, 3) and layout.dp_ranks(1, 0) == (0,)


def test_group_specs_of_a_small_layout():
    names = [(s.name, s.ranks) for s in GroupLayout(5, 2).group_specs()]
    assert names == [("self/0", (0,)), ("self/1", (1,)), ("self/2", (2,)), ("self/3", (3,)), ("self/4", (4,)),
                     ("tp/0", (0, 1)), ("tp/1", (2, 3)), ("dp/2/0", (0, 2)), ("dp/2/1", (1, 3)),
                     ("actors/2", (0, 1, 2, 3))]


@pytest.mark.parametrize("world,tp,count", [(1, 1, 1), (8, 1, 15), (8, 2, 21), (64, 1, 127), (64, 2, 189),
                                            (64, 8, 135), (65, 8, 136)])
def test_group_count_grows_linearly_with_the_rank_count(world, tp, count):
    layout = GroupLayout(world, tp)
    assert layout.num_groups == len(layout.group_specs()) == count
    assert count < 3 * world  # W single-rank + W/tp TP + about W DP groups, never 2^W


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_every_configuration_finds_its_groups(layout):
    specs = {s.ranks for s in layout.group_specs()}
    assert len(specs) == layout.num_groups  # member sets are unique
    for k in range(1, layout.num_blocks + 1):
        assert layout.actor_ranks(k) in specs
        for j in range(layout.tp_size):
            assert layout.dp_ranks(k, j) in specs
    for rank in range(layout.world_size):
        assert layout.home_tp_ranks(rank) in specs and (rank,) in specs
        mine = layout.groups_of(rank)
        assert all(rank in s.ranks for s in mine)
        # A rank joins its own groups only: about 2 W/tp of them, not W.
        assert len(mine) <= 2 + 2 * max(layout.num_blocks - 1, 0)


def test_only_prefixes_of_whole_blocks_are_actor_configurations():
    layout = GroupLayout(8, 2)
    assert layout.actor_blocks_of([0, 1, 2, 3]) == 2
    for bad in ([0, 1, 4, 5], [0], [2, 3], []):
        with pytest.raises(ValueError, match="not the first k TP blocks"):
            layout.actor_blocks_of(bad)


def _store_factory(store: dist.Store, rank: int):
    def create(spec: GroupSpec) -> dist.ProcessGroup | None:
        if rank not in spec.ranks:
            return None
        name = "/".join(map(str, spec.ranks))
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), spec.ranks.index(rank), len(spec.ranks),
                                     timedelta(seconds=30))
    return create


def test_registry_builds_each_rank_its_groups_and_collections_need_none_after():
    layout = GroupLayout(7, 2)
    store = dist.HashStore()
    registries: dict[int, GroupRegistry] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            registries[rank] = GroupRegistry.build(layout, rank, _store_factory(store, rank))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(layout.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(registries) == layout.world_size
    assert sum(len(r.groups) for r in registries.values()) == sum(len(s.ranks) for s in layout.group_specs())
    reg = registries[2]  # block 1, TP position 0
    assert reg.tp_group.size() == 2 and reg.self_group.size() == 1
    assert reg.dp_group(3).size() == 3 and reg.dp_group(2).size() == 2 and reg.dp_group(2).rank() == 1
    assert reg.actors_group(2).size() == 4 and reg.actors_group(2).rank() == 2
    with pytest.raises(ValueError, match="not an actor"):
        reg.dp_group(1)
    with pytest.raises(KeyError, match="never made it"):
        reg.group((0, 2, 4, 5))


def test_forbid_new_groups_refuses_every_creator_and_restores_them():
    original = dist.new_group
    with forbid_new_groups() as attempts:
        with pytest.raises(GroupCreatedError):
            dist.new_group([0])
        with pytest.raises(GroupCreatedError):
            dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=1))
        assert attempts == ["torch.distributed.new_group", "torch.distributed.ProcessGroupGloo"]
    assert dist.new_group is original
