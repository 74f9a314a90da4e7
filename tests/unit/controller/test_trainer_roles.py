"""ERS at rank 0: role plans <-> trainer assignments on the job's prefix of TP blocks, the
drills, and the order of a move between rollout and the trainer (against a fake rollout
service); the role changes themselves run end to end in tests/integration/e2e/test_every_mode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tide_megatron.comm.groups import GroupLayout
from tide_megatron.comm.messages import RolesDone
from tide_megatron.config import ERSJobConfig
from tide_megatron.controller.trainer_roles import TrainerRoles
from tide_megatron.core.ers import ERSMeasurements
from tide_megatron.core.ra2p import MicroBatchTimes, RA2PConfig
from tide_megatron.core.roles import RA2PMode, Role
from tide_megatron.trainer.assignment import TrainerAssignment


class FakeWorker:
    """What TrainerRoles reads and calls on rank 0's TrainerWorker."""

    def __init__(self, layout: GroupLayout, assignment: TrainerAssignment):
        self.registry = SimpleNamespace(layout=layout)
        self.assignment = assignment
        self.applied: list[TrainerAssignment] = []

    def apply(self, new: TrainerAssignment) -> dict[str, float]:
        self.applied.append(new)
        self.assignment = new
        return {"total_s": 0.5}


class FakeMailbox:
    owner = 0

    def __init__(self):
        self.posted: list[tuple[int, str]] = []

    def post(self, dest, msg):
        self.posted.append((dest, msg.KIND))


def make(world: int, tp: int, trainers: int, refs: int, drill_every: int = 1):
    layout = GroupLayout(world, tp)
    start = TrainerAssignment.at_startup(layout, range(trainers), range(trainers, trainers + refs))
    topo = SimpleNamespace(trainer_ranks=list(range(trainers)), ref_ranks=list(range(trainers, trainers + refs)),
                           rollout_ranks=list(range(trainers + refs, world)), world_size=world)
    worker, mailbox = FakeWorker(layout, start), FakeMailbox()
    replies = [RolesDone("actor", {"total_s": 1.5})] * (trainers + refs - 1)
    roles = TrainerRoles(ERSJobConfig(enabled=True, drill_every=drill_every), topo, mailbox, worker, RA2PConfig(),
                         take=lambda kind, count, timeout_s: replies[:count])
    return roles, worker, mailbox


def window() -> ERSMeasurements:
    return ERSMeasurements(window_s=1.0, trainer_ranks=3, trainer_busy_s=1.0, trainer_starved_s=0.0,
                           trained_tokens=100, rollout_ranks=1, fresh_tokens=100, eval_tokens=0,
                           slots_full_s=0.0, kv_used_fraction=0.0)


def test_the_start_up_hybrid_reads_as_colocated_over_every_trainer_side_rank():
    roles, _, _ = make(world=4, tp=1, trainers=2, refs=1)
    assert roles.plan.mode is RA2PMode.COLOCATED
    assert roles.plan.ranks_with(Role.ACTOR_REF) == [0, 1, 2] and roles.plan.rollout_ranks == [3]


def test_the_drill_alternates_layouts_and_every_trainer_side_rank_is_told():
    roles, worker, mailbox = make(world=4, tp=1, trainers=2, refs=1)
    times = MicroBatchTimes(0.05, 0.05, 0.1)
    first = roles.after_update(1, window(), times)
    assert worker.assignment == TrainerAssignment(worker.registry.layout, 2, (2,), actors_hold_ref=False)
    assert sorted(dest for dest, kind in mailbox.posted if kind == "roles") == [1, 2]
    assert first["ers/changes"] == 1 and first["ers/role_change_slowest_rank_s"] == 1.5
    roles.after_update(2, window(), times)
    assert worker.assignment == TrainerAssignment(worker.registry.layout, 3, (), actors_hold_ref=True)
    assert worker.assignment.dp_size == 3 and len(worker.applied) == 2


