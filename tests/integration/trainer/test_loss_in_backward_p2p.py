"""Loss-in-backward with reference log-probs arriving from another rank (gloo irecv).

Rank 1 plays the reference: it sends its log-probs only after rank 0 has finished the actor's
forward. Rank 0's forward must not block on it; its backward waits, then its gradient equals the
ordinary loss's.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from tide_megatron.trainer.batch import MicroBatch
from tide_megatron.trainer.config import TrainerConfig
from tide_megatron.trainer.grpo_loss import grpo_loss
from tide_megatron.trainer.loss_in_backward import ReceivedLogprobs, deferred_grpo_loss

pytestmark = pytest.mark.integration

SHAPE = (3, 16)  # [B, T]
REF_DELAY_S = 0.3


def _inputs():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(SHAPE, generator=g) * 2
    new = old + 0.3 * torch.randn(SHAPE, generator=g)
    ref = old + 0.3 * torch.randn(SHAPE, generator=g)
    mask = (torch.rand(SHAPE, generator=g) > 0.3).float()
    mask[:, 0] = 0
    return new, old, ref, torch.tensor([1.0, -0.5, 0.2]), mask


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    new, old, ref, adv, mask = _inputs()
    cfg = TrainerConfig(kl_coef=0.1, kl_estimator="k3", clip_eps_high=0.28)
    if rank == 1:
        torch.distributed.recv(torch.zeros(1), src=0)  # "actor forward done"
        time.sleep(REF_DELAY_S)
        torch.distributed.send(ref.contiguous(), dst=0)
    else:
        mb = MicroBatch(torch.zeros(SHAPE, dtype=torch.long), torch.zeros(SHAPE, dtype=torch.long), mask, old, adv)
        mb.ref_logprobs = ReceivedLogprobs.irecv(SHAPE, src=1)
        leaf = new.clone().requires_grad_()
        started = time.perf_counter()
        loss_sum, _, report = deferred_grpo_loss(leaf * 1.0, mb, cfg)
        forward_s = time.perf_counter() - started
        torch.distributed.send(torch.ones(1), dst=1)
        loss_sum.backward()
        expected_leaf = new.clone().requires_grad_()
        expected, _, expected_report = grpo_loss(expected_leaf, old, adv, ref, mask, cfg)
        expected.backward()
        torch.save({"forward_s": forward_s, "ref_wait_s": report["ref_wait_s"], "grad": leaf.grad,
                    "expected_grad": expected_leaf.grad, "loss": report["loss"],
                    "expected_loss": expected_report["loss"]}, out)
    torch.distributed.destroy_process_group()


def test_reference_from_another_rank_is_awaited_only_in_backward(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result.pt")
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    r = torch.load(out)
    assert r["forward_s"] < REF_DELAY_S  # the forward did not wait for the reference
    assert r["ref_wait_s"] > 0.5 * REF_DELAY_S  # the backward did
    torch.testing.assert_close(r["grad"], r["expected_grad"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r["loss"], r["expected_loss"], rtol=1e-6, atol=1e-6)
