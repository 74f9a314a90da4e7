import random
import statistics

import pytest

from tide_megatron.envs.config import DoorGameConfig, EnvConfig
from tide_megatron.envs.door_game import (
    COLOURS, DoorGameEnv, bigram_similarity, build_door_task, near_miss_similarity, parse_door,
)


def play(env, task_id, policy):
    env.reset(task_id, "t")
    total, turns = 0.0, 0
    while True:
        res = env.step(policy(env))
        total += res.reward
        turns += 1
        if res.done:
            assert res.info["episode_return"] == pytest.approx(total)
            return total, turns, res


def test_task_is_a_pure_function_of_its_id():
    cfg = DoorGameConfig()
    assert build_door_task(cfg, "door_game", "train/5") == build_door_task(cfg, "door_game", "train/5")
    assert build_door_task(cfg, "door_game", "train/5") != build_door_task(cfg, "door_game", "train/6")
    env_a, env_b = DoorGameEnv(EnvConfig()), DoorGameEnv(EnvConfig())
    # Group members (different trajectory ids) share the first observation exactly.
    assert env_a.reset("eval/3", "g0-t0").observation == env_b.reset("eval/3", "g0-t1").observation


def test_unknown_task_ids_raise_key_error():
    env = DoorGameEnv(EnvConfig())
    for bad in ["train/10000", "test/1", "train", "train/x"]:
        with pytest.raises(KeyError):
            env.task(bad)


def test_task_types_and_pools():
    env = DoorGameEnv(EnvConfig(door_game=DoorGameConfig(num_train_tasks=50, num_eval_tasks=7)))
    tasks = env.list_tasks("train")
    assert len(tasks) == 50 and len(env.list_tasks("eval")) == 7
    assert {t.task_type for t in tasks} == {"door_game/rooms2", "door_game/rooms3"}
    assert all(t.split == "train" and t.env == "door_game" for t in tasks)


def test_perfect_policy_scores_one_in_as_many_turns_as_rooms():
    env = DoorGameEnv(EnvConfig())
    for i in range(50):
        total, turns, res = play(env, f"train/{i}", lambda e: f"I open the {e.solution()} door.")
        assert total == pytest.approx(1.0)
        assert res.info["won"] and turns == res.info["rooms_solved"]


def test_random_policy_scores_between_point_one_and_point_three():
    env = DoorGameEnv(EnvConfig())
    rng = random.Random(0)
    returns, turns = [], set()
    for i in range(1500):
        total, n, _ = play(env, f"train/{i}", lambda e: rng.choice(e.current_doors()))
        returns.append(total)
        turns.add(n)
    mean = statistics.mean(returns)
    assert 0.1 <= mean <= 0.3, mean
    assert statistics.pstdev(returns) > 0.1  # GRPO needs spread within groups
    assert turns == {2, 3, 4}  # turn counts vary with play


def test_random_text_gets_small_varying_credit():
    env = DoorGameEnv(EnvConfig())
    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz   "
    returns = [play(env, f"train/{i}", lambda e: "".join(rng.choice(letters) for _ in range(20)))[0] for i in range(300)]
    assert 0 < max(returns) < 0.2
    assert len(set(returns)) > 10


def test_retry_credit_and_messages():
    env = DoorGameEnv(EnvConfig(door_game=DoorGameConfig(min_rooms=2, max_rooms=2)))
    env.reset("train/0", "t")
    wrong = next(d for d in env.current_doors() if d != env.solution())
    r1 = env.step(wrong)
    assert r1.reward == 0 and not r1.done and "locked" in r1.observation and "Room 1 of 2" in r1.observation
    r2 = env.step(env.solution())
    assert r2.reward == pytest.approx(0.25)  # half of a room's share after a wrong try
    missing = next(c for c in COLOURS if c not in env.current_doors())
    r3 = env.step(f"{missing}!")
    assert r3.done and not r3.info["won"] and f"no {missing} door" in r3.observation
    with pytest.raises(RuntimeError):
        env.step("red")


def test_parsing_and_similarity():
    assert parse_door("I think BLUE, then red") == "blue"
    assert parse_door("bluebell") is None and parse_door("") is None
    assert bigram_similarity("blue", "blue") == 1.0 and bigram_similarity("x", "blue") == 0.0
    assert 0 < near_miss_similarity("glue", "blue") < 1
    assert near_miss_similarity("", "blue") == 0.0
