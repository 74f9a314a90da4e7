"""`workload`: the simulator's task stream as an environment, for emulated runs.

Task `train/i` is the simulator's training group i (`sim.workload.WorkloadModel`, same workload
file and seed), and the trajectory with index k in its group replays member k of that group:
its prompt, its turns, each turn's observation tokens and env latency, and the tokens the
policy answers with each turn. So a real run on emulated devices (`cluster.device=emulated`)
and the simulator roll out the same trajectories.

The policy's answer length is a property of the trajectory, which the env knows and the engine
does not: each observation ends with `[answer N]`, and the emulated engine's `answer_length`
(`answer_length_reader` below, both ends of the directive in this module) reads it from the
context's last tokens. Observations are `ok` words (one token each in the BPE tokenizers here);
the chat template adds its own few tokens per turn. The action text is not read. Rewards are a
fixed draw per trajectory, so GRPO groups see varied returns.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Optional

from tide_megatron.envs.config import EnvConfig
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.task_ids import parse_task_id, pool_task_ids

FILLER = "ok"
ANSWER = "[answer {n}]"
_ANSWER = re.compile(r"\[answer (\d+)\]")
TAIL_TOKENS = 32
"""Context tokens the reader decodes: the directive and the chat template's turn end after it."""


def observation_text(tokens: int, answer: int) -> str:
    """An observation of about `tokens` tokens that asks for an answer of `answer` tokens."""
    return " ".join([FILLER] * max(0, tokens)) + "\n" + ANSWER.format(n=answer)


def answer_length_reader(tokenizer) -> Callable[[list[int]], Optional[int]]:
    """The emulated engine's `answer_length`: the last directive in a context's tail, or None."""
    def answer_length(context: list[int]) -> Optional[int]:
        found = _ANSWER.findall(tokenizer.decode(context[-TAIL_TOKENS:]))
        return int(found[-1]) if found else None

    return answer_length


class WorkloadEnv(Env):
    """One trajectory of the simulator's workload, replayed."""

    def __init__(self, env_cfg: EnvConfig):
        from tide_megatron.sim.loader import load_workload
        from tide_megatron.sim.workload import WorkloadModel

        self._cfg = env_cfg.workload
        if self._cfg.time_scale < 0:
            raise ValueError(f"workload.time_scale={self._cfg.time_scale}: expected >= 0")
        self._key = env_cfg.key
        self._model = WorkloadModel(load_workload(self._cfg.workload), self._cfg.seed)
        self._pools = {"train": self._cfg.num_train_tasks, "eval": self._cfg.num_eval_tasks}
        self._traj = None
        self._turn = 0
        self._reward = 0.0

    def _group_id(self, task_id: str) -> tuple[int, bool]:
        from tide_megatron.sim.workload import EVAL_GROUP_BASE

        split, index = parse_task_id(task_id, self._pools)
        return (EVAL_GROUP_BASE + index, True) if split == "eval" else (index, False)

    def list_tasks(self, split: str) -> list[TaskSpec]:
        return [self.task(t) for t in pool_task_ids(split, self._pools)]

    def task(self, task_id: str) -> TaskSpec:
        group, is_eval = self._group_id(task_id)
        ttype, _prompt = self._model.group_shape(group)
        return TaskSpec(env=self._key, task_id=task_id, task_type=f"workload/{ttype.name}",
                        split="eval" if is_eval else "train")

    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        group, is_eval = self._group_id(task_id)
        member = trajectory_id.rsplit("/", 1)[-1]
        index = int(member) if member.isascii() and member.isdigit() else 0
        self._traj = traj = self._model.trajectory(group, index, is_eval)
        self._turn = 0
        self._reward = random.Random(traj.traj_id * 7 + group).random()
        return ResetResult(observation=observation_text(traj.prompt_tokens, traj.gen[0]),
                           info={"turns": traj.n_turns, "task_type": traj.task_type},
                           task_type=f"workload/{traj.task_type}", latency_s=traj.reset_s * self._cfg.time_scale)

    def step(self, action: str) -> StepResult:
        traj = self._traj
        if traj is None or self._turn >= traj.n_turns:
            raise RuntimeError("step on a finished or unstarted workload episode")
        t = self._turn
        self._turn += 1
        done = self._turn == traj.n_turns
        text = "" if done else observation_text(traj.obs[t], traj.gen[t + 1])
        return StepResult(observation=text, reward=self._reward if done else 0.0, done=done,
                          info={"episode_return": self._reward} if done else {},
                          latency_s=traj.env_s[t] * self._cfg.time_scale)

    def close(self) -> None:
        self._traj = None
