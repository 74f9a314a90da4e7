"""A run's checkpoint out as a Hugging Face model directory (what `launch/export_hf.py` calls).

A run saves the actor with Megatron `dist_checkpointing` under `<run.output_dir>/checkpoints`
(`trainer/checkpoint.py`): model, optimizer and step, sharded by the TP size it trained with. The
export turns the model part of one such checkpoint into what transformers and SGLang load:

    OUT/config.json                          the base model's, with the exported dtype
    OUT/model.safetensors                    every weight under its HF name, or, past the shard size,
    OUT/model-00001-of-0000N.safetensors     HF-style shards and
    OUT/model.safetensors.index.json         the index naming the shard of each weight
    OUT/tokenizer.json, generation_config.json, preprocessor_config.json, ...
                                             every other non-weight file of the base model, as is

The base model is the HF directory the run started from (`model.path` in the run's `config.json`,
or `<run.output_dir>/initial_model` for a random-init run): it gives the architecture, the
tokenizer and the generation config; the run changed none of them.

How: one process (world size 1, gloo on CPU) builds the policy model at TP=1 from the base
model's config.json, loads the checkpoint's model tensors into it (dist_checkpointing reshards a
checkpoint saved at another TP size on load) and streams `policy.hf_weights` (full HF tensors,
one at a time) into the shards, so the peak memory is the model plus one shard. The output is
written to `OUT.partial` and renamed at the end: an interrupted export leaves no half directory
under the name asked for.

Limits: the exported weights are the model's own, in the dtype it trained in (bf16 runs: bf16; the
optimizer's fp32 master copy is not read) unless `dtype` asks for another; the whole model must fit
in this machine's memory at TP=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

from tide_megatron.models.config import read_hf_config
from tide_megatron.trainer.checkpoint import (
    LATEST_MARKER,
    CheckpointCorrupt,
    CheckpointError,
    latest_checkpoint,
    step_dir_name,
    step_of,
    verify_checkpoint,
)

if TYPE_CHECKING:
    import torch

Progress = Callable[[str], None]

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""As the Hugging Face Hub's released checkpoints (a shard per ~5 GB)."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""`auto`: the dtype the run trained in."""
PROGRESS_INTERVAL_S = 10.0
"""A progress line at least this often while tensors are converted and written."""
# Files of a base model directory that are weights (never copied) or that the export writes.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
_WRITTEN = {"config.json"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.I)
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


class ExportError(RuntimeError):
    """The export cannot start or finish; the message says what is missing and what to pass."""


@dataclass(frozen=True)
class ExportSource:
    """One checkpoint of a run and what the export needs to read it."""

    checkpoint: str
    """The step directory (`.../checkpoints/step_NNNNNN`, a dist_checkpointing directory)."""
    step: int
    """Its training step (the directory's name)."""
    base_model: str
    """The Hugging Face directory the run started from: config.json, tokenizer, generation config."""
    bf16: Optional[bool]
    """The run trained in bf16 (`trainer.bf16`); None when there is no run config to say (read
    from the checkpoint's tensor metadata then)."""
    trained_tp: Optional[int] = None
    """The run's `trainer.tp_size` (shown; the load reshards to TP=1 whatever it was)."""
    run_dir: Optional[str] = None
    """The run's output directory, when the checkpoint lies under `<run_dir>/checkpoints`."""


@dataclass
class ExportResult:
    """What an export wrote."""

    out_dir: str
    step: int
    weight_files: list[str]
    """The safetensors files, in order."""
    copied_files: list[str]
    """Files copied from the base model (tokenizer, generation config, ...)."""
    num_tensors: int
    total_bytes: int
    dtype: str


# ---- finding the checkpoint and the base model -----------------------------------------------
def parse_size(size: str | int) -> int:
    """Bytes of "5GB" (10^9), "500MiB" (2^20), "1000000" or an int."""
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        if match is None:
            raise ValueError(f"size {size!r}: expected a number of bytes or e.g. 5GB, 500MB, 2GiB")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return value


