"""Soak: a long tide-mode run of the tiny recipe under chaos faults aimed at the step's phases.

One job (`launch/torchrun.py` with `--max-restarts` and `run.resume=auto`, tide mode, CTB on,
two or more rollout ranks, long-tailed env latency with injected env failures) runs for
`--minutes`; meanwhile this script injects `--faults` faults, one at a time, of these kinds
(every kind at least once when there are enough faults):

- `engine`: one rollout rank's SGLang scheduler is SIGKILLed (the rank replaces its engine);
- `all_engines`: every rollout rank's scheduler at once;
- `env_server`: the env server is SIGKILLed (its supervisor restarts it on the same address);
- `rollout_rank_kill`, `trainer_kill`: a rollout rank, or rank 0 (trainer and controller), is
  SIGKILLed; torchrun stops the other ranks and restarts them all (`--max-restarts`, one per
  such fault), and the job resumes from its last checkpoint;
- `rollout_rank_stop`: a rollout rank is SIGSTOPped until it is quarantined (past
  `scheduler.heartbeat_timeout_s`), then SIGCONTed; it must rejoin and generate again.

Each fault is aimed at a phase of a step drawn uniformly from `PHASES` (training mid-step,
just after a step boundary, the weight sync, the checkpoint, just after a checkpoint): the
script watches `metrics.jsonl` for step boundaries and predicts the phase's time from the
last steps' durations. Afterwards every fault's time is placed in the phases of the step it
fell in (the phase actually hit, which a prediction can miss). In tide mode the controller's
weight sync is a push of ~10 ms on the tiny model (the ranks load the weights after it, just
after the boundary), so a fault aimed at it mostly lands next to it; the record says where.

The record (benchmarks/results/soak_cpu.json) has, per fault, its kind, the phase aimed at
and hit, the time to detection and to recovery (from the rank logs, `events.jsonl` and the
step records); the tokens recounted from the per-step records against the ledger; lost tokens
and staleness violations. A run that makes no step for `--hang-s` is a hang: every process of
the job gets a `py-spy dump` (when py-spy is installed), the job is killed, and the record
says so. Each torchrun restart starts `run.max_wall_minutes` afresh: a job still running four
minutes past `--minutes` is ended by the soak (SIGTERM), which passes as finished.

    python benchmarks/soak.py --minutes 30 --faults 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

import bench_record

REPO = Path(__file__).resolve().parent.parent
LATENCY = ["envs.server.envs.0.latency.enabled=true", "envs.server.envs.0.latency.step_median_s=0.2",
           "envs.server.envs.0.latency.slow_step_prob=0.02", "envs.server.envs.0.latency.extra_turns_mean=0.5"]
MAX_STALENESS = 1  # scheduler.max_staleness, the recipe's default

KINDS = ("engine", "all_engines", "env_server", "rollout_rank_kill", "rollout_rank_stop", "trainer_kill")
RESTARTING = ("rollout_rank_kill", "trainer_kill")
"""Kinds that end the attempt: each needs one torchrun restart."""
PHASES = ("mid_step", "after_boundary", "weight_sync", "checkpoint", "after_checkpoint")
BOUNDARY_S = 1.0
"""A fault this soon after a step's record counts as "just after the boundary"."""
LEDGER_BUCKETS = ("in_flight", "ready", "consumed", "dropped_stale", "cancelled", "failed", "lost", "evaluated")
LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
ENGINE_DIED = re.compile(r"an SGLang subprocess of this rollout rank died")
ENV_RESTARTING = re.compile(r"restarting the env server")
ENV_UP = re.compile(r"env server on \S+ serving")
WATCHED = (ENGINE_DIED, ENV_RESTARTING, ENV_UP)


