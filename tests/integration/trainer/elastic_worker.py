"""Multi-rank trainer scenarios for `test_elastic_trainer.py` (run as a script).

    python elastic_worker.py --scenario single    --hf HF --out OUT   # 1 rank: reference numbers
    python elastic_worker.py --scenario tp2dp2    --hf HF --out OUT   # 5 ranks: 2 TP=2 actor blocks + a reference
    python elastic_worker.py --scenario dp_change --hf HF --out OUT   # 4 ranks, TP=1: DP 4 -> 2 -> 4

Rank 0 plays the controller with the library's own controller half (`trainer.step_feed`): it
opens steps, routes micro-batches and role changes over the mailbox and trains its own share;
every other rank runs `TrainerWorker.serve`, and a rank made ROLLOUT waits in a stand-in of the
rollout loop for the "roles" message that takes it back. Everything after start-up runs under
`forbid_new_groups`. Each rank writes OUT/rank{r}.pt.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from datetime import timedelta

import torch

from tide_megatron.utils.net import free_port

MODEL_KWARGS = dict(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, ffn_hidden_size=128)
# Adam divides each gradient by sqrt(v) + eps: with eps = 1e-8 a gradient that is zero in one
# layout and 1e-9 of rounding in another (sums in another order: TP shards, DP splits, padding)
# moves that weight by up to lr. eps = 1e-5 keeps such elements in Adam's linear regime, so the
# comparisons below measure the trainer, not Adam's amplification of rounding.
TRAINER_KWARGS = dict(lr=1e-3, adam_eps=1e-5, kl_coef=0.1, kl_estimator="k3", clip_grad=1.0)
WORLD = {"single": 1, "tp2dp2": 5, "dp_change": 4}
TP = {"single": 1, "tp2dp2": 2, "dp_change": 1}
TRAJECTORIES_PER_BATCH = 8
ROWS_PER_MICRO_BATCH = 2


def make_batch(seed: int) -> list:
    """A global batch of rollout trajectories (`core.trajectory.Trajectory`)."""
    from tide_megatron.core.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    batch = []
    for _ in range(TRAJECTORIES_PER_BATCH):
        n = 10 + int(torch.randint(0, 24, (1,), generator=g))
        mask = torch.zeros(n)
        mask[n // 2:] = 1
        batch.append(Trajectory.from_tokens(torch.randint(0, MODEL_KWARGS["vocab_size"], (n,), generator=g).tolist(),
                                            mask.tolist(), (-torch.rand(n, generator=g) * mask).tolist(),
                                            advantage=float(torch.randn((), generator=g)), index=len(batch)))
    return batch


def micro_batches_by_dp(batch: list, dp_size: int) -> dict[int, list[list]]:
    """The global batch split by the current DP size, each shard in micro-batches of 2 rows."""
    from tide_megatron.trainer.assignment import split_by_dp

    shards = split_by_dp(list(range(len(batch))), dp_size)
    return {dp: [[batch[i] for i in shard[j:j + ROWS_PER_MICRO_BATCH]]
                 for j in range(0, len(shard), ROWS_PER_MICRO_BATCH)] for dp, shard in enumerate(shards)}


def params(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.actor.module.named_parameters()}


def optimizer_tensors(worker) -> list[torch.Tensor]:
    from tide_megatron.trainer.state_transfer import state_tensors

    return [t.detach().clone() for t in state_tensors(worker.actor)]


_INBOX: list[dict] = []  # rank 0's replies not yet asked for


def _wait(mailbox, kind: type, ranks, timeout_s: float = 300.0) -> dict:
    """The replies of type `kind` of `ranks` (others stay in the inbox for their turn)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _INBOX.extend(mailbox.poll())
        got = {m.src: m for m in _INBOX if isinstance(m, kind) and m.src in ranks}
        if set(got) == set(ranks):
            _INBOX[:] = [m for m in _INBOX if not (isinstance(m, kind) and m.src in ranks)]
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {kind.__name__} from {sorted(set(ranks) - set(got))} within {timeout_s:.0f} s")
        time.sleep(0.005)


def drive_step(worker, mailbox, batch: list, mode: str) -> dict:
    """Rank 0's part of one step under the worker's current assignment."""
    from tide_megatron.comm.messages import Trained
    from tide_megatron.trainer.step_feed import StepFeed

    mbs = micro_batches_by_dp(batch, worker.assignment.dp_size)
    feed = StepFeed(mailbox, worker.assignment, mode, {dp: len(m) for dp, m in mbs.items()}, local=worker)
    for dp, chunks in mbs.items():
        for chunk in chunks:
            feed.put(dp, chunk)
    result, report = worker.run_step(mode, feed.local_source)
    replies = {kind: _wait(mailbox, kind, ranks) for kind, ranks in feed.replies_expected().items()}
    return {"loss": result.loss, "kl": result.kl, "num_tokens": result.num_tokens, "mode": mode,
            "ref_wait_s": report.ref_wait_s,
            "peer_losses": [m.result["loss"] for m in replies[Trained].values()]}


