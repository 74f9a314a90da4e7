"""Runs Megatron-core's training path on CPU with or without the CPU shims (a subprocess probe).

    python megatron_shim_probe.py [--shims]

Prints `STAGE <name>` before each stage and `PROBE OK` at the end; without the shims on a CUDA-less
machine it is expected to die with a CUDA error (the test checks both outcomes).
"""

from __future__ import annotations

import os
import socket
import sys
import warnings


def main() -> None:
    warnings.filterwarnings("ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    import torch
    import torch.nn.functional as F

    def stage(name: str) -> None:
        print(f"STAGE {name}", flush=True)

    if "--shims" in sys.argv:
        from tide_megatron.compat.megatron_cpu import install_megatron_cpu_shims, shims_installed

        assert install_megatron_cpu_shims() and install_megatron_cpu_shims()  # idempotent
        assert shims_installed()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    stage("init")
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    stage("build")
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                               normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, masked_softmax_fusion=False,
                               bias_activation_fusion=False, bias_dropout_fusion=False,
                               gradient_accumulation_fusion=False, calculate_per_token_loss=True)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                     max_sequence_length=16, position_embedding_type="rope")
    stage("ddp")
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    stage("optimizer")
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0), [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]

    def forward_step(data_iterator, m):
        logits = m(ids, torch.arange(16)[None].expand(2, 16), mask)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), ids[:, 1:])
        return loss, lambda out: (out.sum(), torch.tensor(out.numel(), dtype=torch.int), {})

    stage("forward_backward")
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=16, micro_batch_size=2)
    stage("optimizer_step")
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful and grad_norm > 0
    print("PROBE OK", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