def test_reference_ranks_are_whole_tp_blocks_at_the_top_of_the_prefix():
    roles, worker, _ = make(world=6, tp=2, trainers=2, refs=2)
    roles.after_update(1, window(), MicroBatchTimes(0.05, 0.05, 0.1))
    assert worker.assignment.ref_ranks == (2, 3) and worker.assignment.actor_ranks == (0, 1)
    roles.after_update(2, window(), MicroBatchTimes(0.05, 0.05, 0.1))
    assert worker.assignment.actor_ranks == (0, 1, 2, 3) and worker.assignment.dp_size == 2


def test_one_trainer_rank_has_nothing_to_move():
    roles, worker, mailbox = make(world=2, tp=1, trainers=1, refs=0)
    assert not roles.enabled


def test_without_the_drill_ers_keeps_the_rollout_split():
    roles, worker, _ = make(world=4, tp=1, trainers=2, refs=1, drill_every=0)
    for step in range(1, 6):
        roles.after_update(step, window(), MicroBatchTimes(0.05, 0.05, 0.1))
        assert roles.plan.rollout_ranks == [3]
        assert set(worker.assignment.actor_ranks) | set(worker.assignment.ref_ranks) == {0, 1, 2}


@pytest.mark.parametrize("bad", [-1])
def test_bad_drill_is_refused(bad):
    from tide_megatron.config import JobConfig, validate

    cfg = JobConfig()
    cfg.scheduler.mode = "tide"
    cfg.ers.enabled, cfg.ers.drill_every = True, bad
    with pytest.raises(ValueError, match="ers.drill_every"):
        validate(cfg, 4)


class FakeRollout:
    """The rollout service calls TrainerRoles makes, in order, into `events`."""

    def __init__(self, serving, events):
        self.quarantine = SimpleNamespace(serving=list(serving))
        self.events = events
        self.moved: set[int] = set()
        self.loading: set[int] = set()  # returned to rollout, weights not loaded yet

    def call(self, fn, timeout_s=600.0):
        return fn()

    def submit(self, fn, when=None):
        return (fn, when)

    def wait(self, fut, timeout_s, what):
        fn, when = fut
        assert when is None or when(), f"would wait for {what}"
        return fn()

    def move_to_trainer(self, rank, reason, retain=True):
        self.events.append(("move_to_trainer", rank) if retain else ("move_to_trainer", rank, "no retention"))
        self.quarantine.serving.remove(rank)
        self.moved.add(rank)
        return 0

    def in_trainer(self, rank):
        return rank in self.moved

    def returning(self, rank):
        return rank in self.loading

    def return_to_rollout(self, rank):
        self.events.append(("return_to_rollout", rank))
        self.moved.discard(rank)
        self.quarantine.serving.append(rank)


def test_the_split_drill_moves_the_next_rank_in_and_back_draining_it_first():
    """Rank 1 leaves rollout (its tasks taken back and dropped before it is told its trainer
    role), joins the actors (DP=2), serves as the reference, then returns to rollout (named to
    the rollout service before the sync)."""
    layout = GroupLayout(4, 1)
    topo = SimpleNamespace(trainer_ranks=[0], ref_ranks=[], rollout_ranks=[1, 2, 3], world_size=4)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0], []))
    worker.needs_ref = True
    events: list = []
    mailbox = FakeMailbox()
    mailbox.post = lambda dest, msg: events.append((msg.KIND, dest))
    rollout = FakeRollout([1, 2, 3], events)
    roles = TrainerRoles(ERSJobConfig(enabled=True, drill_every=1, drill="split"), topo, mailbox, worker,
                         RA2PConfig(), take=lambda kind, count, timeout_s: [RolesDone("actor", {"total_s": 0.1})] * count,
                         rollout=rollout)
    assert roles.enabled and roles.moves_split
    times = MicroBatchTimes(0.05, 0.05, 0.1)
    first = roles.after_update(1, window(), times)
    assert events == [("move_to_trainer", 1), ("roles", 1)]
    assert worker.assignment == TrainerAssignment(layout, 2, (), actors_hold_ref=True)
    assert first["ers/moves"] == 1 and first["ers/trainer_ranks"] == 2
    assert roles.rollout_resized  # the next window opens on a smaller rollout: not a rollout rate
    events.clear()
    roles.after_update(2, window(), times)
    assert events == [("roles", 1)] and worker.assignment == TrainerAssignment(layout, 1, (1,), actors_hold_ref=False)
    assert not roles.rollout_resized  # a change of layout alone leaves rollout as it was
    events.clear()
    third = roles.after_update(3, window(), times)
    assert events == [("roles", 1), ("return_to_rollout", 1)]
    assert worker.assignment == TrainerAssignment(layout, 1, (), actors_hold_ref=True)
    assert third["ers/moves"] == 2 and third["ers/changes"] == 3 and roles.ranks == [0]


