"""Emulated remote-environment latency and turn-count variation, for any env.

Remote agentic environments (a browser, a VM, a shop backend) answer slowly and unevenly:
most steps take tens of milliseconds to seconds, a few stall for much longer, some tasks are
slow throughout, and transient failures make the agent repeat itself. CTB, RA2P and ERS are
designed for exactly that spread, so the tiny recipe and the learning tests need it too.

`LatencyModel` draws, as pure functions of (seed, task, trajectory, turn):
- a per-task speed multiplier, lognormal(0, task_speed_sigma);
- each step's delay: step_median_s * speed * lognormal(0, step_sigma), times slow_step_factor
  with probability slow_step_prob, capped at max_delay_s;
- a per-task number of injected retry turns (Poisson, capped), placed before some of the first
  `extra_turns_within` real steps of each trajectory.

`LatencyEnv` wraps an env with it. It does not sleep: it records the delay in the result's
`latency_s` and the server awaits it without holding a thread, so thousands of slow sessions
cost nothing but timers. An injected retry turn swallows the action (the inner env never sees
it) and asks for it again, so the inner game's rules and rewards are unchanged; it repeats
the last observation, screenshots included.
"""

from __future__ import annotations

import math
import random

from tide_megatron.envs.config import LatencyConfig
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.task_ids import stable_seed

RETRY_TEXT = "[remote env] The action was not applied (the environment timed out). Send your action again."


class LatencyModel:
    """Deterministic draws of delays and extra turns."""

    def __init__(self, cfg: LatencyConfig, namespace: str = ""):
        self.cfg = cfg
        # The namespace (the served env name) keeps two envs with equal task ids apart.
        self._ns = namespace

    def _rng(self, *parts: object) -> random.Random:
        return random.Random(stable_seed("latency", self.cfg.seed, self._ns, *parts))

    def task_speed(self, task_id: str) -> float:
        """Multiplier of every step delay of this task (>1: a slow task)."""
        return math.exp(self._rng("speed", task_id).gauss(0.0, self.cfg.task_speed_sigma))

    def reset_delay_s(self, task_id: str, trajectory_id: str) -> float:
        rng = self._rng("reset", task_id, trajectory_id)
        delay = self.cfg.reset_median_s * math.exp(rng.gauss(0.0, self.cfg.step_sigma))
        return min(delay, self.cfg.max_delay_s) * self.cfg.time_scale

    def step_delay_s(self, task_id: str, trajectory_id: str, turn: int) -> float:
        rng = self._rng("step", task_id, trajectory_id, turn)
        delay = self.cfg.step_median_s * self.task_speed(task_id) * math.exp(rng.gauss(0.0, self.cfg.step_sigma))
        if rng.random() < self.cfg.slow_step_prob:
            delay *= self.cfg.slow_step_factor
        return min(delay, self.cfg.max_delay_s) * self.cfg.time_scale

    def extra_turns(self, task_id: str) -> int:
        """Injected retry turns of every trajectory of this task."""
        if self.cfg.extra_turns_mean <= 0:
            return 0
        return min(_poisson(self._rng("extra", task_id), self.cfg.extra_turns_mean), self.cfg.max_extra_turns)

    def retry_schedule(self, task_id: str, trajectory_id: str) -> list[int]:
        """For each real step index k < extra_turns_within, how many retry turns come before it."""
        within = max(1, self.cfg.extra_turns_within)
        schedule = [0] * within
        rng = self._rng("placement", task_id, trajectory_id)
        for _ in range(self.extra_turns(task_id)):
            schedule[rng.randrange(within)] += 1
        return schedule


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: fine for the small means used here.
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


class LatencyEnv(Env):
    """Any env, with emulated latency and retry turns."""

    def __init__(self, inner: Env, cfg: LatencyConfig, namespace: str = ""):
        self.inner = inner
        self.model = LatencyModel(cfg, namespace)
        self.blocking = inner.blocking
        self._task_id = ""
        self._trajectory_id = ""
        self._turn = 0  # every step call, retries included: the delay stream's index
        self._real_steps = 0  # steps forwarded to the inner env
        self._schedule: list[int] = []
        self._last_observation = ""
        self._last_images: list[bytes] = []

    def list_tasks(self, split: str) -> list[TaskSpec]:
        return self.inner.list_tasks(split)

    def task(self, task_id: str) -> TaskSpec:
        return self.inner.task(task_id)

    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        result = self.inner.reset(task_id, trajectory_id)
        self._task_id, self._trajectory_id = task_id, trajectory_id
        self._turn = 0
        self._real_steps = 0
        self._schedule = self.model.retry_schedule(task_id, trajectory_id)
        self._last_observation = result.observation
        self._last_images = list(result.image_data)
        result.latency_s = self.model.reset_delay_s(task_id, trajectory_id)
        result.info = {**result.info, "injected_retry_turns": sum(self._schedule)}
        return result

    def step(self, action: str) -> StepResult:
        delay = self.model.step_delay_s(self._task_id, self._trajectory_id, self._turn)
        self._turn += 1
        k = self._real_steps
        if k < len(self._schedule) and self._schedule[k] > 0:
            self._schedule[k] -= 1
            text = RETRY_TEXT + "\n" + self._last_observation
            return StepResult(observation=text, reward=0.0, done=False, info={"retry": True}, latency_s=delay,
                              image_data=list(self._last_images))
        self._real_steps += 1
        result = self.inner.step(action)
        self._last_observation = result.observation
        self._last_images = list(result.image_data)
        result.latency_s = delay
        return result

    def close(self) -> None:
        self.inner.close()
