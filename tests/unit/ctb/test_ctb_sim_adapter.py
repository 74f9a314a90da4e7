"""The simulator's CTB adapter is glue over the core policy: decisions reach the cluster, and with
a trainer clock doomed groups are handed to the simulator to stop and book."""

from types import SimpleNamespace

import pytest

from tide_megatron.core.ctb import CTBConfig
from tide_megatron.core.ctb_deadline import TrainerClock
from tide_megatron.sim.ctb_policy import CTBPolicy


def _traj(tid, gid, prompt=100):
    return SimpleNamespace(traj_id=tid, group_id=gid, task_type="web", prompt_tokens=prompt, is_eval=False,
                           context=prompt, gen=[20, 20, 20], turn=0, cancelled=False, admitted=False)


class FakeCluster:
    """What the simulator's cluster does with the adapter's decisions (admit / resume / pause)."""

    def __init__(self, policy):
        self.policy = policy
        self.log = []

    def admit(self, traj, rank, now):
        traj.admitted = True
        self.log.append(("admit", traj.traj_id, rank))

    def resume(self, traj, rank, now):
        self.log.append(("resume", traj.traj_id, rank))

    def pause(self, traj, now):
        self.log.append(("pause", traj.traj_id))

    def cancel_group(self, group_id):
        for traj in [self.policy.trajs[t] for t in self.policy.group_members.get(group_id, [])]:
            traj.cancelled = True
            if traj.admitted:  # as the simulator's cluster: a cancelled running trajectory ends
                self.policy.on_finished(traj)


def test_doomed_groups_are_handed_to_the_simulator_and_forgotten():
    clock = {"version": 0}
    cancelled = []
    policy = CTBPolicy(CTBConfig(rank_token_budget=10_000, probe_turn_reserve_tokens=50, max_staleness=1),
                       10_000, lambda: 0,
                       clock_fn=lambda now: TrainerClock(clock["version"], 10.0, 10.0 * (clock["version"] + 1)),
                       on_group_cancelled=lambda gid: (cancelled.append(gid), cluster.cancel_group(gid)))
    cluster = FakeCluster(policy)
    policy.bind(cluster)
    policy.on_rank_added(0)
    trajs = [_traj(i, g) for g in (1, 2) for i in range(g * 10, g * 10 + 3)]
    policy.submit(trajs)
    policy.dispatch(0.0)
    assert [e[1] for e in cluster.log if e[0] == "admit"] == [10, 20]  # the probes
    assert policy.backlog() == 4
    clock["version"] = 2  # both groups started at version 0 can no longer be consumed (bound 1)
    policy.dispatch(25.0)
    assert cancelled == [1, 2]
    assert policy.backlog() == 0 and not policy.group_members and policy.sched.audit() == []


def test_a_clock_needs_the_cancellation_hook():
    with pytest.raises(ValueError, match="on_group_cancelled"):
        CTBPolicy(CTBConfig(), 1000, lambda: 0, clock_fn=lambda now: TrainerClock(0, 1.0, 1.0))


def test_without_a_clock_the_adapter_only_relays_the_policy():
    policy = CTBPolicy(CTBConfig(rank_token_budget=1000, probe_turn_reserve_tokens=50), 1000, lambda: 0)
    cluster = FakeCluster(policy)
    policy.bind(cluster)
    policy.on_rank_added(0)
    policy.submit([_traj(1, 1), _traj(2, 1)])
    policy.dispatch(0.0)
    traj = policy.trajs[1]
    policy.on_turn_finished(traj)
    policy.dispatch(1.0)
    assert [e[1] for e in cluster.log if e[0] == "admit"] == [1, 2]
    traj.context = 300
    policy.on_finished(traj)
    policy.on_finished(policy.trajs[2])
    assert not policy.trajs and policy.sched.counts()["finished"] == 0  # the group was forgotten
    with pytest.raises(KeyError):
        policy.sched.status(1)
