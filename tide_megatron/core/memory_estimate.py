"""What a rank of a plan holds on its GPU, and how long one weight sync takes: estimates a user
reads before renting a cluster (`launch/train.py --dry-run`). Pure arithmetic on the model's
shape and the job's sizes; every constant says where it comes from.

Trainer rank (Megatron, this project's settings: `trainer/actor.py` builds DDP with
`grad_reduce_in_fp32=True` and Adam):
- weights: 2 bytes/param in bf16 (4 in fp32), sharded over TP x PP;
- gradients: 4 bytes/param (the fp32 grad buffer);
- optimizer: fp32 main params + Adam m and v = 12 bytes/param in bf16 (8 in fp32, where the
  params are the main params), divided by DP with the distributed optimizer;
- the reference model (when `kl_coef > 0`): another copy of the weights;
- activations of one micro-batch of T tokens in rows of L (the padded layout the trainer runs
  today), per layer, from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", eq. 1, no sequence parallelism): T*h*(10 + 24/tp) bytes for the linear
  parts and 5*a*T*L/tp bytes for the attention scores of the unfused (local-spec) attention,
  which is O(L^2) per row. `selective` recompute keeps the scores of one layer only, `full` keeps
  each layer's input (2*T*h bytes) and one layer's activations. Plus the logits in fp32 and
  their gradient: 2 * 4*T*V/tp bytes.
Rollout engine (SGLang): `mem_fraction_static` of the GPU holds the weights (sharded over the
engine's TP) and the KV pool; the rest is SGLang's activations and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
# Korthikanti et al. 2022, eq. 1 (bytes per token per hidden unit, 16-bit activations).
ACT_LINEAR_UNSHARDED = 10
ACT_LINEAR_SHARDED = 24
ACT_SCORES = 5
ADAM_BYTES_BF16 = 12   # fp32 main params + m + v
ADAM_BYTES_FP32 = 8    # m + v (the fp32 params are the main params)
GRAD_BYTES = 4         # DDP's grad buffer with grad_reduce_in_fp32=True
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder (and its vision tower, for VL models) that memory depends on."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    vision_params: int = 0
    """Parameters of the vision tower and merger (0 for text models)."""

    @property
    def params(self) -> int:
        """Parameters of the whole model (norms and biases included; close, not exact)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_attention_heads * d * 2 + h * self.num_key_value_heads * d * 2 + \
            (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        mlp = 3 * h * self.ffn_hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + embed + h + self.vision_params

    def kv_bytes_per_token(self, dtype_bytes: int, engine_tp: int = 1) -> int:
        """KV cache bytes one token takes on one GPU of an engine (K and V of every layer; KV
        heads are replicated when the engine's TP exceeds them)."""
        heads = max(1, self.num_key_value_heads // engine_tp)
        return 2 * self.num_layers * heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, name: str, hf: dict) -> "ModelShape":
        """From a Hugging Face `config.json` (Qwen2/Qwen2.5, Qwen3, Qwen3-VL with text_config)."""
        text = hf.get("text_config", hf)
        heads = text["num_attention_heads"]
        vision = hf.get("vision_config")
        vision_params = 0
        if vision:
            vh, vi, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
            merged = vh * vision.get("spatial_merge_size", 2) ** 2
            # blocks (qkv + proj + MLP) plus the patch merger(s): merged -> merged -> out.
            mergers = 1 + len(vision.get("deepstack_visual_indexes", []))
            vision_params = depth * (4 * vh * vh + 2 * vh * vi) + mergers * (merged * merged + merged *
                                                                             vision.get("out_hidden_size", text["hidden_size"]))
        return cls(name=name, num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
                   num_attention_heads=heads, num_key_value_heads=text.get("num_key_value_heads", heads),
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads,
                   ffn_hidden_size=text["intermediate_size"], vocab_size=text.get("vocab_size", hf.get("vocab_size")),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                   vision_params=vision_params)


@dataclass(frozen=True)
class TrainerMemoryInputs:
    """The trainer settings memory depends on (`trainer.*`, the plan's sizes)."""

    tp: int
    pp: int
    dp: int
    bf16: bool
    distributed_optimizer: bool
    with_reference: bool
    micro_batch_tokens: int
    row_tokens: int
    """Longest row of a micro-batch (the padded length): min(max context, micro-batch tokens)."""
    recompute: str = "none"
    packed: bool = False
    """Packed micro-batches (`trainer.packing`): attention runs per trajectory through a kernel
    that keeps no score matrix for backward (flash / TE fused attention: O(tokens) per head),
    so the O(row^2) score term is gone; padded rows keep Megatron's local softmax probabilities."""


@dataclass(frozen=True)
class MemoryLine:
    """One GPU's estimate, GB, by part."""

    parts: tuple[tuple[str, float], ...]
    budget_gb: float
    """What the GPU can give these parts."""

    @property
    def total_gb(self) -> float:
        return sum(v for _, v in self.parts)

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.budget_gb

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.parts)
        verdict = "fits" if self.fits else "OVER"
        return f"{parts} = {self.total_gb:.1f} GB of {self.budget_gb:.1f} GB ({verdict})"


