"""A trainer of many ranks: TP x DP actors with a reference rank, DP-size changes between steps,
and no process group created after start-up (`elastic_worker.py` runs each scenario in spawned
gloo processes; the tests compare what they wrote)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
from tide_megatron.models.weight_conversion import hf_to_megatron
from tide_megatron.testing import run_script

pytestmark = pytest.mark.integration

sys.path.insert(0, os.path.dirname(__file__))
from elastic_worker import MODEL_KWARGS, WORLD  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "elastic_worker.py")
# fp32 everywhere; TP and DP change only the order of sums (vocab-parallel softmax, gradient
# all-reduce), a few ulps per op, and two to three Adam steps of lr 1e-3 keep that far below.
ATOL = 2e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return write_random_hf_checkpoint(tmp_path_factory.mktemp("hf"), ModelConfig(**MODEL_KWARGS), seed=0)


def _run(scenario: str, hf_dir: str, out_dir: str) -> dict[int, dict]:
    run_script(WORKER, "--scenario", scenario, "--hf", hf_dir, "--out", out_dir, timeout=900)
    return {r: torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD[scenario])}


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory):
    return _run("single", hf_dir, str(tmp_path_factory.mktemp("single")))[0]


@pytest.fixture(scope="module")
def tp2dp2(hf_dir, tmp_path_factory):
    return _run("tp2dp2", hf_dir, str(tmp_path_factory.mktemp("tp2dp2")))


@pytest.fixture(scope="module")
def dp_change(hf_dir, tmp_path_factory):
    return _run("dp_change", hf_dir, str(tmp_path_factory.mktemp("dp_change")))


def _shard_of(hf: dict, tp_rank: int, tp: int = 2) -> dict:
    return hf_to_megatron(hf, ModelConfig(**MODEL_KWARGS), tp_rank, tp)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_tp2_dp2_steps_match_a_single_rank_on_the_same_batches(single, tp2dp2):
    rank0 = tp2dp2[0]
    assert [s["mode"] for s in rank0["steps"]] == ["decoupled", "colocated", "colocated", "decoupled"]
    for ours, ref in zip(rank0["steps"], single["steps"]):
        assert ours["num_tokens"] == ref["num_tokens"]  # the whole global batch, once
        assert ours["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert ours["kl"] == pytest.approx(ref["kl"], abs=1e-6)
        assert all(p == pytest.approx(ours["loss"], abs=1e-7) for p in ours["peer_losses"])
    # Weights after the decoupled and the colocated step equal the single-rank run's.
    assert _max_diff(rank0["params_after_2"], _shard_of(single["hf_after_2"], 0)) < ATOL


def test_checkpoint_of_tp2_dp2_loads_back_on_every_actor_rank(single, tp2dp2):
    assert _max_diff(tp2dp2[0]["params_after_3"], tp2dp2[0]["params_after_2"]) > 1e-4  # step 3 moved them
    for rank in range(4):
        shard = _shard_of(single["hf_after_2"], rank % 2)
        assert _max_diff(tp2dp2[rank]["params_loaded"], shard) < ATOL, rank


def test_an_actor_block_turned_tp2_reference_unit_serves_a_decoupled_step(tp2dp2):
    rank0 = tp2dp2[0]
    moves = rank0["transitions"]
    assert "actor_release_s" in moves[2] and "actor_release_s" in moves[3]  # block 1 left the actors
    assert "ref_restore_host_s" in moves[2] and "ref_release_s" in moves[4]  # its reference, resident
    again, first = rank0["steps"][3], rank0["steps"][2]
    assert again["num_tokens"] == first["num_tokens"] and again["peer_losses"] == [pytest.approx(again["loss"])]
    assert again["loss"] == pytest.approx(first["loss"], abs=1e-5)  # same state, same batch
    assert _max_diff(rank0["params_after_3_again"], rank0["params_after_3"]) < ATOL


def test_dp_change_4_2_4_keeps_weights_and_optimizer_state(dp_change):
    for rank, out in dp_change.items():
        assert _max_diff(out["b_params"], out["a_params"]) < ATOL, rank
        a, b = out["a_optimizer"], out["b_optimizer"]
        assert len(a) == len(b) > len(out["a_params"])  # weights, then Adam moments and steps
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) < ATOL, rank
    steps_a, steps_b = dp_change[0]["a_steps"], dp_change[0]["b_steps"]
    assert [len(s["peer_losses"]) for s in steps_b] == [3, 1, 3]  # DP 4, 2, 4
    for a, b in zip(steps_a, steps_b):
        assert b["num_tokens"] == a["num_tokens"] and b["loss"] == pytest.approx(a["loss"], abs=1e-5)


def test_leaving_and_joining_ranks_do_what_the_plan_says(dp_change):
    down, up = dp_change[0]["b_transitions"]
    assert "actor_release_s" in down[2] and "ref_release_s" in down[2] and "dp_switch_s" in down[0]
    assert "actor_restore_s" in up[3] and "state_recv_s" in up[3] and "ref_restore_host_s" in up[3]
    assert "state_send_s" in up[0] and "state_send_s" in up[1]
    # The leaving ranks' own record of the two transitions.
    assert [sorted(t) for t in dp_change[2]["b_transitions"]] == [sorted(up[2])]


def test_distributed_optimizer_trains_alike_and_refuses_a_dp_change(dp_change):
    out = dp_change[0]
    assert _max_diff(out["c_params_after_1"], out["a_params_after_1"]) < ATOL
    assert "distributed_optimizer" in out["c_dp_change_error"]


def test_no_process_group_is_created_after_startup(tp2dp2, dp_change):
    for runs in (tp2dp2, dp_change):
        for rank, out in runs.items():
            assert out["group_attempts_after_startup"] == [], rank
            assert out["groups_made"] == out["groups_expected"], rank
    assert tp2dp2[0]["layout_groups"] == 5 + 2 + 2 + 1  # single-rank, TP, DP, all-actors groups
