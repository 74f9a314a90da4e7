"""Issue 39 item 4: what a job started with `launch/torchrun.py` listens on is what the docs say.

The tiny CPU job (two ranks, real SGLang and Megatron, an embedded env server, a checkpoint)
runs under `launch/torchrun.py` while this test lists, every half second, the listening TCP
sockets held by the job's processes: the launcher's descendants, and any process carrying the
job's `TIDE_LAUNCH_ID`. Sockets come from `/proc/<pid>/net/tcp{,6}` (state LISTEN), mapped to
their processes by inode through `/proc/<pid>/fd`. Every one must be bound to loopback, and
every kind of process holding one must be a row of the "What binds where" table of
`docs/threat_model.md` that says 127.0.0.1.

Sampling is a union over the whole run, so a slow (loaded) machine only gives more samples; the
test requires that some samples were taken while training was under way (metrics.jsonl had a
line) and that they saw the four kinds that always listen then, so it cannot pass vacuously.
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tide_megatron.testing import REPO, child_env

pytestmark = pytest.mark.integration

THREAT_MODEL = REPO / "docs" / "threat_model.md"
LAUNCH_ID_ENV = "TIDE_LAUNCH_ID"
TCP_LISTEN = "0A"
ALWAYS_LISTENING = {"launch/torchrun.py", "launch/train.py", "sglang::scheduler", "tide_megatron.envs.server"}
"""Kinds that hold listening sockets for the whole of training (the store, the ranks' gloo
groups, the scheduler's process groups, the env server): seen, or the test saw nothing."""


def process_kind(cmdline: list[str], name: str) -> str | None:
    """The name `docs/threat_model.md` gives to the process behind a listening socket; None
    for one caught between fork and exec (an empty command line): it holds its parent's
    sockets, which are counted under the parent, and checked for loopback all the same."""
    if not "".join(cmdline).strip():
        return None
    if not "".join(cmdline[1:]):  # a title (setproctitle: a forked rank, SGLang's children) is one string
        cmdline = cmdline[0].split()
    head = cmdline[:3]  # the interpreter, maybe `-u` or `-m`, then the script or module
    for script in ("launch/torchrun.py", "launch/train.py"):
        if any(arg.endswith(script) for arg in head):
            return script
    if "tide_megatron.envs.server" in head:
        return "tide_megatron.envs.server"
    title = (cmdline[0].strip() if cmdline else "") or name  # SGLang sets `sglang::<role>` as the title
    return title.split()[0] if title.startswith("sglang::") else name


def job_processes(root: int, launch_id: list[str]) -> list[psutil.Process]:
    """The launcher, its descendants, and any process carrying the job's launch id (one that
    left the tree by being reparented still belongs to the job)."""
    try:
        tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    if not launch_id:
        for p in tree[1:]:
            try:
                value = p.environ().get(LAUNCH_ID_ENV)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if value:
                launch_id.append(value)
                break
    if launch_id:
        pids = {p.pid for p in tree}
        for p in psutil.process_iter():
            if p.pid in pids:
                continue
            try:
                if p.environ().get(LAUNCH_ID_ENV) == launch_id[0]:
                    tree.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
    return tree


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} write each 32-bit word of the address in host (little-endian) order.
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def tcp_listeners(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in `pid`'s network namespace."""
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            found[fields[9]] = (str(_address(hex_addr)), int(hex_port, 16))
    return found


def is_loopback(address: str) -> bool:
    addr = ipaddress.ip_address(address)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def documented_bindings() -> dict[str, str]:
    """Process kind (the code span opening a row) -> the row, from the table under
    "## What binds where" in docs/threat_model.md."""
    text = THREAT_MODEL.read_text()
    start = text.index("\n## What binds where")
    end = text.find("\n## ", start + 1)
    rows = {}
    for line in text[start:end if end > 0 else None].splitlines():
        m = re.match(r"\|\s*`([^`]+)`", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_every_listening_socket_of_a_job_is_on_loopback_and_documented(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "2",
           str(REPO / "launch" / "train.py"), "+recipe=tiny_cpu", "metrics.progress=false",
           f"run.output_dir={run_dir}", "run.steps=4", "run.checkpoint_interval=2", "scheduler.groups_per_step=2",
           "scheduler.group_size=2", "rollout.runner.max_turns=4"]
    env = child_env()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the launcher's defaults are what is checked
        env.pop(var, None)
    seen: dict[str, dict] = {}  # inode -> {"address", "port", "kinds", "cmdlines"}
    kinds_while_training: set[str] = set()
    samples_while_training = 0
    launch_id: list[str] = []
    metrics = run_dir / "metrics.jsonl"
    # Output goes to files, not pipes: a helper process left holding a pipe cannot hang the test.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO, env=env)
        deadline = time.monotonic() + 900
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                training = metrics.exists() and metrics.stat().st_size > 0
                holders: dict[str, list[tuple[str | None, str]]] = {}
                for p in job_processes(proc.pid, launch_id):
                    try:
                        cmdline, name = p.cmdline(), p.name()
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        continue
                    for inode in socket_inodes(p.pid):
                        holders.setdefault(inode, []).append((process_kind(cmdline, name), " ".join(cmdline)[:160]))
                for inode, (address, port) in tcp_listeners(proc.pid).items():
                    if inode not in holders:
                        continue  # not the job's
                    entry = seen.setdefault(inode, {"address": address, "port": port, "kinds": set(), "cmdlines": set()})
                    kinds = {k for k, _ in holders[inode] if k is not None}
                    entry["kinds"].update(kinds)
                    entry["cmdlines"].update(c for _, c in holders[inode])
                    if training:
                        kinds_while_training.update(kinds)
                samples_while_training += training
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
        err.seek(0)
        stderr = err.read()
    assert proc.returncode == 0, stderr[-8000:]

    assert samples_while_training >= 1, "the job ended before any sample saw training under way"
    assert ALWAYS_LISTENING <= kinds_while_training, (
        f"while training, only {sorted(kinds_while_training)} were seen listening; expected {sorted(ALWAYS_LISTENING)}")

    off_loopback = [f"{s['address']}:{s['port']} held by {sorted(s['cmdlines'])}" for s in seen.values()
                    if not is_loopback(s["address"])]
    assert not off_loopback, "listening off loopback:\n" + "\n".join(off_loopback)

    rows = documented_bindings()
    by_kind: dict[str, int] = {}
    for s in seen.values():
        for kind in s["kinds"]:
            by_kind[kind] = by_kind.get(kind, 0) + 1
    undocumented = sorted(k for k in by_kind if k not in rows)
    assert not undocumented, (
        f"listening processes missing from the 'What binds where' table of {THREAT_MODEL}: {undocumented} "
        f"(ports per kind: {by_kind}); their command lines: "
        f"{sorted({c for s in seen.values() if s['kinds'] & set(undocumented) for c in s['cmdlines']})}")
    wrong = sorted(k for k in by_kind if "127.0.0.1" not in rows[k])
    assert not wrong, f"rows of {THREAT_MODEL} that do not say 127.0.0.1 for kinds seen listening there: {wrong}"
    print(f"listening sockets per kind: {by_kind}")
