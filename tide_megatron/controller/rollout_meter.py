"""What ERS reads of the rollout side over each step, measured on the rollout service's thread.

ERS decides whether rollout or the trainer needs a rank from what rollout actually delivered
and how hard it ran, so the measurements must come from where the tasks are booked: the
tokens of training groups that became ready and of evaluation trajectories (counted only while
admission was open: groups completing while the staleness window's slots were full are what
the throttle allowed, not what rollout can), the time those slots were full, the CTB ranks' KV
use and the tasks in flight (sampled at most every `SAMPLE_S`, time-weighted), and the ranks'
decode iteration times (from the cumulative counters in each finished turn's plugin report).

Owned by the rollout service's thread, like everything it reads (the placement, the
quarantine's ranks in service); `take_window` hands the main thread one window and starts the
next.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from sglang_patches.scheduler_hooks import DECODE_COUNTERS
from tide_megatron.core.buffer import CompletedGroup

SAMPLE_S = 0.1
"""How often the KV use and the tasks in flight that ERS reads are sampled."""


def _empty_window() -> dict[str, float]:
    return {"fresh_tokens": 0, "eval_tokens": 0, "slots_full_s": 0.0, "kv_share_s": 0.0, "kv_s": 0.0,
            "tasks_s": 0.0, "decode_iterations": 0, "decode_s": 0.0, "decode_seq_s": 0.0, "batch_s": 0.0}


class RolloutMeter:
    def __init__(self, *, placement, quarantine):
        self.placement = placement  # its `running()` and, with CTB, `kv_usage(ranks)`
        self.quarantine = quarantine  # its `serving`: the ranks whose decode and KV count
        self._window = _empty_window()
        self._decode_last: dict[int, tuple[int, tuple[float, ...]]] = {}  # rank -> (scheduler pid, counters)
        self._floor = [0, 0.0]  # batch-of-one decode iterations and seconds, the whole run
        self._full_since: Optional[float] = None
        self._kv_share: Optional[float] = None  # CTB ranks' mean KV use at the last sample (None: unknown)
        self._tasks = 0  # tasks placed on rollout ranks at the last sample
        self._sampled_at = 0.0

    def delivered(self, group: CompletedGroup) -> None:
        """A group completed; ERS counts its tokens only while admission is open."""
        if self._full_since is None:
            self._window["eval_tokens" if group.is_eval else "fresh_tokens"] += group.total_tokens

    def note_slots(self, now: float, full: bool) -> None:
        """Whether the staleness window's admission slots are full as of `now`."""
        if self._full_since is not None:
            self._window["slots_full_s"] += now - self._full_since
        self._full_since = now if full else None

    def sample(self, now: float, force: bool = False) -> None:
        """Time-weighted KV use and tasks in flight: each sample, taken at most every
        `SAMPLE_S`, holds until the next (the loop runs every few ms; a sample per pass would
        weigh busy spells, when the loop is slow, less than idle ones)."""
        if not force and now - self._sampled_at < SAMPLE_S:
            return
        if self._kv_share is not None:
            self._window["kv_share_s"] += self._kv_share * (now - self._sampled_at)
            self._window["kv_s"] += now - self._sampled_at
        self._window["tasks_s"] += self._tasks * (now - self._sampled_at)
        usage = getattr(self.placement, "kv_usage", None)
        self._kv_share = usage(self.quarantine.serving) if usage is not None else None
        self._tasks = self.placement.running()
        self._sampled_at = now

    def decode_report(self, rank: int, report: dict[str, Any]) -> None:
        """Book the decode a rank in service ran since its previous turn report. The counters
        are cumulative per scheduler process (`pid`): a new process (the engine restarted)
        starts afresh, so its values are the difference; a report of the same process with
        fewer iterations is an older one that arrived late and is skipped. A rank out of
        service (moved to the trainer, quarantined) only updates its last values."""
        if "decode_iterations" not in report:
            return
        pid, now = report.get("pid", 0), tuple(report[f] for f in DECODE_COUNTERS)
        prev = self._decode_last.get(rank)
        same = prev is not None and prev[0] == pid
        if same and now[0] < prev[1][0]:
            return
        self._decode_last[rank] = (pid, now)
        if rank not in self.quarantine.serving:
            return
        diff = dict(zip(DECODE_COUNTERS, (a - b for a, b in zip(now, prev[1])) if same else now))
        for f in ("decode_iterations", "decode_s", "decode_seq_s", "batch_s"):
            self._window[f] += diff[f]
        self._floor[0] += diff["decode_floor_iterations"]
        self._floor[1] += diff["decode_floor_s"]

    def take_window(self, now: Optional[float] = None) -> dict[str, float]:
        """What ERS reads of rollout since the last call (then reset): tokens of training groups
        that became ready and of evaluation trajectories while admission was open (a group was
        waiting for a rank: Rollout ran at capacity), seconds the admission slots were full,
        the mean KV use of the CTB ranks in service (0 without CTB), the task-seconds of the
        tasks placed on rollout ranks (`tasks_in_flight_s`), and their decode:
        `decode_iteration_s`, the mean decode iteration of the window (pooled over the ranks:
        seconds / iterations); `mean_decode_batch`, the time-averaged sequences per iteration
        (sum of batch size x seconds / seconds, as the simulator's); `decode_seq_s`, that sum;
        `decode_floor_s`, the mean batch-of-one iteration of the whole run so far (rare under
        load, so not per window); `rollout_busy_s`, the seconds the engines ran batches of any
        kind, summed over the ranks.
        Each is 0 when nothing was measured (no CTB report yet, or no batch of one): ERS then
        reads decode as unslowed. The window lags by up to a turn (the counters travel in the
        plugin's report at each turn's end)."""
        now = time.monotonic() if now is None else now
        self.note_slots(now, self._full_since is not None)
        self.sample(now, force=True)
        w, self._window = self._window, _empty_window()
        floor_n, floor_s = self._floor
        return {"fresh_tokens": w["fresh_tokens"], "eval_tokens": w["eval_tokens"], "slots_full_s": w["slots_full_s"],
                "kv_used_fraction": w["kv_share_s"] / w["kv_s"] if w["kv_s"] else 0.0,
                "decode_iteration_s": w["decode_s"] / w["decode_iterations"] if w["decode_iterations"] else 0.0,
                "mean_decode_batch": w["decode_seq_s"] / w["decode_s"] if w["decode_s"] > 0 else 0.0,
                "decode_seq_s": w["decode_seq_s"], "tasks_in_flight_s": w["tasks_s"], "rollout_busy_s": w["batch_s"],
                "decode_floor_s": floor_s / floor_n if floor_n else 0.0}
