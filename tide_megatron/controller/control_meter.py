"""What the control plane costs rank 0, step by step (the `control/*` metrics).

The controller's work grows with the ranks it drives: messages to read and post, tasks to place,
roles to plan. These figures say how much of a step that work takes, so that its growth with
ranks can be measured (`benchmarks/control_plane.py`) instead of assumed:

    control/cpu_process_s          rank 0's CPU time in the step, every thread (rank 0 also
                                   runs its own trainer passes and weight sends)
    control/cpu_rollout_thread_s   the rollout service's thread: mailbox reads, task placement,
                                   the buffer, health; the control plane proper
    control/cpu_main_thread_s      the step loop's thread (rank 0's trainer passes included)
    control/loops                  passes of the rollout service's loop (one mailbox read
                                   each, 5-40 ms apart: idle passes cost per wall second)
    control/messages_sent          messages rank 0 posted in the step
    control/messages_received      messages rank 0 read in the step
    control/placement_passes       placement passes that decided something (CTB: admit,
                                   pause, resume, cancel; request level: post a task)
    control/placement_p50_ms ...   their latency: p50, p99, max
    control/ers_plan_ms            ERS's planning of the next step's roles (0: no plan;
                                   drills and time sharing's loans are not plans)

The store that carries the messages runs in torchrun's agent, not in rank 0: its CPU time is not
in these figures.
"""

from __future__ import annotations

import math
import threading
import time


class DecisionTimer:
    """Durations of one kind of decision, recorded on any thread, taken once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: list[float] = []

    def record(self, seconds: float) -> None:
        with self._lock:
            self._seconds.append(seconds)

    def take(self) -> list[float]:
        """The durations recorded since the last take, sorted."""
        with self._lock:
            out, self._seconds = self._seconds, []
        return sorted(out)


def quantile(xs: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of sorted `xs` (0 for none)."""
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class ControlMeter:
    """Rank 0's control-plane cost per step. `step_metrics` is called once per step, from the
    step loop's thread (it reads that thread's CPU clock). The rollout service's thread books its
    own `loops` and `cpu_s` each pass: another thread's CPU clock is not read, since a thread id
    outlives its thread and may name another."""

    def __init__(self, mailbox, rollout, ers_plan: DecisionTimer):
        """`rollout`: the rollout service (its `placement.decision_times`, `loops`, `cpu_s`)."""
        self._mailbox, self._rollout, self._ers_plan = mailbox, rollout, ers_plan
        self._last = self._read()

    def start(self) -> None:
        """Count from now on: what came before (the engines' start-up) is left out."""
        self._last = self._read()
        self._rollout.placement.decision_times.take()
        self._ers_plan.take()

    def _read(self) -> dict[str, float]:
        return {"process": time.process_time(), "main": time.thread_time(), "rollout": self._rollout.cpu_s,
                "loops": float(self._rollout.loops), "sent": float(self._mailbox.posted),
                "received": float(self._mailbox.received)}

    def step_metrics(self) -> dict[str, float]:
        now = self._read()
        d = {k: now[k] - self._last[k] for k in now}
        self._last = now
        passes, plans = self._rollout.placement.decision_times.take(), self._ers_plan.take()
        return {"control/cpu_process_s": d["process"], "control/cpu_rollout_thread_s": d["rollout"],
                "control/cpu_main_thread_s": d["main"], "control/loops": d["loops"], "control/messages_sent": d["sent"],
                "control/messages_received": d["received"], "control/placement_passes": float(len(passes)),
                "control/placement_p50_ms": 1e3 * quantile(passes, 0.5),
                "control/placement_p99_ms": 1e3 * quantile(passes, 0.99),
                "control/placement_max_ms": 1e3 * (passes[-1] if passes else 0.0),
                "control/ers_plan_ms": 1e3 * sum(plans)}