# ----------------------------------------------------------------------------- the plan (pure)
def balanced_draw(n: int, options: tuple[str, ...], rng: random.Random) -> list[str]:
    """`n` draws, each option equally likely, and every option once before any repeats
    (shuffled rounds): twelve faults over six kinds hit each kind twice, not by luck."""
    out: list[str] = []
    while len(out) < n:
        round_ = list(options)
        rng.shuffle(round_)
        out.extend(round_)
    return out[:n]


def draw_plan(n: int, rng: random.Random, kinds: tuple[str, ...] = KINDS,
              phases: tuple[str, ...] = PHASES) -> list[dict]:
    return [{"kind": k, "aimed_phase": p} for k, p in zip(balanced_draw(n, kinds, rng), balanced_draw(n, phases, rng))]


# ----------------------------------------------------------------------------- steps and phases (pure)
@dataclass
class StepSeen:
    """A step's record and when it appeared in metrics.jsonl (the step's end, to a poll)."""

    step: int
    end: float
    step_s: float
    train_s: float
    sync_s: float
    checkpoint_s: float

    @classmethod
    def of(cls, row: dict, end: float) -> "StepSeen":
        return cls(row["step"], end, row["time/step_s"], row["time/train_s"], row["time/sync_s"],
                   row["time/checkpoint_s"])

    @property
    def wait_s(self) -> float:
        """The wait for data before training (what the step's time is not spent on otherwise)."""
        return max(0.0, self.step_s - self.train_s - self.sync_s - self.checkpoint_s)

    def windows(self) -> list[tuple[str, float, float]]:
        """The step's phases in order (`controller/loop.py`: wait, train, sync, checkpoint, record)."""
        ck0 = self.end - self.checkpoint_s
        sync0 = ck0 - self.sync_s
        train0 = sync0 - self.train_s
        return [("data_wait", self.end - self.step_s, train0), ("mid_step", train0, sync0),
                ("weight_sync", sync0, ck0), ("checkpoint", ck0, self.end)]


def classify(t: float, steps: list[StepSeen]) -> str:
    """The phase a fault at `t` hit. Just after a boundary wins over the next step's wait; a
    time in no recorded step is `unrecorded_step`: start-up, a restart, or a step the fault
    cut short (a killed rank's step is never recorded; `since_boundary_s` says how far in)."""
    for s in steps:
        if s.end <= t < s.end + BOUNDARY_S:
            return "after_checkpoint" if s.checkpoint_s > 0 else "after_boundary"
    for s in steps:
        for phase, start, end in s.windows():
            if start <= t < end:
                return phase
    return "unrecorded_step"


def aim(phase: str, boundary: StepSeen, history: list[StepSeen], checkpoint_interval: int) -> Optional[float]:
    """When to fire at `phase`, seen from the record of step `boundary` that just appeared
    (the next step's phases predicted from the median of the recent ones); None when the next
    step has no such phase (wait for another boundary)."""
    next_checkpoints = checkpoint_interval > 0 and (boundary.step + 1) % checkpoint_interval == 0
    plain = [s for s in history[-8:] if s.checkpoint_s == 0] or history[-8:] or [boundary]
    med = {k: statistics.median(getattr(s, k) for s in plain) for k in ("wait_s", "train_s", "sync_s", "step_s")}
    if phase == "after_boundary":
        return None if boundary.checkpoint_s > 0 else boundary.end + 0.2
    if phase == "after_checkpoint":
        return boundary.end + 0.2 if boundary.checkpoint_s > 0 else None
    if phase == "mid_step":
        return boundary.end + med["wait_s"] + med["train_s"] / 2
    if phase == "weight_sync":
        return None if next_checkpoints else boundary.end + med["wait_s"] + med["train_s"] + med["sync_s"] / 2
    if phase == "checkpoint":
        if not next_checkpoints:
            return None
        saved = [s for s in history[-8:] if s.checkpoint_s > 0]
        if not saved:
            return boundary.end + med["step_s"] + 0.1
        return boundary.end + statistics.median(s.step_s - s.checkpoint_s / 2 for s in saved)
    raise ValueError(f"unknown phase {phase!r}")


