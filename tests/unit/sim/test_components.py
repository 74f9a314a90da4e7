"""Hardware model, workload draws, trainer strategies and the KV cache model."""

import pytest

from tide_megatron.core.ra2p import RA2PConfig
from tide_megatron.sim.hardware import HardwareModel
from tide_megatron.sim.simulator import Simulator
from tide_megatron.sim import run_simulation
from tide_megatron.core.roles import RA2PMode
from tide_megatron.sim.trainer_model import (TrainerCosts, aggregated_round, colocated_rounds,
                                            per_microbatch_alternation, plan)
from tide_megatron.sim.workload import WorkloadModel


def test_hardware_numbers_follow_the_specs(small_config):
    cfg = small_config()
    hw = HardwareModel(cfg.hardware, cfg.model)
    # Qwen2.5-7B KV: 2 (K,V) x 28 layers x 4 heads x 128 dim x 2 bytes
    assert cfg.model.kv_bytes_per_token == 57344
    pool = (80 * cfg.hardware.rollout_mem_fraction - cfg.hardware.rollout_reserved_gb) * 1e9 - 7.61e9 * 2
    assert hw.kv_capacity_tokens == int(pool // 57344)
    # decode is memory bound at small batch: one weight read at the achieved HBM bandwidth
    assert hw.decode_iteration_s(1, 0) == pytest.approx(7.61e9 * 2 / (3.35e12 * cfg.hardware.decode_hbm_efficiency))
    assert hw.decode_iteration_s(64, 10**5) > hw.decode_iteration_s(64, 10**4) >= hw.decode_iteration_s(1, 10**4)
    assert hw.decode_iteration_s(1024, 0) > hw.decode_iteration_s(1, 0)  # compute bound past the ridge
    # training: 6N FLOPs per token (plus attention) at train_mfu of 989 TFLOP/s
    assert hw.train_tokens_per_s(1, seq_len=0) == pytest.approx(989e12 * cfg.hardware.train_mfu / (6 * 7.61e9))
    # one Ref<->Actor alternation moves the larger state over ~51 GB/s of PCIe
    assert hw.ref_actor_swap_s(24) == pytest.approx(hw.actor_state_bytes_per_gpu(24) / (64e9 * 0.8))


def test_workload_is_deterministic_and_shared_by_modes(small_config):
    cfg = small_config()
    a = WorkloadModel(cfg.workload, seed=3)
    b = WorkloadModel(cfg.workload, seed=3)
    ga, gb = a.next_train_group(), b.next_train_group()
    assert [t.gen for t in ga.trajectories] == [t.gen for t in gb.trajectories]
    assert all(t.prompt_tokens == ga.trajectories[0].prompt_tokens for t in ga.trajectories)
    for t in ga.trajectories:
        assert 1 <= t.n_turns <= 50 and len(t.gen) == len(t.obs) == len(t.env_s)


def test_stream_swaps_per_micro_batch(small_config):
    cfg = small_config()
    hw = HardwareModel(cfg.hardware, cfg.model)
    costs = TrainerCosts(hw, 1, 3000)
    ra2p = RA2PConfig(tokens_per_rank=8192)
    lengths = [3000] * 64  # 192k tokens on 4 ranks: several micro-batches
    alternating = per_microbatch_alternation(costs, lengths, 4, ra2p)
    aggregated = aggregated_round(costs, lengths, 4, ra2p)
    compute = aggregated - 2 * costs.swap_s(4)
    n_mb = round((alternating - compute) / (2 * costs.swap_s(4)))
    assert n_mb >= 4  # two model loads per micro-batch, not per step
    assert alternating > aggregated


def test_only_an_offloading_trainer_pays_swaps(small_config):
    # VS and resident colocated rounds pay no swap; VSO and offloading rounds pay a pair each.
    cfg = small_config()
    costs = TrainerCosts(HardwareModel(cfg.hardware, cfg.model), 1, 3000)
    ra2p = RA2PConfig(tokens_per_rank=8192, aggregation_limit=2)
    lengths = [3000] * 64
    vs = per_microbatch_alternation(costs, lengths, 4, ra2p, offload=False)
    vso = per_microbatch_alternation(costs, lengths, 4, ra2p, offload=True)
    resident = colocated_rounds(costs, lengths, 4, ra2p, offload=False)
    offloading = colocated_rounds(costs, lengths, 4, ra2p, offload=True)
    assert vs >= resident  # the same passes (a round waits for its busiest rank once, not per micro-batch)
    pair = 2 * costs.swap_s(4)
    n_mb = len(plan(lengths, 4, RA2PMode.COLOCATED, ra2p).micro_batches)
    assert n_mb >= 4
    assert (vso - vs) / pair == pytest.approx(n_mb)  # a pair per micro-batch
    assert (offloading - resident) / pair == pytest.approx(-(-n_mb // ra2p.aggregation_limit))  # a pair per round


def test_stream_runs_the_executor_it_is_given(small_config):
    runs = {ex: run_simulation(small_config("mode=stream", f"scheduler.stream_executor={ex}"))
            for ex in ("vso", "vs", "colocated")}
    assert runs["vs"].goodput > runs["vso"].goodput  # the same schedule, without the swaps
    with pytest.raises(ValueError, match="stream_executor"):
        small_config("mode=stream", "scheduler.stream_executor=dm")


def test_request_level_evicts_waiting_prefixes_and_ctb_keeps_them(small_config):
    # one rollout rank with far more concurrent tasks than its KV pool holds (paper's C1)
    over = ["n_gpus=2", "steps=1", "scheduler.rollout_share=0.5", "scheduler.ers=false", "scheduler.ra2p=false",
            "workload.batch_groups=96", "workload.min_batch_groups=96", "workload.env_concurrency=768",
            "workload.task_types.1.weight=0",
            "workload.eval_every=0", "workload.staleness_bound=0"]
    rl = Simulator(small_config("mode=tide", "scheduler.ctb=false", *over))
    ctb = Simulator(small_config("mode=tide", "scheduler.ctb=true", *over))
    m_rl, m_ctb = rl.run(), ctb.run()
    assert m_rl.evictions > 0 and m_rl.recompute_tokens > 0
    assert m_ctb.evictions == 0
    assert m_ctb.kv_hit_rate > m_rl.kv_hit_rate


def test_verl_like_policy_activation_gate_and_adaptive_ratio():
    from tide_megatron.sim.verl_elastic import VerlElasticConfig, VerlElasticPolicy

    pol = VerlElasticPolicy(VerlElasticConfig(deactivate_ratio=0.3, default_switch_cost_s=10.0))
    assert pol.deactivate_threshold(100) == 30
    # before any measurement the wait per sample is pessimistic: any gap is worth a switch
    assert pol.should_activate(100, surplus_samples=0) and not pol.should_activate(100, surplus_samples=30)
    # the trainer waited 20 s for 40 fresh samples: 0.5 s per sample; the ratio grows (capped)
    pol.after_step(100, wait_s=20.0, wait_samples=40, switch_s=12.0)
    assert pol.per_sample_s == pytest.approx(0.5) and pol.ratio == pytest.approx(0.4)
    assert pol.switch_cost_s() == pytest.approx(12.0)
    # gap 40 - 10 = 30 samples x 0.5 s = 15 s > 12 s switch: activate; a gap of 20 is not worth it
    assert pol.should_activate(100, surplus_samples=10) and not pol.should_activate(100, surplus_samples=20)
    pol.after_step(100, wait_s=0.0, wait_samples=0, switch_s=0.0)  # no wait: lend less next time
    assert pol.ratio == pytest.approx(0.38)
