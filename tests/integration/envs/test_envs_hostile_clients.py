"""A real env server process under a crowd of hostile clients keeps serving a polite one.

The attacks replay the probes of issue 13: half-sent messages, idle connections past the
connection cap, session theft, oversized requests and replies, a pipelining flood that never
reads its replies, deep nesting and huge integers. Meanwhile a well-behaved client plays door
game episodes and pings; every one of its calls must succeed within its ordinary timeout.
"""

import asyncio
import json
import os
import re

import pytest

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvServerConfig, EnvServerLimits, EnvServerProcess,
    EnvServerProcessConfig,
)
from tide_megatron.envs.config import DoorGameConfig
from tide_megatron.envs.door_game import INDIRECT_CLUES

pytestmark = pytest.mark.integration

_CLUE_TO_DOOR = {clue: door for door, clues in INDIRECT_CLUES.items() for clue in clues}
LIMITS = EnvServerLimits(max_connections=48, max_sessions_per_connection=8, max_inflight_per_connection=16,
                         max_request_bytes=64 * 1024, read_timeout_s=2.0, idle_timeout_s=3.0, write_timeout_s=3.0,
                         max_page_bytes=128 * 1024, log_interval_s=5.0)


def solve(text: str) -> str:
    clue = re.findall(r"Clue: the way on is (.*?)\.$", text, re.M)[-1]
    direct = re.fullmatch(r"the (\w+) door", clue)
    return direct.group(1) if direct else _CLUE_TO_DOOR[clue]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


async def connect(port):
    return await asyncio.open_connection("127.0.0.1", port, limit=4 << 20)


async def half_sent(port, n):
    conns = []
    for _ in range(n):
        try:
            r, w = await connect(port)
            w.write(b'{"id": 1, "op": "tasks", "args": {"env": "door_ga')
            conns.append((r, w))
        except OSError:
            pass
    closed = 0
    for r, _ in conns:
        try:
            closed += await asyncio.wait_for(r.read(), 15) is not None
        except (ConnectionError, asyncio.TimeoutError):
            closed += 1
    return closed, len(conns)


async def idle_crowd(port, n):
    refused = 0
    conns = []
    for _ in range(n):
        try:
            conns.append(await connect(port))
        except OSError:
            refused += 1
    for r, w in conns:
        try:
            line = await asyncio.wait_for(r.read(), 15)
            refused += b"ServerBusy" in line
        except (ConnectionError, asyncio.TimeoutError):
            pass
        w.close()
    return refused


async def thief(port, victim_ids):
    r, w = await connect(port)
    answers = []
    for i, sid in enumerate(victim_ids):
        for op in ("step", "close"):
            w.write((json.dumps({"id": i, "op": op, "args": {"session_id": sid, "action": "red"}}) + "\n").encode())
            await w.drain()
            answers.append(json.loads(await r.readline()))
    w.close()
    return answers


async def malformed(port):
    r, w = await connect(port)
    kinds = []
    payloads = ([b'{"id": 5, "op": "ping", "args": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}\n"] * 20
                + [b'{"id": 5, "op": "ping", "args": {"x": ' + b"9" * 5000 + b"}}\n"] * 20
                + [b'{"id": 5, "op": "step", "args": {"action": "' + b"x" * 200_000 + b'"}}\n'] * 10)
    for p in payloads:
        w.write(p)
        await w.drain()
        kinds.append(json.loads(await asyncio.wait_for(r.readline(), 15))["error"]["type"])
    w.write(b'{"id": 6, "op": "ping", "args": {}}\n')
    await w.drain()
    alive = json.loads(await asyncio.wait_for(r.readline(), 15))["ok"]
    w.write(b'{"id": 7, "op": "tasks", "args": {"env": "door_game", "limit": 1000000000}}\n')
    await w.drain()
    page = await asyncio.wait_for(r.readline(), 15)
    w.close()
    return kinds, alive, len(page)


async def pipelined_flood(port, seconds=20.0):
    """Pipeline tasks calls and never read a reply; True once the server drops the connection."""
    loop = asyncio.get_running_loop()
    _, w = await asyncio.open_connection("127.0.0.1", port, limit=64 * 1024)
    requests = b'{"id": 1, "op": "tasks", "args": {"env": "door_game", "limit": 100000}}\n' * 50
    deadline = loop.time() + seconds
    try:
        while loop.time() < deadline:
            w.write(requests)
            await asyncio.wait_for(w.drain(), max(0.1, deadline - loop.time()))
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        w.close()
    return False


async def polite(client, rounds):
    """Door game episodes and pings; every call must succeed."""
    won = pings = 0
    for k in range(rounds):
        async with client.session("door_game", f"train/{k}", f"polite-{k}") as first:
            obs = first.observation
            while True:
                res = await client.step(first.session_id, solve(obs))
                obs = res.observation
                if res.done:
                    won += res.info["won"]
                    break
        await client.ping()
        pings += 1
        await asyncio.sleep(0.1)
    return won, pings


def test_hostile_clients_cannot_starve_a_polite_one(tmp_path):
    cfg = EnvServerConfig(envs=[EnvConfig(name="door_game", door_game=DoorGameConfig(num_train_tasks=10_000))],
                          limits=LIMITS, num_workers=2)
    log = tmp_path / "server.log"
    with EnvServerProcess(cfg, EnvServerProcessConfig(log_path=str(log))) as proc:
        rss_before = rss_mb(proc.pid)

        async def main():
            async with EnvClient(proc.client_config(EnvClientConfig(call_timeout_s=10))) as client:
                held = [await client.reset("door_game", "train/9", f"held-{i}") for i in range(3)]
                attacks = asyncio.gather(
                    half_sent(proc.port, 20), idle_crowd(proc.port, 60), thief(proc.port, [h.session_id for h in held]),
                    malformed(proc.port), pipelined_flood(proc.port), pipelined_flood(proc.port))
                good = asyncio.create_task(polite(client, 25))
                results = await attacks
                won, pings = await good
                for h in held:  # the theft attempts left the victim's sessions alone
                    assert not (await client.step(h.session_id, "red")).observation == ""
                return results, won, pings, await client.stats()

        (half, refused, stolen, (kinds, alive, page_len), flood1, flood2), won, pings, stats = asyncio.run(main())
        rss_after = rss_mb(proc.pid)
    assert won == 25 and pings == 25
    assert half[0] == half[1] > 0  # every half-sent connection was closed
    assert refused > 0 and stats["refused_connections"] > 0  # past max_connections: a ServerBusy line, then close
    assert all(a["error"]["type"] == "UnknownSession" for a in stolen if not a["ok"])
    assert all(a["ok"] or a["error"]["type"] == "UnknownSession" for a in stolen)  # close answers {} and does nothing
    assert kinds == ["BadRequest"] * 40 + ["TooLarge"] * 10 and alive
    assert page_len <= 128 * 1024 + 200  # a tasks reply is one bounded page
    assert flood1 and flood2  # the flooders were dropped for not reading
    assert rss_after - rss_before < 300, (rss_before, rss_after)
    text = log.read_text()
    assert text.count("sent part of a request") <= 3  # rate-limited: one line per interval, not per event
    print(f"\nenv server RSS {rss_before:.0f} -> {rss_after:.0f} MB; log {os.path.getsize(log)} bytes")
