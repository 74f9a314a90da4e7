"""Synthetic multi-turn agentic task stream.

A task is a GRPO group: G trajectories of the same prompt. Each trajectory is a sequence of
turns (generate `gen` tokens, the env answers with `obs` tokens after `env_s` seconds). Turn
counts come from a log-normal "needed turns" plus wrong actions, each of which costs one more
turn (an invalid ALFWorld command answers "Nothing happens."; a wrong WebShop click needs a
"back"), capped by the env's step limit and the model's context limit.

Trajectories are drawn from a generator seeded by (seed, task id, index), never from a shared
stream, so every scheduling mode sees exactly the same tasks whatever order it runs them in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import List

from tide_megatron.sim.config import TaskTypeConfig, WorkloadConfig


@dataclass(eq=False)
class SimTrajectory:
    """One multi-turn rollout: everything the simulator needs, drawn up front (compared by
    identity: two trajectories with equal draws are still two tasks)."""

    traj_id: int
    group_id: int
    index: int
    """Position in its group (0..G-1)."""
    task_type: str
    is_eval: bool
    prompt_tokens: int
    gen: List[int]
    """Tokens generated at each turn."""
    obs: List[int]
    """Observation tokens returned after each turn (the last turn's obs is the final reward msg)."""
    env_s: List[float]
    """Env latency after each turn."""
    reset_s: float
    # ----- run-time state, owned by the simulator
    turn: int = 0
    context: int = 0
    """Tokens in the context right now (prompt + all turns so far)."""
    version: int = -1
    """Policy version its staleness is measured from: the group's admission version (default
    rule) or the trajectory's own admission version (legacy drop rule)."""
    segment_versions: List[int] = field(default_factory=list)
    """Engine policy version at the start of each turn (the weights that generated it); a
    trajectory runs across weight updates, its next turn re-prefilled under the new weights."""
    generated_so_far: int = 0
    """Tokens of the turns whose decode has finished (what a cancellation books as wasted)."""
    rank: int = -1
    start_time: float = 0.0
    end_time: float = -1.0
    paused: bool = False
    env_busy: bool = False
    """The env is working on this trajectory's last action (or its reset)."""
    started: bool = False
    """The env reset is done (turns may run)."""
    admitted: bool = False
    """Holds an env slot (admitted and neither finished nor cancelled)."""
    cancelled: bool = False
    """Its group missed the staleness deadline and was cancelled (tokens booked as wasted)."""

    @property
    def n_turns(self) -> int:
        return len(self.gen)

    @property
    def generated_tokens(self) -> int:
        return sum(self.gen)

    @property
    def total_tokens(self) -> int:
        """Tokens the trainer processes for this trajectory (prompt, actions, observations)."""
        return self.prompt_tokens + sum(self.gen) + sum(self.obs[:-1])

    def footprint(self) -> int:
        """KV tokens the trajectory needs for its next turn."""
        return self.context + (self.gen[self.turn] if self.turn < len(self.gen) else 0)


@dataclass
class Group:
    """A GRPO group: complete when every trajectory is done."""

    group_id: int
    trajectories: List[SimTrajectory]
    is_eval: bool = False
    done: int = 0
    complete_time: float = -1.0
    version: int = -1
    """Admission version (cancel rule): the group must be consumed by version + bound."""
    admitted: bool = False
    """Some member has taken an env slot (the group holds staleness-throttle slots)."""

    @property
    def size(self) -> int:
        return len(self.trajectories)

    @property
    def complete(self) -> bool:
        return self.done == len(self.trajectories)


def _lognormal(rng: random.Random, median_sigma: List[float]) -> float:
    median, sigma = median_sigma
    if median <= 0:
        return 0.0
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median


EVAL_GROUP_BASE = 1_000_000_000
"""Group ids of evaluation tasks start here (a separate range from training tasks)."""


class WorkloadModel:
    """Draws groups of trajectories for training steps and evaluation phases."""

    def __init__(self, cfg: WorkloadConfig, seed: int):
        if not cfg.task_types:
            raise ValueError(f"workload {cfg.name} has no task types")
        self.cfg = cfg
        self.seed = seed
        self._weights = [t.weight for t in cfg.task_types]
        self._next_group = 0
        self._next_eval = 0

    def _task_type(self, rng: random.Random) -> TaskTypeConfig:
        return rng.choices(self.cfg.task_types, weights=self._weights)[0]

    def _trajectory(self, group_id: int, index: int, ttype: TaskTypeConfig, prompt: int,
                    is_eval: bool) -> SimTrajectory:
        rng = random.Random((self.seed * 1_000_003 + group_id) * 1009 + index)
        needed = max(1, round(_lognormal(rng, ttype.base_turns)))
        gen: List[int] = []
        obs: List[int] = []
        env: List[float] = []
        context = prompt
        done_useful = 0
        while done_useful < needed and len(gen) < ttype.max_turns:
            g = max(1, round(_lognormal(rng, ttype.gen_tokens_per_turn)))
            o = max(1, round(_lognormal(rng, ttype.obs_tokens_per_turn)))
            if context + g + o > ttype.max_context_tokens:
                break
            gen.append(g)
            obs.append(o)
            env.append(_lognormal(rng, ttype.env_step_s))
            context += g + o
            if rng.random() >= ttype.wrong_action_prob:
                done_useful += 1
        if not gen:  # the prompt alone fills the context: one short answer
            gen, obs, env = [1], [1], [_lognormal(rng, ttype.env_step_s)]
        return SimTrajectory(
            traj_id=group_id * 1024 + index,
            group_id=group_id,
            index=index,
            task_type=ttype.name,
            is_eval=is_eval,
            prompt_tokens=prompt,
            gen=gen,
            obs=obs,
            env_s=env,
            reset_s=_lognormal(rng, ttype.env_reset_s),
            context=prompt,
        )

    def group_shape(self, group_id: int) -> tuple[TaskTypeConfig, int]:
        """The task type and prompt tokens of group `group_id` (what its members share)."""
        rng = random.Random(self.seed * 7_919 + group_id)
        ttype = self._task_type(rng)
        return ttype, max(16, round(_lognormal(rng, ttype.prompt_tokens)))

    def trajectory(self, group_id: int, index: int, is_eval: bool = False) -> SimTrajectory:
        """Member `index` of group `group_id`, as `next_train_group` / `next_eval_group` draw it
        (the emulated `workload` env replays these)."""
        ttype, prompt = self.group_shape(group_id)
        return self._trajectory(group_id, index, ttype, prompt, is_eval)

    def _group(self, group_id: int, size: int, is_eval: bool) -> Group:
        ttype, prompt = self.group_shape(group_id)
        trajs = [self._trajectory(group_id, i, ttype, prompt, is_eval) for i in range(size)]
        return Group(group_id=group_id, trajectories=trajs, is_eval=is_eval)

    def next_train_group(self) -> Group:
        gid = self._next_group
        self._next_group += 1
        return self._group(gid, self.cfg.group_size, is_eval=False)

    @property
    def groups_drawn(self) -> int:
        """Training groups handed out so far."""
        return self._next_group

    def next_eval_group(self) -> Group:
        """Evaluation tasks: one trajectory each, ids in a separate range from training tasks."""
        gid = EVAL_GROUP_BASE + self._next_eval
        self._next_eval += 1
        return self._group(gid, 1, is_eval=True)

    def is_eval_step(self, step: int) -> bool:
        """Whether an evaluation phase follows training step `step` (1-based; step 0 = start)."""
        k = self.cfg.eval_every
        return k > 0 and step % k == 0

    def sample_stats(self, n_groups: int = 256) -> dict:
        """Mean shape of the task stream, from a throw-away sample (same seed, other ids)."""
        probe = WorkloadModel(self.cfg, self.seed + 99_991)
        trajs = [t for _ in range(n_groups) for t in probe.next_train_group().trajectories]
        n = len(trajs)
        return {
            "turns": sum(t.n_turns for t in trajs) / n,
            "gen_tokens": sum(t.generated_tokens for t in trajs) / n,
            "total_tokens": sum(t.total_tokens for t in trajs) / n,
            "max_turns": max(t.n_turns for t in trajs),
            "env_s": sum(sum(t.env_s) + t.reset_s for t in trajs) / n,
        }