# ----------------------------------------------------------------------------- the token recount (pure)
def recount(rows: list[dict]) -> dict:
    """Tokens recounted from the per-step records against the ledger.

    The run writes no per-trajectory record; each step's record sums its consumed
    trajectories' generated tokens (`consumed_tokens`, counted from the trajectories, not the
    ledger). So: the sum over steps must equal the ledger's `consumed`, each step's
    `consumed_tokens` must be the step's increase of `ledger/consumed` (a resumed step follows
    the checkpoint's record, whose ledger it restored), and the buckets must add up to
    `generated` in every record."""
    consumed = sum(r["consumed_tokens"] for r in rows)
    last = rows[-1] if rows else {}
    bad_steps = [r["step"] for prev, r in zip([{"ledger/consumed": 0}, *rows], rows)
                 if r["ledger/consumed"] - prev["ledger/consumed"] != r["consumed_tokens"]]
    unbalanced = [r["step"] for r in rows
                  if r["ledger/generated"] != sum(r.get(f"ledger/{b}", 0) for b in LEDGER_BUCKETS)]
    return {
        "source": "per-step records (metrics.jsonl consumed_tokens); the run writes no per-trajectory record",
        "recounted_consumed": consumed,
        "ledger_consumed": last.get("ledger/consumed", 0),
        "equal": consumed == last.get("ledger/consumed", 0) and not bad_steps and not unbalanced,
        "steps_off": bad_steps,
        "steps_unbalanced": unbalanced,
        "ledger": {b: last.get(f"ledger/{b}") for b in (*LEDGER_BUCKETS, "generated")},
    }


def log_times(text: str, pattern: re.Pattern) -> list[float]:
    """Wall times of the log lines matching `pattern` (the logging stamp is local time, ms)."""
    out = []
    for line in text.splitlines():
        m = LOG_STAMP.match(line)
        if m and pattern.search(line):
            out.append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000)
    return out


# ----------------------------------------------------------------------------- the live job
class Steps(threading.Thread):
    """Follows metrics.jsonl: every step record with the time it appeared. A resume rewrites
    the file without the steps after its checkpoint; those stay here (they happened)."""

    def __init__(self, path: Path, poll_s: float = 0.2):
        super().__init__(daemon=True)
        self.path, self.poll_s = path, poll_s
        self.seen: list[StepSeen] = []
        self.last_progress = time.time()
        self.stop = threading.Event()
        self.arrived = threading.Condition()
        self._inode, self._offset, self._partial = None, 0, ""

    def run(self) -> None:
        while not self.stop.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        fresh = (st.st_ino, st.st_dev) != self._inode or st.st_size < self._offset
        if fresh:  # created, or rewritten by a resume: what it holds now was seen before (or is the start)
            first = self._inode is None
            self._inode, self._offset, self._partial = (st.st_ino, st.st_dev), 0, ""
            if not first:
                self._offset = st.st_size
                return
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        now = time.time()
        new = [StepSeen.of(row, now) for row in map(json.loads, filter(None, lines)) if "time/step_s" in row]
        if new:
            with self.arrived:
                self.seen.extend(new)
                self.last_progress = now
                self.arrived.notify_all()

    def next_boundary(self, after: int, timeout: float) -> Optional[StepSeen]:
        """The first record seen after the first `after` ones, waiting up to `timeout`."""
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.seen) > after or self.stop.is_set(), timeout)
            return self.seen[after] if len(self.seen) > after else None


