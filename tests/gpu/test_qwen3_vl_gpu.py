"""The Megatron Qwen3-VL trainer on a GPU: log-probs of a multimodal trajectory equal Hugging
Face's on CUDA (fp32), and GRPO steps run in fp32 and bf16.

Skipped where CUDA is absent (conftest.py). Runs in a subprocess so the NCCL process group and
CUDA context do not outlive the test.
"""

from __future__ import annotations

import textwrap

from tide_megatron.testing import run_script

SCRIPT = textwrap.dedent("""
    import dataclasses, io, os, sys, time, numpy as np, torch
    from PIL import Image
    torch.backends.cudnn.allow_tf32 = False  # the patch embedding is a convolution: keep it fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tide_megatron.core.trajectory import Trajectory
    from tide_megatron.trainer.payload import to_train_trajectory
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.models.policy import banned_token_ids
    from tide_megatron.models.qwen3_vl_checkpoint import load_hf_vl_model, write_random_vl_checkpoint
    from tide_megatron.models.qwen3_vl_config import VisionTowerConfig, VLModelConfig
    from tide_megatron.models.qwen3_vl_inputs import ImageProcessor, TrajectoryImages, encode_image_for_record
    from tide_megatron.tokenizer import TINY_BPE_DIR
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.batch import collate
    from tide_megatron.trainer.config import TrainerConfig
    from tide_megatron.trainer.logprobs import BANNED_LOGIT

    path, cfg = write_random_vl_checkpoint(sys.argv[1], VLModelConfig(
        num_layers=3, tie_word_embeddings=True, vision=VisionTowerConfig(deepstack_visual_indexes=(1, 0))),
        TINY_BPE_DIR)
    proc = ImageProcessor(path)
    ids, mask, images = list(range(20, 30)), [0] * 10, []
    for k, (w, h) in enumerate([(96, 64), (64, 96), (96, 64)]):
        buf = io.BytesIO()
        Image.fromarray((np.random.RandomState(k).rand(h, w, 3) * 255).astype("uint8")).save(buf, "PNG")
        n = proc.num_tokens(proc.grid(w, h))
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id] + [40 + k] * 6
        mask += [0] * (n + 2) + [1] * 6
        images.append(encode_image_for_record(buf.getvalue()))
    record = {"group_id": "g", "index": 0, "token_ids": ids, "loss_mask": mask, "logprobs": [0.0] * len(ids),
              "advantage": 1.0, "images": images}
    init_parallel(tp_size=1, seed=0)
    vision = TrajectoryImages.for_model(cfg, path)
    traj = to_train_trajectory(Trajectory.from_tokens(**record), vision)
    mb = collate([traj])
    actor = MegatronActor(cfg, TrainerConfig(lr=1e-3, kl_coef=0.0), path)
    ours = actor.logprobs(mb)[0].float().cpu()
    hf = load_hf_vl_model(path).cuda()
    with torch.no_grad():
        logits = hf(input_ids=traj.token_ids[None].cuda(), pixel_values=traj.pixel_values.cuda(),
                    image_grid_thw=traj.image_grid_thw.cuda(),
                    mm_token_type_ids=traj.image_mask[None].int().cuda()).logits[0].float()
        logits[:, list(banned_token_ids(cfg))] = BANNED_LOGIT
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, traj.token_ids[1:, None].cuda())[:, 0].cpu()
    diff = (ours[1:] - ref).abs().max().item()
    assert diff < 1e-4, diff
    mb.old_logprobs = ours * mb.loss_mask
    losses = [actor.train_step([mb]).loss for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    bf16 = MegatronActor(cfg, TrainerConfig(lr=1e-3, kl_coef=0.0, bf16=True), path)
    t0 = time.perf_counter()
    result = bf16.train_step([mb])
    assert torch.isfinite(torch.tensor(result.loss)), result
    print("ok", diff, losses, result.loss, round(time.perf_counter() - t0, 3))
""")


def test_megatron_qwen3_vl_on_cuda_matches_hf_and_trains(tmp_path):
    proc = run_script("-c", SCRIPT, tmp_path / "hf", timeout=600)  # the script's own process: CUDA and NCCL end with it
    assert proc.stdout.startswith("ok"), proc.stdout
    print(proc.stdout)
