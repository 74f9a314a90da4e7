"""The real env server in a subprocess, played through the asyncio client."""

import asyncio
import re

import pytest

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvRemoteError, EnvServerConfig, EnvServerDown, EnvServerProcess,
    EnvServerProcessConfig, LatencyConfig, TextWorldConfig,
)
from tide_megatron.envs.door_game import INDIRECT_CLUES

pytestmark = pytest.mark.integration

_CLUE_TO_DOOR = {clue: door for door, clues in INDIRECT_CLUES.items() for clue in clues}


def solve_door_observation(text: str) -> str:
    """A scripted perfect door_game player that reads only the observation text, as a model would."""
    clue = re.findall(r"Clue: the way on is (.*?)\.$", text, re.M)[-1]
    direct = re.fullmatch(r"the (\w+) door", clue)
    return direct.group(1) if direct else _CLUE_TO_DOOR[clue]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = EnvServerConfig(envs=[
        EnvConfig(name="door_game"),
        EnvConfig(name="door_game", served_name="door_remote",
                  latency=LatencyConfig(enabled=True, seed=1, reset_median_s=0.02, step_median_s=0.02,
                                        slow_step_prob=0.05, slow_step_factor=10, extra_turns_mean=1.0)),
        EnvConfig(name="textworld", textworld=TextWorldConfig(
            cache_dir=str(tmp_path_factory.mktemp("tw")), max_rooms=2, max_quest_length=2, list_commands_in_text=True)),
    ])
    log = tmp_path_factory.mktemp("log") / "env_server.log"
    with EnvServerProcess(cfg, EnvServerProcessConfig(log_path=str(log))) as proc:
        yield proc


async def play_door(client, env, task_id, trajectory_id):
    async with client.session(env, task_id, trajectory_id) as first:
        obs, total, turns = first.observation, 0.0, 0
        while True:
            res = await client.step(first.session_id, solve_door_observation(obs))
            obs, total, turns = res.observation, total + res.reward, turns + 1
            if res.done:
                return first, total, turns, res


def test_server_binds_loopback_and_lists_envs(server):
    assert server.host == "127.0.0.1" and server.port > 0

    async def main():
        async with EnvClient(server.client_config()) as client:
            assert await client.envs() == ["door_game", "door_remote", "textworld"]
            tasks = await client.list_tasks("door_game", split="eval", offset=5, limit=10)
            assert [t.task_id for t in tasks] == [f"eval/{i}" for i in range(5, 15)]
            assert all(t.task_type.startswith("door_game/rooms") for t in tasks)
    asyncio.run(main())


def test_concurrent_groups_score_server_side(server):
    async def main():
        async with EnvClient(server.client_config()) as client:
            tasks = await client.list_tasks("door_remote", limit=8)
            results = await asyncio.gather(*[
                play_door(client, "door_remote", t.task_id, f"{t.task_id}#{g}") for t in tasks for g in range(4)
            ])
            stats = await client.stats()
        return tasks, results, stats

    tasks, results, stats = asyncio.run(main())
    assert len(results) == 32
    assert all(total == pytest.approx(1.0) and res.info["won"] for _, total, _, res in results)
    # The members of a group share their first observation; sessions are distinct.
    for i in range(8):
        group = results[4 * i : 4 * i + 4]
        assert len({first.observation for first, *_ in group}) == 1
        assert len({first.session_id for first, *_ in group}) == 4
    # Injected retry turns make turn counts vary per task beyond the room count.
    assert len({turns for _, _, turns, _ in results}) >= 3
    assert any(first.latency_s > 0 for first, *_ in results)
    assert stats["sessions"] == 0 and stats["steps"] >= 32


def test_sessions_die_with_their_connection(server):
    async def main():
        client = EnvClient(server.client_config())
        first = await client.reset("door_game", "train/1", "t")
        await client.close()  # drops the connection: the server closes its sessions
        async with EnvClient(server.client_config()) as other:
            for _ in range(50):
                if (await other.stats())["sessions"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await other.stats())["sessions"] == 0
            with pytest.raises(EnvRemoteError) as e:
                await other.step(first.session_id, "red")
            assert e.value.kind == "UnknownSession"
    asyncio.run(main())


def test_remote_errors_are_typed(server):
    async def main():
        async with EnvClient(server.client_config()) as client:
            with pytest.raises(EnvRemoteError) as e:
                await client.reset("webshop", "train/0", "t")
            assert e.value.kind == "UnknownEnv" and server.address in str(e.value) and "reset(env=webshop" in str(e.value)
            with pytest.raises(EnvRemoteError) as e:
                await client.reset("door_game", "train/99999999", "t")
            assert e.value.kind == "UnknownTask"
            _, _, _, res = await play_door(client, "door_game", "train/2", "t")
            first = await client.reset("door_game", "train/2", "t2")
            for _ in range(10):
                if (await client.step(first.session_id, "nothing")).done:
                    break
            with pytest.raises(EnvRemoteError) as e:
                await client.step(first.session_id, "red")
            assert e.value.kind == "EpisodeDone"
            with pytest.raises(EnvRemoteError) as e:
                await client.call("teleport", {}, "teleport")
            assert e.value.kind == "UnknownOp"
    asyncio.run(main())


def test_textworld_episode_through_the_server(server):
    async def main():
        async with EnvClient(server.client_config(EnvClientConfig(reset_timeout_s=60))) as client:
            (task,) = await client.list_tasks("textworld", limit=1)
            assert task.task_type.startswith("textworld/quest")
            first = await client.reset("textworld", task.task_id, "t0")
            again = await client.reset("textworld", task.task_id, "t1")  # cached game: same start
            assert first.observation == again.observation
            commands = first.info["admissible_commands"]
            assert commands and "Commands:" in first.observation
            res = await client.step(first.session_id, commands[0])
            assert isinstance(res.reward, float) and res.observation
            await client.close_session(first.session_id)
            await client.close_session(again.session_id)
    asyncio.run(main())


def test_sigterm_stops_the_server_cleanly():
    proc = EnvServerProcess(EnvServerConfig()).start()

    async def main():
        client = EnvClient(proc.client_config(EnvClientConfig(call_timeout_s=5)))
        first = await client.reset("door_game", "train/0", "t")
        assert proc.stop() == 0  # SIGTERM, graceful exit
        with pytest.raises(EnvServerDown) as e:
            await client.step(first.session_id, "red")
        assert proc.address in str(e.value) and "step(env=door_game, task=train/0, session=" in str(e.value)
        await client.close()
    asyncio.run(main())


def test_embedded_server_exits_when_its_launcher_is_killed():
    import os
    import subprocess
    import sys
    import time

    launcher = (
        "import os, signal\n"
        "from tide_megatron.envs import EnvServerConfig, EnvServerProcess\n"
        "p = EnvServerProcess(EnvServerConfig()).start()\n"
        "print(p.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"  # no chance to stop() the server
    )
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    server_pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(server_pid, 9)
    pytest.fail("orphaned env server kept running after its launcher died")


def test_the_server_starts_beside_more_than_1024_open_descriptors():
    """Rank 0 of a 64-rank job holds over 1,024 sockets (gloo's, to every rank of each process
    group), so the server's ready pipe gets a descriptor number that select() refuses."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1100
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this host allows {hard} open descriptors, fewer than {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need) if soft != resource.RLIM_INFINITY else soft, hard))
    held = []
    try:
        while not held or held[-1] < 1030:  # the next descriptor opened is above 1,024
            held.append(os.open(os.devnull, os.O_RDONLY))
        with EnvServerProcess(EnvServerConfig()) as proc:
            assert proc.port > 0
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