def change_roles(worker, mailbox, new, world: int) -> dict:
    """Rank 0's part of a role change: every rank gets `SetRoles`; returns everyone's times."""
    from tide_megatron.comm.messages import RolesDone
    from tide_megatron.trainer.step_feed import post_roles

    post_roles(mailbox, worker.assignment, new, range(world))
    times = {0: worker.apply(new)}
    times.update({r: m.times for r, m in _wait(mailbox, RolesDone, range(1, world)).items()})
    return times


def serve_until_stopped(worker, mailbox) -> list[dict]:
    """A rank other than 0: trainer loop, and the rollout stand-in while it is ROLLOUT."""
    from tide_megatron.comm.messages import RolesDone, SetRoles, Stop

    transitions = []
    while worker.serve(mailbox) is not None:  # made ROLLOUT: wait for the way back
        while True:
            msgs = mailbox.poll(limit=1)
            if not msgs:
                time.sleep(0.005)
                continue
            msg = msgs[0]
            if isinstance(msg, Stop):
                return transitions
            if not isinstance(msg, SetRoles):
                raise RuntimeError(f"a rollout stand-in got {type(msg).__name__}")
            times = worker.set_roles(msg)
            transitions.append(times)
            mailbox.post(0, RolesDone(worker.role.value, times))
            if worker.role.value != "rollout":
                break
    return transitions


def _stop_all(mailbox, world: int) -> None:
    from tide_megatron.comm.messages import Stop

    for r in range(1, world):
        mailbox.post(r, Stop())


def scenario_single(rank, registry, mailbox, hf_dir, out_dir) -> dict:
    from tide_megatron.trainer.assignment import TrainerAssignment
    from tide_megatron.trainer.payload import micro_batch_of

    worker = _worker(registry, TrainerAssignment(registry.layout, 1), hf_dir, out_dir)
    steps = []
    for seed in (1, 2, 3):
        mbs = [micro_batch_of(chunk) for chunk in micro_batches_by_dp(make_batch(seed), 1)[0]]
        result, _ = worker.run_step("colocated", mbs)
        steps.append({"loss": result.loss, "kl": result.kl, "num_tokens": result.num_tokens})
        if seed == 2:
            hf_after_2 = {n: t.clone() for n, t in worker.actor.hf_weights()}
    return {"steps": steps, "hf_after_2": hf_after_2}


def scenario_tp2dp2(rank, registry, mailbox, hf_dir, out_dir) -> dict:
    """Decoupled step, colocated step, checkpoint, one more step, load the checkpoint back, then
    that step again, decoupled, with the second actor block as a TP=2 reference unit."""
    from tide_megatron.comm.messages import LoadCheckpoint, SaveCheckpoint
    from tide_megatron.trainer.assignment import TrainerAssignment

    assignment = TrainerAssignment(registry.layout, 2, ref_ranks=(4,), actors_hold_ref=True)
    worker = _worker(registry, assignment, hf_dir, out_dir)
    out: dict = {}
    if rank != 0:
        load = worker.load

        def load_and_record(path):  # the state each actor rank read back
            step = load(path)
            out["params_loaded"] = params(worker)
            return step

        worker.load = load_and_record
        serve_until_stopped(worker, mailbox)
        return out
    out["steps"] = [drive_step(worker, mailbox, make_batch(1), "decoupled"),
                    drive_step(worker, mailbox, make_batch(2), "colocated")]
    out["params_after_2"] = params(worker)
    for r in range(1, 4):
        mailbox.post(r, SaveCheckpoint())
    path = worker.save()
    out["steps"].append(drive_step(worker, mailbox, make_batch(3), "colocated"))
    out["params_after_3"] = params(worker)
    for r in range(1, 4):
        mailbox.post(r, LoadCheckpoint(path))
    worker.load(path)  # collective over the four actor ranks
    out["params_loaded"] = params(worker)
    # Block 1 becomes a TP=2 reference unit (it held the reference as ACTOR_REF), rank 4 rolls
    # out: step 3 again, decoupled at DP=1 from the loaded state, must land where the colocated
    # DP=2 step 3 did.
    out["transitions"] = change_roles(worker, mailbox, TrainerAssignment(
        registry.layout, 1, ref_ranks=(2, 3), actors_hold_ref=False), 5)
    out["steps"].append(drive_step(worker, mailbox, make_batch(3), "decoupled"))
    out["params_after_3_again"] = params(worker)
    _stop_all(mailbox, 5)
    return out


