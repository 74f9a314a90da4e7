"""One run of the real system on emulated devices (`recipes/recipe/text_emulated.yaml`), for the
paper-scale benchmarks (`paper_scale.py`, `control_plane.py`).

A run is `launch/torchrun.py --nproc-per-node N launch/train.py +recipe=text_emulated ...` with
`cluster.emulation.dilation` set; its figures are read back from `metrics.jsonl` and converted to
the modelled device's time (wall time / dilation, throughput x dilation), next to the share of the
host's cores that was busy while it trained (every rank shares them: a host near 100% busy makes
the control plane, not the modelled devices, set the pace).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_busy import CpuBusySampler
from rank_memory_sampler import RankMemorySampler

REPO = Path(__file__).resolve().parent.parent
RECIPE = "text_emulated"


def failure_text(stderr: str, log_dir: Path, tail_chars: int = 2000, log_chars: int = 4000) -> str:
    """What names a failed job's cause, kept before its output folder goes: every line a rank or
    the launcher wrote on its own (`[rankN] ...`, `launch/torchrun.py: ...`; at 64 ranks the end of
    stderr alone held only the other ranks' shutdown), the end of stderr, and the end of each rank
    log that holds a traceback."""
    named = [line for line in stderr.splitlines() if line.startswith(("[rank", "launch/torchrun.py"))]
    parts = ["\n".join(named[-200:]), "-- end of stderr --", stderr[-tail_chars:]]
    for log in sorted(log_dir.glob("rank*.log")) if log_dir.is_dir() else []:
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            parts += [f"-- end of {log.name} --", text[-log_chars:]]
    return "\n".join(parts)


def run_job(cmd: list[str], timeout_s: float, env: dict[str, str], cwd: Path) -> tuple[int | None, str]:
    """Run a launch command in a session of its own; returns its exit code (None: timed out) and
    stderr. At the timeout the whole session is stopped (SIGTERM, then SIGKILL after 60 s): the
    ranks are the launcher's forkserver's children, and killing the launcher alone left 64 of
    them running without their store."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the launcher's own stop left
        except ProcessLookupError:
            pass
        _, stderr = proc.communicate()  # every writer is gone: the pipes end
        return None, stderr


def run_emulated(ranks: int, dilation: float, overrides: list[str], timeout_s: float,
                 env: dict[str, str] | None = None, repo: Path = REPO) -> dict:
    """Run the emulated recipe on `ranks` processes (`env`: extra environment; `repo`: the
    checkout whose launcher runs, by default this one); returns its
    per-step metrics (`rows`), the process wall time, the host's busy share over the training
    window and over the process, the ranks' peak memory (`rank_memory_sampler.py`), and on
    failure `failed` with the end of stderr."""
    # a rank stopped late may still write there: the folder goes as far as it can
    with tempfile.TemporaryDirectory(prefix="emulated_", ignore_cleanup_errors=True) as tmp:
        args = [f"+recipe={RECIPE}", f"cluster.emulation.dilation={dilation}", "metrics.progress=false",
                "metrics.tensorboard=false", "run.checkpoint_interval=0", *overrides]
        cmd = [sys.executable, str(repo / "launch" / "torchrun.py"), "--nproc-per-node", str(ranks),
               str(repo / "launch" / "train.py"), *args, f"run.output_dir={tmp}"]
        started = time.time()
        with CpuBusySampler() as cpu, RankMemorySampler() as memory:
            code, stderr = run_job(cmd, timeout_s, dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), repo)
            error = None if code == 0 else failure_text(stderr, Path(tmp) / "logs")
            if code is None:
                error = f"timed out after {timeout_s:.0f} s\n{error}"
        out = {"command": " ".join(["python launch/torchrun.py --nproc-per-node", str(ranks), "launch/train.py", *args]),
               "process_wall_s": round(time.time() - started, 1), "cpu_busy_share_process": cpu.busy_share(),
               "memory": memory.summary()}
        metrics = Path(tmp) / "metrics.jsonl"
        if error is not None or not metrics.is_file():
            return {**out, "failed": True, "error": error or "no metrics.jsonl"}
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if "eval/mean_reward" not in line]
        timeline = Path(tmp) / "timeline.json"
        window = (float("-inf"), float("inf"))
        if timeline.is_file():
            t = json.loads(timeline.read_text())
            window = (t["origin_unix"], t["origin_unix"] + t["steps"][-1]["end"])
        png = Path(tmp) / "timeline.png"
        return {**out, "failed": False, "rows": rows, "cpu_busy_share": cpu.busy_share(*window),
                "timeline_png": png.read_bytes() if png.is_file() else None}


def modelled(run: dict, ranks: int, dilation: float) -> dict:
    """A run's figures at the modelled device's speed: run goodput, mean step time, the waits
    (rank-seconds, as the simulator counts them: each step's RWT, a mean per rollout rank, times
    its rollout ranks, plus its TWT times its trainer ranks; no reference ranks here), the wasted
    share, ERS's moves, and the host's busy share and the ranks' memory beside them."""
    rows = run["rows"]
    last = rows[-1]
    generated = last["ledger/generated"]
    return {
        "steps": len(rows),
        "goodput_tok_s": last["run_goodput_tok_s"] * dilation,
        "mean_step_s": statistics.fmean(r["time/step_s"] for r in rows) / dilation,
        "rwt_plus_twt_s": sum(r["rwt_s"] + r["twt_s"] for r in rows) / dilation,
        "waiting_rank_s": sum(r["rwt_s"] * (ranks - r["trainer/dp_size"]) + r["twt_s"] * r["trainer/dp_size"]
                              for r in rows) / dilation,
        "wasted_share": last["ledger/wasted"] / generated if generated else 0.0,
        "lost_tokens": last["ledger/lost"],
        "consumed_tokens": sum(r["consumed_tokens"] for r in rows),
        "rank_moves": int(max((r.get("ers/moves", 0) for r in rows), default=0)),
        "ra2p_modes": [r.get("ra2p/mode") for r in rows],
        "cpu_busy_share": run["cpu_busy_share"],
        "memory": run["memory"],
    }