class Logs:
    """The run directory's logs and events.jsonl, read as they grow."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._logs: dict[Path, tuple[int, str, list[str]]] = {}
        """Per log: the offset read to, the unfinished last line, the lines that match `WATCHED`."""

    def times(self, name: str, pattern: re.Pattern) -> list[float]:
        """Wall times of the lines of log `name` (under the run directory) that match
        `pattern`, one of `WATCHED`; the log is read on from where the last call stopped."""
        path = self.run_dir / name
        offset, partial, kept = self._logs.get(path, (0, "", []))
        try:
            with open(path, errors="replace") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (partial + chunk).split("\n")
        partial = lines.pop()  # a line still being written
        kept = kept + [line for line in lines if any(p.search(line) for p in WATCHED)]
        self._logs[path] = (offset, partial, kept)
        return log_times("\n".join(kept), pattern)

    def events(self, kind: str) -> list[tuple[float, str]]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [(r["time"], r["text"]) for r in rows if r["event"] == kind]


def first_after(times: list[float], t: float) -> Optional[float]:
    later = [x for x in times if x >= t]
    return min(later) if later else None


class Job:
    """The launched job's processes, found fresh each time (ranks come back under new pids)."""

    def __init__(self, pid: int, run_dir: Path):
        self.root = psutil.Process(pid)
        self.logs = Logs(run_dir)

    def ranks(self) -> dict[int, psutil.Process]:
        """torchrun's workers by rank: the processes under it that run launch/train.py (its
        children, or its forkserver's where ranks are forked: `forked_ranks`)."""
        out = {}
        for p in self.root.children(recursive=True):
            try:
                if "train.py" in " ".join(p.cmdline()) and "RANK" in p.environ():
                    out[int(p.environ()["RANK"])] = p
            except psutil.Error:
                continue
        return out

    @staticmethod
    def descendants(root: psutil.Process, marker: str) -> list[psutil.Process]:
        out = []
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            return out
        for p in children:
            try:
                if marker in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def schedulers(self, rank: psutil.Process) -> list[psutil.Process]:
        return self.descendants(rank, "sglang::scheduler")



