"""Configuration of CTB in the real system, and the start-up check of its resources.

What a resident task holds on its rollout rank, and how each budget is derived:

- KV tokens: its context. The rank's budget is `kv_budget_fraction` x the engine's KV pool
  (`rollout.engine.max_total_tokens`); the rest is headroom for tokens generated before a
  footprint is reported. Pausing keeps a rank below `policy.hard_water` x budget, which must
  stay within the pool.
- A request row (SGLang's `req_to_token_pool`): measured on SGLang 0.5.23
  (`benchmarks/ctb_rows.py`, results in `benchmarks/results/ctb_rows.json`): the pool has
  exactly `max_running_requests` rows; a one-shot request frees its row when it finishes; a
  streaming session takes its first turn's row and keeps it until the session closes, and
  every later turn borrows that row (no second row). But the scheduler admits a waiting
  request only while some row is FREE (`Scheduler.get_num_allocatable_reqs` > 0), even a turn
  that would borrow its own session's row: with as many open sessions as rows, every next turn
  waits forever, and runs as soon as one session closes. So a rank
  may hold at most `max_running_requests - 1` tasks (`resident_cap_for_rows`): each resident
  task has at most one session (one row), and tasks whose pause or cancel is not yet confirmed
  by the carrier still count, so one row is always free for the next turn of any of them.
- An environment slot: `policy.env_concurrency` over all ranks.

`check_ctb_resources` runs in the job's `validate()`: a configuration whose caps contradict
each other fails at start with a one-line message naming the keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tide_megatron.core.ctb import CTBConfig

FREE_ROWS_FOR_TURNS = 1
"""Request rows a rank keeps free so that any resident task's next turn can be admitted (see
the module docstring: SGLang admits a borrowing turn only while one row is free)."""


def resident_cap_for_rows(request_rows: int) -> int:
    """Most tasks a rank may hold when its engine has `request_rows` request rows."""
    return request_rows - FREE_ROWS_FOR_TURNS


@dataclass
class CTBDispatchConfig:
    """How rollout tasks are dispatched to rollout ranks (`ctb.*` of the job)."""

    enabled: bool = True
    """Task-level CTB. False: vanilla request-level scheduling (every task dispatched at once,
    whole context resent each turn, SGLang alone batches and retracts)."""
    policy: CTBConfig = field(default_factory=CTBConfig)
    """The CTB policy (priority weights, hysteresis, pause bounds, env concurrency, staleness,
    probing reserve). Its `rank_token_budget` is used only for ranks whose engine's KV pool size
    is not configured, and its `max_resident_per_rank` never (each rank's cap comes from rows)."""
    kv_budget_fraction: float = 0.85
    """A rank's CTB token budget as a fraction of its engine's KV pool (`max_total_tokens`):
    the rest is headroom for the tokens a turn generates before its footprint is reported, so
    CTB pauses before SGLang has to retract."""
    max_resident_tasks_per_rank: Optional[int] = None
    """Most tasks one rank holds (resident, or paused/cancelled and not yet released). None: as
    many as the engine's request rows allow, `rollout.engine.max_running_requests - 1`; a larger
    value is refused at start (every open session holds a row, and a turn needs one free)."""
    prompt_tokens_estimate: int = 256
    """Prompt length assumed for a task before its probe has measured one."""
    turn_reserve_tokens: int = 64
    """Tokens one more turn of a waiting task may add (observation + action); carried in the
    task tag for the engine-side report."""
    require_plugin: bool = True
    """Fail a rank whose responses carry no `tide_ctb` report (plugin missing or refused)."""
    schedule_interval_s: float = 0.01
    """Longest wait between two scheduling passes when no event wakes the loop earlier."""

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_budget_fraction <= 1.0:
            raise ValueError("ctb.kv_budget_fraction must be in (0, 1]")
        if self.max_resident_tasks_per_rank is not None and self.max_resident_tasks_per_rank < 1:
            raise ValueError("ctb.max_resident_tasks_per_rank must be >= 1 (or null: derived from the engine)")

    def rank_limits(self, kv_tokens: Optional[int], request_rows: Optional[int]) -> tuple[int, int]:
        """(token budget, task cap) of a rank whose engine has `kv_tokens` of KV pool and
        `request_rows` request rows (`max_running_requests`); ValueError naming the keys when
        they contradict each other."""
        if request_rows is None:
            raise ValueError("ctb.enabled needs rollout.engine.max_running_requests set: CTB caps the tasks a rank "
                             "holds below the engine's request rows")
        most = resident_cap_for_rows(request_rows)
        cap = self.max_resident_tasks_per_rank if self.max_resident_tasks_per_rank is not None else most
        if most < 1 or cap > most:
            raise ValueError(
                f"ctb.max_resident_tasks_per_rank={cap} with rollout.engine.max_running_requests={request_rows}: "
                f"at most {most} tasks may be resident (each open SGLang streaming session holds a request row, "
                f"and a turn is admitted only while {FREE_ROWS_FOR_TURNS} row is free)")
        budget = int(kv_tokens * self.kv_budget_fraction) if kv_tokens else self.policy.rank_token_budget
        return budget, cap


def check_ctb_resources(ctb: CTBDispatchConfig, *, max_running_requests: Optional[int],
                        max_total_tokens: Optional[int]) -> None:
    """Start-up check of CTB against its engines: rows, KV headroom, and the first probe."""
    if not ctb.enabled:
        return
    budget, _cap = ctb.rank_limits(max_total_tokens, max_running_requests)
    policy = ctb.policy
    if max_total_tokens and ctb.kv_budget_fraction * policy.hard_water > 1.0:
        raise ValueError(
            f"ctb.kv_budget_fraction={ctb.kv_budget_fraction} x ctb.policy.hard_water={policy.hard_water} > 1: "
            "pausing would let a rank's tasks outgrow the engine's KV pool (rollout.engine.max_total_tokens)")
    probe = ctb.prompt_tokens_estimate + policy.probe_turn_reserve_tokens
    if probe > budget:
        source = ("ctb.kv_budget_fraction x rollout.engine.max_total_tokens" if max_total_tokens
                  else "ctb.policy.rank_token_budget")
        raise ValueError(
            f"a probe needs ctb.prompt_tokens_estimate + ctb.policy.probe_turn_reserve_tokens = {probe} tokens, more "
            f"than a rank's CTB budget of {budget} ({source}): no rank could ever hold a task")