def human_size(n: float) -> str:
    """1536 -> "1.5 KiB" (progress lines)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _step_dirs(root: str) -> list[str]:
    return sorted((d for d in os.listdir(root) if step_of(d) is not None and os.path.isdir(os.path.join(root, d))),
                  key=step_of)


def _choose_checkpoint(root: str, step: Optional[int]) -> str:
    """The step directory to export: `step`'s, or the one `root/latest` names (the newest
    complete save: `latest` moves only after a save's manifest is written)."""
    present = _step_dirs(root)
    listed = ", ".join(present) if present else "none"
    if step is not None:
        path = os.path.join(root, step_dir_name(step))
        if not os.path.isdir(path):
            raise ExportError(f"no checkpoint of step {step} under {root} (step directories there: {listed})")
        return path
    if not os.path.isfile(os.path.join(root, LATEST_MARKER)):
        if present:
            raise ExportError(f"no complete checkpoint under {root}: there is no {LATEST_MARKER!r} marker, so "
                              f"the step directories there ({listed}) are interrupted saves; pass --step N to "
                              "try one anyway")
        raise ExportError(f"no checkpoint under {root} yet (a run saves one every run.checkpoint_interval "
                          "steps and at its end)")
    try:
        return latest_checkpoint(root)
    except FileNotFoundError as exc:
        raise ExportError(f"{exc} (step directories there: {listed}; pass --step N)") from None


def read_run_config(run_dir: str) -> Optional[dict]:
    """The resolved job config a run wrote at its start (`<run.output_dir>/config.json`), None
    when the directory has none."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"the run config {path} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("trainer"), dict):
        raise ExportError(f"{path} is not a tide-megatron run config (no model and trainer sections)")
    return cfg


def _base_model_candidates(run_dir: str, run_cfg: dict) -> list[str]:
    """Where the run's base model may be: `model.path` as written (relative paths: to this
    directory, then to the directory the run was started from), or the random init it wrote."""
    path = run_cfg["model"].get("path") or ""
    if not path:
        return [os.path.join(run_dir, "initial_model")]
    if os.path.isabs(path):
        return [path]
    out = [os.path.abspath(path)]
    # `run.output_dir` is relative to where the run started; strip it from the run directory.
    output_dir = os.path.normpath((run_cfg.get("run") or {}).get("output_dir") or "")
    if output_dir and not os.path.isabs(output_dir) and run_dir.endswith(os.sep + output_dir):
        out.append(os.path.normpath(os.path.join(run_dir[: -len(output_dir)], path)))
    return out


def find_export_source(path: str | os.PathLike, step: Optional[int] = None,
                       base_model: Optional[str | os.PathLike] = None) -> ExportSource:
    """The checkpoint and base model of `path`: a run directory (`run.output_dir`), its
    `checkpoints` directory, or one `step_NNNNNN` directory. `step`: that step's checkpoint
    (default: the newest complete one). `base_model`: the HF directory the run started from,
    when the run config's `model.path` is not where it was. ExportError saying what is missing."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise ExportError(f"no run directory or checkpoint at {path}")
    if step_of(path) is not None:
        if step is not None and step != step_of(path):
            raise ExportError(f"{path} is the checkpoint of step {step_of(path)}, not of step {step}")
        checkpoint, root = path, os.path.dirname(path)
    else:
        root = path if os.path.basename(path) == "checkpoints" else os.path.join(path, "checkpoints")
        if not os.path.isdir(root):
            raise ExportError(f"no checkpoints under {path}: a run saves them in <run.output_dir>/checkpoints "
                              "(every run.checkpoint_interval steps and at its end); pass the run's output "
                              "directory or a step_NNNNNN directory")
        checkpoint = _choose_checkpoint(root, step)
    run_dir = os.path.dirname(root) if os.path.basename(root) == "checkpoints" else None
    run_cfg = read_run_config(run_dir) if run_dir else None
    if base_model is not None:
        base = os.path.abspath(os.fspath(base_model))
        if not os.path.isfile(os.path.join(base, "config.json")):
            raise ExportError(f"--base-model {base} holds no Hugging Face config.json")
    elif run_cfg is None:
        raise ExportError(f"no run config.json next to {root}, so the base model is unknown: pass --base-model "
                          "DIR (the Hugging Face directory the run started from)")
    else:
        tried = _base_model_candidates(run_dir, run_cfg)
        found = [p for p in tried if os.path.isfile(os.path.join(p, "config.json"))]
        if not found:
            raise ExportError(f"the run's base model is not there (tried {', '.join(tried)}; model.path="
                              f"{run_cfg['model'].get('path')!r} in {run_dir}/config.json): pass --base-model DIR")
        base = found[0]
    trainer = (run_cfg or {}).get("trainer") or {}
    return ExportSource(checkpoint=checkpoint, step=step_of(checkpoint), base_model=base,
                        bf16=bool(trainer["bf16"]) if "bf16" in trainer else None,
                        trained_tp=trainer.get("tp_size"), run_dir=run_dir)