class Injector(threading.Thread):
    """Injects the plan's faults one at a time: waits for the fault's slot, aims at its phase,
    fires, then waits for its detection and recovery before the next."""

    def __init__(self, job: Job, steps: Steps, plan: list[dict], rng: random.Random, *, warmup_steps: int,
                 spacing_s: float, checkpoint_interval: int, heartbeat_timeout_s: float, recover_timeout_s: float):
        super().__init__(daemon=True)
        self.job, self.steps, self.plan, self.rng = job, steps, plan, rng
        self.warmup_steps, self.spacing_s = warmup_steps, spacing_s
        self.checkpoint_interval, self.heartbeat_timeout_s = checkpoint_interval, heartbeat_timeout_s
        self.recover_timeout_s = recover_timeout_s
        self.stop = threading.Event()
        self.faults: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            first = self.steps.next_boundary(self.warmup_steps - 1, timeout=1e9)
            for i, planned in enumerate(self.plan):
                if first is None or self.stop.wait(max(0.0, first.end + i * self.spacing_s - time.time())):
                    return
                fault = self._fire(planned)
                if fault is None:
                    continue
                self.faults.append(fault)
                self._follow(fault)
        finally:
            self.done.set()

    def _say(self, text: str) -> None:
        print(f"[soak] {time.strftime('%H:%M:%S')} {text}", flush=True)

    def _fire(self, planned: dict) -> Optional[dict]:
        """Wait for a boundary from which the aimed phase can be reached, then inject."""
        for _ in range(40):  # boundaries; then fire anyway (the phase hit is recorded either way)
            n = len(self.steps.seen)
            boundary = self.steps.next_boundary(n, timeout=self.recover_timeout_s)
            if boundary is None or self.stop.is_set():
                return None
            at = aim(planned["aimed_phase"], boundary, self.steps.seen[:n + 1], self.checkpoint_interval)
            if at is not None:
                break
        # The victims are found before the wait: finding processes takes long enough on a busy
        # machine to move the fault out of a short phase.
        targets, sig = self._targets(planned["kind"])
        if at is not None and self.stop.wait(max(0.0, at - time.time())):
            return None
        fault = {**planned, "at": time.time(), "victims": []}
        for rank, proc in targets:
            try:
                proc.send_signal(sig)
                fault["victims"].append({"rank": rank, "pid": proc.pid})
            except psutil.Error:
                continue
        if not fault["victims"]:
            self._say(f"{planned['kind']}: nothing to hit")
            return None
        self._say(f"{fault['kind']} (aimed at {fault['aimed_phase']}): {fault['victims']}")
        if sig == signal.SIGSTOP:
            fault["schedulers"] = [s.pid for s in self.job.schedulers(targets[0][1])]
            fault["_cpu_at_stop"] = self._scheduler_cpu(fault)
        return fault

    def _targets(self, kind: str) -> tuple[list[tuple[int, psutil.Process]], signal.Signals]:
        """The processes a fault of `kind` hits, by rank, and the signal."""
        ranks = self.job.ranks()
        rollout = sorted((r, p) for r, p in ranks.items() if r > 0)
        if kind in ("engine", "all_engines"):
            engines = [(r, s) for r, p in rollout for s in self.job.schedulers(p)]
            return (engines if kind == "all_engines" or not engines else [self.rng.choice(engines)]), signal.SIGKILL
        if kind == "env_server":
            return [(0, s) for p in ranks.values() for s in self.job.descendants(p, "tide_megatron.envs.server")][:1], \
                signal.SIGKILL
        if kind in ("rollout_rank_kill", "rollout_rank_stop"):
            return [self.rng.choice(rollout)] if rollout else [], \
                signal.SIGKILL if kind == "rollout_rank_kill" else signal.SIGSTOP
        if kind == "trainer_kill":
            return [(0, ranks[0])] if 0 in ranks else [], signal.SIGKILL
        raise ValueError(f"unknown fault kind {kind!r}")

    def _follow(self, fault: dict) -> None:
        """Fill in `detected_s` and `recovered_s` (from the fault), polling the job's own
        records, until recovered or `recover_timeout_s`."""
        at, kind = fault["at"], fault["kind"]
        ranks = sorted({v["rank"] for v in fault["victims"]})
        pids_before = {p.pid for p in self.job.ranks().values()}
        deadline = at + self.recover_timeout_s
        cont_at = None
        while not self.stop.wait(1.0) and time.time() < deadline:
            detected, recovered = self._signals(kind, ranks, at, pids_before, cont_at, fault)
            if kind == "rollout_rank_stop" and cont_at is None and (
                    detected is not None or time.time() > at + 3 * self.heartbeat_timeout_s):
                cont_at = self._cont(fault)
            if detected is not None:
                fault["detected_s"] = round(detected - at, 1)
            if recovered is not None:
                fault["recovered_s"] = round(recovered - at, 1)
                self._say(f"{kind}: detected after {fault.get('detected_s')} s, recovered after "
                          f"{fault['recovered_s']} s")
                break
        if kind == "rollout_rank_stop" and cont_at is None:
            self._cont(fault)  # never leave a rank stopped
        if kind == "rollout_rank_stop" and "rejoined_after_cont_s" in fault:
            self._took_tasks_again(fault)
        fault.setdefault("detected_s", None)
        fault.setdefault("recovered_s", None)

    def _cont(self, fault: dict) -> float:
        for v in fault["victims"]:
            try:
                psutil.Process(v["pid"]).send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        now = time.time()
        fault["cont_s"] = round(now - fault["at"], 1)
        try:  # the idle rate: no request reaches an engine while its rank is stopped
            fault["scheduler_cpu_rate_stopped"] = round((self._scheduler_cpu(fault) - fault["_cpu_at_stop"])
                                                        / (now - fault["at"]), 3)
        except psutil.Error:
            pass
        return now

    def _signals(self, kind: str, ranks: list[int], at: float, pids_before: set[int], cont_at: Optional[float],
                 fault: dict) -> tuple[Optional[float], Optional[float]]:
        """(detected, recovered) wall times, None where not yet."""
        job = self.job
        if kind in ("engine", "all_engines"):
            died = [first_after(job.logs.times(f"logs/rank{r}.log", ENGINE_DIED), at) for r in ranks]
            restarted = [first_after([t for t, text in job.logs.events("engine_restart")
                                      if text.startswith(f"rollout rank {r} ")], at) for r in ranks]
            detected = min((t for t in died if t is not None), default=None)
            return detected, (max(restarted) if None not in restarted else None)
        if kind == "env_server":
            detected = first_after(job.logs.times("logs/rank0.log", ENV_RESTARTING), at)
            return detected, first_after(job.logs.times("env_server.log", ENV_UP), at)
        if kind in RESTARTING:
            # torchrun noticed once the job's ranks run under new pids; back once a step is made again
            if "_restarted_at" not in fault:
                now_pids = {p.pid for p in job.ranks().values()}
                if now_pids and not now_pids & pids_before:
                    fault["_restarted_at"] = time.time()
            restarted = fault.get("_restarted_at")
            step_after = next((s.end for s in self.steps.seen if restarted and s.end > restarted), None)
            return restarted, step_after
        if kind == "rollout_rank_stop":
            r = ranks[0]
            quarantined = first_after([t for t, text in job.logs.events("quarantine")
                                       if text.startswith(f"rollout rank {r} ")], at)
            rejoined = first_after([t for t, text in job.logs.events("rejoin")
                                    if text.startswith(f"rollout rank {r} ")], cont_at) if cont_at else None
            if rejoined is not None:
                fault["rejoined_after_cont_s"] = round(rejoined - cont_at, 1)
            return quarantined, rejoined
        raise ValueError(kind)

    @staticmethod
    def _scheduler_cpu(fault: dict) -> float:
        return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in fault["schedulers"])

    def _took_tasks_again(self, fault: dict, window_s: float = 15.0) -> None:
        """A rejoined rank generates again: its SGLang schedulers' CPU rate over `window_s`
        after the rejoin against the rate while the rank was stopped (the run records no
        per-rank task counts)."""
        try:
            start = self._scheduler_cpu(fault)
            self.stop.wait(window_s)
            rate = (self._scheduler_cpu(fault) - start) / window_s
        except psutil.Error as exc:
            fault["took_tasks_again"] = f"not measured: {exc}"
            return
        fault["scheduler_cpu_rate_after_rejoin"] = round(rate, 3)
        idle = fault.get("scheduler_cpu_rate_stopped")
        fault["took_tasks_again"] = idle is not None and rate > 2 * idle + 0.05