def test_a_planned_join_of_a_quarantined_rank_holds_the_roles():
    layout = GroupLayout(3, 1)
    topo = SimpleNamespace(trainer_ranks=[0], ref_ranks=[], rollout_ranks=[1, 2], world_size=3)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0], []))
    worker.needs_ref = True
    rollout = FakeRollout([2], [])  # rank 1 is quarantined
    roles = TrainerRoles(ERSJobConfig(enabled=True, drill_every=1, drill="split"), topo, FakeMailbox(), worker,
                         RA2PConfig(), take=lambda kind, count, timeout_s: [], rollout=rollout)
    out = roles.after_update(1, window(), MicroBatchTimes(0.05, 0.05, 0.1))
    assert out["ers/moves"] == 0 and worker.applied == [] and rollout.events == []


def test_with_tensor_parallel_actors_whole_tp_blocks_move():
    """TP=2, ranks 0-1 the actor, 2-5 rollout: the split drill moves ranks 2-3 (a TP block, one
    data-parallel replica) in as actors (DP=2), then as the reference unit, then back out."""
    layout = GroupLayout(6, 2)
    topo = SimpleNamespace(trainer_ranks=[0, 1], ref_ranks=[], rollout_ranks=[2, 3, 4, 5], world_size=6)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1], []))
    worker.needs_ref = True
    events: list = []
    mailbox = FakeMailbox()
    mailbox.post = lambda dest, msg: events.append((msg.KIND, dest))
    roles = TrainerRoles(ERSJobConfig(enabled=True, drill_every=1, drill="split"), topo, mailbox, worker,
                         RA2PConfig(), take=lambda kind, count, timeout_s: [RolesDone("actor", {"total_s": 0.1})] * count,
                         rollout=FakeRollout([2, 3, 4, 5], events))
    assert roles.moves_split and roles.ers.config.rank_block == 2
    times = MicroBatchTimes(0.05, 0.05, 0.1)
    roles.after_update(1, window(), times)
    assert [e for e in events if e[0] == "move_to_trainer"] == [("move_to_trainer", 2), ("move_to_trainer", 3)]
    assert worker.assignment == TrainerAssignment(layout, 2, (), actors_hold_ref=True)
    roles.after_update(2, window(), times)
    assert worker.assignment == TrainerAssignment(layout, 1, (2, 3), actors_hold_ref=False)
    events.clear()
    out = roles.after_update(3, window(), times)
    assert [e for e in events if e[0] == "return_to_rollout"] == [("return_to_rollout", 2), ("return_to_rollout", 3)]
    assert roles.ranks == [0, 1] and out["ers/moves"] == 4


def test_standby_engines_start_on_the_trainer_ranks_ers_may_move_and_need_the_memory_saver_on_gpu():
    from tide_megatron.config import JobConfig, validate
    from tide_megatron.controller.trainer_roles import may_train, standby_engine_ranks

    cfg = JobConfig()
    cfg.scheduler.mode = "tide"
    assert standby_engine_ranks(cfg, [0, 1, 2]) == []  # ERS off
    cfg.ers.enabled = True
    assert standby_engine_ranks(cfg, [0, 1, 2]) == [1, 2]  # rank 0 always trains
    cfg.ers.move_ranks = False
    assert standby_engine_ranks(cfg, [0, 1, 2]) == []
    cfg.ers.move_ranks = True
    cfg.trainer.tp_size = 2
    assert standby_engine_ranks(cfg, [0, 1, 2, 3]) == [2, 3]  # rank 0's TP block always trains
    cfg.cluster.rollout_ranks = 3  # 5 ranks: actor block 0-1, rollout 2-4; rank 4 is in no whole block
    assert [r for r in range(5) if may_train(cfg, r, 5)] == [0, 1, 2, 3]
    cfg.ers.enabled = False
    assert [r for r in range(5) if may_train(cfg, r, 5)] == [0, 1]
    cfg.ers.enabled, cfg.trainer.tp_size, cfg.cluster.rollout_ranks = True, 1, 1
    cfg.rollout.engine.device = "cuda"
    with pytest.raises(ValueError, match="enable_memory_saver"):
        validate(cfg, 4)
    cfg.rollout.engine.extra_args = {"enable_memory_saver": True}
    validate(cfg, 4)


