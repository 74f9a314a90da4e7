"""Multi-process RA2P scenario for the integration tests (run as a script).

    python ra2p_worker.py --hf HF_DIR --out OUT_DIR

Three processes: stream ranks 0 and 1 are Actor ranks (their own default group, Megatron DP=2),
stream rank 2 is a Ref rank (its own single-rank default group). A gloo `LogprobStream` group
spans all three. The Actor ranks first run the colocated executors (CM, VSO, VS, CM on an
arriving stream) against the plain sync path, then the decoupled step with the Ref rank
streaming. Each Actor rank writes OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch

from tide_megatron.testing import worker_args
from tide_megatron.utils.net import free_port

MODEL_KWARGS = dict(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, ffn_hidden_size=128)
NUM_ACTORS = 2
STEPS = 2


def make_trajectories(vocab_size: int) -> dict:
    from tide_megatron.trainer.batch import TrajectoryTensors

    g = torch.Generator().manual_seed(7)
    out = {}
    for i in range(12):
        length = 10 + int(torch.randint(0, 30, (1,), generator=g))
        ids = torch.randint(0, vocab_size, (length,), generator=g)
        mask = torch.zeros(length)
        mask[length // 2:] = 1
        old = -torch.rand(length, generator=g) * mask
        out[f"t{i}"] = TrajectoryTensors(ids, mask, old, advantage=float(torch.randn((), generator=g)))
    return out


def _state(actor) -> dict:
    return {n: p.detach().clone() for n, p in actor.module.named_parameters()}


def _grads(actor) -> dict:
    return {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()}


def _opt_tensors(actor) -> list:
    from tide_megatron.trainer.offload import ModelOffloader

    return [t.detach().clone() for t in ModelOffloader(actor.model, optimizer=actor.optimizer)._optimizer_tensors()]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def actor_scenario(rank: int, hf_dir: str, stream) -> dict:

    from tide_megatron.core.ra2p import RA2PConfig
    from tide_megatron.core.roles import RA2PMode
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.trainer.actor import MegatronActor, ReferenceModel
    from tide_megatron.trainer.config import TrainerConfig
    from tide_megatron.trainer.offload import ModelOffloader, OffloadConfig
    from tide_megatron.trainer.ra2p import (ArrivingSource, ColocatedConfig, ColocatedExecutor, CostMeter,
                                            DecoupledActorExecutor, DecoupledConfig, micro_batches_for_rank,
                                            plan_step)

    cfg = ModelConfig(**MODEL_KWARGS)
    tcfg = TrainerConfig(lr=1e-3, kl_coef=0.1, kl_estimator="k3", clip_grad=1.0)
    trajectories = make_trajectories(cfg.vocab_size)
    ra2p_cfg = RA2PConfig(tokens_per_rank=48)
    results: dict = {}

    def micro_batches(mode: RA2PMode):
        return micro_batches_for_rank(plan_step(trajectories, NUM_ACTORS, mode, ra2p_cfg), trajectories, rank)

    # The plain sync path: reference log-probs attached to every micro-batch, then train_step.
    col_mbs = micro_batches(RA2PMode.COLOCATED)
    results["num_micro_batches"] = len(col_mbs)
    ref = ReferenceModel(cfg, hf_dir)
    sync_actor = MegatronActor(cfg, tcfg, hf_dir)
    expected = {}
    for mode in (RA2PMode.COLOCATED, RA2PMode.DECOUPLED):
        actor = sync_actor if mode is RA2PMode.COLOCATED else MegatronActor(cfg, tcfg, hf_dir)
        losses = []
        for _ in range(STEPS):
            mbs = ref.attach_logprobs(micro_batches(mode))
            losses.append(actor.train_step(mbs).loss)
        expected[mode] = (_state(actor), _grads(actor), losses)

    # Offload round trip of a trained Megatron actor: params, grad buffer, Adam state.
    before = (_state(sync_actor), _grads(sync_actor), _opt_tensors(sync_actor))
    offloader = ModelOffloader(sync_actor.model, OffloadConfig(optimizer_state=True), optimizer=sync_actor.optimizer)
    offloader.offload()
    results["offload_freed"] = all(p.untyped_storage().nbytes() == 0 for p in sync_actor.module.parameters())
    offloader.restore()
    after = (_state(sync_actor), _grads(sync_actor), _opt_tensors(sync_actor))
    results["offload_bit_exact"] = (all(torch.equal(before[i][k], after[i][k]) for i in (0, 1) for k in before[i])
                                    and len(before[2]) == len(after[2]) > 0
                                    and all(torch.equal(a, b) for a, b in zip(before[2], after[2])))

    # Colocated executors (CM, VSO, VS, CM on an arriving stream): same updates as sync.
    variants = {
        "colocated": ColocatedConfig(),
        "vanilla_streaming_offload": ColocatedConfig.vanilla_streaming(offload=True),
        "vanilla_streaming": ColocatedConfig.vanilla_streaming(offload=False),
        "colocated_arriving": ColocatedConfig(aggregation_limit=3, name="colocated_arriving"),
    }
    exp_state, exp_grads, exp_losses = expected[RA2PMode.COLOCATED]
    for name, ccfg in variants.items():
        meter = CostMeter()
        executor = ColocatedExecutor(MegatronActor(cfg, tcfg, hf_dir), ReferenceModel(cfg, hf_dir), ccfg, meter)
        losses, reports = [], []
        for _ in range(STEPS):
            mbs = micro_batches(RA2PMode.COLOCATED)
            if name == "colocated_arriving":
                source = ArrivingSource(len(mbs))
                for mb in mbs[:2]:  # RAS = 2; the rest arrive while the step runs
                    source.put(mb)
                import threading

                def produce(rest=mbs[2:], source=source):
                    import time
                    for mb in rest:
                        time.sleep(0.05)
                        source.put(mb)

                threading.Thread(target=produce, daemon=True).start()
                result, report = executor.run_step(source)
            else:
                result, report = executor.run_step(mbs)
            losses.append(result.loss)
            reports.append(report.as_dict())
        results[name] = dict(
            weights_equal=all(torch.equal(exp_state[k], v) for k, v in _state(executor.actor).items()),
            grads_equal=all(torch.equal(exp_grads[k], v) for k, v in _grads(executor.actor).items()),
            weight_diff=_max_diff(exp_state, _state(executor.actor)),
            losses=losses, expected_losses=exp_losses, reports=reports, meter=dict(meter.values))

    # Decoupled: Ref rank streams, actor's loss in backward; planner's decoupled order.
    exp_state, exp_grads, exp_losses = expected[RA2PMode.DECOUPLED]
    meter = CostMeter()
    executor = DecoupledActorExecutor(MegatronActor(cfg, tcfg, hf_dir), stream,
                                      DecoupledConfig(ref_rank=NUM_ACTORS, actor_ranks=tuple(range(NUM_ACTORS))), meter)
    losses, reports = [], []
    for _ in range(STEPS):
        result, report = executor.run_step(micro_batches(RA2PMode.DECOUPLED))
        losses.append(result.loss)
        reports.append(report.as_dict())
    results["decoupled"] = dict(
        weight_diff=_max_diff(exp_state, _state(executor.actor)),
        weight_scale=max(v.abs().max().item() for v in exp_state.values()),
        grad_diff=_max_diff(exp_grads, _grads(executor.actor)),
        grad_scale=max(v.abs().max().item() for v in exp_grads.values()),
        losses=losses, expected_losses=exp_losses, reports=reports, meter=dict(meter.values),
        tokens=[int(mb.token_ids.numel()) for mb in micro_batches(RA2PMode.DECOUPLED)])
    return results


def ref_scenario(hf_dir: str, stream) -> None:
    from tide_megatron.core.ra2p import RA2PConfig
    from tide_megatron.core.roles import RA2PMode
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.trainer.actor import ReferenceModel
    from tide_megatron.trainer.ra2p import DecoupledConfig, RefStreamServer, micro_batches_for_rank, plan_step

    cfg = ModelConfig(**MODEL_KWARGS)
    trajectories = make_trajectories(cfg.vocab_size)
    plan = plan_step(trajectories, NUM_ACTORS, RA2PMode.DECOUPLED, RA2PConfig(tokens_per_rank=48))
    server = RefStreamServer(ReferenceModel(cfg, hf_dir), stream,
                             DecoupledConfig(ref_rank=NUM_ACTORS, actor_ranks=tuple(range(NUM_ACTORS))))
    for _ in range(STEPS):
        server.serve_step({r: micro_batches_for_rank(plan, trajectories, r) for r in range(NUM_ACTORS)})


def _worker(rank: int, ports: tuple[int, int], hf_dir: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from tide_megatron.models.megatron_gpt import init_parallel, spawned_rank
    from tide_megatron.trainer.ra2p import LogprobStream

    actor_port, stream_port = ports
    world = NUM_ACTORS + 1
    is_ref = rank == NUM_ACTORS
    with spawned_rank(rank, NUM_ACTORS, actor_port):  # the actors' world; the Ref rank has its own
        if is_ref:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=NUM_ACTORS)
        init_parallel(tp_size=1, seed=0)
        store = dist.TCPStore("127.0.0.1", stream_port, world, is_master=rank == 0,
                              timeout=timedelta(seconds=300))
        stream = LogprobStream.create(store, rank, world)
        if is_ref:
            ref_scenario(hf_dir, stream)
        else:
            results = actor_scenario(rank, hf_dir, stream)
            torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        stream.group.barrier().wait()  # keep the store's host alive until everyone is done
        stream.close()


def main() -> None:
    args = worker_args(paths=("hf",))
    torch.multiprocessing.spawn(_worker, args=((free_port(), free_port()), args.hf, args.out),
                                nprocs=NUM_ACTORS + 1, join=True)


if __name__ == "__main__":
    main()
