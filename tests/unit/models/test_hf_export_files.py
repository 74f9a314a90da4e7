"""The Hugging Face export without Megatron: finding a run's checkpoint and base model, the
refusals of a missing / incomplete / corrupt checkpoint, safetensors sharding, the files copied,
and the command's one-line errors (the export of real checkpoints is in
tests/integration/models/test_hf_export.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tide_megatron.models.config import ModelConfig
from tide_megatron.models.hf_checkpoint import load_hf_model, load_hf_state_dict, write_random_hf_checkpoint
from tide_megatron.models.hf_export import (
    ExportError,
    copy_base_files,
    export_checkpoint,
    find_export_source,
    parse_size,
    write_safetensors,
)
from tide_megatron.testing import REPO, child_env
from tide_megatron.tokenizer import TINY_BPE_DIR
from tide_megatron.trainer.checkpoint import CheckpointCorrupt, write_manifest

EXPORT = REPO / "launch" / "export_hf.py"


def _fake_run(root, base: str = "", steps=(5,), latest: int | None = 5, manifest: bool = True,
              output_dir: str = "") -> str:
    """A run directory as a run leaves it: config.json, checkpoints/step_N (a stand-in shard and
    a manifest), checkpoints/latest. No real tensors: nothing here gets as far as loading."""
    run = os.path.join(root, "run")
    os.makedirs(os.path.join(run, "checkpoints"))
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump({"run": {"output_dir": output_dir or run}, "model": {"path": base},
                   "trainer": {"tp_size": 2, "bf16": False}}, f)
    for step in steps:
        path = os.path.join(run, "checkpoints", f"step_{step:06d}")
        os.makedirs(path)
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(b"x" * 100)
        if manifest:
            write_manifest(path, step)
    if latest is not None:
        with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
            f.write(f"step_{latest:06d}\n")
    return run


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    cfg = ModelConfig(vocab_size=3072, hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      ffn_hidden_size=64)
    return write_random_hf_checkpoint(tmp_path_factory.mktemp("base"), cfg, tokenizer_dir=TINY_BPE_DIR)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10 ** 9
    assert parse_size("500MiB") == 500 * 2 ** 20
    assert parse_size("1.5KB") == 1500 and parse_size("123") == 123 and parse_size(7) == 7
    for bad in ("5 parsecs", "0", "-1GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_the_newest_complete_checkpoint_and_the_base_model_are_found(tmp_path, base):
    run = _fake_run(tmp_path, base=base, steps=(5, 10, 15), latest=10)
    source = find_export_source(run)
    assert source.checkpoint == os.path.join(run, "checkpoints", "step_000010")  # 15: an interrupted save
    assert (source.step, source.base_model, source.trained_tp, source.bf16) == (10, base, 2, False)
    assert find_export_source(run, step=5).step == 5
    assert find_export_source(os.path.join(run, "checkpoints")).step == 10
    by_dir = find_export_source(os.path.join(run, "checkpoints", "step_000015"))
    assert by_dir.step == 15 and by_dir.run_dir == run


def test_a_random_init_run_exports_against_its_initial_model(tmp_path):
    run = _fake_run(tmp_path)
    with pytest.raises(ExportError, match="initial_model"):
        find_export_source(run)
    os.makedirs(os.path.join(run, "initial_model"))
    with open(os.path.join(run, "initial_model", "config.json"), "w") as f:
        f.write("{}")
    assert find_export_source(run).base_model == os.path.join(run, "initial_model")


def test_a_relative_model_path_is_resolved_from_where_the_run_started(tmp_path, base, monkeypatch):
    """model.path and run.output_dir are relative to the directory the run was started from."""
    start = os.path.dirname(base)
    run = _fake_run(tmp_path, base=os.path.basename(base), output_dir="")
    # The run was started in `start` with run.output_dir=<tmp_path relative to it>/run.
    with open(os.path.join(run, "config.json")) as f:
        cfg = json.load(f)
    cfg["run"]["output_dir"] = os.path.relpath(run, start)
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(cfg, f)
    monkeypatch.chdir(tmp_path)
    assert find_export_source(run).base_model == base


@pytest.mark.parametrize("setup, message", [
    (lambda root, base: os.path.join(root, "nowhere"), "no run directory or checkpoint at"),
    (lambda root, base: str(root), "no checkpoints under"),
    (lambda root, base: _fake_run(root, base, steps=(), latest=None), "no checkpoint under .* yet"),
    (lambda root, base: _fake_run(root, base, steps=(3, 4), latest=None),
     "no 'latest' marker.*step_000003, step_000004"),
    (lambda root, base: _fake_run(root, base, latest=9), "names 'step_000009'"),
])
def test_missing_checkpoints_say_what_is_missing(tmp_path, base, setup, message):
    with pytest.raises(ExportError, match=message):
        find_export_source(setup(tmp_path, base))


def test_a_step_that_does_not_exist_names_the_ones_that_do(tmp_path, base):
    run = _fake_run(tmp_path, base, steps=(5, 10), latest=10)
    with pytest.raises(ExportError, match="no checkpoint of step 7 under .*step_000005, step_000010"):
        find_export_source(run, step=7)
    with pytest.raises(ExportError, match="checkpoint of step 10, not of step 5"):
        find_export_source(os.path.join(run, "checkpoints", "step_000010"), step=5)


def test_a_checkpoint_outside_a_run_needs_the_base_model(tmp_path, base):
    run = _fake_run(tmp_path, base)
    os.remove(os.path.join(run, "config.json"))
    with pytest.raises(ExportError, match="pass --base-model"):
        find_export_source(run)
    assert find_export_source(run, base_model=base).bf16 is None  # read from the checkpoint then
    with pytest.raises(ExportError, match="holds no Hugging Face config.json"):
        find_export_source(run, base_model=tmp_path)


def test_incomplete_and_corrupt_checkpoints_are_refused_before_loading(tmp_path, base):
    incomplete = find_export_source(_fake_run(tmp_path / "a", base, manifest=False))
    with pytest.raises(CheckpointCorrupt, match="is incomplete: no manifest.json"):
        export_checkpoint(incomplete, tmp_path / "out", progress=lambda _: None)
    corrupt = find_export_source(_fake_run(tmp_path / "b", base))
    with open(os.path.join(corrupt.checkpoint, "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        export_checkpoint(corrupt, tmp_path / "out", progress=lambda _: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_non_empty_output_is_kept(tmp_path, base):
    source = find_export_source(_fake_run(tmp_path, base))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_checkpoint(source, tmp_path / "out", progress=lambda _: None)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="max shard size"):
        export_checkpoint(source, tmp_path / "other", max_shard_size="lots", progress=lambda _: None)


def test_the_output_never_overlaps_what_is_read(tmp_path, base):
    source = find_export_source(_fake_run(tmp_path, base))
    for out in (tmp_path, source.run_dir, base, os.path.join(source.checkpoint, "hf")):
        with pytest.raises(ExportError, match="overlaps the"):
            export_checkpoint(source, out, overwrite=True, progress=lambda _: None)
    assert os.path.isfile(os.path.join(base, "config.json"))
    # (Inside the run directory is allowed: tests/integration/models/test_hf_export.py exports there.)


def test_sharded_safetensors_load_in_transformers(tmp_path, base):
    """Shards of at most 64 KiB (the 384 KiB embedding gets one of its own), an index, and
    transformers reads the directory back to the same tensors."""
    state = load_hf_state_dict(base)
    out = tmp_path / "out"
    out.mkdir()
    lines: list[str] = []
    files, count, total = write_safetensors(str(out), state.items(), 64 * 1024, lines.append)
    assert count == len(state) and total == sum(t.nbytes for t in state.values())
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted(files + ["model.safetensors.index.json"])
    assert sum("wrote shard" in line for line in lines) == len(files)
    index = json.load(open(out / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(state)
    for name in files:  # a shard stays under the limit unless it is one tensor larger than it
        names = [n for n, f in index["weight_map"].items() if f == name]
        assert sum(state[n].nbytes for n in names) <= 64 * 1024 or len(names) == 1, (name, names)
    copied = copy_base_files(base, str(out))
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    with open(out / "config.json", "w") as f:
        json.dump(json.load(open(os.path.join(base, "config.json"))), f)
    reloaded = load_hf_model(out).state_dict()
    assert all(torch.equal(reloaded[name], state[name]) for name in state)


def test_one_shard_is_model_safetensors_and_duplicates_are_refused(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    files, _, _ = write_safetensors(str(tmp_path), [("a", t), ("b", t[0])], 10 ** 6)
    assert files == ["model.safetensors"] and sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert torch.equal(load_hf_state_dict(tmp_path)["b"], t[0])  # a view is written as itself
    with pytest.raises(ValueError, match="given twice"):
        write_safetensors(str(tmp_path / "x"), [("a", t), ("a", t)], 10 ** 6)


def _command(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXPORT), *map(str, args)], capture_output=True, text=True,
                          env=child_env(), timeout=120)


def test_command_help():
    proc = _command("--help")
    assert proc.returncode == 0 and "--max-shard-size" in proc.stdout and "RUN_DIR" in proc.stdout


def test_command_errors_are_one_line(tmp_path, base):
    proc = _command(tmp_path / "nowhere", "--out", tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"export_hf.py: error: no run directory or checkpoint at {tmp_path / 'nowhere'}"
    run = _fake_run(tmp_path, base, manifest=False)
    proc = _command(run, "--out", tmp_path / "out")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "step_000005 is incomplete: no manifest.json" in proc.stderr
    assert "checking the checkpoint's files" in proc.stdout  # progress came first
