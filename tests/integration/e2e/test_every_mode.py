"""Every scheduling mode finishes on the real stack, and tide mode finishes at the settings that
used to deadlock: the README's command, larger batches, and KV pools from 10% to 150% of the
live context. No run may waste or lose tokens, or exceed the staleness bound.

Short runs (2-3 steps) of the tiny recipe; each is a full torchrun job with SGLang and Megatron.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tide_megatron.testing import read_metrics, run_job, slow_env

import metric_sinks

pytestmark = pytest.mark.integration

# The tiny recipe's live context: 2 x groups_per_step x group_size tasks of up to ~300 tokens.
LIVE_CONTEXT_TOKENS = 2 * 4 * 4 * 300


def train(run_dir: Path, ranks: int, *overrides: str, env: dict[str, str] | None = None) -> list[dict]:
    proc = run_job("metrics.tensorboard=false", "run.checkpoint_interval=0", "scheduler.stall_timeout_s=120",
                   f"run.output_dir={run_dir}", *overrides, nproc=ranks, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return read_metrics(run_dir)


def check(rows: list[dict], steps: int, groups: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["groups"] == groups
        assert r["staleness/max"] <= 1
        assert r["ledger/lost"] == 0
    assert rows[-1]["ledger/wasted"] <= 0.02 * rows[-1]["ledger/generated"]


# sync_split, the tiny recipe's own mode, is the run of test_train_tiny_cpu.py. The tide run is the
# README's command (`torchrun --nproc-per-node 3 launch/train.py +recipe=tiny_cpu scheduler.mode=tide
# cluster.ref_ranks=1`: actor, reference rank, rollout rank), and it also logs to W&B and MLflow
# (metric_sinks.py; both in requirements/loggers.lock), the path a user takes.
SPLITS = {"sync": (3, ("cluster.rollout_share=0", "cluster.rollout_ranks=1")),  # rank 2 rolls out, rank 1 is lent
          "tide": (3, ("cluster.ref_ranks=1",))}


@pytest.mark.parametrize("mode", ["sync", "async_static", "stream", "tide"])
def test_every_mode_trains(tmp_path, mode):
    sinks = mode == "tide"
    run_dir = tmp_path / "run"
    ranks, split = SPLITS.get(mode, (2, ()))
    rows = train(run_dir, ranks, f"scheduler.mode={mode}", "run.steps=3", *split,
                 *(metric_sinks.OVERRIDES if sinks else ()), env=metric_sinks.job_env(tmp_path) if sinks else None)
    check(rows, 3, 4)
    assert {r["mode"] for r in rows} == {mode}
    if mode == "sync":
        assert all(r["staleness/max"] == 0 for r in rows)
        # sync time-shares: ranks 1 and 2 roll out each batch, then train it beside rank 0
        assert [r["trainer/dp_size"] for r in rows] == [3] * 3
        spans = json.loads((run_dir / "timeline.json").read_text())["ranks"]
        assert [s["role"] for s in spans["2"]] == ["rollout", "actor_ref"] * 3
        assert [s["role"] for s in spans["1"]] == ["actor_ref"] + ["rollout", "actor_ref"] * 3
        # the lent rank is in service before the first batch is placed: every step feeds both
        assert [r["placement/ranks_fed"] for r in rows] == [2] * 3
    if mode == "stream":
        assert all(r["ra2p/num_swaps"] >= 2 for r in rows)  # a Ref/Actor alternation per micro-batch
    if mode == "tide":
        check_timeline(run_dir, rows)
        metric_sinks.check_logged(tmp_path, run_dir, rows, mode)


def check_timeline(run_dir: Path, rows: list[dict]) -> None:
    """timeline.json holds one record per step, with the step's RA2P mode and staleness as the
    metrics log has them, and every rank's role (rank 2 rolls out throughout); timeline.png is
    written next to it."""
    timeline = json.loads((run_dir / "timeline.json").read_text())
    steps = timeline["steps"]
    assert [s["step"] for s in steps] == [r["step"] for r in rows]
    for s, r in zip(steps, rows):
        assert s["ra2p_mode"] == r["ra2p/mode"] and s["ra2p_mode"] in ("colocated", "decoupled")
        assert s["staleness_max"] == r["staleness/max"] and s["staleness_mean"] == r["staleness/mean"]
        assert 0 <= s["start"] < s["end"] and s["rollout_ranks"] == 1
    assert {int(k) for k in timeline["ranks"]} == {0, 1, 2}
    assert [span["role"] for span in timeline["ranks"]["2"]] == ["rollout"]
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("groups_per_step,pool_share", [(8, 1.5), (16, 0.1)])
def test_tide_finishes_with_larger_batches_and_any_kv_pool(tmp_path, groups_per_step, pool_share):
    """Larger batches, with a KV pool from a tenth of the tiny recipe's live context (CTB must
    pause and resume) to one and a half times it (CTB must not get in the way)."""
    pool = int(LIVE_CONTEXT_TOKENS * pool_share)
    rows = train(tmp_path, 2, "scheduler.mode=tide", f"scheduler.groups_per_step={groups_per_step}",
                 f"rollout.engine.max_total_tokens={pool}", "run.steps=2")
    check(rows, 2, groups_per_step)


def test_trainer_roles_change_every_step_under_load(tmp_path):
    """ERS's drill moves the trainer side between its two layouts at every post-update boundary:
    colocated over ranks 0-2 (DP=3) and decoupled (DP=2 actors, rank 2 the reference). Rank 2
    joins and leaves the actor group with state handed over, while rollout runs on rank 3.

    Steps 1, 2 and 4 stream with DP=2 actors (ranks 0, 1) beside the reference rank: every group
    completing during the step goes to one DP rank, and both join the gradient all-reduce."""
    rows = train(tmp_path, 4, "scheduler.mode=tide", "cluster.rollout_ranks=1", "cluster.ref_ranks=1",
                 "ers.enabled=true", "ers.drill_every=1", "run.steps=5")
    check(rows, 5, 4)
    assert all(r["grad_norm"] > 0 for r in rows)
    # The roles in force during step k are those the boundary after step k-1 chose; no roles
    # change after the last step (no step follows). Step 1 runs on the start-up split.
    assert [r.get("ers/changes") for r in rows] == [1, 2, 3, 4, None]
    assert [r["trainer/dp_size"] for r in rows] == [2, 2, 3, 2, 3]
    assert {r["ra2p/mode"] for r in rows[1::2]} == {"decoupled"}
    assert all(r["ers/role_change_s"] > 0 for r in rows[:-1])
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    # Step 1 runs the start-up hybrid: RA2P picks its mode (rank 2 serves as the reference, or
    # idles in a colocated step); then the drill's layouts.
    roles = [role_during(timeline["ranks"]["2"], s) for s in timeline["steps"]]
    assert roles[0] in ("ref", "idle") and roles[1:] == ["ref", "actor_ref", "ref", "actor_ref"]


def role_during(spans: list[dict], step: dict) -> str:
    """A rank's role at the middle of a timeline step."""
    t = (step["start"] + step["end"]) / 2
    return next(s["role"] for s in spans if s["start"] <= t and (s["end"] is None or t < s["end"]))