def trainer_memory(shape: ModelShape, t: TrainerMemoryInputs, gpu_gb: float, usable: float = 0.9) -> MemoryLine:
    """One trainer GPU (the first PP stage, which also holds the embedding and, untied, the
    output layer; the logits are counted there too: the worst stage). `usable`: the share of
    the GPU the caching allocator can hand out before fragmentation bites."""
    if t.recompute not in RECOMPUTE_MODES:
        raise ValueError(f"trainer.recompute={t.recompute!r}: expected one of {RECOMPUTE_MODES}")
    shard = shape.params / (t.tp * t.pp)
    wbytes = 2 if t.bf16 else 4
    adam = (ADAM_BYTES_BF16 if t.bf16 else ADAM_BYTES_FP32) / (t.dp if t.distributed_optimizer else 1)
    layers = -(-shape.num_layers // t.pp)
    h, tokens, row = shape.hidden_size, t.micro_batch_tokens, min(t.row_tokens, t.micro_batch_tokens)
    act_scale = wbytes / 2  # the formula's bytes are for 16-bit activations
    linear = tokens * h * (ACT_LINEAR_UNSHARDED + ACT_LINEAR_SHARDED / t.tp) * act_scale
    scores = 0.0 if t.packed else ACT_SCORES * (shape.num_attention_heads / t.tp) * tokens * row * act_scale
    if t.recompute == "none":
        acts = layers * (linear + scores)
    elif t.recompute == "selective":
        acts = layers * linear + scores
    else:
        acts = layers * 2 * tokens * h * act_scale + linear + scores
    logits = 2 * 4 * tokens * shape.vocab_size / t.tp
    parts = [("weights", shard * wbytes / GB), ("grads", shard * GRAD_BYTES / GB), ("optimizer", shard * adam / GB)]
    if t.with_reference:
        parts.append(("reference", shard * wbytes / GB))
    parts += [("activations", acts / GB), ("logits", logits / GB)]
    return MemoryLine(tuple(parts), gpu_gb * usable)


@dataclass(frozen=True)
class EngineMemory:
    """One SGLang engine GPU: what `mem_fraction_static` of it holds."""

    line: MemoryLine
    kv_tokens: int
    """Tokens the KV pool holds (per engine: every GPU of it holds its shard of each token)."""


def engine_memory(shape: ModelShape, gpu_gb: float, engine_tp: int, dtype_bytes: int,
                  mem_fraction_static: float, max_total_tokens: int | None) -> EngineMemory:
    """The KV pool SGLang would size: `max_total_tokens` when set, else what the static share
    leaves after the weights."""
    weights = shape.params * dtype_bytes / engine_tp
    static = mem_fraction_static * gpu_gb * GB
    per_token = shape.kv_bytes_per_token(dtype_bytes, engine_tp)
    if max_total_tokens:
        kv_tokens = max_total_tokens
    else:
        kv_tokens = max(0, int((static - weights) // per_token))
    line = MemoryLine((("weights", weights / GB), ("kv pool", kv_tokens * per_token / GB)), static / GB)
    return EngineMemory(line, kv_tokens)


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths of the weight path, GB/s (1e9 bytes). Assumptions, not measurements: the
    defaults are H100 SXM nodes (NVLink 4: 900 GB/s per GPU, of which NCCL all-gathers reach about
    half; PCIe 5 x16 host copies about 25 GB/s; one 400 Gb/s NIC per GPU = 50 GB/s, about 40
    reached by NCCL) and gloo over TCP on one host's NIC (about 3 GB/s, the figure this project
    measured on one CPU host is in `benchmarks/results/weight_sync.json`)."""

    nvlink_gbps: float = 450.0
    pcie_gbps: float = 25.0
    nic_gbps: float = 40.0
    gloo_gbps: float = 3.0


def node_sync_seconds(model_bytes: float, engines_by_node: dict[int, int], sender_node: int, trainer_tp: int,
                      link: LinkModel = LinkModel()) -> float:
    """The path `comm/weight_sync.py` takes: the trainer's TP shards gathered on rank 0 (NVLink)
    and written once to host shared memory (PCIe); the packed buffer sent over gloo (TCP,
    `gloo_gbps`) to one relay per other node that has engines, one after another from rank 0,
    each received into that node's shared memory; every engine then loads from its node's copy (PCIe, the engines
    of a node in parallel). `engines_by_node`: node -> engines on it."""
    gather = model_bytes * (trainer_tp - 1) / trainer_tp / (link.nvlink_gbps * GB)
    to_host = model_bytes / (link.pcie_gbps * GB)
    remote = sum(1 for node, n in engines_by_node.items() if n and node != sender_node)
    relays = remote * model_bytes / (link.gloo_gbps * GB)
    load = model_bytes / (link.pcie_gbps * GB) if any(engines_by_node.values()) else 0.0
    return gather + to_host + relays + load


def broadcast_sync_seconds(model_bytes: float, engines_off_sender_node: bool, trainer_tp: int,
                           link: LinkModel = LinkModel()) -> float:
    """The broadcast path (`comm/update_group.py`): the trainer's TP shards gathered on rank 0
    (NVLink), then one NCCL broadcast in buckets from rank 0's GPU to every engine GPU of the
    split. NCCL pipelines a broadcast in chunks along its ring or tree, so its time is the model
    over the slowest link on the way (a NIC when some engine is on another node, else NVLink),
    nearly independent of the number of receivers. Conservative: the gather and the broadcast
    are summed (the sender overlaps them, one bucket apart); the engines' copy from their
    receive bucket into their parameters stays on the GPU and is left out."""
    gather = model_bytes * (trainer_tp - 1) / trainer_tp / (link.nvlink_gbps * GB)
    return gather + model_bytes / ((link.nic_gbps if engines_off_sender_node else link.nvlink_gbps) * GB)


def relay_sync_seconds(model_bytes: float, engines: int, trainer_tp: int, link: LinkModel = LinkModel()) -> float:
    """The earlier path, for comparison (`benchmarks/weight_sync.py`): the trainer's TP shards gathered to rank 0 (NVLink), one copy to host (PCIe),
    then sent over gloo to each engine in turn, each receiver copying to its GPU (PCIe)."""
    gather = model_bytes * (trainer_tp - 1) / trainer_tp / (link.nvlink_gbps * GB)
    return gather + model_bytes / (link.pcie_gbps * GB) + engines * model_bytes / (link.gloo_gbps * GB) + \
        model_bytes / (link.pcie_gbps * GB)
