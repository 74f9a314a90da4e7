"""Hugging Face Qwen2 / Qwen3 checkpoints on local disk: write a tiny random one, read one back.

Tests, the `tiny_cpu` recipe and SGLang all start from the same directory: `config.json` plus
`model.safetensors` in fp32 (and, when given, the tokenizer files), so SGLang serves exactly the
weights the Megatron actor loads. Nothing here touches the network.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch

from tide_megatron.models.config import ModelConfig

_TOKENIZER_SKIP = {"config.json", "generation_config.json"}


def randomise_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter with seeded noise, norms around 1.

    HF's own init leaves norms at exactly 1 and biases at 0, which would let a converter that
    drops or swaps them pass the round-trip tests; noise everywhere makes every tensor matter.
    A norm's scale is a weight of a module whose name contains "norm" (`input_layernorm`,
    `q_norm`, a vision block's `norm1`, ...).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            module, _, kind = name.rpartition(".")
            if kind == "weight" and "norm" in module.rpartition(".")[2]:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)


def write_random_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
    init_std: float = 0.1,
) -> str:
    """Write a random `Qwen2ForCausalLM`, or `Qwen3ForCausalLM` when `cfg.qk_layernorm`
    (fp32 safetensors + config.json), to `path`.

    Deterministic in (cfg, seed). If `tokenizer_dir` is given, its tokenizer files are copied
    next to the weights so that the directory is servable by SGLang / loadable by AutoTokenizer.
    Returns the directory path.
    """
    import transformers

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf_kwargs = cfg.to_hf_config_dict()
    architecture = hf_kwargs.pop("architectures")[0]
    hf_kwargs.pop("model_type")
    hf_kwargs.pop("torch_dtype")
    config_class = getattr(transformers, "Qwen3Config" if cfg.qk_layernorm else "Qwen2Config")
    hf_config = config_class(**hf_kwargs)
    hf_config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(hf_config).to(torch.float32)
    randomise_(model, seed, init_std)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_dir is not None:
        for src in glob.glob(os.path.join(os.fspath(tokenizer_dir), "*")):
            name = os.path.basename(src)
            if os.path.isfile(src) and name not in _TOKENIZER_SKIP and not name.endswith(
                (".safetensors", ".bin")
            ):
                shutil.copy(src, os.path.join(path, name))
    return path


def load_hf_state_dict(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, keyed by HF name, on CPU."""
    from safetensors.torch import load_file

    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"no checkpoint directory at {checkpoint_dir}")
    index_path = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [os.path.basename(p) for p in glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {checkpoint_dir}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(checkpoint_dir, name), device="cpu"))
    return state


def load_hf_model(checkpoint_dir: str | os.PathLike) -> torch.nn.Module:
    """The checkpoint as a transformers causal LM (`Qwen2ForCausalLM` / `Qwen3ForCausalLM`, as its
    config.json says) in fp32, eval mode (a reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(checkpoint_dir), dtype=torch.float32)
    return model.eval()
