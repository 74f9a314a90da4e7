"""The `workload` env replays the simulator's trajectories turn for turn."""

from __future__ import annotations

import pytest

from tide_megatron.envs.config import EnvConfig, WorkloadEnvConfig
from tide_megatron.envs.registry import build_env
from tide_megatron.envs.workload_env import _ANSWER, FILLER
from tide_megatron.sim.loader import load_workload
from tide_megatron.sim.workload import EVAL_GROUP_BASE, WorkloadModel


def _replay(env, task_id, trajectory_id):
    first = env.reset(task_id, trajectory_id)
    observations, latencies, answers, rewards = [first.observation], [], [], []
    while True:
        answers.append(int(_ANSWER.findall(observations[-1])[-1]))
        step = env.step("anything")
        latencies.append(step.latency_s)
        rewards.append(step.reward)
        if step.done:
            return first, observations, latencies, answers, rewards, step
        observations.append(step.observation)


@pytest.mark.parametrize("task_id,group,is_eval", [("train/3", 3, False), ("eval/2", EVAL_GROUP_BASE + 2, True)])
def test_a_trajectory_is_the_simulators_member_of_that_group(task_id, group, is_eval):
    cfg = EnvConfig(name="workload", workload=WorkloadEnvConfig(seed=5, time_scale=2.0))
    env = build_env(cfg)
    sim = WorkloadModel(load_workload(cfg.workload.workload), seed=5).trajectory(group, 6, is_eval)
    first, observations, latencies, answers, rewards, last = _replay(env, task_id, "g17v0/6")
    assert env.task(task_id).task_type == first.task_type == f"workload/{sim.task_type}"
    assert answers == sim.gen
    assert [o.split().count(FILLER) for o in observations] == [sim.prompt_tokens, *sim.obs[:-1]]
    assert first.latency_s == pytest.approx(2.0 * sim.reset_s)
    assert latencies == pytest.approx([2.0 * s for s in sim.env_s])
    assert rewards[:-1] == [0.0] * (len(rewards) - 1) and last.info["episode_return"] == rewards[-1]
    with pytest.raises(RuntimeError, match="finished"):
        env.step("again")


def test_members_of_a_group_share_the_prompt_and_differ_after():
    env = build_env(EnvConfig(name="workload"))
    a = _replay(env, "train/0", "g0v0/0")
    b = _replay(env, "train/0", "g0v0/1")
    assert a[1][0].split().count(FILLER) == b[1][0].split().count(FILLER)
    assert (a[3], a[2]) != (b[3], b[2])