def test_cold_start_lends_every_trainer_rank_but_rank_0_to_rollout_and_a_boundary_ends_the_loan():
    layout = GroupLayout(4, 1)
    topo = SimpleNamespace(trainer_ranks=[0, 1, 2], ref_ranks=[], rollout_ranks=[3], world_size=4)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1, 2], []))
    worker.needs_ref = True
    events: list = []
    mailbox = FakeMailbox()
    mailbox.post = lambda dest, msg: events.append((msg.KIND, dest))
    rollout = FakeRollout([3], events)
    roles = TrainerRoles(ERSJobConfig(enabled=True), topo, mailbox, worker, RA2PConfig(),
                         take=lambda kind, count, timeout_s: [RolesDone("actor", {"total_s": 0.1})] * count, rollout=rollout)
    lent = roles.cold_start()
    assert worker.assignment == TrainerAssignment(layout, 1, (), actors_hold_ref=True) and roles.ranks == [0]
    assert sorted(e for e in events if e[0] == "return_to_rollout") == [("return_to_rollout", 1),
                                                                       ("return_to_rollout", 2)]
    assert lent["ers/moves"] == 2 and roles.plan.trainer_ranks == [0, 1, 2]  # the reactive plan is kept
    events.clear()
    back = roles.after_update(1, window(), MicroBatchTimes(0.05, 0.05, 0.1))  # rates unmeasured: hold the split
    assert [e for e in events if e[0] == "move_to_trainer"] == [("move_to_trainer", 1), ("move_to_trainer", 2)]
    assert worker.assignment.actor_ranks == (0, 1, 2) and back["ers/moves"] == 4


def test_the_cold_start_loan_ends_when_the_first_step_has_its_data():
    """The first step's data is ready: the lent ranks come back to the trainer then, before it
    trains (not at the first boundary), without starting data retention (the loan's end is not
    a scale-down ERS planned); the loan ends once. A lent rank still loading the first weights
    is waited for."""
    layout = GroupLayout(4, 1)
    topo = SimpleNamespace(trainer_ranks=[0, 1, 2], ref_ranks=[], rollout_ranks=[3], world_size=4)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1, 2], []))
    events: list = []
    rollout = FakeRollout([3], events)
    roles = TrainerRoles(ERSJobConfig(enabled=True), topo, FakeMailbox(), worker, RA2PConfig(),
                         take=lambda kind, count, timeout_s: [RolesDone("actor", {"total_s": 0.1})] * count, rollout=rollout)
    roles.cold_start()
    rollout.loading = {2}
    with pytest.raises(AssertionError, match=r"would wait for lent rank\(s\) \[1, 2\] to load the first weights"):
        roles.end_cold_start(1, timeout_s=5.0)
    roles.cold_start()  # (the failed attempt above ended that loan's bookkeeping)
    assert not roles.rollout_resized  # lent before anything was in flight
    rollout.loading = set()
    events.clear()
    ended = roles.end_cold_start(1, timeout_s=5.0)
    assert events == [("move_to_trainer", 1, "no retention"), ("move_to_trainer", 2, "no retention")]
    assert worker.assignment.actor_ranks == (0, 1, 2) and ended["ers/cold_start_end_s"] >= 0
    # their groups complete on rank 3 in the window that opens now: ERS does not read it as rank 3's rate
    assert roles.rollout_resized
    assert roles.end_cold_start(2, timeout_s=5.0) == {}  # over: nothing moves again
    events.clear()
    roles.after_update(1, window(), MicroBatchTimes(0.05, 0.05, 0.1))  # rates unmeasured: the split holds
    assert events == [] and worker.assignment.actor_ranks == (0, 1, 2) and not roles.rollout_resized