SLOW_ENV = slow_env(0.5)
# A move under load needs tasks still running when the trainer finishes step 1: a KV pool of
# ~8 tasks per rank makes the window's 32 tasks roll out in waves, and 1.5 s env steps make a
# wave far longer than a training step, also on a loaded CI machine (with 16k-token pools and
# 0.5 s steps the window once drained before the move).
HANDOVER_LOAD = ["rollout.engine.max_total_tokens=2048", *slow_env(1.5)]


def test_ranks_move_between_rollout_and_the_trainer_under_load(tmp_path):
    """ERS's split drill on 3 ranks with a slow env (tasks are resident when a move comes):
    rank 1 leaves rollout and joins the actors (DP=2), serves as the reference (decoupled),
    returns to rollout, and joins the actors again. Its tasks are handed over to rank 2 and go on
    there (episode, env session and all); nothing is lost, every step trains within the
    staleness bound. After the rollout scale-down the buffer retains a reservoir
    (`scheduler.min_groups_per_step=2`): a step trains fewer groups, and nothing is wasted.

    The weights go by the broadcast path, and its update group follows the split: rank 2 alone
    while rank 1 trains (it moved at the first boundary, before that sync), the same group kept
    at the next sync, rank 1 sent the weights of its return by the host path, and then both in a
    re-formed group. (The host path alone, the default, carries the weights of every other ERS
    test here: ranks returning to rollout in the TP-block and cold-start tests load by it.)"""
    rows = train(tmp_path, 3, "scheduler.mode=tide", "cluster.rollout_ranks=2", "ers.enabled=true",
                 "ers.drill=split", "ers.drill_every=1", "run.steps=4", "scheduler.min_groups_per_step=2",
                 "scheduler.weight_sync_path=broadcast", *HANDOVER_LOAD)
    assert [(r["weights/host_ranks"], r["weights/broadcast_ranks"]) for r in rows] == [(0, 1), (0, 1), (1, 1), (0, 2)]
    assert [r["weights/group_rebuild_s"] > 0 for r in rows] == [True, False, False, True]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 2 <= r["groups"] <= 4 and r["staleness/max"] <= 1 and r["ledger/lost"] == 0
    # boundary 1 scales rollout down (retention for steps 2-3: a step may keep room for groups on
    # their last chance, never less than 2); boundary 3 scales it up again
    assert rows[0]["groups"] == 4 and min(r["groups"] for r in rows[1:3]) < 4 and rows[3]["groups"] == 4
    assert rows[-1]["ledger/wasted"] <= 0.02 * rows[-1]["ledger/generated"]
    assert [r.get("ers/moves") for r in rows] == [1, 1, 2, None]  # none after the last step
    # The roles in force during step k are those the boundary after step k-1 chose.
    assert [r["trainer/dp_size"] for r in rows[1:]] == [2, 1, 1]
    assert rows[2]["ra2p/mode"] == "decoupled"
    last = rows[-1]
    assert last["rollout/tasks_moved"] >= 1  # a move under load
    # at least one had begun its episode and went on elsewhere (a task not begun starts afresh)
    assert last["rollout/tasks_carried"] >= 1 and last["rollout/carried_tokens"] > 0
    assert last["rollout/moves_out"] == 1 and last["rollout/moves_in"] == 1 and last["rollout/quarantines"] == 0
    assert last.get("rollout/retries", 0) == 0  # a moved task goes on, it is not retried
    timeline = json.loads((tmp_path / "timeline.json").read_text())  # the roles of steps 1-4
    assert [span["role"] for span in timeline["ranks"]["1"]] == ["rollout", "actor_ref", "ref", "rollout"]


