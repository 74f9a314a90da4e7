"""`torchrun` for one node, with every control channel of the job on loopback.

    python launch/torchrun.py --nproc-per-node 2 [--max-restarts 3] launch/train.py +recipe=tiny_cpu run.resume=auto

takes torchrun's own options and runs torchrun (`torch.distributed.run`) with three changes:

- The rendezvous store listens on 127.0.0.1 only. That store carries this job's control
  messages (task assignments, trajectories with their rewards, stop), unauthenticated. torch's
  TCPStore server binds the wildcard address whatever `--master-addr` or `--rdzv-endpoint` say
  (torch 2.13; pytorch/pytorch#173909); the one way to restrict it is a socket bound
  beforehand (`TCPStore(master_listen_fd=...)`). So this launcher binds 127.0.0.1 on a free
  port (or `--master-port`) itself and hands the socket to torchrun's static rendezvous.
- `GLOO_SOCKET_IFNAME=lo` and `NCCL_SOCKET_IFNAME=lo` (unless already set): the process
  groups (the weight transfers, the trainers' collectives) listen on loopback too.
- `TIDE_CONTROL_LOOPBACK=1` (`CONTROL_LOOPBACK_ENV`), so the job does not warn about an exposed store.

With `--max-restarts N` a failed job is restarted on the same store; with `run.resume=auto` it
continues from its last good checkpoint (README, "Restartable jobs"). A job that fails ends
with one line per rank (above) and one summary line here, not torchrun's traceback report.

Where no GPU is present the ranks are forked from a server that has imported torch,
Megatron-core and SGLang once (`tide_megatron/utils/forked_ranks.py`; `TIDE_PRELOAD_RANKS=0`
starts each rank as a fresh interpreter, as torchrun does).

When the job ends, processes it left behind are stopped: a rank killed mid-run (SIGKILL, the
OOM killer) cannot stop its helpers, e.g. the spawn Manager that Megatron's checkpoint writer
starts, and torchrun only signals the process groups of ranks still alive. Every process of
the job carries `TIDE_LAUNCH_ID` in its environment; what still carries it at the end goes.

Several nodes: use torchrun itself, with its store and process groups on the cluster's private
network (docs/threat_model.md); this launcher refuses options that span nodes.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from tide_megatron.utils import forked_ranks  # noqa: E402
from tide_megatron.utils.net import CONTROL_LOOPBACK_ENV  # noqa: E402

LOOPBACK = "127.0.0.1"
LAUNCH_ID_ENV = "TIDE_LAUNCH_ID"
SHM_MANAGER = "torch_shm_manager"
SHM_DIR = "/dev/shm"
_NODE_OPTIONS = ("standalone", "rdzv_endpoint", "rdzv_conf", "local_addr")


def bind_loopback(port: int = 0) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 (`port` 0: a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(4096)
    return sock


def serve_store_on(sock: socket.socket) -> None:
    """Make torchrun's static rendezvous host its store on `sock` (once) instead of binding
    every interface."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    real = static_tcp_rendezvous.TCPStore
    held = [sock]

    def tcp_store(*args, **kwargs):
        is_master = args[3] if len(args) > 3 else kwargs.get("is_master", False)
        if is_master:
            if not held:
                raise RuntimeError("launch/torchrun.py: the loopback store socket was already handed out")
            kwargs["master_listen_fd"] = held.pop().detach()  # the store owns the descriptor now
        return real(*args, **kwargs)

    static_tcp_rendezvous.TCPStore = tcp_store


def check_one_node(args) -> None:
    """Refuse options that make the job span nodes or move its store off loopback."""
    nnodes = str(args.nnodes)
    if nnodes not in ("1", "1:1"):
        raise SystemExit(f"launch/torchrun.py runs one node (got --nnodes {nnodes}); for several nodes use "
                         "torchrun on the cluster's private network, see docs/threat_model.md")
    for name in _NODE_OPTIONS:
        if getattr(args, name, None):
            raise SystemExit(f"launch/torchrun.py sets the rendezvous itself: drop --{name.replace('_', '-')}")
    if args.rdzv_backend != "static":
        raise SystemExit(f"launch/torchrun.py uses the static rendezvous: drop --rdzv-backend {args.rdzv_backend}")
    if args.master_addr not in (LOOPBACK, "localhost"):
        raise SystemExit(f"launch/torchrun.py binds the store to {LOOPBACK}: drop --master-addr {args.master_addr}")


