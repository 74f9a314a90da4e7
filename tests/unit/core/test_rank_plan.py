"""The rank plan (`core/rank_plan.py`) over 1x8, 4x8 and 8x8 GPUs with engine TP 1/2/4, trainer
TP 1/2/4/8 and PP 1/2: roles, GPUs, engines, trainer groups, what ERS moves, and the errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tide_megatron.comm.groups import GroupLayout
from tide_megatron.core.rank_plan import PlanError, PlanRequest, describe, plan_ranks

MACHINES = [(1, 8), (4, 8), (8, 8)]
ENGINE_TP = [1, 2, 4]
TRAINER_TP = [1, 2, 4, 8]
TRAINER_PP = [1, 2]


def _cases():
    for (nodes, gpus), etp, tp, pp, ers in itertools.product(MACHINES, ENGINE_TP, TRAINER_TP, TRAINER_PP,
                                                              (False, True)):
        world, unit = nodes * gpus, tp * pp
        # About a quarter of the world rolls out, in whole engines, the trainer in whole units.
        step = math.lcm(unit, etp)
        rollout = max(step, world // 4 // step * step)
        if world - rollout < unit or (world - rollout) % unit or rollout % etp:
            continue
        if ers and max(unit, etp) % min(unit, etp):
            continue
        yield PlanRequest(nodes, gpus, rollout_ranks=rollout, trainer_tp=tp, trainer_pp=pp, engine_tp=etp,
                          ers_moves_ranks=ers)


CASES = list(_cases())


def test_the_grid_covers_every_size_named():
    seen = {(r.nnodes, r.engine_tp, r.trainer_tp, r.trainer_pp, r.ers_moves_ranks) for r in CASES}
    for (nodes, _), etp, tp, pp in itertools.product(MACHINES, ENGINE_TP, TRAINER_TP, TRAINER_PP):
        if nodes > 1 or tp * pp < 8:  # on one node of 8, TP x PP = 8 leaves nothing to roll out
            assert (nodes, etp, tp, pp, False) in seen, (nodes, etp, tp, pp)


@pytest.mark.parametrize("req", CASES, ids=lambda r: f"{r.nnodes}x{r.gpus_per_node}-e{r.engine_tp}-t{r.trainer_tp}"
                                                     f"-p{r.trainer_pp}-{'ers' if r.ers_moves_ranks else 'static'}")
def test_plan_invariants(req):
    plan = plan_ranks(req)
    g, world, unit, etp = req.gpus_per_node, req.world_size, req.trainer_unit, req.engine_tp
    # Every rank once, on its node's GPU = its local rank; actors a prefix, rollout the suffix.
    assert [s.rank for s in plan.slots] == list(range(world))
    for s in plan.slots:
        assert (s.node, s.local_rank, s.gpu) == (s.rank // g, s.rank % g, s.rank % g)
    assert plan.actor_ranks == list(range(len(plan.actor_ranks)))
    assert plan.rollout_ranks == list(range(world - req.rollout_ranks, world))
    # Engines: etp consecutive ranks of one node, hosted by the first, GPUs from base_gpu_id.
    assert sum(len(e.ranks) for e in plan.engines) == len(plan.rollout_ranks)
    for e in plan.engines:
        assert e.host == e.ranks[0] and e.host % etp == 0 and len(e.ranks) == etp
        assert {e.node} == {r // g for r in e.ranks}
        assert e.gpus == tuple(range(e.base_gpu_id, e.base_gpu_id + etp))
        for r in e.ranks:
            assert plan.slot(r).engine_host == e.host
    assert [r for r in plan.rollout_ranks if plan.slot(r).hosts_engine] == [e.host for e in plan.engines]
    # Trainer groups: TP inside one node, TP x PP x DP = the actors, each actor once per kind.
    groups = plan.groups
    assert plan.dp_size * unit == len(plan.actor_ranks)
    for kind, size in (("tp", req.trainer_tp), ("pp", req.trainer_pp), ("dp", plan.dp_size)):
        members = [r for grp in getattr(groups, kind) for r in grp]
        assert sorted(members) == plan.actor_ranks, kind
        assert {len(grp) for grp in getattr(groups, kind)} == {size}, kind
    for grp in groups.tp:
        assert len({r // g for r in grp}) == 1 and list(grp) == list(range(grp[0], grp[0] + len(grp)))
    if req.trainer_pp == 1:  # the groups the runtime makes (comm/groups.py) are the plan's
        layout = GroupLayout(world, req.trainer_tp)
        k = plan.dp_size
        assert set(groups.dp) == {layout.dp_ranks(k, j) for j in range(req.trainer_tp)}
        assert set(groups.tp) == {layout.home_tp_ranks(r) for r in plan.actor_ranks}
    # ERS: whole move units, never rank 0's, each unit whole engines and whole trainer units.
    movable = plan.movable_ranks
    if not req.ers_moves_ranks:
        assert plan.move_unit == 0 and movable == []
        return
    m = plan.move_unit
    assert m % unit == 0 and m % etp == 0 and m == max(unit, etp)
    assert movable == list(range(m, world // m * m))
    assert 0 not in movable and len(movable) % m == 0
    text = "\n".join(describe(plan))  # the dry run's listing: every rank once, the movable ones starred
    assert all(f"[{r}:" in text for r in range(world)) and text.count("*]") == len(movable)


@pytest.mark.parametrize("req,moves,movable_end", [
    # One node, TP-4 trainer of 4 and 4 single-GPU engines: ERS moves the upper half in one block of 4.
    (PlanRequest(1, 8, rollout_ranks=4, trainer_tp=4, ers_moves_ranks=True), 4, 8),
    # Engines of 4 GPUs, a TP-2 trainer: a move takes one whole engine (4 ranks = 2 trainer units).
    (PlanRequest(4, 8, rollout_ranks=8, trainer_tp=2, engine_tp=4, ers_moves_ranks=True), 4, 32),
    # TP 2 x PP 2 = units of 4 over 64 GPUs, engines of 2: units of 4.
    (PlanRequest(8, 8, rollout_ranks=16, trainer_tp=2, trainer_pp=2, engine_tp=2, ers_moves_ranks=True), 4, 64),
    # TP 8 (a whole node) with single-GPU engines: whole nodes move.
    (PlanRequest(4, 8, rollout_ranks=8, trainer_tp=8, ers_moves_ranks=True), 8, 32),
])
def test_what_ers_moves(req, moves, movable_end):
    plan = plan_ranks(req)
    assert plan.move_unit == moves
    assert plan.movable_ranks == list(range(moves, movable_end))


def test_pp_stages_are_tp_groups_of_one_unit():
    plan = plan_ranks(PlanRequest(2, 8, rollout_ranks=8, trainer_tp=2, trainer_pp=2))
    assert plan.groups.tp[:2] == ((0, 1), (2, 3))
    assert plan.groups.pp[:2] == ((0, 2), (1, 3))
    assert plan.groups.dp == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize("share,world,tp,expected", [
    (0.25, 32, 4, 8),    # exact
    (0.25, 8, 4, 4),     # 2 would leave 6 trainer ranks: not whole TP-4 units
    (0.5, 8, 4, 4),
    (0.3, 8, 1, 2),      # 2.4 -> 2
    (0.01, 8, 1, 1),     # at least one engine
])
def test_a_rollout_share_rounds_to_whole_engines_and_trainer_units(share, world, tp, expected):
    plan = plan_ranks(PlanRequest(world // 8 if world >= 8 else 1, min(world, 8), rollout_share=share, trainer_tp=tp))
    assert len(plan.rollout_ranks) == expected
    assert bool(plan.notes) == (share * world != expected)


@given(nodes=st.integers(1, 8), gpus=st.sampled_from([1, 2, 4, 8]), share=st.floats(0.01, 0.99),
       tp=st.sampled_from([1, 2, 4, 8]), etp=st.sampled_from([1, 2, 4]))
def test_any_share_either_plans_whole_units_or_names_the_key(nodes, gpus, share, tp, etp):
    req = PlanRequest(nodes, gpus, rollout_share=share, trainer_tp=tp, engine_tp=etp)
    try:
        plan = plan_ranks(req)
    except PlanError as exc:
        assert any(key in str(exc) for key in ("trainer.tp_size", "rollout.engine.tp_size", "cluster.rollout_share"))
        return
    assert len(plan.rollout_ranks) % etp == 0 and len(plan.actor_ranks) % tp == 0
    assert plan.rollout_ranks and plan.actor_ranks


@pytest.mark.parametrize("req,key", [
    (PlanRequest(1, 8, rollout_ranks=8), "cluster.rollout_ranks=8"),
    (PlanRequest(1, 8, rollout_ranks=0), "cluster.rollout_ranks=0"),
    (PlanRequest(1, 8, rollout_ranks=2, trainer_tp=4), "cluster.rollout_ranks=2"),
    (PlanRequest(2, 6, rollout_ranks=4, trainer_tp=4), "trainer.tp_size=4 does not divide the 6 GPUs"),
    (PlanRequest(2, 6, rollout_ranks=4, engine_tp=4), "rollout.engine.tp_size=4 does not divide the 6 GPUs"),
    (PlanRequest(1, 8, rollout_ranks=4, trainer_tp=4, num_attention_heads=28, num_key_value_heads=2),
     "trainer.tp_size=4 does not divide the model's 2 key_value_heads"),
    (PlanRequest(1, 8, rollout_ranks=4, trainer_tp=2, num_attention_heads=28, num_key_value_heads=4, engine_tp=8),
     "rollout.engine.tp_size=8 does not divide the model's 28 attention_heads"),
    (PlanRequest(1, 8, rollout_ranks=3, engine_tp=2), "whole engines of rollout.engine.tp_size=2"),
    (PlanRequest(1, 8, rollout_ranks=2, ref_ranks=1, trainer_tp=2), "cluster.ref_ranks=1"),
    (PlanRequest(1, 8, rollout_ranks=4, trainer_tp=2, engine_tp=4, trainer_pp=3), "trainer.tp_size x trainer.pp_size=6"),
    (PlanRequest(1, 3, rollout_ranks=1, trainer_tp=2, ers_moves_ranks=True), "ers.move_ranks"),
    (PlanRequest(1, 8, rollout_share=1.5), "cluster.rollout_share=1.5"),
])
def test_a_plan_that_cannot_work_names_the_key(req, key):
    with pytest.raises(PlanError) as info:
        plan_ranks(req)
    assert key in str(info.value)
    assert "\n" not in str(info.value)
