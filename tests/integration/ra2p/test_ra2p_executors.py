"""RA2P executors on Megatron-core (CPU, gloo): each gives the plain sync path's updates.

One run of `ra2p_worker.py` (3 processes: 2 Actor ranks with Megatron DP=2, 1 Ref rank, a gloo
log-prob stream group over all three); the tests read what the Actor ranks recorded.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
from tide_megatron.testing import run_script

pytestmark = pytest.mark.integration

sys.path.insert(0, os.path.dirname(__file__))
from ra2p_worker import MODEL_KWARGS, NUM_ACTORS, STEPS  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "ra2p_worker.py")
COLOCATED = ("colocated", "vanilla_streaming_offload", "vanilla_streaming", "colocated_arriving")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    hf_dir = write_random_hf_checkpoint(tmp_path_factory.mktemp("hf"), ModelConfig(**MODEL_KWARGS), seed=0)
    out = str(tmp_path_factory.mktemp("out"))
    run_script(WORKER, "--hf", hf_dir, "--out", out, timeout=600)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(NUM_ACTORS)]


def test_steps_have_several_micro_batches(ranks):
    assert all(r["num_micro_batches"] >= 3 for r in ranks)


@pytest.mark.parametrize("name", COLOCATED)
def test_colocated_executors_match_sync_bit_exactly(ranks, name):
    """Aggregation, per-micro-batch alternation, swapping (grad buffer parked mid-step), arrivals:
    the same ops on the same bytes, so the same updated weights and gradients, bit for bit."""
    for r in ranks:
        res = r[name]
        assert res["weights_equal"] and res["grads_equal"], res["weight_diff"]
        assert res["losses"] == res["expected_losses"]


def test_swap_counts_follow_the_mode(ranks):
    n = ranks[0]["num_micro_batches"]
    for r in ranks:
        for report in r["colocated"]["reports"]:
            assert (report["ref_rounds"], report["num_swaps"]) == (1, 2)  # Ref loaded once
        for report in r["vanilla_streaming_offload"]["reports"]:
            assert (report["ref_rounds"], report["num_swaps"]) == (n, 2 * n)  # every micro-batch
        for report in r["vanilla_streaming"]["reports"]:
            assert (report["ref_rounds"], report["num_swaps"]) == (n, 0)  # both resident
        for report in r["colocated_arriving"]["reports"]:
            assert report["ref_rounds"] >= 2  # 2 ready at start, the rest arrived later
        assert r["colocated"]["meter"]["swap"] > 0
        assert {"ref_fwd", "actor_fwd", "actor_bwd"} <= set(r["colocated"]["meter"])


def test_decoupled_streaming_matches_sync(ranks):
    """Ref on its own rank, log-probs streamed over gloo, loss in backward: fp32 agreement."""
    for r in ranks:
        res = r["decoupled"]
        assert len(res["losses"]) == STEPS
        assert res["grad_diff"] <= 1e-5 * res["grad_scale"]
        assert res["weight_diff"] <= 1e-5 * res["weight_scale"]
        assert res["losses"] == pytest.approx(res["expected_losses"], rel=1e-6)
        assert res["tokens"][-1] == min(res["tokens"])  # the planner's smallest-last order
        assert {"actor_fwd", "actor_bwd"} <= set(res["meter"])


def test_megatron_actor_offload_round_trip_is_bit_exact(ranks):
    for r in ranks:
        assert r["offload_freed"]
        assert r["offload_bit_exact"]  # params, DDP grad buffer and Adam state
