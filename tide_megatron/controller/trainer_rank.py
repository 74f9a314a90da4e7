"""What every trainer rank does: hold the actor and the reference, train on its shard,
and take part in checkpointing and the weight push.

Rank 0 calls these methods directly from the controller; the other trainer ranks run
`serve()`, which executes the controller's commands from their mailbox. Collective
calls (the TP gather of weights, DDP's gradient all-reduce, checkpoint barriers) thus
happen on every trainer rank in the same order.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tide_megatron.comm import weight_sync
from tide_megatron.comm.mailbox import CONTROLLER, Mailbox
from tide_megatron.comm.messages import Stop
from tide_megatron.models.policy import model_config_from_checkpoint
from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
from tide_megatron.trainer import checkpoint as ckpt
from tide_megatron.trainer.actor import MegatronActor, ReferenceModel, StepResult
from tide_megatron.trainer.batch import MicroBatch, collate, pack_micro_batches
from tide_megatron.trainer.batch import Trajectory as TrainTrajectory
from tide_megatron.trainer.config import TrainerConfig

POLL_INTERVAL_S = 0.01


def to_train_trajectory(data: dict[str, Any], images: TrajectoryImages | None = None) -> TrainTrajectory:
    """A rollout trajectory (JSON) as the trainer's tensors; `images` turns its images (if any)
    into the vision inputs of a vision-language policy."""
    token_ids = torch.tensor(data["token_ids"], dtype=torch.long)  # [T]
    loss_mask = torch.tensor(data["loss_mask"], dtype=torch.float32)  # [T]
    if images is None and data.get("images"):
        raise ValueError(f"trajectory {data.get('group_id')}/{data.get('index')} has images, "
                         "but the policy is a text-only model")
    return TrainTrajectory(
        token_ids=token_ids, loss_mask=loss_mask,
        old_logprobs=torch.tensor(data["logprobs"], dtype=torch.float32),  # [T]
        advantage=float(data["advantage"]),
        **(images.fields(data, token_ids, loss_mask) if images is not None else {}),
    )


def micro_batch_of(trajectories: list[dict[str, Any]], pad_to_multiple_of: int = 1,
                   images: TrajectoryImages | None = None) -> MicroBatch:
    """One micro-batch of rollout trajectories; the actor and a reference rank build the same
    tensors from the same message, so their shapes match for the log-prob stream."""
    return collate([to_train_trajectory(t, images) for t in trajectories], pad_to_multiple_of)


class TrainerRank:
    def __init__(self, trainer_cfg: TrainerConfig, model_path: str, rank: int, checkpoint_root: str, job_group):
        self.cfg = trainer_cfg
        self.job_group = job_group
        self.rank = rank
        self.checkpoint_root = checkpoint_root
        model_cfg = model_config_from_checkpoint(model_path)
        model_cfg.check_tensor_parallel(trainer_cfg.tp_size)
        self.images = TrajectoryImages.for_model(model_cfg, model_path)
        self.actor = MegatronActor(model_cfg, trainer_cfg, model_path)
        self.ref = ReferenceModel(model_cfg, model_path, bf16=trainer_cfg.bf16) if trainer_cfg.kl_coef else None

    def train(self, trajectories: list[dict[str, Any]]) -> tuple[StepResult, dict[str, float]]:
        """One optimizer step on this rank's shard; returns the step report and phase times."""
        trajs = [to_train_trajectory(t, self.images) for t in trajectories]
        # Similar lengths in one micro-batch waste less padding.
        trajs.sort(key=len, reverse=True)
        micro_batches = pack_micro_batches(trajs, self.cfg.micro_batch_tokens, self.cfg.pad_to_multiple_of)
        t0 = time.perf_counter()
        if self.ref is not None:
            self.ref.attach_logprobs(micro_batches)
        t1 = time.perf_counter()
        result = self.actor.train_step(micro_batches)
        t2 = time.perf_counter()
        return result, {"time/ref_s": t1 - t0, "time/actor_s": t2 - t1, "micro_batches": len(micro_batches)}

    def push_weights(self, version: int, send=None) -> float:
        """Gather HF weights (collective over TP); rank 0 packs them and hands them to `send`,
        the controller's point-to-point push to the rollout ranks it names (weight_sync.py)."""
        named = list(self.actor.hf_weights())
        if self.rank != 0:
            return 0.0  # rank 0 alone sends
        manifest, flat = weight_sync.pack(named, version)
        t0 = time.perf_counter()
        send(manifest, flat)
        return time.perf_counter() - t0

    def save(self, run_state: dict[str, Any] | None = None) -> str:
        """Collective over the trainer ranks; rank 0 passes the controller's run state."""
        return ckpt.save_checkpoint(self.actor, self.checkpoint_root, run_state=run_state)

    def load(self, path: str | None) -> int:
        """Load `path`, or the latest checkpoint under the root when `path` is None."""
        if path is None:
            return ckpt.load_latest_checkpoint(self.actor, self.checkpoint_root)
        return ckpt.load_checkpoint(self.actor, path)

    def serve(self, mailbox: Mailbox) -> None:
        """Trainer ranks other than 0: run the controller's commands until told to stop."""
        while True:
            for msg in mailbox.poll():
                if isinstance(msg, Stop):
                    return
                kind = msg["kind"]
                if kind == "train":
                    result, _ = self.train(msg["trajectories"])
                    mailbox.post(CONTROLLER, "trained", step=result.step)
                elif kind == "push_weights":
                    self.push_weights(int(msg["version"]))
                elif kind == "save":
                    self.save()
                elif kind == "load":
                    self.load(msg.get("path"))
                else:
                    raise ValueError(f"trainer rank {self.rank}: unknown message kind {kind!r}")
            time.sleep(POLL_INTERVAL_S)
