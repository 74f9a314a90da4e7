"""Issue 39 item 3: hostile input gets a clear answer.

A malformed task id (5,000 digits, a non-ASCII digit) is `BadRequest` naming `task_id`, never
an `EnvFailure` carrying Python's ValueError; and a burst of clients past `max_connections`
each read either a reply or one `ServerBusy` line, never a connection reset.
"""

import asyncio
import collections
import json
import socket

import pytest

from tide_megatron.envs import EnvConfig, EnvServer, EnvServerConfig, EnvServerLimits
from tide_megatron.envs.door_game import DoorGameEnv
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.registry import register_env
from tide_megatron.envs.task_ids import MAX_INDEX_DIGITS, MalformedTaskId, parse_task_id

POOLS = {"train": 100, "eval": 10}


class IntIdEnv(Env):
    """A plugin env whose ids are bare integers, parsed with int(): what a third-party adapter
    may well do. Its ValueError on a bad id must still reach the client as `BadRequest`."""

    def list_tasks(self, split):
        return [self.task("1")]

    def task(self, task_id):
        if int(task_id) != 1:
            raise KeyError(f"no task {task_id}")
        return TaskSpec("int_ids", task_id, "int_ids/any")

    def reset(self, task_id, trajectory_id):
        return ResetResult("start")

    def step(self, action):
        return StepResult("o", 0.0, True)


register_env("int_ids", lambda cfg: IntIdEnv())


@pytest.mark.parametrize("task_id", [
    "train/" + "1" * 5000,  # int() refuses it with ValueError past 4,300 digits
    "train/" + "9" * (MAX_INDEX_DIGITS + 1),
    "train/²",  # str.isdigit() is True, int() raises
    "train/١",  # Arabic-Indic one: int() would take it as 1
    "train/01", "train/+1", "train/-1", "train/ 1", "train/1 ", "train/", "train", "1" * 5000, "",
])
def test_malformed_task_ids_raise_malformed_task_id(task_id):
    with pytest.raises(MalformedTaskId) as e:
        parse_task_id(task_id, POOLS)
    assert isinstance(e.value, KeyError)  # Env.task's contract: KeyError for a bad id
    assert len(e.value.args[0]) < 300  # the id is clipped, not echoed whole


def test_well_formed_task_ids_parse_and_unknown_ones_stay_key_errors():
    assert parse_task_id("train/0", POOLS) == ("train", 0)
    assert parse_task_id("eval/9", POOLS) == ("eval", 9)
    for unknown in ("train/100", "test/1", "eval/" + "9" * MAX_INDEX_DIGITS):
        with pytest.raises(KeyError) as e:
            parse_task_id(unknown, POOLS)
        assert not isinstance(e.value, MalformedTaskId)


def serve(main, **cfg_kw):
    cfg = EnvServerConfig(envs=cfg_kw.pop("envs", [EnvConfig(name="door_game"), EnvConfig(name="int_ids")]),
                          **cfg_kw)

    async def wrapped():
        async with EnvServer(cfg) as server:
            await main(server)
    asyncio.run(wrapped())


async def call(conn, message):
    reader, writer = conn
    writer.write((json.dumps(message) + "\n").encode())
    await writer.drain()
    return json.loads(await asyncio.wait_for(reader.readline(), 10))


