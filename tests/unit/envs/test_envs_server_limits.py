"""The hardened env server, in process: token, ownership, caps, limits, timeouts, NaN refusal,
pagination, fair workers. Raw sockets play the misbehaving clients."""

import asyncio
import json
import logging
import threading

import pytest

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvProtocolError, EnvRemoteError, EnvServer, EnvServerConfig,
    EnvServerLimits,
)
from tide_megatron.envs.config import DoorGameConfig
from tide_megatron.envs.fair_executor import FairExecutor
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.registry import register_env
from tide_megatron.envs.server_connection import RateLimitedLog

TOKEN = "a-shared-token-of-24-chars"


class OddEnv(Env):
    """Steps answer by action: `nan`/`inf` rewards, `nan-info`, `big` (a 200 KB observation)."""

    def list_tasks(self, split):
        return [self.task("t/0")]

    def task(self, task_id):
        if task_id != "t/0":
            raise KeyError(task_id)
        return TaskSpec("odd", task_id, "odd/any")

    def reset(self, task_id, trajectory_id):
        return ResetResult("start")

    def step(self, action):
        if action in ("nan", "inf"):
            return StepResult("o", float(action), False)
        if action == "nan-info":
            return StepResult("o", 0.0, False, {"score": [1.0, float("nan")]})
        if action == "big":
            return StepResult("x" * 200_000, 0.0, False)
        return StepResult("fine", 0.5, False)


register_env("odd", lambda cfg: OddEnv())


def serve(main, **cfg_kw):
    limits = cfg_kw.pop("limits", EnvServerLimits())
    envs = cfg_kw.pop("envs", [EnvConfig(name="door_game"), EnvConfig(name="odd")])
    cfg = EnvServerConfig(envs=envs, limits=limits, **cfg_kw)

    async def wrapped():
        async with EnvServer(cfg) as server:
            await main(server)
    asyncio.run(wrapped())


async def raw(server):
    return await asyncio.open_connection("127.0.0.1", server.port)


async def ask(conn, message, timeout=5.0):
    reader, writer = conn
    writer.write(message if isinstance(message, bytes) else (json.dumps(message) + "\n").encode())
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), timeout)
    return json.loads(line) if line else None


async def closed(conn, timeout=5.0):
    """True when the server closes the connection within `timeout`."""
    try:
        return await asyncio.wait_for(conn[0].read(1 << 20), timeout) == b""
    except ConnectionError:
        return True


def client(server, **kw):
    return EnvClient(EnvClientConfig(port=server.port, **kw))


def test_a_token_is_required_off_loopback_and_must_be_long():
    with pytest.raises(ValueError, match="without a shared token"):
        EnvServer(EnvServerConfig(host="0.0.0.0"))
    with pytest.raises(ValueError, match="at least 16"):
        EnvServer(EnvServerConfig(auth_token="short"))
    EnvServer(EnvServerConfig(host="0.0.0.0", auth_token=TOKEN))  # constructs; binding is not needed here


def test_token_gates_every_call(monkeypatch):
    async def main(server):
        conn = await raw(server)
        reply = await ask(conn, {"id": 1, "op": "envs", "args": {}})
        assert reply["error"]["type"] == "Unauthorized" and await closed(conn)
        conn = await raw(server)
        reply = await ask(conn, {"id": 2, "op": "hello", "args": {"token": TOKEN[:-1] + "x"}})
        assert reply["error"]["type"] == "Unauthorized" and reply["id"] == 2 and await closed(conn)
        async with client(server, auth_token=TOKEN) as good:
            assert "door_game" in await good.envs()
        with pytest.raises(EnvRemoteError) as e:
            await client(server, auth_token="wrong-token-wrong-token").envs()
        assert e.value.kind == "Unauthorized"
        monkeypatch.setenv("TIDE_ENV_TOKEN", TOKEN)  # the client's fallback
        async with client(server) as from_env:
            assert "odd" in await from_env.envs()
    serve(main, auth_token=TOKEN)


