"""The bucketed broadcast (`comm/bucket_broadcast.py`) over gloo between three processes: one
sender, two receivers. Every receiver ends with each tensor equal to the sender's (a hash each),
whatever the bucket size: many small buckets, a tensor larger than a bucket, one bucket for all;
and SGLang's own receiver of a flattened bucket (`FlattenedTensorBucket`, what
`update_weights_from_distributed(load_format="flattened_bucket")` does) reads the same buckets."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tide_megatron.comm.bucket_broadcast import broadcast_weights, bucket_specs, receive_weights
from tide_megatron.comm.weight_sync import manifest_of
from tide_megatron.utils.net import free_port

pytestmark = pytest.mark.integration

SHAPES = [(64, 32), (32,), (1000,), (7, 9, 5), (3,), (256, 64), (1,)]


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer.{i}.weight", torch.randn(s, generator=g).to(torch.bfloat16)) for i, s in enumerate(SHAPES)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def _sglang_receive(manifest, src: int) -> dict[str, torch.Tensor]:
    """What an SGLang engine's scheduler does per bucket (`WeightUpdater`'s bucketed receive)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    got = {}
    for names, shapes in bucket_specs(manifest):
        bucket = FlattenedTensorBucket.empty(names, [manifest.dtype] * len(names), shapes, "cpu")
        dist.broadcast(bucket.get_flattened_tensor(), src=src)
        got.update({n: t.clone() for n, t in bucket.reconstruct_tensors()})
    return got


def _worker(rank: int, port: int, bucket_bytes: int, out_dir: str, sglang_receivers: bool = False) -> None:
    if sglang_receivers:
        # Imported before the process group exists, as in an engine's scheduler process: imported
        # while a gloo group exists, SGLang (through transformers' continuous batching) keeps
        # that group's threads alive past `destroy_process_group`, and their destructor aborts
        # the process at exit ("terminate called without an active exception", ~1 run in 3).
        import sglang.srt.weight_sync.tensor_bucket  # noqa: F401
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=60))
    try:
        for version in (1, 2):  # a second sync reuses nothing of the first
            named = _named(version)
            manifest = manifest_of(named, version, bucket_bytes)
            got: dict[str, torch.Tensor] = {}
            stats = None
            if rank == 0:
                stats = broadcast_weights(None, iter(named), manifest, 0, "cpu")
            elif sglang_receivers:
                got = _sglang_receive(manifest, 0)
            else:
                stats = receive_weights(None, manifest, 0, "cpu",
                                        lambda views: got.update({n: t.clone() for n, t in views}))
            if rank:
                torch.save({n: _digest(t) for n, t in got.items()}, os.path.join(out_dir, f"r{rank}_v{version}.pt"))
            if stats is not None:
                torch.save((stats.nbytes, stats.buckets), os.path.join(out_dir, f"stats{rank}_v{version}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_bytes", [300, 4096, 1 << 20])
def test_every_receiver_holds_the_senders_tensors(tmp_path, bucket_bytes):
    mp.start_processes(_worker, args=(free_port(), bucket_bytes, str(tmp_path)), nprocs=3, start_method="spawn")
    for version in (1, 2):
        named = _named(version)
        want = {n: _digest(t) for n, t in named}
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        sent = torch.load(tmp_path / f"stats0_v{version}.pt")
        assert sent[0] == nbytes
        for rank in (1, 2):
            assert torch.load(tmp_path / f"r{rank}_v{version}.pt") == want
            assert torch.load(tmp_path / f"stats{rank}_v{version}.pt") == sent
        # 300 bytes gives every tensor a bucket of its own; 1 MiB holds them all in one.
        assert sent[1] == {300: 7, 4096: 4, 1 << 20: 1}[bucket_bytes]


def test_sglangs_flattened_bucket_receiver_reads_what_the_sender_broadcasts(tmp_path):
    mp.start_processes(_worker, args=(free_port(), 4096, str(tmp_path), True), nprocs=3, start_method="spawn")
    for version in (1, 2):
        want = {n: _digest(t) for n, t in _named(version)}
        for rank in (1, 2):
            assert torch.load(tmp_path / f"r{rank}_v{version}.pt") == want


def test_a_sender_whose_weights_do_not_match_the_manifest_names_the_first_wrong_one():
    named = _named(0)
    manifest = manifest_of(named, 1, 1 << 20)
    swapped = [named[1], named[0], *named[2:]]
    with pytest.raises(ValueError, match=r"weight 0: expected layer\.0\.weight \[64, 32\], got layer\.1\.weight"):
        broadcast_weights(None, iter(swapped), manifest, 0, "cpu")
    with pytest.raises(ValueError, match="weight 6: expected layer.6.weight .*got nothing"):
        broadcast_weights(None, iter(named[:-1]), manifest, 0, "cpu")
