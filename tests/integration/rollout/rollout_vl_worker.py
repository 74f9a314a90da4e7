"""One process that runs a vision-language rollout against the trainer, for test_rollout_vl_sync.py.

Rollout: a real SGLang engine (CPU) serves a tiny random Qwen3-VL checkpoint; trajectories run
against an in-process env whose observations carry generated images (screenshot-like PNGs of
three sizes, one or two per turn), with and without streaming sessions. Trainer: the Megatron
Qwen3-VL actor (world of one, gloo) scores the trajectories, trains one GRPO step, and pushes its
weights (HF names) into the engine; then the same tasks (same images) roll out again. Everything
measured goes to a JSON file; the test process asserts on it.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from types import SimpleNamespace

SIZES = [(96, 64), (64, 64), (40, 90)]


def screenshot(task: str, turn: int, k: int) -> bytes:
    """A deterministic image per (task, turn, k): the same task shows the same screens."""
    import zlib

    import numpy as np
    from PIL import Image

    width, height = SIZES[(turn + k) % len(SIZES)]
    seed = zlib.crc32(f"{task}/{turn}/{k}".encode())
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


class ImageEnv:
    """An env client whose observations are screenshots: turn 1 shows two, the others one."""

    def __init__(self, turns: int = 3):
        self.turns = turns
        self.steps: dict[str, int] = {}

    def _images(self, task: str, turn: int) -> list[bytes]:
        return [screenshot(task, turn, k) for k in range(2 if turn == 1 else 1)]

    async def reset(self, env, task_id, trajectory_id):
        self.steps[trajectory_id] = 0
        return SimpleNamespace(observation=f"Task {task_id}: find the door.", session_id=trajectory_id,
                               image_data=self._images(task_id, 0), info={})

    async def close_quietly(self, session_id):
        pass

    async def step(self, session_id, action):
        self.steps[session_id] += 1
        turn = self.steps[session_id]
        done = turn >= self.turns
        reward = float("e" in action) if done else 0.0
        task = session_id.split("|")[0]
        return SimpleNamespace(observation=f"Step {turn}.", reward=reward, done=done,
                               info={"episode_return": reward}, image_data=[] if done else self._images(task, turn))

from tide_megatron.testing import worker_args


def main() -> None:
    args = worker_args()

    import torch

    from tide_megatron.models.qwen3_vl_checkpoint import write_random_vl_checkpoint
    from tide_megatron.models.qwen3_vl_config import VLModelConfig
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunner, TaskRunnerConfig
    from tide_megatron.rollout.worker import build_chat
    from tide_megatron.tokenizer import TINY_BPE_DIR
    from tide_megatron.utils.net import free_port

    ckpt, cfg = write_random_vl_checkpoint(os.path.join(args.out, "hf"), VLModelConfig(), TINY_BPE_DIR)
    results: dict = {"image_token_id": cfg.image_token_id}
    engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=8192, max_running_requests=16), ckpt)
    chat = build_chat(ckpt, None)

    def rollout(temperature: float, use_sessions: bool = True) -> list:
        runner = TaskRunner(TaskRunnerConfig(max_turns=4, max_context_tokens=512, max_new_tokens=6,
                                             temperature=temperature), engine, chat, ImageEnv())
        runner._runner.use_sessions = use_sessions
        # The env keys sessions by trajectory id; the task id rides in front for its screenshots.
        assignments = [TaskAssignment(task={"env": "gui", "task_id": f"t{i}"}, group_id=f"t{i}|g", index=j)
                       for i in range(2) for j in range(4)]

        async def go():
            return await asyncio.gather(*(runner.run(a) for a in assignments))

        return engine.loop.run_until_complete(go())

    trajs = rollout(1.0)
    results["trajectories"] = [t.to_json() for t in trajs]

    # --- trainer: score, one GRPO step, push the weights ------------------------------------
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    from dataclasses import replace

    from tide_megatron.core.trajectory import Trajectory
    from tide_megatron.trainer.payload import to_train_trajectory
    from tide_megatron.models.megatron_gpt import init_parallel
    from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
    from tide_megatron.trainer.actor import MegatronActor
    from tide_megatron.trainer.batch import collate, micro_batches_by_budget
    from tide_megatron.trainer.config import TrainerConfig

    init_parallel(tp_size=1, seed=0)
    actor = MegatronActor(cfg, TrainerConfig(lr=1e-2, kl_coef=0.0), ckpt)
    images = TrajectoryImages.for_model(cfg, ckpt)

    def max_diff(records: list) -> tuple[float, int]:
        """Largest |trainer - engine| log-prob over the generated tokens of `records`."""
        worst, count = 0.0, 0
        for record in records:
            mb = collate([to_train_trajectory(Trajectory.from_json({**record, "advantage": 0.0}), images)])
            lp = actor.logprobs(mb)[0]
            mask = mb.loss_mask[0].bool()
            worst = max(worst, float((lp[mask] - mb.old_logprobs[0][mask]).abs().max()))
            count += int(mask.sum())
        return worst, count

    results["pre_sync_max_abs_diff"], results["pre_sync_tokens"] = max_diff(results["trajectories"])
    before = {n: t.clone() for n, t in actor.hf_weights()}
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / len(rewards)
    train = [to_train_trajectory(replace(t, advantage=(t.reward - mean) + 0.5 * (i % 2 - 0.5)), images)
             for i, t in enumerate(trajs)]
    actor.train_step(micro_batches_by_budget(train, 4096))
    after = list(actor.hf_weights())
    results["vision_weight_change"] = max(float((t - before[n]).abs().max()) for n, t in after if "visual" in n)
    engine.loop.run_until_complete(engine.update_weights(after, version=1))

    # --- after the sync: the same tasks (same screenshots), greedy, with and without sessions ---
    with_sessions = rollout(0.0)
    without = rollout(0.0, use_sessions=False)
    results["post_sync_max_abs_diff"], results["post_sync_tokens"] = max_diff([t.to_json() for t in with_sessions])
    results["post_sync_no_session_max_abs_diff"], _ = max_diff([t.to_json() for t in without])
    results["post_sync_policy_versions"] = sorted({t.policy_version for t in with_sessions + without})
    results["sessions_equal_no_sessions"] = [t.token_ids for t in with_sessions] == [t.token_ids for t in without]
    results["no_session_cached_tokens"] = sum(t.cached_tokens for t in without)
    engine.shutdown()
    torch.distributed.destroy_process_group()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