def test_no_cold_start_loan_with_a_drill_or_when_turned_off():
    for cfg in (ERSJobConfig(enabled=True, drill_every=1, drill="split"),
                ERSJobConfig(enabled=True, preemptive_cold_start=False)):
        layout = GroupLayout(4, 1)
        topo = SimpleNamespace(trainer_ranks=[0, 1], ref_ranks=[], rollout_ranks=[2, 3], world_size=4)
        worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1], []))
        roles = TrainerRoles(cfg, topo, FakeMailbox(), worker, RA2PConfig(), take=lambda *a, **k: [],
                             rollout=FakeRollout([2, 3], []))
        assert roles.cold_start() == {} and worker.applied == []


def test_an_evaluation_step_lends_the_trainer_ranks_the_step_does_not_need_and_gets_them_back():
    """Measured: 300 tokens a step at 100 tokens per trainer-rank-second. An evaluation expected
    to take 2 s needs ceil(300 / (100 x 2)) = 2 trainer ranks for the step to end within it, so
    rank 2 rolls out during the evaluation step and the next boundary returns to the reactive
    plan."""
    layout = GroupLayout(4, 1)
    topo = SimpleNamespace(trainer_ranks=[0, 1, 2], ref_ranks=[], rollout_ranks=[3], world_size=4)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1, 2], []))
    worker.needs_ref = True
    events: list = []
    rollout = FakeRollout([3], events)
    roles = TrainerRoles(ERSJobConfig(enabled=True, preemptive_cold_start=False), topo, FakeMailbox(), worker,
                         RA2PConfig(), take=lambda kind, count, timeout_s: [RolesDone("actor", {"total_s": 0.1})] * count,
                         rollout=rollout)
    m = ERSMeasurements(window_s=1.0, trainer_ranks=3, trainer_busy_s=1.0, trainer_starved_s=0.0, trained_tokens=300,
                        rollout_ranks=1, fresh_tokens=1000, eval_tokens=0, slots_full_s=0.0, kv_used_fraction=0.0)
    times = MicroBatchTimes(0.05, 0.05, 0.1)
    short = roles.after_update(1, m, times, expected_eval_s=0.5)  # 6 ranks would be needed: no loan
    assert short["ers/lent_ranks"] == 0 and worker.applied == [] and events == []
    assert short["ers/reason"].startswith("balance: trainer 100 tok/rank-s, rollout 1000 tok/rank-s")  # the split held
    lent = roles.after_update(2, m, times, expected_eval_s=2.0)
    assert events == [("return_to_rollout", 2)] and worker.assignment.actor_ranks == (0, 1)
    assert lent["ers/lent_ranks"] == 1 and lent["ers/moves"] == 1
    assert lent["ers/reason"].startswith("evaluation expected to take 2.0 s; 2 trainer rank(s)")  # the loan's
    assert roles.plan.trainer_ranks == [0, 1, 2]  # the reactive plan is what ERS goes on from
    events.clear()
    back = roles.after_update(3, m, times)
    assert events == [("move_to_trainer", 2)] and worker.assignment.actor_ranks == (0, 1, 2)
    assert back["ers/lent_ranks"] == 0


