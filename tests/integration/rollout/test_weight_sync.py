"""The weight sync end to end on the real stack (`weight_sync_worker.py`): a Megatron trainer at
TP 1 and TP 2, three SGLang engines reached by each of the three host paths (rank 0's shared
buckets, a relay's point-to-point receive, the relay's shared buckets) or by the broadcast path
(a gloo update group, re-formed when the split changes), across a change of the split.
After every sync, each receiving engine's weights equal the trainer's export, tensor by tensor
(a hash each)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

import pytest
import torch

from tide_megatron.testing import run_script

pytestmark = pytest.mark.integration

WORKER = os.path.join(os.path.dirname(__file__), "weight_sync_worker.py")
sys.path.insert(0, os.path.dirname(__file__))
from weight_sync_worker import receivers_of  # noqa: E402


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _as_sglang(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's HF tensors under SGLang's names (its Qwen2 fuses Q/K/V and gate/up)."""
    out = {}
    for name, t in hf.items():
        if ".self_attn.q_proj." in name:
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([t, k, v])
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, hf[name.replace("gate_proj", "up_proj")]])
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


@pytest.mark.parametrize("tp,sync_path", [(1, "host"), (2, "host"), (2, "broadcast")])
def test_every_engine_holds_the_trainers_tensors_after_each_sync_across_a_split_change(tmp_path, tp, sync_path):
    from safetensors.torch import load_file

    run_script(WORKER, "--tp", tp, "--out", tmp_path, "--path", sync_path, timeout=1200)
    kinds = set()
    for version in (1, 2, 3):
        want = {n: _digest(t) for n, t in _as_sglang(torch.load(tmp_path / f"trainer_v{version}.pt")).items()}
        for rank in range(tp, tp + 3):
            path = tmp_path / f"engine{rank}_v{version}"
            assert path.exists() == (rank in receivers_of(version, tp)), (rank, version)
            if not path.exists():
                continue
            kinds.add((path / "kind").read_text())
            got = {}
            for f in glob.glob(str(path / "*.safetensors")):
                got.update({n: _digest(t) for n, t in load_file(f).items()})
            assert got == want, (rank, version, sorted(n for n in want if got.get(n) != want[n]))
    if sync_path == "host":
        assert kinds == {"shared", "relay"}  # rank 0's node maps its buckets; the other node gets one copy
    else:
        assert kinds == {"broadcast"}
        # formed for the first split, re-formed for each change of it (3 receivers, 2, 3)
        assert json.loads((tmp_path / "groups.json").read_text())["formations"] == 3
