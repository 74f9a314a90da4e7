"""SGLang's children forked on CPU (`tide_megatron/compat/sglang_fork.py`): a fork made while an
engine starts forgets the rank's process groups and signal handlers, any other fork keeps them,
an engine so started generates beside the rank's own group, and upstream still does what the
wrapper relies on."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import tide_megatron.compat as compat
from tide_megatron.testing import child_env, run_report

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(compat.cuda_present(), reason="on a CUDA machine SGLang's children are spawned")]

# A parent with what a rollout rank has when its engine starts: a default process group, an
# event-loop signal wake-up fd (on a Unix socket pair), its own SIGTERM handler and a listening
# TCP port; a child forked outside and one inside the block report what they inherited.
PROBE = r"""
import json, os, signal, socket, stat, tempfile
import torch.distributed as dist
from tide_megatron.compat import sglang_fork

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
wake, _ = socket.socketpair()
wake.setblocking(False)
signal.set_wakeup_fd(wake.fileno())
signal.signal(signal.SIGTERM, lambda *_: None)
port = socket.create_server(("127.0.0.1", 0))

def is_socket(fd):
    return stat.S_ISSOCK(os.fstat(fd).st_mode)

def child_view():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        view = {"group": dist.is_initialized(), "wakeup_fd_set": signal.set_wakeup_fd(-1) != -1,
                "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                "tcp_port": is_socket(port.fileno()), "unix_socket": is_socket(wake.fileno())}
        os.write(w, json.dumps(view).encode())
        os._exit(0)
    os.close(w)
    view = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    return view

outside = child_view()
with sglang_fork.forked_engine_children():
    inside = child_view()
print(json.dumps({"outside": outside, "inside": inside, "after": child_view(), "parent_group": dist.is_initialized()}))
"""


def test_only_a_fork_during_engine_start_forgets_the_ranks_groups_signals_and_tcp_sockets():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    views = json.loads(proc.stdout.splitlines()[-1])
    kept = {"group": True, "wakeup_fd_set": True, "sigterm_default": False, "tcp_port": True, "unix_socket": True}
    assert views["outside"] == kept and views["after"] == kept
    assert views["inside"] == {"group": False, "wakeup_fd_set": False, "sigterm_default": True, "tcp_port": False,
                               "unix_socket": True}
    assert views["parent_group"]


@pytest.mark.parametrize("fork", [True, False])
def test_an_engine_started_beside_the_ranks_group_forks_its_children_when_asked(tmp_path, fork):
    report = run_report(Path(__file__).with_name("engine_fork_worker.py"), tmp_path, "--fork", int(fork), timeout=300)
    assert report["generated"] == 4 and report["rank_group_kept"] and report["children_forked"] == fork
    assert len(report["children"]) >= 2  # scheduler and detokenizer
    forked = set(report["children"]) & set(report["forked"])
    assert forked == (set(report["children"]) if fork else set())
    # SGLang never unlinks its scheduler's load file in /dev/shm; the engine's shutdown does
    assert report["load_snapshot_file_while_up"] and not report["load_snapshot_file_after_shutdown"]


def test_children_are_spawned_while_torch_runs_several_intra_op_threads():
    import torch

    from tide_megatron.compat import sglang_fork

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert sglang_fork.fork_hazard() is None
        torch.set_num_threads(2)
        assert "2 intra-op threads" in sglang_fork.fork_hazard()
        with sglang_fork.forked_engine_children() as forked:
            assert not forked and not sglang_fork._starting_engine
    finally:
        torch.set_num_threads(threads)


def test_upstream_still_spawns_from_the_function_the_wrapper_follows():
    import torch.distributed.distributed_c10d as c10d
    import sglang.srt.entrypoints.engine as engine_module

    assert 'mp.set_start_method("spawn", force=True)' in inspect.getsource(engine_module._set_envs_and_config)
    assert "_set_envs_and_config(" in inspect.getsource(engine_module.Engine)
    assert isinstance(c10d._world, c10d._World)  # the state a forked child replaces