# ---- loading the checkpoint into a TP=1 model ----------------------------------------------------
@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """torch.distributed as a world of this process alone, with TP=1 model groups, torn down
    after. Refuses to run as one rank of a bigger job (the export reads every shard itself)."""
    import torch

    from tide_megatron.models.megatron_gpt import destroy_parallel, init_parallel
    from tide_megatron.utils.net import free_port

    if torch.distributed.is_initialized() or os.environ.get("WORLD_SIZE", "1") != "1":
        raise ExportError("the export runs as one process (world size 1): start it with python, not "
                          "torchrun, and outside a running job")
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        init_parallel(tp_size=1)
        yield
    finally:
        destroy_parallel()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def saved_in_bf16(checkpoint: str) -> bool:
    """Whether the checkpoint's model tensors are bf16, from its tensor metadata (the optimizer's
    state, `optimizer.*`, is fp32 either way)."""
    import torch
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(checkpoint)
    dtypes = {t.dtype for key, t in metadata.items() if not key.startswith("optimizer.") and t.dtype.is_floating_point}
    return torch.bfloat16 in dtypes


def _load_failure(exc: BaseException) -> str:
    """One line for a failed dist_checkpointing load. torch's `CheckpointException` (a
    BaseException) wraps each rank's error with its traceback; the rank's error says what
    differs (a shape, the keys the checkpoint lacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:600] + ' ...' if len(text) > 600 else text}"


def load_checkpoint_model(source: ExportSource):
    """The policy model of `source.base_model`'s architecture at TP=1, with the checkpoint's model
    weights, in eval mode; and its config. Inside `single_process_group()`. CheckpointError when
    the checkpoint does not fit the architecture."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    from tide_megatron.models.policy import build_model, model_config_from_checkpoint

    try:
        cfg = model_config_from_checkpoint(source.base_model)
    except (ValueError, KeyError) as exc:
        raise ExportError(f"{source.base_model}/config.json: {exc}") from None
    bf16 = source.bf16 if source.bf16 is not None else saved_in_bf16(source.checkpoint)
    model = build_model(cfg, bf16=bf16)
    # The save's layout (`checkpoint._sharded_state_dict`): the model under "model", the optimizer
    # and step beside it. RAISE_UNEXPECTED: a model tensor the checkpoint lacks is an error; the
    # checkpoint's optimizer state, which the export does not ask for, is not.
    request = {"model": model.sharded_state_dict(metadata={"dp_cp_group": model.pg_collection.dp_cp})}
    try:
        state = dist_checkpointing.load(request, source.checkpoint, strict=StrictHandling.RAISE_UNEXPECTED)
        model.load_state_dict(state["model"])
    except (Exception, CheckpointException) as exc:
        model_type = read_hf_config(source.base_model).get("model_type")
        raise CheckpointError(f"checkpoint {source.checkpoint} does not load into the model of "
                              f"{source.base_model}/config.json ({model_type}, {cfg.num_layers} layers, hidden "
                              f"{cfg.hidden_size}; pass the run's base model as --base-model): "
                              f"{_load_failure(exc)}") from exc
    model.eval()
    return model, cfg