def test_sessions_belong_to_their_connection():
    async def main(server):
        async with client(server) as owner, client(server) as thief:
            first = await owner.reset("door_game", "train/0", "t")
            assert first.session_id.startswith("s-") and len(first.session_id) >= 26
            for attempt in (thief.step(first.session_id, "red"),
                            thief.call("image", {"session_id": first.session_id, "image_id": "x"}, "image")):
                with pytest.raises(EnvRemoteError) as e:
                    await attempt
                assert e.value.kind == "UnknownSession" and "never opened here" in e.value.message
            await thief.close_session(first.session_id)  # no effect on another connection's session
            assert not (await owner.step(first.session_id, "red")).observation == ""
            second = await owner.reset("door_game", "train/0", "t2")
            assert second.session_id != first.session_id
    serve(main)


def test_session_and_connection_caps():
    async def main(server):
        async with client(server) as greedy, client(server) as other:
            for i in range(3):
                await greedy.reset("door_game", "train/0", f"g{i}")
            with pytest.raises(EnvRemoteError, match="max_sessions_per_connection=3") as e:
                await greedy.reset("door_game", "train/0", "g3")
            assert e.value.kind == "ServerBusy"
            await other.reset("door_game", "train/0", "o")  # others still get sessions
            extra = await raw(server)  # the third connection is over max_connections=2
            reply = await asyncio.wait_for(extra[0].readline(), 5)
            assert json.loads(reply)["error"]["type"] == "ServerBusy" and await closed(extra)
            assert (await other.stats())["refused_connections"] == 1
    serve(main, limits=EnvServerLimits(max_connections=2, max_sessions_per_connection=3))