def scenario_dp_change(rank, registry, mailbox, hf_dir, out_dir) -> dict:
    """Run A: DP=4 for three steps. Run B: the same batches with DP 4 -> 2 -> 4 between the
    steps. Run C: the distributed optimizer at DP=4 for one step."""
    import dataclasses

    from tide_megatron.trainer.assignment import TrainerAssignment

    layout = registry.layout
    four, two = TrainerAssignment(layout, 4), TrainerAssignment(layout, 2)
    out: dict = {}
    worker_a = _worker(registry, four, hf_dir, out_dir)
    if rank == 0:
        out["a_steps"] = [drive_step(worker_a, mailbox, make_batch(1), "colocated")]
        out["a_params_after_1"] = params(worker_a)
        out["a_steps"] += [drive_step(worker_a, mailbox, make_batch(s), "colocated") for s in (2, 3)]
        _stop_all(mailbox, 4)
    else:
        serve_until_stopped(worker_a, mailbox)
    out["a_params"], out["a_optimizer"] = params(worker_a), optimizer_tensors(worker_a)

    worker_b = _worker(registry, four, hf_dir, out_dir)
    if rank == 0:
        out["b_steps"] = [drive_step(worker_b, mailbox, make_batch(1), "colocated")]
        out["b_transitions"] = [change_roles(worker_b, mailbox, two, 4)]
        out["b_steps"].append(drive_step(worker_b, mailbox, make_batch(2), "colocated"))
        out["b_transitions"].append(change_roles(worker_b, mailbox, four, 4))
        out["b_steps"].append(drive_step(worker_b, mailbox, make_batch(3), "colocated"))
        _stop_all(mailbox, 4)
    else:
        out["b_transitions"] = serve_until_stopped(worker_b, mailbox)
    out["b_params"], out["b_optimizer"] = params(worker_b), optimizer_tensors(worker_b)

    cfg = dataclasses.replace(worker_a.cfg, distributed_optimizer=True)
    worker_c = _worker(registry, four, hf_dir, out_dir, cfg)
    if rank == 0:
        out["c_steps"] = [drive_step(worker_c, mailbox, make_batch(1), "colocated")]
        out["c_params_after_1"] = params(worker_c)
        try:
            worker_c.actor.set_data_parallel(registry.actor_groups(2))
            out["c_dp_change_error"] = None
        except NotImplementedError as exc:
            out["c_dp_change_error"] = str(exc)
        _stop_all(mailbox, 4)
    else:
        serve_until_stopped(worker_c, mailbox)
    return out


def _worker(registry, assignment, hf_dir, out_dir, cfg=None):
    import torch.distributed as dist

    from tide_megatron.trainer.config import TrainerConfig
    from tide_megatron.trainer.worker import TrainerWorker

    cfg = cfg or TrainerConfig(**TRAINER_KWARGS)
    return TrainerWorker(cfg, hf_dir, os.path.join(out_dir, "ckpt"), registry, assignment, dist.group.WORLD, seed=0)


def _run(rank: int, scenario: str, ports: tuple[int, int], hf_dir: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    world = WORLD[scenario]
    import torch.distributed as dist

    from tide_megatron.comm.groups import forbid_new_groups
    from tide_megatron.comm.mailbox import Mailbox
    from tide_megatron.models.megatron_gpt import init_parallel, spawned_rank

    with spawned_rank(rank, world, ports[0]):
        registry = init_parallel(tp_size=TP[scenario], seed=0)
        store = dist.TCPStore("127.0.0.1", ports[1], world, is_master=rank == 0, timeout=timedelta(seconds=300))
        mailbox = Mailbox(store, rank)
        with forbid_new_groups() as attempts:
            out = globals()[f"scenario_{scenario}"](rank, registry, mailbox, hf_dir, out_dir)
        out.update(group_attempts_after_startup=list(attempts), groups_made=len(registry.groups),
                   groups_expected=len(registry.layout.groups_of(rank)), layout_groups=registry.layout.num_groups,
                   startup_s=registry.startup_s)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=sorted(WORLD), required=True)
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.multiprocessing.spawn(_run, args=(args.scenario, (free_port(), free_port()), args.hf, args.out),
                                nprocs=WORLD[args.scenario], join=True)


if __name__ == "__main__":
    main()