# ----------------------------------------------------------------------------- hangs
def py_spy() -> Optional[str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return spy if Path(spy).exists() else None


def dump_stacks(root: psutil.Process, out_dir: Path) -> list[str]:
    """`py-spy dump` of `root` and every process under it; the files written (none without py-spy)."""
    spy = py_spy()
    if spy is None:
        return []
    written = []
    for proc in [root, *sorted(root.children(recursive=True), key=lambda p: p.pid)]:
        try:
            name = " ".join(proc.cmdline())[:120]
        except psutil.Error:
            continue
        try:
            dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
            text = dump.stdout + dump.stderr
        except subprocess.TimeoutExpired:
            text = "py-spy dump took over 60 s\n"
        path = out_dir / f"hang_{proc.pid}.txt"
        path.write_text(f"# {name}\n{text}")
        written.append(str(path))
    return written


def kill_tree(root: psutil.Process) -> None:
    """SIGKILL `root` and every process under it. Only those under it are waited for here: the
    root's exit status is left for its parent (the soak's `Popen`) to read."""
    below = root.children(recursive=True)
    for p in [root, *below]:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(below, timeout=30)


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="the job's run.max_wall_minutes")
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    parser.add_argument("--ranks", type=int, default=3, help="1 actor rank, the rest roll out")
    parser.add_argument("--checkpoint-interval", type=int, default=5)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=30.0)
    parser.add_argument("--warmup-steps", type=int, default=6, help="steps before the first fault")
    parser.add_argument("--quiet-minutes", type=float, default=2.0, help="no fault starts this close to the end")
    parser.add_argument("--recover-timeout-s", type=float, default=420.0)
    parser.add_argument("--hang-s", type=float, default=420.0,
                        help="no step this long (start-up and restarts included) is a hang")
    parser.add_argument("--env-error-prob", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak_cpu.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS) or args.ranks < 3:
        parser.error(f"--kinds from {KINDS}; --ranks at least 3 (two rollout ranks)")

    rng = random.Random(args.seed)
    plan = draw_plan(args.faults, rng, kinds)
    restarts = sum(f["kind"] in RESTARTING for f in plan)
    run_dir = Path(tempfile.mkdtemp(prefix="soak_"))
    overrides = ["+recipe=tiny_cpu", "scheduler.mode=tide", f"cluster.rollout_ranks={args.ranks - 1}",
                 "run.steps=1000000", f"run.max_wall_minutes={args.minutes}",
                 f"run.checkpoint_interval={args.checkpoint_interval}", "run.resume=auto",
                 f"scheduler.heartbeat_timeout_s={args.heartbeat_timeout_s}",
                 "metrics.progress=false", "metrics.tensorboard=false", f"run.output_dir={run_dir}",
                 f"run.seed={args.seed}", f"envs.server.envs.0.latency.error_prob={args.env_error_prob}",
                 "scheduler.max_task_retries=2", *LATENCY, *args.overrides]
    cmd = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--nproc-per-node", str(args.ranks),
           "--max-restarts", str(restarts), str(REPO / "launch" / "train.py"), *overrides]
    # Output to a file, not a pipe: a leftover process holding a pipe cannot hang the soak.
    output_path = run_dir.parent / f"{run_dir.name}_output.txt"
    started = time.time()
    with open(output_path, "w") as output:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                stdout=output, stderr=subprocess.STDOUT, text=True)
    print(f"[soak] run {run_dir}, output {output_path}, {len(plan)} faults, --max-restarts {restarts}", flush=True)
    job = Job(proc.pid, run_dir)
    steps = Steps(run_dir / "metrics.jsonl")
    steps.start()
    window_s = max(0.0, 60.0 * (args.minutes - args.quiet_minutes) - 60.0)  # ~a minute of start-up and warm-up
    injector = Injector(job, steps, plan, rng, warmup_steps=args.warmup_steps,
                        spacing_s=window_s / max(1, len(plan)), checkpoint_interval=args.checkpoint_interval,
                        heartbeat_timeout_s=args.heartbeat_timeout_s, recover_timeout_s=args.recover_timeout_s)
    injector.start()

    hang, dumps, ended_by = None, [], "job"
    # Each torchrun restart runs run.max_wall_minutes afresh; past this the soak ends the job itself.
    deadline = started + 60.0 * args.minutes + 240.0
    while proc.poll() is None:
        time.sleep(1.0)
        quiet_s = time.time() - steps.last_progress
        if quiet_s > args.hang_s:
            in_progress = injector.faults[-1] if injector.faults and not injector.done.is_set() else None
            hang = {"no_step_for_s": round(quiet_s, 1), "last_step": steps.seen[-1].step if steps.seen else None,
                    "during_fault": in_progress and {k: in_progress[k] for k in ("kind", "aimed_phase", "victims")}}
            print(f"[soak] HANG: no step for {quiet_s:.0f} s; dumping stacks", flush=True)
            injector.stop.set()
            dumps = dump_stacks(job.root, run_dir)
            kill_tree(job.root)
            ended_by = "soak (hang)"
        elif time.time() > deadline and injector.done.is_set():
            print("[soak] the job runs past its time (restarted attempts start their clock afresh); ending it",
                  flush=True)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                kill_tree(job.root)
            ended_by = "soak (time)"
    injector.stop.set()
    steps.stop.set()
    with steps.arrived:  # an injector waiting for a step hears of the stop
        steps.arrived.notify_all()
    injector.join(timeout=60)
    steps.join()
    steps.read()
    wall = time.time() - started

    metrics_path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if "time/step_s" in line] \
        if metrics_path.exists() else []
    faults = injector.faults
    for f in faults:
        f["hit_phase"] = classify(f["at"], steps.seen)
        before = [s.end for s in steps.seen if s.end <= f["at"]]
        f["since_boundary_s"] = round(f["at"] - max(before), 2) if before else None
        f["at"] = round(f["at"] - started, 1)
        for key in [k for k in f if k.startswith("_")]:
            del f[key]
    count = recount(rows)
    last = rows[-1] if rows else {}
    recovered = [f for f in faults if f["recovered_s"] is not None]
    output_text = output_path.read_text(errors="replace")
    result = {
        "finished": proc.returncode == 0 and hang is None,
        "exit_code": proc.returncode,
        "ended_by": ended_by,
        "hang": hang,
        "stack_dumps": dumps,
        "wall_s": round(wall, 1),
        "steps": len(rows),
        "restarts": len(job.logs.events("resume")),
        "faults_planned": len(plan),
        "faults_injected": len(faults),
        "faults_by_kind": {k: sum(f["kind"] == k for f in faults) for k in kinds},
        "faults_recovered": len(recovered),
        "phases_hit": {p: sum(f["hit_phase"] == p for f in faults) for p in sorted({f["hit_phase"] for f in faults})},
        "aimed_phase_hit": sum(f["hit_phase"] == f["aimed_phase"] for f in faults),
        "recount": count,
        "lost_tokens": last.get("ledger/lost"),
        "staleness_violations": sum(r["staleness/max"] > MAX_STALENESS for r in rows),
        "groups_given_up": last.get("rollout/groups_failed", 0),
        "task_failures": last.get("rollout/task_failures", 0),
        "retries": last.get("rollout/retries", 0),
        "wasted_share": last["ledger/wasted"] / last["ledger/generated"] if rows else None,
        "incomplete_steps": sum(r["groups"] != rows[0]["groups"] for r in rows),
        "goodput_tok_s_last": last.get("run_goodput_tok_s"),
        "run_dir": str(run_dir),
        "faults": faults,
        "tail_of_output": output_text[-3000:] if proc.returncode or hang else "",
    }
    # A stopped rank that rejoined but generates nothing is a rank lost in all but name.
    idle_after_rejoin = [f for f in faults if f["kind"] == "rollout_rank_stop"
                         and f.get("took_tasks_again") is not True]  # (or "not measured")
    # A job the soak ended for time (restarted attempts run run.max_wall_minutes afresh) passes.
    result["passed"] = ok = (result["finished"] or ended_by == "soak (time)") \
        and len(recovered) == len(faults) == len(plan) and not idle_after_rejoin and count["equal"] \
        and result["lost_tokens"] == 0 and result["staleness_violations"] == 0
    record = {
        **bench_record.header("soak", device="cpu", config={**vars(args), "launcher": " ".join(cmd[1:])}),
        "result": result,
    }
    bench_record.write(args.out, record)
    print(f"\n{'kind':<18}{'aimed':<17}{'hit':<17}{'detect s':>9}{'recover s':>10}")
    for f in faults:
        print(f"{f['kind']:<18}{f['aimed_phase']:<17}{f['hit_phase']:<17}{str(f['detected_s']):>9}"
              f"{str(f['recovered_s']):>10}")
    print(f"\nsteps {len(rows)}, faults {len(faults)}/{len(plan)} recovered {len(recovered)}, restarts "
          f"{result['restarts']}, recount {'=' if count['equal'] else '!='} ledger ({count['recounted_consumed']} vs "
          f"{count['ledger_consumed']}), lost {result['lost_tokens']}, stale {result['staleness_violations']}, "
          f"hang {'yes' if hang else 'no'}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
