"""Trajectories that run across a weight update, for test_weight_update_midtask.py.

A real SGLang engine runs door-game tasks whose env steps take 1.5 s. Once every task has
finished its first turn (and waits for its env), new weights (one Megatron GRPO step away from
the initial ones) are loaded into the engine. Each trajectory's log-probs are then scored by the
trainer under both weight versions, per segment; the JSON report holds what the test asserts on.
"""

from __future__ import annotations

import asyncio
import json
import os

from tide_megatron.testing import tiny_checkpoint, worker_args


def main() -> None:
    args = worker_args()

    import torch

    from tide_megatron.comm.messages import TaskAssignment
    from tide_megatron.envs.client import EnvClient
    from tide_megatron.envs.config import EnvConfig, EnvServerConfig, LatencyConfig
    from tide_megatron.envs.server_process import EnvServerProcess
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner, TaskHandle
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.rollout.task_runner import TaskRunnerConfig
    from tide_megatron.rollout.worker import build_chat

    ckpt = tiny_checkpoint(args.out, vocab_size=3072)
    slow = LatencyConfig(enabled=True, reset_median_s=0.0, step_median_s=1.5, step_sigma=0.0, task_speed_sigma=0.0,
                         slow_step_prob=0.0)
    report: dict = {}
    with EnvServerProcess(EnvServerConfig(envs=[EnvConfig(name="door_game", latency=slow)])) as server:
        engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=8192, max_running_requests=16), ckpt)

        # The trainer: weights one GRPO step away from the engine's, and the frozen initial model.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port + 1), RANK="0", WORLD_SIZE="1")
        from dataclasses import replace

        from tide_megatron.trainer.payload import to_train_trajectory
        from tide_megatron.models.megatron_gpt import init_parallel
        from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
        from tide_megatron.trainer.batch import TrajectoryTensors as TrainTrajectory
        from tide_megatron.trainer.batch import collate
        from tide_megatron.trainer.config import TrainerConfig

        init_parallel(tp_size=1, seed=0)
        model_cfg = ModelConfig.from_hf_checkpoint(ckpt)
        actor = MegatronActor(model_cfg, TrainerConfig(lr=5e-2, kl_coef=0.0), ckpt)
        old = ReferenceModel(model_cfg, ckpt)
        g = torch.Generator().manual_seed(0)
        synthetic = [TrainTrajectory(torch.randint(0, 3072, (48,), generator=g), torch.cat([torch.zeros(8), torch.ones(40)]),
                                     torch.full((48,), -8.0), advantage=1.0 - 2 * (i % 2)) for i in range(4)]
        actor.train_step([collate(synthetic)])

        client = EnvClient(server.client_config())
        runner = CTBTaskRunner(TaskRunnerConfig(max_turns=3, max_context_tokens=512, max_new_tokens=6),
                               {0: engine}, build_chat(ckpt, None), client, use_sessions=True)
        first_turns = {"n": 0}

        class Listener:
            def turn_started(self, task_id, context_tokens, kind):
                return None

            def turn_finished(self, task_id, context_tokens, report_):
                first_turns["n"] += 1

        async def run_all():
            await client.connect()
            tasks = await client.list_tasks("door_game", "train", limit=2)
            assignments = [TaskAssignment(task=t.to_json(), group_id=f"g{i}", index=j)
                           for i, t in enumerate(tasks) for j in range(2)]
            handles = [TaskHandle(a.trajectory_id) for a in assignments]
            for h in handles:
                h.place(0)
            jobs = [asyncio.create_task(runner.run(a, h, Listener())) for a, h in zip(assignments, handles)]
            while first_turns["n"] < len(jobs):  # every task generated its first turn
                await asyncio.sleep(0.01)
            sessions_before = engine.open_sessions
            await engine.update_weights(list(actor.hf_weights()), version=1)
            report["sessions_open_before_update"] = sessions_before
            report["sessions_open_after_update"] = engine.open_sessions
            out = await asyncio.gather(*jobs)
            await client.close()
            return out

        trajectories = engine.loop.run_until_complete(run_all())
        rows = []
        for t in trajectories:
            mb = collate([to_train_trajectory(replace(t, advantage=1.0))])
            lp_old, lp_new = old.logprobs(mb)[0], actor.logprobs(mb)[0]
            behaviour = torch.tensor(t.logprobs)
            segs = []
            for s in t.segments:
                sl = slice(s.start, s.end)
                ref = lp_old if s.version == 0 else lp_new
                segs.append({"version": s.version, "tokens": len(s),
                             "diff_own_version": float((behaviour[sl] - ref[sl]).abs().max()),
                             "diff_other_version": float((behaviour[sl] - (lp_new if s.version == 0 else lp_old)[sl]).abs().max())})
            rows.append({"policy_version": t.policy_version, "versions": t.versions, "segments": segs,
                         "turns": t.turns, "generated_tokens": t.generated_tokens})
        report["trajectories"] = rows
        # Training on them: the importance ratio uses each token's behaviour log-prob.
        train = [to_train_trajectory(replace(t, advantage=1.0 - 2 * (i % 2))) for i, t in enumerate(trajectories)]
        result = actor.train_step([collate(train)])
        report["train_loss"] = float(result.loss)
        engine.shutdown()
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
