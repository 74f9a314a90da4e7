"""The simulated engines' KV pool: SGLang's radix prefix cache with LRU eviction
(tide_megatron/sim/prefix_cache.py), the same model under request-level scheduling and CTB."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tide_megatron.sim.prefix_cache import RadixPrefixCache
from tide_megatron.sim.rollout_rank import RolloutRank
from tide_megatron.sim.workload import SimTrajectory


class _Hardware:
    """The few HardwareModel members a RolloutRank reads: a small pool, cheap decode/prefill."""

    def __init__(self, capacity: int):
        self.kv_capacity_tokens = capacity
        self.decode_weight_s = 0.01
        self.decode_token_compute_s = 0.0
        self.decode_kv_s_per_token = 0.0

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        return 1e-4 * new_tokens


def _traj(tid: int, gid: int, prompt: int, gen, obs) -> SimTrajectory:
    return SimTrajectory(traj_id=tid, group_id=gid, index=0, task_type="t", is_eval=False, prompt_tokens=prompt,
                         gen=list(gen), obs=list(obs), env_s=[1.0] * len(gen), reset_s=0.0, context=prompt)


def _run_turn(rank: RolloutRank, traj: SimTrajectory, now: float) -> float:
    """Submit `traj`'s turn, decode it to its end; returns the time it ended."""
    rank.submit(traj, now)
    assert rank.is_running(traj)
    t = rank.next_wake()
    done, _ = rank.wake(t)
    assert traj in done
    return t


def _env_step(traj: SimTrajectory) -> None:
    """What the cluster does when the env answers: the observation joins the context."""
    traj.context += traj.gen[traj.turn] + traj.obs[traj.turn]
    traj.turn += 1


def test_request_level_next_turn_hits_its_resident_prefix():
    rank = RolloutRank(0, _Hardware(1000), pinned=False)
    a = _traj(1, 1, prompt=100, gen=[10, 10], obs=[20, 5])
    rank.place(a)
    t = _run_turn(rank, a, 0.0)
    assert rank.stats.hit_tokens == 0
    _env_step(a)
    _run_turn(rank, a, t + 1.0)
    # prompt + the first action were still in the tree: the second turn prefills only the observation
    assert rank.stats.hit_tokens == 110
    assert rank.stats.recompute_tokens == 0 and rank.stats.evictions == 0
    assert rank.kv.check() is None


def test_request_level_prefix_evicted_under_pressure_is_recomputed():
    rank = RolloutRank(0, _Hardware(300), pinned=False)
    a = _traj(1, 1, prompt=100, gen=[10, 10], obs=[20, 5])
    b = _traj(2, 2, prompt=250, gen=[10], obs=[1])
    rank.place(a)
    rank.place(b)
    t = _run_turn(rank, a, 0.0)  # a's 110 tokens cached
    _env_step(a)
    t = _run_turn(rank, b, t)  # b needs 260 of 300: LRU evicts a's prefix
    assert rank.kv.match(a.traj_id, a.group_id) == 0
    assert rank.stats.evictions == 1
    hits = rank.stats.hit_tokens
    _run_turn(rank, a, t)
    assert rank.stats.hit_tokens == hits  # nothing of a's context was left
    assert rank.stats.recompute_tokens == 110  # prompt + first action prefilled a second time
    assert rank.kv.check() is None


def test_ctb_pins_a_resident_prefix_and_the_request_waits():
    rank = RolloutRank(0, _Hardware(300), pinned=True)
    a = _traj(1, 1, prompt=100, gen=[10, 10], obs=[20, 5])
    c = _traj(3, 3, prompt=50, gen=[100], obs=[1])
    b = _traj(2, 2, prompt=250, gen=[10], obs=[1])
    for x in (a, b, c):
        rank.place(x)
    t = _run_turn(rank, a, 0.0)
    rank.submit(c, t)  # running: 150 held
    rank.submit(b, t)  # needs 260: a's prefix is pinned and c runs, so b queues
    assert list(rank.queue) == [b]
    assert rank.kv.match(a.traj_id, a.group_id) == 110 and rank.stats.evictions == 0
    assert rank.used <= rank.capacity


def test_group_prompt_is_stored_once_and_shared():
    kv = RadixPrefixCache(10_000, pinned=False)
    assert kv.start(1, 7, prompt=500, context=500, gen=20) == 0
    # a sibling starting while the first still decodes matches the prompt (inserted after prefill)
    assert kv.start(2, 7, prompt=500, context=500, gen=30) == 500
    assert kv.used == 500 + 20 + 30
    kv.finish_turn(1, 520)
    kv.finish_turn(2, 530)
    assert kv.used == 500 + 20 + 30 and kv.check() is None