def test_ers_lends_trainer_ranks_to_rollout_at_cold_start(tmp_path):
    """ERS on, no drill, 4 ranks (actors 0-2, rollout 3): before the first step ranks 1 and 2
    roll out on their standby engines (nothing is ready to train yet), from the weights of
    version 0; the loan ends when the first step's data is ready, both return at once, and that
    step trains on the start-up split (DP=3), as in the simulator. Nothing is lost or wasted,
    the bound holds."""
    rows = train(tmp_path, 4, "scheduler.mode=tide", "cluster.rollout_ranks=1", "ers.enabled=true", "run.steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["groups"] == 4 and r["staleness/max"] <= 1 and r["ledger/lost"] == 0 and r["ledger/wasted"] == 0
    assert rows[0]["trainer/dp_size"] == 3 and rows[0]["ers/cold_start_end_s"] > 0  # the loan ended first
    assert rows[0]["ers/moves"] >= 4  # two out, two back
    # Step 1's window opened as they came back: their groups complete on rank 3 in it, so ERS
    # reads no rollout rate from it (it would read rank 3 at up to three times its own), nor
    # the slots they filled, and holds the split.
    assert rows[0]["ers/rollout_rate"] == 0.0 and rows[0]["ers/trainer_rate"] > 0
    assert rows[0]["ers/reason"].startswith("split held: the rollout ranks changed")
    assert rows[-1]["rollout/moves_in"] >= 2 and rows[-1]["rollout/quarantines"] == 0  # ranks 1-2 loaded v0
    # ERS read the decode the engines measured (SGLang's scheduler -> turn report -> rank 0).
    # Step 1's window opens when the loan ends (as the simulator's): on this recipe it lasts
    # about one short training step, often less than a turn, whose end brings the counters, so
    # it may read none (ERS then reads decode as unslowed). The next window spans a boundary
    # and a step; a measured mean batch is at least one sequence. Its slowdown is a ratio of
    # times measured under other loads of this shared machine (seen below 1): only a reading.
    assert rows[1]["ers/mean_decode_batch"] >= 1.0 and rows[1]["ers/decode_slowdown"] > 0
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    for rank in ("1", "2"):
        # The run's clock starts with rollout, while the standby engines may still be starting:
        # trainer ranks until then, then lent, then back within step 1 (not at its boundary).
        segments = timeline["ranks"][rank]
        roles = [seg["role"] for seg in segments]
        lent = roles.index("rollout")
        assert roles[:lent] in ([], ["actor_ref"]) and roles[lent + 1] == "actor_ref"
        assert segments[lent + 1]["start"] < timeline["steps"][0]["end"]


def test_ers_lends_trainer_ranks_to_rollout_while_an_evaluation_runs(tmp_path):
    """ERS on, 4 ranks (actors 0-2, rollout 3), a slow env and an evaluation of 6 groups every
    2 steps: at boundary 2, where the evaluation of step 2's model starts, every trainer rank
    the step does not need to finish within the last evaluation's measured duration rolls out;
    boundary 3 gathers the evaluation and returns to ERS's reactive plan. Every evaluation
    completes, nothing is lost, the bound holds."""
    rows = train(tmp_path, 4, "scheduler.mode=tide", "cluster.rollout_ranks=1", "ers.enabled=true",
                 "ers.preemptive_cold_start=false", "scheduler.eval_every=2", "scheduler.eval_groups=6",
                 "run.steps=4", *SLOW_ENV)
    steps = [r for r in rows if "groups" in r]
    evals = {r["eval/version"]: r for r in rows if "eval/version" in r}
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["groups"] == 4 and r["staleness/max"] <= 1 and r["ledger/lost"] == 0
    assert sorted(evals) == [0, 2, 4] and all(e["eval/complete"] == 1 and e["eval/duration_s"] > 0
                                              for e in evals.values())
    assert steps[0].get("ers/lent_ranks", 0) == 0  # no evaluation starts at boundary 1
    def runs_on(step: dict, boundary: dict) -> bool:  # the step's actors and reference ranks are the boundary's
        return step["trainer/dp_size"] + boundary["ers/trainer_ranks_ref"] == boundary["ers/trainer_ranks"]

    assert steps[1]["ers/lent_ranks"] >= 1 and runs_on(steps[2], steps[1])  # step 3 ran on the loan
    # Boundary 3 returns to ERS's reactive plan, which moves at most one rank a step: the
    # trainer (actors and reference ranks) is at least as large as on the loan; step 4 runs on it.
    after = steps[2]
    assert after["ers/lent_ranks"] == 0 and after["ers/trainer_ranks"] >= steps[1]["ers/trainer_ranks"]
    assert runs_on(steps[3], after) and steps[-1]["rollout/quarantines"] == 0


def test_whole_tp_blocks_move_between_rollout_and_the_trainer(tmp_path):
    """TP=2: the actor is ranks 0-1, rollout 2-4. The split drill moves ranks 2-3 (one TP block)
    in as a second data-parallel replica (DP=2), makes them the reference unit (decoupled),
    then returns them to rollout; rank 4, in no whole block, only rolls out. Steps 1 and 4 train
    the TP=2 actor alone (DP=1): both TP ranks join each step and each weight gather."""
    rows = train(tmp_path, 5, "scheduler.mode=tide", "cluster.rollout_ranks=3", "trainer.tp_size=2",
                 "ers.enabled=true", "ers.drill=split", "ers.drill_every=1", "run.steps=4", *SLOW_ENV)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["groups"] == 4 and r["staleness/max"] <= 1 and r["ledger/lost"] == 0
    assert [r["trainer/dp_size"] for r in rows] == [1, 2, 1, 1] and all(r["grad_norm"] > 0 for r in rows)
    assert rows[2]["ra2p/mode"] == "decoupled"
    assert [r.get("ers/moves") for r in rows] == [2, 2, 4, None]
    assert rows[-1]["rollout/quarantines"] == 0 and rows[-1]["rollout/moves_out"] == 2
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    for rank in ("2", "3"):
        assert [role_during(timeline["ranks"][rank], s) for s in timeline["steps"]] == \
            ["rollout", "actor_ref", "ref", "rollout"]
