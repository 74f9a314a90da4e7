"""Checkpoints out: a run's Megatron checkpoint -> `launch/export_hf.py` -> transformers, exact.

For Qwen2, Qwen3 (dense) and Qwen3-VL: a tiny random HF checkpoint goes into the Megatron actor
(2 ranks, TP=2, gloo), every weight is perturbed (so the export is not the input again), the
actor's logits are recorded and it is saved as a run saves it (`export_worker.py`). The command
then exports each run (one process, TP=1: dist_checkpointing reshards the TP=2 checkpoint) and the
logits transformers computes from the export must equal Megatron's (fp32). Megatron never runs
in the pytest process.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from tide_megatron.core.trajectory import Trajectory
from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import load_hf_model, load_hf_state_dict, write_random_hf_checkpoint
from tide_megatron.models.qwen3_vl_checkpoint import load_hf_vl_model, write_random_vl_checkpoint
from tide_megatron.models.qwen3_vl_config import VLModelConfig
from tide_megatron.models.qwen3_vl_inputs import ImageProcessor, TrajectoryImages, encode_image_for_record
from tide_megatron.testing import REPO, child_env, run_script
from tide_megatron.tokenizer import TINY_BPE_DIR

pytestmark = pytest.mark.integration

WORKER = os.path.join(os.path.dirname(__file__), "export_worker.py")
EXPORT = REPO / "launch" / "export_hf.py"
LOGITS_ATOL = 1e-4  # fp32; Megatron local spec vs HF eager
TEXT = dict(vocab_size=3072, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
            ffn_hidden_size=128)
CASES = {
    "qwen2": ModelConfig(**TEXT),
    # As Qwen3-0.6B: tied embeddings, head_dim not hidden_size / heads (24 != 16).
    "qwen3": ModelConfig(**TEXT, head_dim=24, qkv_bias=False, qk_layernorm=True, tie_word_embeddings=True),
    "qwen3_vl": VLModelConfig(tie_word_embeddings=True),
}
SHARDED = "qwen3"  # exported with a small --max-shard-size: several files and an index


def _png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _text_inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, TEXT["vocab_size"], (2, 19), generator=g)}


def _vl_inputs(path: str, cfg: VLModelConfig) -> dict:
    """One row: text, an image (its pads between the vision markers), text; with the trainer's
    vision inputs for it (`TrajectoryImages`, as the trainer builds them from a rollout record)."""
    processor = ImageProcessor(path)
    g = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(10, 3000, (n,), generator=g).tolist()  # noqa: E731
    grid = processor.grid(96, 64)
    ids = text(5) + [cfg.vision_start_token_id] + [cfg.image_token_id] * processor.num_tokens(grid) \
        + [cfg.vision_end_token_id] + text(7)
    record = Trajectory.from_tokens(ids, [0] * len(ids), [0.0] * len(ids),
                                    images=[encode_image_for_record(_png(96, 64, 3))], image_grid_thw=[list(grid)])
    token_ids = torch.tensor(ids)
    fields = TrajectoryImages.for_model(cfg, path).fields(record, token_ids, torch.zeros(len(ids)))
    return {"input_ids": token_ids[None], "position_ids": fields["position_ids"][:, None],  # [3, 1, S]
            "pixel_values": fields["pixel_values"], "image_grid_thw": fields["image_grid_thw"],
            "image_mask": fields["image_mask"][None]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each case's HF checkpoint, inputs and saved run (TP=2), from one worker run."""
    root = tmp_path_factory.mktemp("export")
    cases, args = {}, []
    for name, cfg in CASES.items():
        hf = str(root / f"{name}_hf")
        if name == "qwen3_vl":
            hf, cfg = write_random_vl_checkpoint(hf, cfg, TINY_BPE_DIR, seed=3)
            inputs = _vl_inputs(hf, cfg)
        else:
            write_random_hf_checkpoint(hf, cfg, seed=3, tokenizer_dir=TINY_BPE_DIR)
            inputs = _text_inputs()
        torch.save(inputs, root / f"{name}_inputs.pt")
        run = root / f"{name}_run"
        # An export may go inside its run directory (it must not contain what it reads).
        out = run / "hf_export" if name == "qwen2" else root / f"{name}_out"
        cases[name] = {"hf": hf, "inputs": inputs, "run": str(run), "out": str(out)}
        args += ["--case", name, hf, root / f"{name}_inputs.pt", cases[name]["run"]]
    run_script(WORKER, "--world", 2, "--tp", 2, *args, timeout=900)
    for case in cases.values():
        case["megatron_logits"] = torch.load(os.path.join(case["run"], "megatron_logits.pt"))
    return cases


