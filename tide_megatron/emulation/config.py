"""Config of emulated device time (`cluster.device=emulated`).

Every rank runs its real code; only device work (an engine's prefill and decode iterations, the
trainer's passes, weight transfers) is replaced by the time the simulator's cost model gives for
it (`tide_megatron.sim.hardware.HardwareModel`), on the GPU and model named here. Those are the
simulator's own files, `recipes/sim/hardware/<name>.yaml` and `recipes/sim/model/<name>.yaml`,
where each figure cites its source: the emulated system and the simulator price the same work
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICES = ("real", "emulated")


@dataclass
class EmulationConfig:
    """What the emulated device is, and how much slower than it the host runs."""

    hardware: str = "h100_sxm"
    """GPU of the cost model: `recipes/sim/hardware/<name>.yaml`."""
    model: str = "qwen2_5_7b"
    """Model of the cost model (its size and attention shape): `recipes/sim/model/<name>.yaml`.
    The checkpoint at `model.path` still gives the tokenizer and chat template."""
    dilation: float = 1.0
    """Every device time is multiplied by this: with many ranks sharing a few host cores, a
    dilated run keeps the host's own work small against the device's. Every result records it;
    divide wall times by it."""
    request_rows: int = 256
    """Requests one emulated engine runs at once when `rollout.engine.max_running_requests` is
    null (SGLang then sizes it from memory); an open streaming session holds one between turns.
    The KV pool likewise is `rollout.engine.max_total_tokens`, or when null what the cost model
    gives for the model on the GPU (HBM x `rollout_mem_fraction` - reserve - weights)."""
    page_tokens: int = 16
    """Granularity of prefix reuse in the emulated KV pool (`emulation/kv_pool.py`); SGLang's is
    1 token, which costs this host a hash per token of every context."""
    max_prefill_tokens: int = 8192
    """New tokens one prefill batch takes at most (SGLang's `chunked_prefill_size` default);
    a longer prompt is prefilled alone."""
    gen_tokens: list[float] = field(default_factory=lambda: [64.0, 0.5])
    """Tokens the emulated policy answers with, [median, log-normal sigma], when the context does
    not say (an env of the `workload` kind does: `envs/workload_env.py`). Drawn per request from
    the engine's seed and the request's context length, capped by `max_new_tokens`."""
    filler_token_id: int = 0
    """The token id every emulated output token carries (its text is not read by emulated envs)."""

    def __post_init__(self) -> None:
        if self.dilation <= 0:
            raise ValueError(f"cluster.emulation.dilation={self.dilation}: expected a positive factor")
        if self.request_rows < 1 or self.page_tokens < 1 or self.max_prefill_tokens < 1:
            raise ValueError("cluster.emulation.request_rows, page_tokens and max_prefill_tokens must be >= 1")
        if len(self.gen_tokens) != 2 or self.gen_tokens[0] < 1 or self.gen_tokens[1] < 0:
            raise ValueError(f"cluster.emulation.gen_tokens={list(self.gen_tokens)}: expected [median >= 1, sigma >= 0]")
