"""The env server under the hostile probes of issues 13 and 39, with a polite client pinging throughout.

Each probe runs alone against a fresh `EnvServerProcess` (door_game, 10,000 train tasks,
default `EnvServerLimits` except shorter read/idle timeouts so the run stays short), while a
polite client pings every 50 ms (5 s timeout). Per probe it reports what the probe saw, the
polite pings (answered, timed out, p50/max latency), the server's RSS before and at peak, its
open descriptors and how many bytes it logged. Issue 39 added `malformed_task_ids` (every one
must be BadRequest naming task_id) and `connect_burst_x500` (resets must be 0).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_server_hostile.py          # about a minute
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_server_hostile.py --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tide_megatron.envs import (  # noqa: E402
    EnvClient, EnvClientConfig, EnvConfig, EnvServerConfig, EnvServerLimits, EnvServerProcess, EnvServerProcessConfig,
)
from tide_megatron.envs.config import DoorGameConfig, config_to_dict  # noqa: E402

import bench_record  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "env_server_hostile.json")
LIMITS = EnvServerLimits(read_timeout_s=5.0, idle_timeout_s=10.0)
MB = 1024 * 1024


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


async def open_raw(port: int):
    return await asyncio.open_connection("127.0.0.1", port, limit=8 * MB)


async def ask(conn, payload: bytes, timeout: float = 30.0):
    r, w = conn
    w.write(payload)
    await w.drain()
    return await asyncio.wait_for(r.readline(), timeout)


# Probes: each returns a dict of what it saw ----------------------------------------------

async def half_sent(port: int, proc) -> dict:
    conns = []
    for _ in range(500):
        try:
            c = await open_raw(port)
            c[1].write(b'{"id": 1, "op": "tasks", "args": {"env": "door_g')
            conns.append(c)
        except OSError:
            pass
    await asyncio.sleep(0.5)
    open_now = await server_connections(port)
    await asyncio.sleep(LIMITS.read_timeout_s + 1.0)
    open_later = await server_connections(port)
    for _, w in conns:
        w.close()
    return {"sent": len(conns), "server_connections_at_once": open_now,
            f"server_connections_after_{LIMITS.read_timeout_s + 1:g}s": open_later}


async def idle_crowd(port: int, proc) -> dict:
    conns, failed = [], 0
    for _ in range(5000):
        try:
            conns.append(await open_raw(port))
        except OSError:
            failed += 1
    await asyncio.sleep(1.0)
    fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
    busy = 0
    for r, w in conns:
        if r.at_eof() or b"ServerBusy" in bytes(r._buffer):  # refused ones got one line and EOF
            busy += 1
        w.close()
    return {"opened": len(conns), "connect_failed": failed, "refused_busy": busy, "server_fds": fds}


async def big_lines(port: int, proc) -> dict:
    conns = [await open_raw(port) for _ in range(40)]
    chunk = b"x" * MB
    peak = rss_mb(proc.pid)
    for _ in range(15):
        for _, w in conns:
            w.write(chunk)
        for _, w in conns:
            try:
                await asyncio.wait_for(w.drain(), 30)
            except (ConnectionError, asyncio.TimeoutError):
                pass
        peak = max(peak, rss_mb(proc.pid))
    replies = 0
    for r, w in conns:
        try:
            replies += b"TooLarge" in await asyncio.wait_for(r.readline(), 10)
        except (ConnectionError, asyncio.TimeoutError, ValueError):
            pass
        w.close()
    return {"connections": 40, "mb_sent_each": 15, "too_large_replies": replies, "server_rss_peak_mb": round(peak, 1)}


async def session_hog(port: int, proc) -> dict:
    conn = await open_raw(port)
    opened = 0
    for i in range(5000):
        reply = json.loads(await ask(conn, json.dumps({"id": i, "op": "reset", "args": {
            "env": "door_game", "task_id": "train/0", "trajectory_id": f"h{i}"}}).encode() + b"\n"))
        if not reply["ok"]:
            return {"sessions_opened": opened, "refusal": reply["error"]["message"]}
        opened += 1
    return {"sessions_opened": opened}


async def pipelined_tasks(port: int, proc) -> dict:
    r, w = await open_raw(port)
    t0 = time.monotonic()
    w.write(b'{"id": 1, "op": "tasks", "args": {"env": "door_game", "limit": 10000}}\n' * 300)
    await w.drain()
    sizes = []
    for _ in range(300):
        sizes.append(len(await asyncio.wait_for(r.readline(), 120)))
    w.close()
    return {"calls": 300, "all_answered_s": round(time.monotonic() - t0, 2), "reply_bytes_max": max(sizes)}


async def all_tasks_x300(port: int, proc) -> dict:
    """The issue's volume: 300 reads of all 10,000 tasks (0.9 MB each), now page by page."""
    async with EnvClient(EnvClientConfig(port=port, max_message_bytes=8 * MB, call_timeout_s=300)) as client:
        t0 = time.monotonic()
        lists = await asyncio.gather(*[client.list_tasks("door_game") for _ in range(300)])
    return {"lists": 300, "tasks_each": len(lists[0]), "all_answered_s": round(time.monotonic() - t0, 2)}


