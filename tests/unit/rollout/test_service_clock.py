"""A rollout rank's busy and idle time, as its heartbeats report them (rank 0's RWT)."""

from tide_megatron.rollout.worker import ServiceClock


def test_time_out_of_rollout_is_neither_busy_nor_idle():
    """Parked on standby from start-up (t=0-10), rolls out (a task 12-15), trains (20-50),
    rolls out again (no task): only the time in rollout without a task is idle. Counted as
    idle, the 30 s in the trainer read as one step's RWT when the rank came back."""
    clock = ServiceClock(0.0)
    clock.left(0.0)  # parked: a standby engine on a trainer rank
    clock.back(10.0)
    assert clock.busy_idle(10.0) == (0.0, 0.0)
    clock.task_started(12.0)
    clock.task_started(13.0)  # a second task: still one busy span
    clock.no_task(15.0)
    assert clock.busy_idle(20.0) == (3.0, 7.0)
    clock.left(20.0)
    assert clock.busy_idle(50.0) == (3.0, 7.0)  # training: nothing accrues
    clock.back(50.0)
    assert clock.busy_idle(52.0) == (3.0, 9.0)


def test_a_rank_that_leaves_with_a_task_running_stops_being_busy():
    clock = ServiceClock(0.0)
    clock.task_started(1.0)
    clock.left(4.0)
    assert clock.busy_idle(9.0) == (3.0, 1.0)