def test_lru_order_tail_first_and_protection():
    kv = RadixPrefixCache(10_000, pinned=False)
    for tid in (1, 2, 3):  # one trajectory per group, two turns each: chain segments [100, 50]
        kv.start(tid, tid, prompt=100, context=100, gen=100)
        kv.finish_turn(tid, 200)
        kv.start(tid, tid, prompt=100, context=230, gen=20)
        kv.finish_turn(tid, 250)
    assert [kv.match(t, t) for t in (1, 2, 3)] == [250, 250, 250]
    # least recently used first, its newest node first: trajectory 1 keeps prompt + first turn
    assert kv.evict(20) == 20
    assert [kv.match(t, t) for t in (1, 2, 3)] == [230, 250, 250]
    # a queued request refreshed (SGLang's waiting-prefix refresh) is no longer the LRU one
    kv.refresh_waiting([(1, 1)])
    kv.evict(1)
    assert [kv.match(t, t) for t in (1, 2, 3)] == [230, 230, 250]
    # the request being admitted never evicts its own prefix: 2 is LRU, 3 goes instead
    kv.evict(1, protect=(2, 2))
    assert [kv.match(t, t) for t in (1, 2, 3)] == [230, 230, 230]
    # a chain goes before its group's prompt; the prompt only once no chain hangs below it
    kv.evict(130, protect=(1, 1))
    assert kv.match(2, 2) == 100 and kv.match(1, 1) == 230
    kv.evict(1, protect=(1, 1))
    assert kv.match(2, 2) == 0
    assert kv.check() is None


def test_finished_task_stays_cached_until_evicted_even_under_ctb():
    kv = RadixPrefixCache(10_000, pinned=True)
    kv.start(1, 1, prompt=100, context=100, gen=10)
    kv.finish_turn(1, 110)
    assert kv.evict(1000) == 0  # live and pinned
    kv.finish_task(1)
    assert kv.used == 110
    assert kv.evict(1000) == 110 and kv.used == 0
    assert kv.evictions == 0  # nothing live was lost


@st.composite
def _ops(draw):
    capacity = draw(st.integers(200, 3000))
    n = draw(st.integers(1, 8))
    trajs = [{"group": i // draw(st.integers(1, 3)), "prompt": draw(st.integers(16, 150)),
              "gen": draw(st.integers(1, 60)), "obs": draw(st.integers(1, 60))} for i in range(n)]
    ops = draw(st.lists(st.tuples(st.sampled_from(["start", "finish", "pause", "done", "flush", "refresh"]),
                                  st.integers(0, n - 1), st.booleans()), max_size=80))
    return capacity, draw(st.booleans()), trajs, ops


@settings(max_examples=200, deadline=None)
@given(_ops())
@example((200, False, [{"group": 0, "prompt": 99, "gen": 1, "obs": 1}, {"group": 0, "prompt": 16, "gen": 2, "obs": 1}],
          [("start", 0, False), ("start", 1, False), ("flush", 0, False)]))  # a shared prompt at a flush
def test_ledger_stays_within_the_pool(case):
    """Driven as RolloutRank drives it (room made before a request starts), the pool's ledger
    never goes negative nor above the pool, and tree/nodes/running requests stay consistent."""
    capacity, pinned, trajs, ops = case
    kv = RadixPrefixCache(capacity, pinned)
    groups_prompt = {}
    state = {}
    for i, t in enumerate(trajs):
        prompt = groups_prompt.setdefault(t["group"], t["prompt"])
        state[i] = {"ctx": prompt, "prompt": prompt, "running": False, "done": False}
    for op, i, flag in ops:
        s, t = state[i], trajs[i]
        if op == "start" and not s["running"] and not s["done"] and s["ctx"] + t["gen"] <= capacity:
            hit = kv.match(i, t["group"])
            assert hit <= s["ctx"]
            need = s["ctx"] + t["gen"] - hit
            if kv.used + need > capacity:
                kv.evict(kv.used + need - capacity, (i, t["group"]), force=flag and not kv.running)
            assert kv.match(i, t["group"]) == hit  # its own prefix is never evicted for it
            if kv.used + need <= capacity:
                assert kv.start(i, t["group"], s["prompt"], s["ctx"], t["gen"]) == hit
                s["running"] = True
        elif op == "finish" and s["running"]:
            kv.finish_turn(i, s["ctx"] + t["gen"])
            s["ctx"] += t["gen"] + t["obs"]
            s["running"] = False
        elif op == "pause":
            kv.abort(i)
            kv.drop(i)
            s["running"] = False
            s["ctx"] += t["obs"] if flag else 0
        elif op == "done" and not s["running"]:
            kv.finish_task(i)
            s["done"] = True
        elif op == "flush":
            kv.flush()
        elif op == "refresh":
            kv.refresh_waiting((j, trajs[j]["group"]) for j in range(i + 1))
        assert kv.check() is None
        assert 0 <= kv.tree_tokens and 0 <= kv.private_tokens
        assert 0 <= kv.used <= capacity