def _export(*args, check: bool = True) -> subprocess.CompletedProcess:
    return run_script(EXPORT, *args, timeout=600, check=check)


@pytest.fixture(scope="module")
def exported(runs) -> dict[str, dict]:
    for name, case in runs.items():
        shard = ["--max-shard-size", "200KB"] if name == SHARDED else []
        case["stdout"] = _export(case["run"], "--out", case["out"], *shard).stdout
    return runs


@torch.no_grad()
def _hf_logits(name: str, path: str, inputs: dict) -> torch.Tensor:
    if name == "qwen3_vl":
        model = load_hf_vl_model(path)
        return model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                     image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=inputs["image_mask"].int()).logits.float()
    return load_hf_model(path)(inputs["input_ids"]).logits.float()


@pytest.mark.parametrize("name", list(CASES))
def test_exported_model_gives_the_megatron_logits(exported, name):
    case = exported[name]
    expected = case["megatron_logits"]
    # The perturbation moved the model away from its input checkpoint: comparing with the
    # export proves the trained weights came out, not the base model's.
    assert (_hf_logits(name, case["hf"], case["inputs"]) - expected).abs().max() > 100 * LOGITS_ATOL
    torch.testing.assert_close(_hf_logits(name, case["out"], case["inputs"]), expected, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_export_directory_is_a_servable_hf_model(exported, name):
    case = exported[name]
    out, hf = case["out"], case["hf"]
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    if name == "qwen3_vl":
        assert "preprocessor_config.json" in files
    assert not os.path.exists(out + ".partial")
    config, base = (json.load(open(os.path.join(d, "config.json"))) for d in (out, hf))
    assert config["model_type"] == base["model_type"] == name
    assert config["architectures"] == base["architectures"]
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    state, base_state = load_hf_state_dict(out), load_hf_state_dict(hf)
    assert set(state) == set(base_state)  # tied models: no lm_head.weight in either
    if name == SHARDED:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards == sorted(f for f in files if f.endswith(".safetensors"))
        assert set(index["weight_map"]) == set(state)
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    else:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files


def test_export_reports_progress_and_the_resharding(exported):
    out = exported["qwen2"]["stdout"]
    assert "step 7, trained at TP=2" in out
    assert "loading the checkpoint's model at TP=1" in out
    assert "wrote shard 1" in out and out.rstrip().splitlines()[-1].startswith("done:")


def test_export_of_a_named_step_directory_and_refusals(exported, tmp_path):
    case = exported["qwen2"]
    step_dir = os.path.join(case["run"], "checkpoints", "step_000007")
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.txt").write_text("from before")
    # A step directory works too; an output that holds something is kept unless --overwrite.
    refused = _export(step_dir, "--out", out, check=False)
    assert refused.returncode == 1
    assert "exists and is not empty (pass --overwrite" in refused.stderr
    assert (out / "stale.txt").exists()
    again = _export(step_dir, "--out", out, "--overwrite", "--dtype", "bfloat16")
    assert "done:" in again.stdout and not (out / "stale.txt").exists()
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
    exported_bf16 = load_hf_state_dict(out)
    assert {t.dtype for t in exported_bf16.values()} == {torch.bfloat16}
    fp32 = load_hf_state_dict(case["out"])
    assert all(torch.equal(exported_bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    missing = _export(case["run"], "--out", tmp_path / "x", "--step", "3", check=False)
    assert missing.returncode == 1
    assert "no checkpoint of step 3 under" in missing.stderr and "step_000007" in missing.stderr
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_copied_out_of_its_run_exports_with_the_base_model(exported, tmp_path):
    """No run config beside it: the base model is given, the dtype read from the checkpoint."""
    case = exported["qwen3"]
    loose = tmp_path / "step_000008"
    shutil.copytree(os.path.join(case["run"], "checkpoints", "step_000008"), loose)
    refused = _export(loose, "--out", tmp_path / "x", check=False)
    assert refused.returncode == 1 and "pass --base-model" in refused.stderr
    _export(loose, "--out", tmp_path / "x", "--base-model", case["hf"])
    torch.testing.assert_close(_hf_logits("qwen3", str(tmp_path / "x"), case["inputs"]), case["megatron_logits"],
                               rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("base", ["qwen3", "wider qwen2"])
def test_checkpoint_of_another_architecture_is_one_line(exported, tmp_path, base):
    """The qwen2 run's checkpoint read as a Qwen3 model (no q/k norms in it: keys missing) or as a
    wider Qwen2 (shapes differ, which torch reports as a BaseException): a one-line error."""
    case = exported["qwen2"]
    if base == "qwen3":
        base_dir, reason = exported["qwen3"]["hf"], "Unexpected keys .*q_layernorm"
    else:
        base_dir = write_random_hf_checkpoint(tmp_path / "wide", ModelConfig(**{**TEXT, "hidden_size": 128}))
        reason = "Global shape mismatch"
    proc = _export(case["run"], "--out", tmp_path / "x", "--base-model", base_dir, check=False)
    assert proc.returncode == 1
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "does not load into the model of" in error[0], proc.stderr[-3000:]
    assert re.search(reason, error[0]), error[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


@torch.no_grad()
def _hf_logprobs(path: str, ids: list[int], generated: list[int]) -> list[float]:
    """log p of each generated token after `ids`, from transformers on `path`."""
    full = torch.tensor([ids + generated])
    logp = torch.log_softmax(load_hf_model(path)(full).logits[0].float(), -1)  # [S, V]
    return [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(generated)]


def test_sglang_serves_the_sharded_qwen3_export_and_takes_its_weights_by_name(exported):
    """The rollout side: SGLang loads the (sharded) Qwen3 export and samples with its
    log-probs; a weight push of HF-named tensors (the base model's here, q/k norms included)
    switches it to those weights."""
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig

    case = exported["qwen3"]
    prompt = case["inputs"]["input_ids"][0].tolist()
    engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=2048, max_running_requests=4), case["out"])
    try:
        run = engine.loop.run_until_complete
        greedy = {"max_new_tokens": 5, "temperature": 0.0}
        gen = run(engine.generate(prompt, greedy))
        assert len(gen.output_ids) == 5
        assert gen.logprobs == pytest.approx(_hf_logprobs(case["out"], prompt, gen.output_ids), abs=LOGITS_ATOL)
        base = load_hf_state_dict(case["hf"])
        assert any(".q_norm." in name for name in base)
        run(engine.update_weights(sorted(base.items()), version=1))
        gen = run(engine.generate(prompt, greedy))
        assert gen.logprobs == pytest.approx(_hf_logprobs(case["hf"], prompt, gen.output_ids), abs=LOGITS_ATOL)
    finally:
        engine.shutdown()


def test_help_names_the_options():
    proc = subprocess.run([sys.executable, str(EXPORT), "--help"], capture_output=True, text=True, env=child_env(),
                          timeout=60)
    assert proc.returncode == 0
    for option in ("RUN_DIR", "--out", "--step", "--base-model", "--dtype", "--max-shard-size", "--overwrite"):
        assert option in proc.stdout