async def deep_and_huge(port: int, proc) -> dict:
    r, w = await open_raw(port)
    w.write(b'{"id": 1, "op": "ping", "args": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}\n"
            + b'{"id": 2, "op": "ping", "args": {"x": ' + b"9" * 5000 + b"}}\n"
            + b"".join(b'{"id": %d, "op": "ping", "args": {}}\n' % i for i in range(3, 13)))
    await w.drain()
    replies = [json.loads(await asyncio.wait_for(r.readline(), 10)) for _ in range(12)]
    w.close()
    return {"errors": [x["error"]["type"] for x in replies if not x["ok"]],
            "queued_pings_answered": sum(x["ok"] for x in replies)}


async def huge_action(port: int, proc) -> dict:
    conn = await open_raw(port)
    reply = await ask(conn, b'{"id": 1, "op": "step", "args": {"session_id": "s", "action": "' + b"a" * (15 * MB) + b'"}}\n')
    after = json.loads(await ask(conn, b'{"id": 2, "op": "ping", "args": {}}\n'))
    conn[1].close()
    return {"reply": json.loads(reply)["error"]["type"], "connection_usable_after": after["ok"]}


async def malformed_task_ids(port: int, proc) -> dict:
    """Issue 39: task ids Python's int() chokes on must be BadRequest naming `task_id`."""
    conn = await open_raw(port)
    ids = {"5000_digits": "train/" + "1" * 5000, "superscript_two": "train/\u00b2", "arabic_indic_one": "train/\u0661",
           "bare_5000_digits": "1" * 5000}
    seen: dict = {"bad_request_naming_task_id": 0, "other": {}}
    for i, (name, task_id) in enumerate(ids.items()):
        reply = json.loads(await ask(conn, json.dumps({"id": i, "op": "reset", "args": {
            "env": "door_game", "task_id": task_id, "trajectory_id": "t"}}).encode() + b"\n"))
        err = reply.get("error") or {}
        if err.get("type") == "BadRequest" and "'task_id'" in err.get("message", ""):
            seen["bad_request_naming_task_id"] += 1
        else:
            seen["other"][name] = err.get("type", "ok")
    seen["probes"] = len(ids)
    conn[1].close()
    return seen


