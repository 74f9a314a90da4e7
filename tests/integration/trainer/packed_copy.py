"""The trajectories of a padded micro-batch as one packed micro-batch (the trainer workers'
packed-vs-padded checks), carrying the padded one's old and reference log-probs."""

from __future__ import annotations

import torch


def packed_like(mb, trajectories):
    """`mb`: a padded `MicroBatch` built from some of `trajectories` (`TrajectoryTensors`)."""
    from tide_megatron.trainer.batch import pack

    rows = [row[:n] for row, n in zip(mb.token_ids, mb.lengths)]
    group = [next(t for t in trajectories if torch.equal(t.token_ids, row)) for row in rows]
    packed = pack(group)
    unpad = lambda t: torch.cat([row[:n] for row, n in zip(t, mb.lengths)])[None]  # noqa: E731  # [1, T]
    packed.old_logprobs = unpad(mb.old_logprobs)
    if mb.ref_logprobs is not None:
        packed.ref_logprobs = unpad(mb.ref_logprobs)
    return packed
