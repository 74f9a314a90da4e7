"""Micro-batch sources (ready vs arriving) and the planner-driven dispatch to DP ranks."""

from __future__ import annotations

import threading
import time

import torch

from tide_megatron.core.ra2p import RA2PConfig
from tide_megatron.core.roles import RA2PMode
from tide_megatron.trainer.batch import TrajectoryTensors, collate
from tide_megatron.trainer.ra2p.dispatch import micro_batches_for_rank, plan_step
from tide_megatron.trainer.ra2p.source import ArrivingSource, ReadySource, as_source


def _traj(n: int) -> TrajectoryTensors:
    mask = torch.zeros(n)
    mask[1:] = 1
    return TrajectoryTensors(torch.arange(n), mask, torch.zeros(n), 1.0)


def test_ready_source_hands_out_aggregates_up_to_the_limit():
    mbs = [collate([_traj(4)]) for _ in range(5)]
    source = as_source(mbs)
    assert isinstance(source, ReadySource) and len(source) == 5
    assert [len(source.take_ready(2)) for _ in range(4)] == [2, 2, 1, 0]


def test_arriving_source_returns_what_is_ready_and_blocks_for_the_rest():
    source = ArrivingSource(4)
    for _ in range(2):
        source.put(collate([_traj(4)]))
    assert len(source.take_ready(8)) == 2  # RAS = 2: both at once

    def later():
        time.sleep(0.1)
        source.put(collate([_traj(4)]))
        source.put(collate([_traj(4)]))

    threading.Thread(target=later).start()
    started = time.perf_counter()
    got = source.take_ready(8)
    assert time.perf_counter() - started >= 0.05 and 1 <= len(got) <= 2
    while len(got) < 2:
        got += source.take_ready(8)
    assert source.take_ready(8) == []


def test_dispatch_follows_the_planner():
    lengths = [5, 40, 12, 33, 8, 21, 17, 29, 3, 26, 14, 37]
    trajectories = {f"t{i}": _traj(n) for i, n in enumerate(lengths)}
    cfg = RA2PConfig(tokens_per_rank=48)
    for mode in RA2PMode:
        plan = plan_step(trajectories, 2, mode, cfg)
        per_rank = [micro_batches_for_rank(plan, trajectories, r) for r in range(2)]
        assert sorted(n for mbs in per_rank for mb in mbs for n in mb.lengths) == sorted(lengths)
        for r, mbs in enumerate(per_rank):
            assert [mb.lengths for mb in mbs] == [[lengths[int(s[1:])] for s in m.shards[r]]
                                                  for m in plan.micro_batches if m.shards[r]]
    plan = plan_step(trajectories, 2, RA2PMode.DECOUPLED, cfg)
    assert min(lengths) in plan.micro_batches[-1].shard_tokens  # smallest last
