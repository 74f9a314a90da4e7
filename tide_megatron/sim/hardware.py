"""Roofline-style cost model of one GPU cluster for rollout and training.

Every time comes from public hardware constants (`HardwareConfig`) and the model's shape
(`SimModelConfig`); nothing here is fitted to a result. The formulas:

- Decode iteration of a batch of n sequences with total context S on a rollout rank of `tp`
  GPUs: max(weight read, token compute) + KV read, i.e.
      max(2N/(tp*BW_hbm*eff), n*2N/(tp*peak*eff_c)) + S*kv_bytes/(tp*BW_hbm*eff).
  Decode is memory bound at small batch and compute bound past the ridge point.
- Prefill of p new tokens behind c cached ones: (2N*p + attention) / (tp*peak*MFU_prefill).
  Attention FLOPs are 4*L*d per (query, key) pair; causal prefill sees c + p/2 keys on average.
- Training: forward = 2N + attention FLOPs per token, backward = 2x forward (the usual 6N rule),
  at `train_mfu` of peak across the DP slot's GPUs.
- Swaps over PCIe, weight broadcasts over NVLink or the inter-node network.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide_megatron.sim.config import HardwareConfig, SimModelConfig

GB = 1e9


@dataclass
class HardwareModel:
    """Times and capacities for one model on one GPU type."""

    hw: HardwareConfig
    model: SimModelConfig

    def __post_init__(self) -> None:
        hw, m = self.hw, self.model
        self.tp = m.rollout_tp
        self.weight_bytes = m.params * m.bytes_per_param
        self.kv_bytes = m.kv_bytes_per_token
        hbm = hw.hbm_bandwidth_tbps * 1e12 * hw.decode_hbm_efficiency * self.tp
        self._peak = hw.peak_bf16_tflops * 1e12
        # Decode, per iteration: a + n*c (compute) vs a; plus kv_s per context token.
        self.decode_weight_s = self.weight_bytes / hbm
        self.decode_token_compute_s = 2 * m.params / (self.tp * self._peak * hw.decode_compute_efficiency)
        self.decode_kv_s_per_token = self.kv_bytes / hbm
        self._prefill_flops_s = self.tp * self._peak * hw.prefill_mfu
        self._attn_flops_per_pair = 4 * m.n_layers * m.hidden_size

    # ----------------------------------------------------------------------------------- rollout
    def decode_base_s(self, n_running: int) -> float:
        """Context-independent part of one decode iteration for `n_running` sequences."""
        return max(self.decode_weight_s, n_running * self.decode_token_compute_s)

    def decode_iteration_s(self, n_running: int, total_context: float) -> float:
        """Wall time of one decode iteration (every running sequence emits one token)."""
        return self.decode_base_s(n_running) + total_context * self.decode_kv_s_per_token

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Wall time to prefill `new_tokens` that follow `cached_tokens` already in the KV cache."""
        if new_tokens <= 0:
            return 0.0
        flops = 2 * self.model.params * new_tokens
        flops += self._attn_flops_per_pair * new_tokens * (cached_tokens + new_tokens / 2)
        return flops / self._prefill_flops_s

    @property
    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens one rollout rank holds: engine memory minus weights and reserve."""
        hw = self.hw
        pool = self.tp * (hw.hbm_capacity_gb * hw.rollout_mem_fraction - hw.rollout_reserved_gb) * GB
        pool -= self.weight_bytes
        if pool <= 0:
            raise ValueError(f"{self.model.name} does not fit a TP={self.tp} engine on {hw.name}")
        return int(pool // self.kv_bytes)

    # ---------------------------------------------------------------------------------- training
    def train_flops_per_token(self, seq_len: float, backward: bool) -> float:
        """FLOPs per token of a forward (ref) or forward+backward (actor) pass."""
        fwd = 2 * self.model.params + self._attn_flops_per_pair * seq_len / 2
        return 3 * fwd if backward else fwd

    def train_s(self, tokens: float, seq_len: float, backward: bool, gpus: int) -> float:
        """Time for `gpus` GPUs to run a forward(+backward) pass over `tokens` tokens."""
        if tokens <= 0:
            return 0.0
        flops = tokens * self.train_flops_per_token(seq_len, backward)
        return flops / (gpus * self._peak * self.hw.train_mfu)

    def train_tokens_per_s(self, gpus: int, seq_len: float = 4096) -> float:
        """Actor (fwd+bwd) training tokens/s on `gpus` GPUs: the figure Megatron papers report."""
        return gpus * self._peak * self.hw.train_mfu / self.train_flops_per_token(seq_len, True)

    # ------------------------------------------------------------------------------ data motion
    @property
    def pcie_bytes_per_s(self) -> float:
        return self.hw.pcie_bandwidth_gbps * GB * self.hw.pcie_efficiency

    def swap_s(self, bytes_out: float, bytes_in: float) -> float:
        """Offload one state and load another over PCIe (full duplex: the directions overlap)."""
        return max(bytes_out, bytes_in) / self.pcie_bytes_per_s

    @property
    def ref_state_bytes_per_gpu(self) -> float:
        """Reference weights held by one trainer GPU."""
        return self.weight_bytes / self.model.train_gpus_per_rank

    def actor_state_bytes_per_gpu(self, dp: int) -> float:
        """Actor state that must move when the actor leaves the GPU mid-step: BF16 weights, FP32
        main gradients (Megatron keeps them in FP32) and the DP shard of the FP32 Adam state."""
        n = self.model.params / self.model.train_gpus_per_rank
        return 2 * n + 4 * n + 12 * n / max(1, dp)

    def ref_actor_swap_s(self, dp: int) -> float:
        """One alternation between reference and actor on a colocated trainer GPU."""
        return self.swap_s(self.ref_state_bytes_per_gpu, self.actor_state_bytes_per_gpu(dp))

    def weight_sync_s(self, n_gpus_total: int) -> float:
        """Broadcast the new BF16 weights to the rollout engines.

        Inside one node this runs on NVLink; once the job spans nodes the slowest hop is the
        inter-node network. A pipelined broadcast costs about one pass of the weights.
        """
        hw = self.hw
        bw = hw.nvlink_bandwidth_gbps if n_gpus_total <= hw.gpus_per_node else hw.internode_bandwidth_gbps
        return self.weight_bytes / (bw * GB * hw.network_efficiency)

    def colocate_switch_s(self, dp: int) -> float:
        """Sync mode: swap the rollout engine (weights; the KV pool is simply released) out and
        the full training state (weights, grads, Adam shard) in, or back."""
        return self.swap_s(self.weight_bytes / self.tp, self.actor_state_bytes_per_gpu(dp))
