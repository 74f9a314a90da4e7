"""The trainer on a GPU: Megatron log-probs equal Hugging Face's on CUDA, packed micro-batches give
the padded ones' log-probs and loss, and a GRPO step runs.

Skipped where CUDA is absent (conftest.py). Runs in a subprocess so the NCCL process group and
CUDA context do not outlive the test.
"""

from __future__ import annotations

import textwrap

from tide_megatron.testing import run_script

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import load_hf_model, write_random_hf_checkpoint
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.batch import TrajectoryTensors, collate, pack
    from tide_megatron.trainer.config import TrainerConfig
    from tide_megatron.trainer.logprobs import logprobs_from_logits
    hf_dir = write_random_hf_checkpoint(sys.argv[1], ModelConfig(vocab_size=2048), seed=0)
    init_parallel(tp_size=1, seed=0)
    actor = MegatronActor(ModelConfig.from_hf_checkpoint(hf_dir), TrainerConfig(lr=1e-3), hf_dir)
    ids = torch.randint(0, 2048, (32,))
    mask = torch.zeros(32); mask[10:] = 1
    mb = collate([TrajectoryTensors(ids, mask, torch.zeros(32), advantage=1.0)])
    ours = actor.logprobs(mb)[0].float().cpu()
    hf = load_hf_model(hf_dir).cuda()
    with torch.no_grad():
        ref = logprobs_from_logits(hf(ids[None].cuda()).logits.float(), ids[None].cuda())[0].cpu()
    diff = (ours[1:] - ref[1:]).abs().max().item()
    assert diff < 1e-3, diff
    # Packed (per-trajectory SDPA on CUDA) against padded (dense mask), fp32.
    trajs = []
    for n in (32, 17, 50):
        m = torch.zeros(n); m[n // 3:] = 1
        trajs.append(TrajectoryTensors(torch.randint(0, 2048, (n,)), m, -0.1 * m, advantage=float(n % 3) - 1))
    padded, packed = collate(trajs), pack(trajs)
    lp_padded = actor.logprobs(padded).float().cpu()
    rows = torch.cat([lp_padded[i, :n] for i, n in enumerate(padded.lengths)])
    packed_diff = (actor.logprobs(packed)[0].float().cpu() - rows).abs().max().item()
    assert packed_diff < 1e-4, packed_diff
    loss_padded = actor.forward_backward([padded])[0]["loss"].float().cpu()  # [sum, count]
    loss_packed = actor.forward_backward([packed])[0]["loss"].float().cpu()
    assert torch.allclose(loss_padded, loss_packed, rtol=1e-4, atol=1e-4), (loss_padded, loss_packed)
    result = actor.train_step([mb])
    assert torch.isfinite(torch.tensor(result.loss)), result
    print("ok", diff, packed_diff)
""")


def test_megatron_on_cuda_matches_hf_and_trains(tmp_path):
    proc = run_script("-c", SCRIPT, tmp_path / "hf", timeout=600)  # the script's own process: CUDA and NCCL end with it
    assert proc.stdout.startswith("ok")