def check_job(args) -> str | None:
    """Compose, validate and plan `launch/train.py`'s config once, before any rank starts (one
    line naming the key, not the same error from every rank after start-up); None when it can
    run, or when the script is not launch/train.py or the process count is torchrun's "auto"."""
    if Path(args.training_script).resolve() != REPO / "launch" / "train.py" or not str(args.nproc_per_node).isdigit():
        return None
    sys.path.insert(0, str(REPO / "launch"))
    from hydra_schema import compose_job_config, refuse_secret_overrides

    from tide_megatron.core.rank_plan import PlanError
    from tide_megatron.job_plan import plan_job

    try:
        refuse_secret_overrides([args.training_script, *args.training_script_args])
    except SystemExit as exc:
        return str(exc).removeprefix("launch/train.py: ")
    try:
        plan_job(compose_job_config(args.training_script_args), 1, int(args.nproc_per_node))
    except (PlanError, ValueError) as exc:
        return str(exc)
    except Exception as exc:  # Hydra's own errors: an unknown key, a bad value, a missing recipe
        why = " ".join(f"{exc}: {exc.__cause__ or ''}".split()).rstrip(": ")
        return f"{type(exc).__name__}: {why}"
    return None


def describe_failures(exc) -> str:
    """One line for torchrun's ChildFailedError: which ranks ended how, first failure first.
    torch stamps a failure in whole seconds, and stops the other ranks with SIGTERM once one has
    failed: within one second, a rank killed by SIGTERM comes after one that ended by itself."""
    parts = []
    for rank, failure in sorted(exc.failures.items(),
                                key=lambda kv: (kv[1].timestamp, kv[1].exitcode == -signal.SIGTERM, kv[0])):
        code = failure.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
            else f"exit code {code}"
        parts.append(f"rank {rank} ({how})")
    return "launch/torchrun.py: the job failed: " + ", then ".join(parts) + "; each rank's line above says why"


def torch_shm_files() -> set[str]:
    """Names of the /dev/shm files torch's `file_system` sharing made (`torch_<pid>_...`)."""
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith("torch_")}
    except OSError:
        return set()


def launch_processes(launch_id: str) -> list:
    """The live processes (psutil) whose environment carries `launch_id`, but this one and its own
    resource tracker (a zombie's environment cannot be read: it is left out)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(LAUNCH_ID_ENV) == launch_id \
                    and not (proc.ppid() == os.getpid() and forked_ranks.is_resource_tracker(proc.cmdline())):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def reap_leftovers(launch_id: str, shm_before: set[str] | None = None, grace_s: float = 10.0) -> int:
    """Kill every process (but this one) whose environment carries `launch_id`; returns how many.

    torch's shared-memory managers (`torch_shm_manager`, started by the weight sync's shared
    buckets) go last. Each unlinks the /dev/shm files its processes left behind (a killed SGLang
    scheduler never drops its mapping) 2 s after its last client is gone, which a SIGKILL would
    prevent; so while a torch file that was not there before the job (`shm_before`) remains,
    they get `grace_s` to do that and exit by themselves. After a clean job no such file
    remains (the weight sync unlinks its buffers at exit) and they go at once."""
    import psutil

    def ours() -> list:
        return launch_processes(launch_id)

    def is_shm_manager(proc) -> bool:
        try:
            return proc.name() == SHM_MANAGER
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    def kill(procs: list) -> int:
        killed = 0
        for proc in procs:
            try:
                proc.kill()
                killed += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return killed

    killed = kill([p for p in ours() if not is_shm_manager(p)])
    managers = [p for p in ours() if is_shm_manager(p)]
    if managers and (shm_before is None or torch_shm_files() - shm_before):
        _, managers = psutil.wait_procs(managers, timeout=grace_s)
        return killed + kill(managers)
    kill(managers)  # nothing left for them to free: not left behind, just not yet gone
    return killed


def main(argv: list[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    check_one_node(args)
    error = check_job(args)
    if error:
        print(f"launch/torchrun.py: the job cannot start: {error}", file=sys.stderr)
        return 2
    sock = bind_loopback(args.master_port or 0)
    args.master_addr, args.master_port = LOOPBACK, sock.getsockname()[1]
    serve_store_on(sock)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ[CONTROL_LOOPBACK_ENV] = "1"
    launch_id = os.environ[LAUNCH_ID_ENV] = uuid.uuid4().hex  # fresh: a nested launch reaps its own only
    shm_before = torch_shm_files()
    forked = forked_ranks.wanted() and forked_ranks.can_run(args)
    try:
        if forked:
            forked_ranks.configure(args)
            config, _, script_and_args = torchrun.config_from_args(args)
            elastic_launch(config, entrypoint=forked_ranks.run_rank)(*script_and_args)
        else:
            torchrun.run(args)
    except ChildFailedError as exc:
        print(describe_failures(exc), file=sys.stderr)
        return 1
    except SignalException as exc:  # scancel, Ctrl-C, a supervisor's SIGTERM: the ranks are stopped
        print(f"launch/torchrun.py: stopped by signal {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if forked:
            forked_ranks.stop_forkserver()
        left = reap_leftovers(launch_id, shm_before)
        if forked:  # after the reap: the job's processes hold its pipe too
            forked_ranks.stop_resource_tracker()
        if left:
            print(f"launch/torchrun.py: stopped {left} process(es) the job left behind", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
