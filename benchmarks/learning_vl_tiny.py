"""Learning check: does GRPO on the tiny vision-language recipe raise the GUI desktop's reward?

    python benchmarks/learning_vl_tiny.py [--steps 40] [--window 5] [--warm-start-steps 15] [overrides ...]

1. Warm start (`--warm-start-steps`, 0 to skip). A random-init model never writes a well-formed
   action (`click X,Y`), so every reply costs the same malformed-reply penalty and GRPO sees no
   spread to learn from. The warm start writes the recipe's random tiny Qwen3-VL, then trains
   it with the Megatron actor on the env's expert first actions (screenshot + instruction ->
   action): the GRPO loss with advantage 1 and the current policy as the old one is the
   behaviour-cloning gradient. Short on purpose (the format, not the task).
2. GRPO: `torchrun --nproc-per-node 2 launch/train.py +recipe=tiny_vl_cpu model.path=<warm start>`
   for STEPS steps (screenshots through SGLang, the Megatron Qwen3-VL trainer, weights pushed
   back every step); compares the mean reward of the first and last WINDOW steps.

Prints a short table and writes benchmarks/results/learning_vl_tiny.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "launch"))

RECIPE = "tiny_vl_cpu"
# A bigger batch and a high learning rate make the signal of a tiny model usable within minutes.
DEFAULTS = ["scheduler.groups_per_step=8", "scheduler.group_size=8", "trainer.lr=2e-3", "trainer.kl_coef=0.0",
            "run.checkpoint_interval=0"]


def compose(overrides: list[str]):
    """The job config the training run will see (the recipe plus `overrides`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra_schema import CONFIG_DIR, register, to_job_config

    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return to_job_config(hydra_compose("config", overrides=[f"+recipe={RECIPE}", *overrides]))


def expert_records(job, chat, n: int, seed: int) -> list[dict]:
    """Trajectory records of the env's expert first action on `n` train tasks."""
    from tide_megatron.envs.registry import build_env
    from tide_megatron.models.qwen3_vl_inputs import encode_image_for_record

    env_cfg = next(e for e in job.envs.server.envs if e.key == job.envs.train_env)
    env = build_env(env_cfg)
    tasks = env.list_tasks("train")
    records = []
    for i, task in enumerate(random.Random(seed).sample(tasks, n)):
        first = env.reset(task.task_id, f"warm/{i}")
        images = chat.images.prepare(first.image_data, f"warm start {task.task_id}")
        send = chat.prompt_ids(first.observation, len(images))
        prompt = chat.images.expand(send, images, task.task_id)
        action = chat.tokenizer(env.expert_action(), add_special_tokens=False)["input_ids"] + [chat.eos_token_id]
        records.append({"group_id": "warm", "index": i, "token_ids": prompt + action,
                        "loss_mask": [0] * len(prompt) + [1] * len(action), "logprobs": [0.0] * (len(prompt) + len(action)),
                        "advantage": 1.0, "images": [encode_image_for_record(im.data) for im in images],
                        "image_grid_thw": [list(im.grid) for im in images]})
    return records


def warm_start(job, out_dir: Path, steps: int, batch: int, lr: float) -> tuple[str, list[float]]:
    """Write the recipe's random checkpoint, behaviour-clone the expert's first actions, save."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from tide_megatron.core.trajectory import Trajectory
    from tide_megatron.trainer.payload import to_train_trajectory
    from tide_megatron.models.megatron_gpt import destroy_parallel, init_parallel
    from tide_megatron.models.policy import model_config_from_checkpoint
    from tide_megatron.models.qwen3_vl_checkpoint import write_random_vl_checkpoint_from
    from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
    from tide_megatron.rollout.worker import build_chat
    from tide_megatron.tokenizer import tokenizer_dir
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.batch import micro_batches_by_budget
    from tide_megatron.trainer.config import TrainerConfig
    from tide_megatron.utils.net import free_port

    base = tokenizer_dir(job.model.tokenizer)
    random_dir = str(out_dir / "random_model")
    write_random_vl_checkpoint_from(random_dir, job.model.random_init, job.model.random_vision, base,
                                    len(AutoTokenizer.from_pretrained(base)), 1, job.run.seed)
    chat = build_chat(random_dir, None)
    records = expert_records(job, chat, steps * batch, job.run.seed)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    init_parallel(tp_size=1, seed=job.run.seed)
    cfg = model_config_from_checkpoint(random_dir)
    actor = MegatronActor(cfg, TrainerConfig(lr=lr, kl_coef=0.0), random_dir)
    images = TrajectoryImages.for_model(cfg, random_dir)
    action_logprob = []
    for step in range(steps):
        trajs = [to_train_trajectory(Trajectory.from_tokens(**r), images) for r in records[step * batch:(step + 1) * batch]]
        mbs = micro_batches_by_budget(trajs, job.trainer.micro_batch_tokens)
        for mb in mbs:  # the current policy as the old one: ratio 1, the behaviour-cloning gradient
            mb.old_logprobs = actor.logprobs(mb) * mb.loss_mask
        action_logprob.append(sum(float(mb.old_logprobs.sum()) for mb in mbs) / sum(mb.num_loss_tokens for mb in mbs))
        actor.train_step(mbs)
    warm_dir = out_dir / "warm_model"
    shutil.rmtree(warm_dir, ignore_errors=True)
    shutil.copytree(random_dir, warm_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({n: t.detach().contiguous() for n, t in actor.hf_weights()}, str(warm_dir / "model.safetensors"),
              metadata={"format": "pt"})
    destroy_parallel()
    return str(warm_dir), action_logprob


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--warm-start-steps", type=int, default=15)
    parser.add_argument("--warm-start-batch", type=int, default=16)
    parser.add_argument("--warm-start-lr", type=float, default=2e-3)
    parser.add_argument("--output-dir", default="outputs/learning_vl_tiny")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    out_dir = Path(args.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = DEFAULTS + [f"run.steps={args.steps}", f"run.output_dir={out_dir / 'run'}",
                            "run.name=learning_vl_tiny", *args.overrides]
    t0 = time.time()
    warm_curve: list[float] = []
    if args.warm_start_steps:
        model_path, warm_curve = warm_start(compose(overrides), out_dir, args.warm_start_steps,
                                            args.warm_start_batch, args.warm_start_lr)
        overrides.append(f"model.path={model_path}")
    warm_s = time.time() - t0
    metrics_path = out_dir / "run" / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
           str(REPO / "launch" / "train.py"), f"+recipe={RECIPE}", "metrics.progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"training failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    k = args.window
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    result = {
        # the resolved config: the arguments and the job the training run composed
        **bench_record.header("learning_vl_tiny", device="cpu", config={
            **vars(args), "job": compose(["metrics.progress=false", *overrides])}),
        "launcher": " ".join(cmd[1:]),
        "warm_start": {"steps": args.warm_start_steps, "batch": args.warm_start_batch, "lr": args.warm_start_lr,
                       "wall_time_s": round(warm_s, 1),
                       "expert_action_logprob_per_token": [round(x, 4) for x in warm_curve]},
        "steps": len(rows),
        "wall_time_s": round(wall, 1),
        "train_time_s": round(sum(r["time/step_s"] for r in rows), 1),
        "mean_reward_first_steps": round(first, 4),
        "mean_reward_last_steps": round(last, 4),
        "window_steps": k,
        "image_tokens_per_step": statistics.fmean(r["image_tokens"] for r in rows),
        "reward_per_step": [round(x, 4) for x in rewards],
        "reward_max_per_step": [round(r["reward/max"], 4) for r in rows],
    }
    dest = REPO / "benchmarks" / "results" / "learning_vl_tiny.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'steps':>6} {'wall s':>8} {'reward first':>13} {'reward last':>12}")
    print(f"{len(rows):>6} {wall:>8.0f} {first:>13.3f} {last:>12.3f}")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