@pytest.mark.parametrize("env, task_id", [
    ("door_game", "train/" + "1" * 5000), ("door_game", "train/²"), ("door_game", "train/١"),
    ("door_game", "eval/0007"), ("int_ids", "1" * 5000), ("int_ids", "²"),
])
def test_a_malformed_task_id_is_a_bad_request_naming_the_field(env, task_id):
    async def main(server):
        conn = await asyncio.open_connection("127.0.0.1", server.port)
        reply = await call(conn, {"id": 3, "op": "reset", "args": {"env": env, "task_id": task_id,
                                                                    "trajectory_id": "t"}})
        assert reply["id"] == 3 and reply["error"]["type"] == "BadRequest", reply
        assert "'task_id'" in reply["error"]["message"] and len(reply["error"]["message"]) < 400
        # Still a well-formed id of no task is UnknownTask, and the connection goes on.
        reply = await call(conn, {"id": 4, "op": "reset", "args": {"env": env, "task_id": "train/99999" if
                                                                    env == "door_game" else "2", "trajectory_id": "t"}})
        assert reply["error"]["type"] == "UnknownTask"
        reply = await call(conn, {"id": 5, "op": "reset", "args": {"env": env, "task_id": "train/1" if
                                                                    env == "door_game" else "1", "trajectory_id": "t"}})
        assert reply["ok"], reply
        stats = await call(conn, {"id": 6, "op": "stats", "args": {}})
        assert stats["result"]["sessions"] == 1  # the refused resets left nothing open
        conn[1].close()
    serve(main)


def test_door_game_env_refuses_non_ascii_digits_itself():
    env = DoorGameEnv(EnvConfig())
    with pytest.raises(MalformedTaskId):
        env.task("train/١")  # would otherwise be a second id of train/1


async def burst(port: int, n: int) -> collections.Counter:
    """`n` clients connect and send a ping before the server accepts any (blocking sockets:
    the kernel completes each connection in the listen backlog and queues its ping, while the
    event loop is held), then read their replies only after every refusal is done: the order
    in which a server that closes a refused connection with its request unread resets it."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b'{"id": 1, "op": "ping", "args": {}}\n')
        socks.append(sock)
    conns = []
    for sock in socks:
        sock.setblocking(False)
        conns.append(await asyncio.open_connection(sock=sock))
    await asyncio.sleep(0.3)  # every refusal is done, and seen by the client, before anyone reads
    seen: collections.Counter = collections.Counter()
    for reader, _ in conns:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            reply = json.loads(line) if line else None
            seen["ok" if reply and reply["ok"] else reply["error"]["type"] if reply else "eof"] += 1
        except ConnectionResetError:
            seen["reset"] += 1
    for _, writer in conns:
        writer.close()
    return seen


def test_clients_over_the_connection_cap_read_server_busy_never_a_reset():
    async def main(server):
        for _ in range(2):
            seen = await burst(server.port, 60)
            assert seen == {"ok": 8, "ServerBusy": 52}, seen
            for _ in range(100):  # the served ones close; the server notices before the next round
                if not server._connections:
                    break
                await asyncio.sleep(0.02)
        assert server.counts["refused_connections"] == 104
    serve(main, limits=EnvServerLimits(max_connections=8, refusal_linger_s=5.0))


def test_refusals_past_the_linger_cap_still_end_cleanly():
    async def main(server):
        seen = await burst(server.port, 40)
        assert seen == {"ok": 4, "ServerBusy": 36}, seen
    serve(main, limits=EnvServerLimits(max_connections=4, max_lingering_refusals=0))


def test_a_refused_client_that_never_closes_is_let_go_after_the_linger():
    async def main(server):
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert b"ServerBusy" in await asyncio.wait_for(reader.readline(), 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # FIN right after the line
        assert server._lingering == 1  # its side still open: the server waits for it
        for _ in range(250):
            if not server._lingering:
                break
            await asyncio.sleep(0.02)
        assert server._lingering == 0  # refusal_linger_s passed: let go
        writer.close()
        for _, w in held:
            w.close()
    serve(main, limits=EnvServerLimits(max_connections=2, refusal_linger_s=1.0))


def test_accept_backlog_is_the_listen_backlog(monkeypatch):
    seen = {}
    start_server = asyncio.start_server

    async def spy(*args, **kw):
        seen.update(kw)
        return await start_server(*args, **kw)
    monkeypatch.setattr(asyncio, "start_server", spy)

    async def main(server):
        assert seen["backlog"] == 777
    serve(main, accept_backlog=777)
    assert EnvServerConfig().accept_backlog >= 512  # a burst of hundreds of ranks fits
    with pytest.raises(ValueError, match="accept_backlog"):
        EnvServer(EnvServerConfig(accept_backlog=0))
