import pytest

from tide_megatron.controller.eval_aggregator import EvalAggregator
from tide_megatron.rollout.task_runner import TaskAssignment, Trajectory


def _traj(group, index, reward, version):
    return Trajectory(group_id=group, index=index, task_id="t", policy_version=version, prompt_tokens=3,
                      generated_tokens=2, reward=reward, is_eval=True, turns=1)


def test_metrics_per_version_best_of_n_and_pass_rate():
    agg = EvalAggregator(pass_threshold=1.0)
    agg.expect(3, [TaskAssignment(task={}, group_id=g, index=i, is_eval=True) for g in ("a", "b") for i in range(2)])
    agg.record(_traj("a", 0, 1.0, 3))
    agg.record(_traj("a", 1, 0.2, 3))
    agg.record(_traj("b", 0, 0.0, 3))
    assert not agg.ready(3) and agg.outstanding(3) == 1 and agg.pop(3) is None
    agg.record(_traj("b", 1, 0.4, 3))
    m = agg.pop(3)
    assert m.complete and m.trajectories == 4 and m.groups == 2
    assert m.mean_reward == pytest.approx(0.4)
    assert m.pass_rate == pytest.approx(0.25)
    assert m.best_of_n_reward == pytest.approx(0.7)
    assert m.pass_at_n == pytest.approx(0.5)
    assert agg.versions() == []


def test_trajectory_caught_by_a_sync_counts_for_the_version_it_was_submitted_for():
    agg = EvalAggregator()
    agg.expect(1, [TaskAssignment(task={}, group_id="a", index=0, is_eval=True)])
    agg.record(_traj("a", 0, 1.0, 0))
    assert agg.ready(1)
    partial = EvalAggregator()
    partial.expect(5, [TaskAssignment(task={}, group_id="x", index=i, is_eval=True) for i in range(3)])
    partial.record(_traj("x", 0, 1.0, 5))
    m = partial.pop(5, partial=True)
    assert not m.complete and m.trajectories == 1 and m.expected == 3


def test_an_abandoned_eval_group_lets_the_evaluation_complete_without_it():
    agg = EvalAggregator()
    agg.expect(2, [TaskAssignment(task={}, group_id=g, index=i, is_eval=True) for g in ("a", "b") for i in range(2)])
    agg.record(_traj("a", 0, 1.0, 2))
    agg.record(_traj("a", 1, 0.0, 2))
    agg.record(_traj("b", 0, 1.0, 2))
    agg.abandon(2, ["b/0", "b/1"])  # group b failed past its retries
    m = agg.pop(2)
    assert m is not None and m.trajectories == 2 and m.groups == 1 and m.mean_reward == pytest.approx(0.5)


def test_duration_runs_from_submission_to_the_trajectory_that_completes_the_evaluation():
    agg = EvalAggregator()
    agg.expect(4, [TaskAssignment(task={}, group_id="a", index=i, is_eval=True) for i in range(2)], now=10.0)
    agg.record(_traj("a", 0, 1.0, 4), now=12.0)
    agg.record(_traj("a", 1, 0.0, 4), now=17.5)
    agg.record(_traj("a", 1, 0.0, 4), now=30.0)  # a late duplicate does not move the end
    assert agg.pop(4).duration_s == pytest.approx(7.5)
    agg.expect(6, [TaskAssignment(task={}, group_id=g, index=0, is_eval=True) for g in ("a", "b")], now=0.0)
    agg.record(_traj("a", 0, 1.0, 6), now=1.0)
    partial = agg.pop(6, partial=True)
    assert not partial.complete and "eval/duration_s" not in partial.to_log()  # not measured: not logged
    agg.expect(8, [TaskAssignment(task={}, group_id=g, index=0, is_eval=True) for g in ("a", "b")], now=0.0)
    agg.record(_traj("a", 0, 1.0, 8), now=1.0)
    agg.abandon(8, ["b/0"], now=3.0)  # the failed group's end completes it
    assert agg.pop(8).to_log()["eval/duration_s"] == pytest.approx(3.0)