# ---- writing the Hugging Face directory --------------------------------------------------------
def _own_storage(t: "torch.Tensor") -> "torch.Tensor":
    """`t` on the CPU, contiguous, owning its storage: safetensors refuses tensors that share
    memory, and a converted weight may be a view of a parameter (norms) or of a larger split."""
    t = t.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def write_safetensors(out_dir: str, tensors: Iterable[tuple[str, "torch.Tensor"]], max_shard_bytes: int,
                      progress: Progress = lambda _: None, total_bytes: int = 0) -> tuple[list[str], int, int]:
    """Write (HF name, tensor) pairs as `model.safetensors`, or as HF-style shards of at most
    `max_shard_bytes` (a single larger tensor gets a shard of its own) with
    `model.safetensors.index.json`. Holds one shard in memory. `total_bytes` (estimated, 0:
    unknown) only sizes the progress lines. Returns (files, tensors, bytes)."""
    from safetensors.torch import save_file

    parts: list[tuple[str, list[str]]] = []  # (temporary file, names) per shard, in order
    shard: dict = {}
    shard_bytes = written = count = 0
    seen: set[str] = set()
    last = time.monotonic()

    def flush() -> None:
        nonlocal shard, shard_bytes
        tmp = os.path.join(out_dir, f".shard-{len(parts):05d}.safetensors")
        save_file(shard, tmp, metadata={"format": "pt"})  # transformers refuses files without "format"
        parts.append((tmp, list(shard)))
        progress(f"  wrote shard {len(parts)} ({len(shard)} tensors, {human_size(shard_bytes)})")
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"weight {name} given twice")
        seen.add(name)
        tensor = _own_storage(tensor)
        size = tensor.nbytes
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += size
        written += size
        count += 1
        if time.monotonic() - last >= PROGRESS_INTERVAL_S:
            last = time.monotonic()
            share = f" of ~{human_size(total_bytes)} ({100 * written / total_bytes:.0f}%)" if total_bytes else ""
            progress(f"  converted {count} tensors, {human_size(written)}{share}")
    if shard or not parts:
        flush()
    if len(parts) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    weight_map = {}
    for (tmp, names), final in zip(parts, files):
        os.replace(tmp, os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    if len(files) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return files, count, written


def _set_dtype(config: dict, dtype: str) -> None:
    """Set the dtype keys a config.json has (transformers 5 writes `dtype`, 4 `torch_dtype`;
    nested text/vision configs may carry their own), or `dtype` when it has none."""
    found = False
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
            found = True
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value):
            _set_dtype(value, dtype)
    if not found:
        config["dtype"] = dtype


def copy_base_files(base_model: str, out_dir: str) -> list[str]:
    """Copy every top-level file of the base model that is neither a weight nor config.json
    (tokenizer files, chat template, generation and preprocessor configs, README, licence)."""
    copied = []
    for name in sorted(os.listdir(base_model)):
        src = os.path.join(base_model, name)
        if (not os.path.isfile(src) or name.startswith(".") or name in _WRITTEN
                or name.endswith(_WEIGHT_SUFFIXES)):
            continue
        shutil.copy2(src, os.path.join(out_dir, name))
        copied.append(name)
    return copied


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(directory)]) == os.path.realpath(directory)


def _check_out_dir(out_dir: str, source: ExportSource, overwrite: bool) -> None:
    """ExportError unless the export may write `out_dir`."""
    # `--overwrite` removes the output directory: never one that holds what is being read; and
    # nothing is written into the checkpoint (its manifest) or the base model. Inside the run
    # directory is fine (`RUN/hf_step_N`).
    for what, path in (("base model", source.base_model), ("checkpoint", source.checkpoint),
                       ("run directory", source.run_dir)):
        if path and (_inside(path, out_dir) or (what != "run directory" and _inside(out_dir, path))):
            raise ExportError(f"the output {out_dir} overlaps the {what} {path}: choose another directory")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"the output {out_dir} is a file")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(f"the output directory {out_dir} exists and is not empty (pass --overwrite to replace it)")


