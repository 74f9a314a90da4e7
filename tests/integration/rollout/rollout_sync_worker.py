"""One process that exercises the rollout side against the trainer, for test_rollout_sync.py.

Rollout: a real SGLang engine serves a tiny random Qwen2 checkpoint (tiny BPE tokenizer) and
runs door-game trajectories against a real env server subprocess. Trainer: a Megatron actor
(world of one, gloo) trains one GRPO step on those trajectories; its weights go to the engine
with `RolloutEngine.update_weights`. Everything measured is written to a JSON file; the test
process asserts on it (Megatron's CPU shims stay out of the pytest process).
"""

from __future__ import annotations

import asyncio
import json
import os

from tide_megatron.testing import tiny_checkpoint, worker_args


def main() -> None:
    args = worker_args()

    from tide_megatron.envs.client import EnvClient
    from tide_megatron.envs.config import EnvConfig, EnvServerConfig
    from tide_megatron.envs.server_process import EnvServerProcess
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunner, TaskRunnerConfig
    from tide_megatron.rollout.worker import build_chat

    ckpt = tiny_checkpoint(args.out, vocab_size=3072)
    results: dict = {}
    with EnvServerProcess(EnvServerConfig(envs=[EnvConfig(name="door_game")])) as server:
        engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=8192, max_running_requests=16), ckpt)
        client = EnvClient(server.client_config())
        runner = TaskRunner(TaskRunnerConfig(max_turns=4, max_context_tokens=512, max_new_tokens=6),
                            engine, build_chat(ckpt, None), client)

        async def rollout(temperature: float):
            runner.cfg.temperature = temperature
            await client.connect()
            tasks = await client.list_tasks("door_game", "train", limit=2)
            assignments = [TaskAssignment(task=t.to_json(), group_id=f"g{i}", index=j)
                           for i, t in enumerate(tasks) for j in range(4)]
            out = await asyncio.gather(*(runner.run(a) for a in assignments))
            await client.close()
            return out

        trajs = engine.loop.run_until_complete(rollout(1.0))
        results["trajectories"] = [t.to_json() for t in trajs]

        # --- trainer: one GRPO step, then push the weights to the engine ---------------------
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port + 1), RANK="0", WORLD_SIZE="1")
        from dataclasses import replace

        from tide_megatron.trainer.payload import to_train_trajectory
        from tide_megatron.models.megatron_gpt import init_parallel
        from tide_megatron.trainer.actor import MegatronActor
        from tide_megatron.trainer.batch import collate, micro_batches_by_budget
        from tide_megatron.trainer.config import TrainerConfig

        init_parallel(tp_size=1, seed=0)
        model_cfg = ModelConfig.from_hf_checkpoint(ckpt)
        actor = MegatronActor(model_cfg, TrainerConfig(lr=1e-2, kl_coef=0.0), ckpt)
        rewards = [t.reward for t in trajs]
        mean = sum(rewards) / len(rewards)
        train = [to_train_trajectory(replace(t, advantage=(t.reward - mean) + 0.5 * (i % 2 - 0.5)))
                 for i, t in enumerate(trajs)]
        before = collate(train[:1])
        # Before any update: the engine's sampling log-probs are the trainer's.
        lp_before = actor.logprobs(before)[0]
        mask = before.loss_mask[0].bool()
        results["pre_sync_max_abs_diff"] = float((lp_before[mask] - before.old_logprobs[0][mask]).abs().max())
        actor.train_step(micro_batches_by_budget(train, 4096))
        engine.loop.run_until_complete(engine.update_weights(list(actor.hf_weights()), version=1))

        # After the sync: a fresh greedy trajectory, scored by both sides.
        trajs_after = engine.loop.run_until_complete(rollout(0.0))
        t = trajs_after[0]
        mb = collate([to_train_trajectory(replace(t, advantage=0.0))])
        lp_trainer = actor.logprobs(mb)[0]
        m = mb.loss_mask[0].bool()
        results["post_sync_max_abs_diff"] = float((lp_trainer[m] - mb.old_logprobs[0][m]).abs().max())
        results["post_sync_tokens"] = int(m.sum())
        results["post_sync_policy_version"] = t.policy_version
        results["old_weights_diff"] = float((lp_before[:5] - lp_trainer[:5]).abs().max()) if len(lp_trainer) >= 5 else 0.0
        engine.shutdown()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