async def connect_burst(port: int, proc) -> dict:
    """Issue 39: 500 clients connect at once, each sends a ping, then each reads its reply.
    Past max_connections a client must read one ServerBusy line, never a connection reset."""
    n = 500
    t0 = time.monotonic()
    conns = await asyncio.gather(*[open_raw(port) for _ in range(n)], return_exceptions=True)
    connect_s = time.monotonic() - t0
    for c in conns:
        if not isinstance(c, BaseException):
            c[1].write(b'{"id": 1, "op": "ping", "args": {}}\n')
    await asyncio.sleep(0.5)  # refusals are done before most clients read: what used to expose resets
    seen = {"clients": n, "ok": 0, "server_busy": 0, "resets": 0, "eof_without_reply": 0, "connect_failed": 0,
            "other": 0}
    for c in conns:
        if isinstance(c, BaseException):
            seen["connect_failed"] += 1
            continue
        try:
            line = await asyncio.wait_for(c[0].readline(), 30)
        except ConnectionResetError:
            seen["resets"] += 1
            continue
        except (OSError, asyncio.TimeoutError):
            seen["other"] += 1
            continue
        key = ("eof_without_reply" if not line else "server_busy" if b'"ServerBusy"' in line
               else "ok" if b'"ok":true' in line else "other")
        seen[key] += 1
    for c in conns:
        if not isinstance(c, BaseException):
            c[1].close()
    seen["connect_all_s"] = round(connect_s, 2)
    return seen


async def server_connections(port: int) -> int:
    """Connections the server holds besides the polite client's (which asks, so it always gets in)."""
    return (await POLITE[0].stats())["connections"] - 1


POLITE: list[EnvClient] = []


PROBES = [("half_sent_x500", half_sent), ("idle_x5000", idle_crowd), ("15MB_lines_x40", big_lines),
          ("session_hog", session_hog), ("pipelined_tasks_x300", pipelined_tasks), ("all_tasks_x300", all_tasks_x300),
          ("deep_nesting_and_5000_digits", deep_and_huge), ("15MB_action", huge_action),
          ("malformed_task_ids", malformed_task_ids), ("connect_burst_x500", connect_burst)]


async def polite(port: int, stop: asyncio.Event, latencies: list[float], timeouts: list[int]) -> None:
    async with EnvClient(EnvClientConfig(port=port, call_timeout_s=5.0, max_retries=0)) as client:
        POLITE[:] = [client]
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await client.ping()
                latencies.append(time.monotonic() - t0)
            except Exception:
                timeouts.append(1)
            await asyncio.sleep(0.05)


def run_probe(name: str, probe, cfg: EnvServerConfig, log_dir: str) -> dict:
    log = os.path.join(log_dir, f"{name}.log")
    with EnvServerProcess(cfg, EnvServerProcessConfig(log_path=log, supervise_interval_s=0)) as proc:
        rss0 = rss_mb(proc.pid)

        async def main():
            stop, lat, tmo = asyncio.Event(), [], []
            pinger = asyncio.create_task(polite(proc.port, stop, lat, tmo))
            await asyncio.sleep(0.3)
            seen = await probe(proc.port, proc)
            await asyncio.sleep(0.3)
            stop.set()
            await pinger
            return seen, lat, tmo

        t0 = time.monotonic()
        seen, lat, tmo = asyncio.run(main())
        row = {"probe": name, "seen": seen, "wall_s": round(time.monotonic() - t0, 1),
               "pings_ok": len(lat), "pings_failed": len(tmo),
               "ping_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
               "ping_max_ms": round(1000 * max(lat), 1) if lat else None,
               "rss_mb_before": round(rss0, 1), "rss_mb_after": round(rss_mb(proc.pid), 1)}
    row["log_bytes"] = os.path.getsize(log)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    args = parser.parse_args()
    cfg = EnvServerConfig(envs=[EnvConfig(name="door_game", door_game=DoorGameConfig(num_train_tasks=10_000))],
                          limits=LIMITS)
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        for name, probe in PROBES:
            rows.append(run_probe(name, probe, cfg, log_dir))
            r = rows[-1]
            print(f"{name:30s} pings ok/failed {r['pings_ok']:4d}/{r['pings_failed']:<3d} p50 {r['ping_p50_ms']} ms "
                  f"max {r['ping_max_ms']} ms  rss {r['rss_mb_before']}->{r['rss_mb_after']} MB  "
                  f"log {r['log_bytes']} B  {r['wall_s']} s\n{'':30s} {json.dumps(r['seen'])}", flush=True)
    if not args.no_write:
        out = {**bench_record.header("env_server_hostile", config={**vars(args), "server": cfg}),
               "server_limits": config_to_dict(LIMITS), "rows": rows}
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