def _partial_dir(out_dir: str) -> str:
    """The temporary directory the export writes into (`OUT.partial`, emptied first)."""
    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return partial


def export_checkpoint(source: ExportSource, out_dir: str | os.PathLike, dtype: str = "auto",
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                      deep_verify: bool = False, progress: Progress = print) -> ExportResult:
    """Write the checkpoint of `source` as a Hugging Face model directory at `out_dir`.

    The checkpoint's files are checked against its manifest first (`deep_verify`: hash every
    file; else the metadata and small files, and the sizes of the large shards). `dtype`: one of
    `EXPORT_DTYPES`. Runs its own one-process torch.distributed (`single_process_group`).
    """
    import torch

    from tide_megatron.models.policy import hf_weights

    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {EXPORT_DTYPES}")
    try:
        max_shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise ExportError(f"max shard size: {exc}") from None
    out_dir = os.path.abspath(os.fspath(out_dir))
    progress(f"checkpoint {source.checkpoint} (step {source.step}"
             + (f", trained at TP={source.trained_tp}" if source.trained_tp else "") + ")")
    progress(f"base model {source.base_model}")
    how = "every file hashed" if deep_verify else "shallow"
    progress(f"checking the checkpoint's files against its manifest ({how})")
    manifest = verify_checkpoint(source.checkpoint, deep=deep_verify)
    if manifest["step"] != source.step:
        raise CheckpointCorrupt(source.checkpoint, f"its manifest is of step {manifest['step']}")
    _check_out_dir(out_dir, source, overwrite)
    from megatron.core import dist_checkpointing

    if not dist_checkpointing.check_is_distributed_checkpoint(source.checkpoint):
        raise CheckpointCorrupt(source.checkpoint,
                                "not a Megatron dist_checkpointing directory (no valid metadata.json)")
    partial = _partial_dir(out_dir)
    try:
        with single_process_group():
            started = time.monotonic()
            progress("loading the checkpoint's model at TP=1 (dist_checkpointing reshards on load)")
            model, cfg = load_checkpoint_model(source)
            params = list(model.parameters())
            trained = params[0].dtype
            out_dtype = trained if dtype == "auto" else getattr(torch, dtype)
            total = sum(p.numel() for p in params) * out_dtype.itemsize
            progress(f"  loaded in {time.monotonic() - started:.0f} s: {sum(p.numel() for p in params) / 1e6:.1f}M "
                     f"parameters in {str(trained).removeprefix('torch.')}")
            progress(f"writing {str(out_dtype).removeprefix('torch.')} safetensors to {out_dir} "
                     f"(shards of at most {max_shard_size})")
            with torch.no_grad():
                converted = ((name, t.to(out_dtype)) for name, t in hf_weights(model, cfg))
                files, count, written = write_safetensors(partial, converted, max_shard_bytes, progress, total)
            del model, params
        dtype_name = str(out_dtype).removeprefix("torch.")
        config = read_hf_config(source.base_model)
        _set_dtype(config, dtype_name)
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        copied = copy_base_files(source.base_model, partial)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    progress(f"done: {count} tensors, {human_size(written)} in {len(files)} file(s); copied from the base "
             f"model: {', '.join(copied) if copied else 'nothing'}")
    return ExportResult(out_dir=out_dir, step=source.step, weight_files=files, copied_files=copied,
                        num_tensors=count, total_bytes=written, dtype=dtype_name)


def export_run(path: str | os.PathLike, out_dir: str | os.PathLike, step: Optional[int] = None,
               base_model: Optional[str | os.PathLike] = None, **kwargs) -> ExportResult:
    """`find_export_source` then `export_checkpoint`: the whole `launch/export_hf.py` command."""
    return export_checkpoint(find_export_source(path, step, base_model), out_dir, **kwargs)
