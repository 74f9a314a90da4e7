"""The soak's pure parts (benchmarks/soak.py), without launching a job: the fault plan over
kinds and phases, placing a time in a step's phases, aiming at a phase from a step boundary,
following metrics.jsonl across a resume's rewrite, the logs' timestamps, the recount of
tokens against the ledger, and what a hang gets (a stack dump of a small process tree)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import soak  # noqa: E402


def test_twelve_faults_hit_every_kind_twice_and_spread_over_the_phases():
    plan = soak.draw_plan(12, random.Random(3))
    assert Counter(f["kind"] for f in plan) == dict.fromkeys(soak.KINDS, 2)
    phases = Counter(f["aimed_phase"] for f in plan)
    assert set(phases) == set(soak.PHASES) and set(phases.values()) <= {2, 3}
    assert soak.draw_plan(12, random.Random(3)) == plan  # the seed decides
    assert soak.draw_plan(12, random.Random(4)) != plan


def test_fewer_faults_than_kinds_are_all_different():
    plan = soak.draw_plan(4, random.Random(0), kinds=("engine", "env_server", "trainer_kill", "all_engines"))
    assert len({f["kind"] for f in plan}) == 4


def step(n: int, end: float, *, step_s=10.0, train_s=6.0, sync_s=1.0, checkpoint_s=0.0) -> soak.StepSeen:
    return soak.StepSeen(n, end, step_s, train_s, sync_s, checkpoint_s)


@pytest.mark.parametrize("t,phase", [
    (101.5, "data_wait"),         # step 2 runs 100-110: wait 100-102 (after the boundary second)
    (100.5, "after_boundary"),    # the first second after step 1's record
    (105.0, "mid_step"),          # training 102-108
    (108.5, "weight_sync"),       # sync 108-109
    (109.5, "checkpoint"),        # checkpoint 109-110
    (110.5, "after_checkpoint"),  # just after step 2, which saved one
    (111.5, "unrecorded_step"),   # past the last step seen (a restart, or a step cut short)
    (50.0, "unrecorded_step"),    # before the first
])
def test_a_time_is_placed_in_the_phase_of_the_step_it_fell_in(t, phase):
    steps = [step(1, 100.0), step(2, 110.0, train_s=6.0, checkpoint_s=1.0)]
    assert soak.classify(t, steps) == phase


@pytest.mark.parametrize("phase", soak.PHASES)
def test_aiming_from_a_boundary_hits_the_phase_when_the_next_step_is_like_the_last(phase):
    interval = 5

    def like_the_others(n: int, after: float) -> soak.StepSeen:  # a checkpoint adds its second to the step
        saves = n % interval == 0
        return step(n, after + (11.0 if saves else 10.0), step_s=11.0 if saves else 10.0,
                    checkpoint_s=1.0 if saves else 0.0)

    history = [like_the_others(1, 0.0)]
    while len(history) < 12:
        history.append(like_the_others(len(history) + 1, history[-1].end))
    aimed = 0
    for boundary in history[1:-1]:  # before any checkpoint was seen, and after
        at = soak.aim(phase, boundary, history[:boundary.step], interval)
        if at is not None:
            assert soak.classify(at, history) == phase, (boundary.step, at)
            aimed += 1
    assert aimed


def test_a_phase_the_next_step_lacks_waits_for_another_boundary():
    plain, saved = step(3, 30.0), step(5, 50.0, checkpoint_s=1.0)
    assert soak.aim("checkpoint", plain, [plain], checkpoint_interval=5) is None  # step 4 saves nothing
    assert soak.aim("after_checkpoint", plain, [plain], checkpoint_interval=5) is None
    assert soak.aim("after_boundary", saved, [saved], checkpoint_interval=5) is None
    assert soak.aim("weight_sync", step(4, 40.0), [step(4, 40.0)], checkpoint_interval=5) is None  # step 5 saves
    with pytest.raises(ValueError):
        soak.aim("lunch", plain, [plain], checkpoint_interval=5)


def row(n: int, consumed: int, total: int, **ledger) -> dict:
    buckets = {f"ledger/{b}": 0 for b in soak.LEDGER_BUCKETS}
    buckets.update({f"ledger/{k}": v for k, v in ledger.items()})
    buckets["ledger/consumed"] = total
    return {"step": n, "consumed_tokens": consumed, "time/step_s": 1.0, **buckets,
            "ledger/generated": sum(buckets[f"ledger/{b}"] for b in soak.LEDGER_BUCKETS)}


def test_the_recount_of_per_step_records_equals_the_ledger_across_a_resume():
    # steps 1-3, a restart from the step-2 checkpoint dropped step 3's record, then 3 and 4 again
    rows = [row(1, 100, 100, ready=50), row(2, 120, 220, failed=7), row(3, 90, 310), row(4, 80, 390, in_flight=5)]
    count = soak.recount(rows)
    assert count["equal"] and count["recounted_consumed"] == count["ledger_consumed"] == 390
    assert count["ledger"]["failed"] == 0 and count["ledger"]["in_flight"] == 5
    assert "no per-trajectory record" in count["source"]


def test_the_recount_names_a_step_the_ledger_disagrees_with():
    rows = [row(1, 100, 100), row(2, 120, 230), row(3, 90, 320)]
    count = soak.recount(rows)
    assert not count["equal"] and count["steps_off"] == [2]
    unbalanced = [row(1, 100, 100)]
    unbalanced[0]["ledger/generated"] += 1
    assert soak.recount(unbalanced)["steps_unbalanced"] == [1]
    assert soak.recount([])["equal"]


def test_log_times_read_the_logging_stamp_and_skip_other_lines():
    text = ("2026-12-04 14:54:37,894 [rank1] ERROR x: an SGLang subprocess of this rollout rank died; ...\n"
            "\tcontinued line that mentions an SGLang subprocess of this rollout rank died\n"
            "2026-12-04 14:54:40,200 [rank1] INFO x: something else\n")
    [t] = soak.log_times(text, soak.ENGINE_DIED)
    assert t == time.mktime(time.strptime("2026-12-04 14:54:37", "%Y-%m-%d %H:%M:%S")) + 0.894


def test_logs_are_read_as_they_grow_even_a_line_cut_in_two(tmp_path):
    logs = soak.Logs(tmp_path)
    log = tmp_path / "env_server.log"
    log.write_text("2026-12-04 14:54:01,128 env-server INFO env server on 127.0.0.1:4")
    assert logs.times("env_server.log", soak.ENV_UP) == []  # the line is not finished
    with open(log, "a") as f:
        f.write("6241 serving ['door_game']\n2026-12-04 14:55:01,000 env-server INFO closing idle session s\n")
    assert len(logs.times("env_server.log", soak.ENV_UP)) == 1
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"step": 3, "event": "rejoin", "text": "rollout rank 2 rejoined", "time": 5.0}) + "\n"
        + json.dumps({"step": 3, "event": "quarantine", "text": "rollout rank 2 quarantined", "time": 4.0}) + "\n")
    assert logs.events("rejoin") == [(5.0, "rollout rank 2 rejoined")]
    assert soak.first_after([1.0, 4.0, 9.0], 3.0) == 4.0 and soak.first_after([1.0], 3.0) is None


def test_steps_follow_metrics_across_a_resume_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = soak.Steps(path)
    record = lambda n: json.dumps({"step": n, "time/step_s": 1.0, "time/train_s": 0.5, "time/sync_s": 0.1,  # noqa: E731
                                   "time/checkpoint_s": 0.0}) + "\n"
    steps.read()  # no file yet
    path.write_text(record(1) + record(2) + record(3)[:10])
    steps.read()
    assert [s.step for s in steps.seen] == [1, 2]
    with open(path, "a") as f:
        f.write(record(3)[10:] + json.dumps({"step": 3, "eval/mean_reward": 0.5}) + "\n")
    steps.read()
    assert [s.step for s in steps.seen] == [1, 2, 3]
    (tmp_path / "rewritten").write_text(record(1) + record(2))  # a resume from step 2 drops step 3
    (tmp_path / "rewritten").replace(path)
    steps.read()
    assert [s.step for s in steps.seen] == [1, 2, 3]  # nothing new happened
    with open(path, "a") as f:
        f.write(record(3))
    steps.read()
    assert [s.step for s in steps.seen] == [1, 2, 3, 3]
    assert steps.next_boundary(3, timeout=0.0).step == 3 and steps.next_boundary(4, timeout=0.0) is None


def test_every_kind_is_one_the_injector_knows():
    assert set(soak.RESTARTING) <= set(soak.KINDS)
    assert all(re.fullmatch(r"[a-z_]+", k) for k in (*soak.KINDS, *soak.PHASES))


def test_a_hung_job_gets_a_stack_dump_of_each_process_then_is_killed(tmp_path):
    assert soak.py_spy(), "py-spy is not installed (it is in requirements/cpu.lock)"
    hung = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                             "def waits_forever(): time.sleep(60)\nwaits_forever()"])
    try:
        root = psutil.Process(hung.pid)
        deadline = time.time() + 20
        while not root.children() and time.time() < deadline:
            time.sleep(0.1)
        below = root.children()
        dumps = soak.dump_stacks(root, tmp_path)
        assert len(dumps) == 2
        assert "waits_forever" in Path(dumps[0]).read_text()
        soak.kill_tree(root)
        assert hung.wait(timeout=10) == -9 and not any(p.is_running() for p in below)
    finally:
        hung.kill()
