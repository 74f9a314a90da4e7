"""launch/torchrun.py: one node, and torchrun's store listening on loopback only."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from torch.distributed import PrefixStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters, static_tcp_rendezvous

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
import torchrun as launcher  # noqa: E402


def parse(*argv: str):
    from torch.distributed import run

    return run.parse_args([*argv, "--nproc-per-node", "2", "launch/train.py", "+recipe=tiny_cpu"])


def listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.parametrize("argv,message", [
    (("--nnodes", "2"), "runs one node (got --nnodes 2)"),
    (("--standalone",), "drop --standalone"),
    (("--rdzv-endpoint", "10.0.0.5:29400"), "drop --rdzv-endpoint"),
    (("--rdzv-backend", "c10d"), "drop --rdzv-backend c10d"),
    (("--master-addr", "10.0.0.5"), "drop --master-addr 10.0.0.5"),
])
def test_options_that_leave_the_node_are_refused(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        launcher.check_one_node(parse(*argv))


def test_plain_options_are_one_node():
    launcher.check_one_node(parse("--max-restarts", "2", "--master-port", "29511"))


def test_static_rendezvous_store_listens_on_loopback_only(monkeypatch):
    monkeypatch.setattr(static_tcp_rendezvous, "TCPStore", static_tcp_rendezvous.TCPStore)  # restored after
    sock = launcher.bind_loopback()
    port = sock.getsockname()[1]
    launcher.serve_store_on(sock)
    handler = static_tcp_rendezvous.create_rdzv_handler(RendezvousParameters(
        backend="static", endpoint=f"127.0.0.1:{port}", run_id="t", min_nodes=1, max_nodes=1, rank=0))
    info = handler.next_rendezvous()
    assert isinstance(info.store, PrefixStore)
    info.store.set("k", "v")
    assert info.store.get("k") == b"v"
    assert listening(port) == {"127.0.0.1"}
    # The same store is reused across torchrun's restarts: no second bind.
    assert handler.next_rendezvous().store.get("k") == b"v"


def test_unpatched_store_would_listen_everywhere():
    """What the launcher exists for (torch 2.13): the host name does not restrict the bind."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    assert listening(store.port) & {"0.0.0.0", "::"}


def test_failures_are_summed_up_in_one_line_first_failure_first(tmp_path):
    first = ProcessFailure(1, 12, 1, str(tmp_path / "none"))
    stopped = ProcessFailure(0, 11, -15, str(tmp_path / "none"))
    for stopped_after_s in (1, 0):  # torch stamps whole seconds: the stop may fall in the same one
        stopped.timestamp = first.timestamp + stopped_after_s
        line = launcher.describe_failures(ChildFailedError("launch/train.py", {0: stopped, 1: first}))
        assert line == ("launch/torchrun.py: the job failed: rank 1 (exit code 1), then rank 0 (killed by SIGTERM); "
                        "each rank's line above says why")


def test_leftovers_of_this_launch_are_reaped_and_nothing_else():
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleep, env={**os.environ, launcher.LAUNCH_ID_ENV: "launch-a"})
    other = subprocess.Popen(sleep, env={**os.environ, launcher.LAUNCH_ID_ENV: "launch-b"})
    try:
        for _ in range(100):  # the child has exec'd once its environment shows the marker
            if launcher.LAUNCH_ID_ENV in psutil.Process(ours.pid).environ():
                break
            time.sleep(0.05)
        assert launcher.reap_leftovers("launch-a") == 1
        assert ours.wait(timeout=10) == -9 and other.poll() is None
    finally:
        other.kill()
        other.wait()


SHARES_A_TENSOR = """
import time, torch, torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")  # as the weight sync's buckets: starts a torch_shm_manager
t = torch.zeros(4).share_memory_()
print(t.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/"), flush=True)
time.sleep(120)
"""


def test_shm_managers_get_time_to_free_a_killed_jobs_files_and_none_when_nothing_is_left(monkeypatch):
    """A process of each launch shares a tensor by /dev/shm name and is killed, as a rank killed
    mid-run would be. Launch a's file is new since its start: the reaper waits for a's manager,
    which unlinks the file and exits by itself. Launch b's file was there before its start
    (nothing of b's own is left to free): b's manager is killed without a wait."""
    before = launcher.torch_shm_files()
    procs = {launch: subprocess.Popen([sys.executable, "-c", SHARES_A_TENSOR], stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, launcher.LAUNCH_ID_ENV: launch})
             for launch in ("launch-a", "launch-b")}
    files = {}
    waited = []
    real_wait = psutil.wait_procs

    def wait_procs(procs, timeout):
        waited.append([p.pid for p in procs])
        return real_wait(procs, timeout=timeout)

    monkeypatch.setattr(psutil, "wait_procs", wait_procs)
    try:
        for launch, proc in procs.items():
            files[launch] = proc.stdout.readline().strip()
            assert files[launch] in launcher.torch_shm_files() - before, proc.poll()
        assert launcher.reap_leftovers("launch-a", before | {files["launch-b"]}) == 1  # the sharing process
        assert len(waited) == 1 and files["launch-a"] not in launcher.torch_shm_files()
        assert launcher.reap_leftovers("launch-b", before | {files["launch-b"]}) == 1
        assert len(waited) == 1  # no wait for b's manager
        deadline = time.monotonic() + 10  # a SIGKILL takes effect soon, not at once
        while (running := [p for launch in procs for p in launcher.launch_processes(launch)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        for name in files.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(launcher.SHM_DIR, name))


def test_a_signalled_launch_stops_its_ranks_and_says_so_in_one_line(tmp_path):
    """scancel or a supervisor's SIGTERM: torchrun stops the ranks and re-raises the signal as an
    exception; the launcher answers with one line and the shell's exit code, not a traceback."""
    worker = tmp_path / "worker.py"
    marker = tmp_path / "started"
    worker.write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", "1", str(worker)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the worker never started"
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + 15
    assert "launch/torchrun.py: stopped by signal SIGTERM" in err and "Traceback" not in err
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(worker) in (p.info["cmdline"] or [])]
