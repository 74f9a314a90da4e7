"""Client failure modes: server down, slow past the timeout, garbage from a fake server."""

import asyncio

import pytest

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvProtocolError, EnvRemoteError, EnvServer, EnvServerConfig,
    EnvServerDown, EnvTimeout, LatencyConfig,
)
from tide_megatron.utils.net import free_port

pytestmark = pytest.mark.integration


def test_server_down_names_address_and_call():
    port = free_port()

    async def main():
        client = EnvClient(EnvClientConfig(port=port, connect_timeout_s=2, max_retries=2, backoff_initial_s=0.05))
        with pytest.raises(EnvServerDown) as e:
            await client.reset("door_game", "train/0", "t")
        assert f"127.0.0.1:{port}" in str(e.value) and e.value.call == "reset(env=door_game, task=train/0, trajectory=t)"
        assert "cannot connect" in e.value.detail and "gave up after 3 attempts" in e.value.detail
    asyncio.run(main())


def test_slow_step_past_timeout_raises_env_timeout():
    slow = LatencyConfig(enabled=True, reset_median_s=0.0, step_median_s=2.0, step_sigma=0.0, task_speed_sigma=0.0,
                         slow_step_prob=0.0)
    cfg = EnvServerConfig(envs=[EnvConfig(name="door_game", latency=slow)])

    async def main():
        async with EnvServer(cfg) as server:
            async with EnvClient(EnvClientConfig(port=server.port, call_timeout_s=0.3)) as client:
                first = await client.reset("door_game", "train/0", "t")
                with pytest.raises(EnvTimeout) as e:
                    await client.step(first.session_id, "red")
                assert e.value.timeout_s == 0.3 and f"step(env=door_game, task=train/0, session={first.session_id})" in str(e.value)
                # The connection survives a timeout; other calls still work.
                assert (await client.ping())["server"] == "tide-env"
    asyncio.run(main())


def test_server_busy_past_max_sessions():
    async def main():
        async with EnvServer(EnvServerConfig(max_sessions=1)) as server:
            async with EnvClient(EnvClientConfig(port=server.port)) as client:
                await client.reset("door_game", "train/0", "a")
                with pytest.raises(EnvRemoteError) as e:
                    await client.reset("door_game", "train/0", "b")
                assert e.value.kind == "ServerBusy"
    asyncio.run(main())


def test_bad_request_gets_an_error_reply_not_a_dropped_connection():
    async def main():
        async with EnvServer(EnvServerConfig()) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"this is not json\n")
            writer.write(b'{"id": 4, "op": "step", "args": {"session_id": 5}}\n')
            await writer.drain()
            first, second = await reader.readline(), await reader.readline()
            assert b"BadRequest" in first and b'"id":-1' in first
            assert b"BadRequest" in second and b'"id":4' in second
            writer.close()
    asyncio.run(main())


async def fake_server(reply_for):
    """A TCP server that answers each request line with reply_for(line) (raw bytes, or None to hang up)."""
    async def handle(reader, writer):
        while line := await reader.readline():
            reply = reply_for(line)
            if reply is None:
                break
            writer.write(reply)
            await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("reply, detail", [
    (b"<html>502 Bad Gateway</html>\n", "not JSON"),
    (b'{"id": 1, "ok": "yes"}\n', "ok must be a bool"),
    (b'{"id": 1, "ok": true, "result": {"observation": 3, "info": {}}}\n', "malformed result"),
    (b'{"id": 1, "ok": true, "result": {"observation": "o", "info": {}, "task_type": "", "latency_s": 0}}\n', "session_id"),
])
def test_malformed_data_raises_protocol_error(reply, detail):
    async def main():
        server = await fake_server(lambda line: reply)
        port = server.sockets[0].getsockname()[1]
        async with server:
            client = EnvClient(EnvClientConfig(port=port, call_timeout_s=2))
            with pytest.raises(EnvProtocolError) as e:
                await client.reset("door_game", "train/0", "t")
            assert detail in str(e.value) and f"127.0.0.1:{port}" in str(e.value) and "reset(env=door_game" in str(e.value)
            await client.close()
    asyncio.run(main())


def test_hang_up_mid_call_raises_server_down():
    async def main():
        server = await fake_server(lambda line: None)
        port = server.sockets[0].getsockname()[1]
        async with server:
            client = EnvClient(EnvClientConfig(port=port, call_timeout_s=2))
            with pytest.raises(EnvServerDown) as e:
                await client.step("s1", "red")
            assert e.value.call == "step(session=s1)"
            await client.close()
    asyncio.run(main())
