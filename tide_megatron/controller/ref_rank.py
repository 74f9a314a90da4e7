"""A dedicated reference rank (decoupled RA2P): stream reference log-probs to the actor.

The rank holds only the frozen reference model. For each decoupled step the controller
sends `ref_step` (how many micro-batches) and then each micro-batch's trajectories
(`ref_mb`) as they become ready; the rank collates them exactly as the actor does, runs
the forward and sends the log-probs to the actor over the job group without waiting
(`RefStreamServer`). The actor consumes them in its backward pass (loss-in-backward), so
the two forwards overlap. A mailbox thread fills the step's source while the main thread
serves it, so arrivals stream in during the step.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from tide_megatron.comm.mailbox import CONTROLLER, Mailbox
from tide_megatron.comm.messages import Stop
from tide_megatron.controller.trainer_rank import micro_batch_of
from tide_megatron.models.policy import model_config_from_checkpoint
from tide_megatron.models.qwen3_vl_inputs import TrajectoryImages
from tide_megatron.trainer.actor import ReferenceModel
from tide_megatron.trainer.ra2p import ArrivingSource, CostMeter, DecoupledConfig, LogprobStream, RefStreamServer

POLL_INTERVAL_S = 0.005


class RefRank:
    def __init__(self, model_path: str, rank: int, actor_rank: int, job_group, pad_to_multiple_of: int = 1):
        self.rank = rank
        self.job_group = job_group
        self.pad = pad_to_multiple_of
        self.meter = CostMeter()
        model_cfg = model_config_from_checkpoint(model_path)
        self.ref = ReferenceModel(model_cfg, model_path)
        self.images = TrajectoryImages.for_model(model_cfg, model_path)
        self.server = RefStreamServer(self.ref, LogprobStream(job_group),
                                      DecoupledConfig(ref_rank=rank, actor_ranks=(actor_rank,)), self.meter)
        self.actor_rank = actor_rank
        self._commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._source: ArrivingSource | None = None

    def _read_mailbox(self, mailbox: Mailbox, stop: threading.Event) -> None:
        """Route messages: micro-batches straight into the running step, the rest to `serve`."""
        while not stop.is_set():
            for msg in mailbox.poll():
                if isinstance(msg, Stop):
                    self._commands.put(msg)
                elif msg["kind"] == "ref_step":
                    self._source = ArrivingSource(int(msg["num_micro_batches"]))
                    self._commands.put({"kind": "ref_step", "source": self._source})
                elif msg["kind"] == "ref_mb":
                    self._source.put(micro_batch_of(msg["trajectories"], self.pad, self.images))
                else:
                    self._commands.put(msg)
            time.sleep(POLL_INTERVAL_S)

    def serve(self, mailbox: Mailbox) -> None:
        stop = threading.Event()
        reader = threading.Thread(target=self._read_mailbox, args=(mailbox, stop), daemon=True, name="ref-mailbox")
        reader.start()
        try:
            while True:
                msg = self._commands.get()
                if isinstance(msg, Stop):
                    return
                kind = msg["kind"]
                if kind == "ref_step":
                    report = self.server.serve_step({self.actor_rank: msg["source"]})
                    mailbox.post(CONTROLLER, "ref_done", report=report.as_dict(), costs=dict(self.meter.values))
                else:
                    raise ValueError(f"reference rank {self.rank}: unknown message kind {kind!r}")
        finally:
            stop.set()
            reader.join(timeout=5)