@pytest.mark.parametrize("payload, kind, detail", [
    (b'{"id": 7, "op": "ping", "args": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}\n", "BadRequest", "max_depth"),
    (b'{"id": 7, "op": "ping", "args": {"x": ' + b"9" * 5000 + b"}}\n", "BadRequest", "a number of 5000"),
    (b'{"id": 7, "op": "ping", "args": {"x": NaN}}\n', "BadRequest", "NaN"),
    (b'{"id": 7, "op": "step", "args": {"session_id": "s", "action": "' + b"a" * 300_000 + b'"}}\n', "TooLarge",
     "max_request_bytes=262144"),
])
def test_bad_requests_get_an_error_reply_and_the_connection_goes_on(payload, kind, detail):
    async def main(server):
        conn = await raw(server)
        reply = await ask(conn, payload)
        assert reply["id"] == 7 and reply["error"]["type"] == kind and detail in reply["error"]["message"]
        assert (await ask(conn, {"id": 8, "op": "ping", "args": {}}))["result"]["server"] == "tide-env"
    serve(main, limits=EnvServerLimits(max_request_bytes=256 * 1024))


def test_half_sent_and_idle_connections_are_closed():
    async def main(server):
        half = await raw(server)
        half[1].write(b'{"id": 1, "op": "pi')
        idle = await raw(server)
        busy = await raw(server)
        reply = await ask(busy, {"id": 1, "op": "reset", "args": {"env": "door_game", "task_id": "train/0",
                                                                  "trajectory_id": "t"}})
        assert reply["ok"]
        assert await closed(half) and await closed(idle)
        await asyncio.sleep(0.6)
        assert (await ask(busy, {"id": 2, "op": "ping", "args": {}}))["ok"]  # holds a session: never idled out
    serve(main, limits=EnvServerLimits(read_timeout_s=0.3, idle_timeout_s=0.3))


def test_nan_rewards_are_refused_at_once_naming_env_and_task():
    async def main(server):
        async with client(server, call_timeout_s=5) as c:
            for action, detail in [("nan", "returned the reward nan"), ("inf", "returned the reward inf"),
                                   ("nan-info", r"NaN or infinity at result.info.score\[1\]")]:
                first = await c.reset("odd", "t/0", action)
                # An error reply: with no reply at all this would be EnvTimeout after call_timeout_s.
                with pytest.raises(EnvRemoteError, match=detail) as e:
                    await c.step(first.session_id, action)
                assert e.value.kind == "EnvFailure" and "env 'odd' task 't/0'" in e.value.message
                with pytest.raises(EnvRemoteError, match="is done"):
                    await c.step(first.session_id, "ok")
    serve(main)


def test_replies_over_the_limit_are_refused_not_dropped():
    async def main(server):
        async with client(server) as c:
            first = await c.reset("odd", "t/0", "t")
            with pytest.raises(EnvRemoteError, match="max_reply_bytes=100000") as e:
                await c.step(first.session_id, "big")
            assert e.value.kind == "TooLarge"
            assert (await c.step(first.session_id, "ok")).reward == 0.5
    serve(main, limits=EnvServerLimits(max_reply_bytes=100_000))


def test_tasks_are_paginated_by_count_and_bytes():
    envs = [EnvConfig(name="door_game", door_game=DoorGameConfig(num_train_tasks=2500))]

    async def main(server):
        conn = await raw(server)
        reply = await ask(conn, {"id": 1, "op": "tasks", "args": {"env": "door_game", "limit": 1 << 40}})
        page = reply["result"]
        assert len(page["tasks"]) <= 300 and page["total"] == 2500 and page["next_offset"] == len(page["tasks"])
        assert len(json.dumps(page["tasks"], separators=(",", ":"))) <= 8192
        async with client(server) as c:
            tasks = await c.list_tasks("door_game")
            assert [t.task_id for t in tasks] == [f"train/{i}" for i in range(2500)]
            assert [t.task_id for t in await c.list_tasks("door_game", offset=2490, limit=5)] == [
                f"train/{i}" for i in range(2490, 2495)]
    serve(main, envs=envs, limits=EnvServerLimits(max_tasks_page=300, max_page_bytes=8192))


def test_a_reply_with_nan_from_an_external_server_fails_only_its_call():
    async def handle(reader, writer):
        while line := await reader.readline():
            req = json.loads(line)
            result = {"observation": "o", "reward": float("nan"), "done": False, "info": {}, "latency_s": 0}
            if req["op"] == "reset":
                result = {"observation": "o", "info": {}, "task_type": "x", "latency_s": 0, "session_id": "s1"}
            elif req["op"] == "ping":
                result = {"server": "other"}
            writer.write((json.dumps({"id": req["id"], "ok": True, "result": result}) + "\n").encode())
            await writer.drain()

    async def main():
        fake = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with fake, EnvClient(EnvClientConfig(port=fake.sockets[0].getsockname()[1])) as c:
            first = await c.reset("webshop", "train/3", "t")
            with pytest.raises(EnvProtocolError, match=r"step\(env=webshop, task=train/3, session=s1\): non-finite"):
                await c.step(first.session_id, "buy")
            assert (await c.ping())["server"] == "other"  # same connection, still in use
    asyncio.run(main())


def test_fair_executor_takes_turns_between_owners():
    order, gate = [], threading.Event()

    def job(name):
        gate.wait(5)
        order.append(name)

    async def main():
        fair = FairExecutor(1)
        flood = [asyncio.create_task(fair.run("A", job, f"A{i}")) for i in range(6)]
        await asyncio.sleep(0.05)
        polite = asyncio.create_task(fair.run("B", job, "B0"))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*flood, polite)
        fair.shutdown()

    asyncio.run(main())
    assert order.index("B0") <= 2  # after at most the running job and one turn of A, not after all six


def test_rate_limited_log_counts_what_it_drops(caplog):
    log = RateLimitedLog(interval_s=60)
    with caplog.at_level(logging.WARNING, logger="tide_megatron.envs.server"):
        for _ in range(500):
            log.warning("accept", "accept failed")
        log.warning("other", "other thing")
    assert [r.getMessage() for r in caplog.records] == ["accept failed", "other thing"]
    log._last["accept"] -= 61
    with caplog.at_level(logging.WARNING, logger="tide_megatron.envs.server"):
        log.warning("accept", "accept failed")
    assert caplog.records[-1].getMessage() == "accept failed (499 more like it in the last 60 s)"