def test_no_evaluation_loan_when_turned_off_or_during_a_drill():
    for cfg in (ERSJobConfig(enabled=True, preemptive_cold_start=False, preemptive_eval=False),
                ERSJobConfig(enabled=True, drill_every=5, drill="split")):
        layout = GroupLayout(4, 1)
        topo = SimpleNamespace(trainer_ranks=[0, 1, 2], ref_ranks=[], rollout_ranks=[3], world_size=4)
        worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1, 2], []))
        worker.needs_ref = True
        roles = TrainerRoles(cfg, topo, FakeMailbox(), worker, RA2PConfig(), take=lambda *a, **k: [],
                             rollout=FakeRollout([3], []))
        m = ERSMeasurements(window_s=1.0, trainer_ranks=3, trainer_busy_s=1.0, trainer_starved_s=0.0,
                            trained_tokens=300, rollout_ranks=1, fresh_tokens=1000, eval_tokens=0, slots_full_s=0.0,
                            kv_used_fraction=0.0)
        out = roles.after_update(1, m, MicroBatchTimes(0.05, 0.05, 0.1), expected_eval_s=100.0)
        assert out.get("ers/lent_ranks", 0) == 0 and worker.applied == []


def test_time_sharing_lends_every_rank_but_rank_0s_block_for_each_rollout_and_trains_on_all():
    """scheduler.mode=sync (VeRL-like): before each step's rollout every trainer rank but rank
    0's TP block rolls out (the boundary's lend comes before the weight sync, so the lent ranks
    take the new weights); when the batch is complete every whole TP block of the world trains,
    the start-up rollout ranks included. No ERS planning is involved (ERS is off)."""
    layout = GroupLayout(5, 2)  # TP blocks {0,1} {2,3}; rank 4 is in no whole block: it only rolls out
    topo = SimpleNamespace(trainer_ranks=[0, 1], ref_ranks=[], rollout_ranks=[2, 3, 4], world_size=5)
    worker = FakeWorker(layout, TrainerAssignment.at_startup(layout, [0, 1], []))
    worker.needs_ref = True
    events: list = []
    mailbox = FakeMailbox()
    mailbox.post = lambda dest, msg: events.append((msg.KIND, dest))
    rollout = FakeRollout([2, 3, 4], events)
    roles = TrainerRoles(ERSJobConfig(enabled=False), topo, mailbox, worker, RA2PConfig(),
                         take=lambda kind, count, timeout_s: [RolesDone("actor", {"total_s": 0.1})] * count,
                         rollout=rollout, time_share=True)
    assert roles.enabled and roles.moves_split
    roles.cold_start()  # rank 0's block already is the whole trainer: nothing moves
    assert roles.ranks == [0, 1] and roles.plan.trainer_ranks == [0, 1, 2, 3]
    for step in range(1, 4):
        events.clear()
        roles.end_cold_start(step, timeout_s=1.0)  # the batch is complete; nothing to retain for
        assert [e for e in events if e[0] == "move_to_trainer"] == [("move_to_trainer", 2, "no retention"),
                                                                    ("move_to_trainer", 3, "no retention")]
        assert worker.assignment == TrainerAssignment(layout, 2, (), actors_hold_ref=True)
        events.clear()
        out = roles.after_update(step, window(), MicroBatchTimes(0.05, 0.05, 0.1))
        assert [e for e in events if e[0] == "return_to_rollout"] == [("return_to_rollout", 2),
                                                                       ("return_to_rollout", 3)]
        assert roles.ranks == [0, 1] and out["ers/lent_ranks"] == 2
    assert roles.end_cold_start(4, timeout_s=1.0)["ers/cold_start_end_s"] >= 0


def test_sync_time_shares_and_needs_the_memory_saver_on_gpu_sync_split_does_not():
    from tide_megatron.config import JobConfig, validate
    from tide_megatron.controller.trainer_roles import may_train, standby_engine_ranks

    cfg = JobConfig()
    cfg.scheduler.mode = "sync"
    assert standby_engine_ranks(cfg, [0, 1, 2]) == [1, 2] and all(may_train(cfg, r, 4) for r in range(4))
    cfg.scheduler.mode = "sync_split"
    assert standby_engine_ranks(cfg, [0, 1, 2]) == [] and not may_train(cfg, 3, 4)
    cfg.rollout.engine.device = "cuda"
    validate(cfg, 4)
    cfg.scheduler.mode = "sync"
    with pytest.raises(ValueError, match="scheduler.mode=sync on GPU .*enable_memory_saver"):
        validate(cfg, 4)
    cfg.rollout.engine.extra_args = {"enable_memory_saver": True}
    validate(cfg, 4)
