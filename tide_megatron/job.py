"""Build, run and close a training job on this rank (what `launch/train.py` calls).

Rank 0 prepares what every rank needs (the env server, the model checkpoint, the output
directory) and publishes it through the job's store; the other ranks wait for it. Then
each rank takes its role: rank 0 runs the controller and trains, other trainer ranks
serve the controller's commands, rollout ranks run an SGLang engine and their tasks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from typing import Any

from tide_megatron.config import JobConfig, check_runnable, validate
from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.topology import Topology, close_topology, init_topology
from tide_megatron.utils.console import say

logger = logging.getLogger(__name__)

_MODEL_KEY = "job/model_path"
_ENV_KEY = "job/env_address"
_ERROR_KEY = "job/setup_error"


class Job:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        world = int(os.environ.get("WORLD_SIZE", "1"))
        validate(cfg, world)
        check_runnable(cfg, world)
        self.topo: Topology = init_topology(cfg.cluster.rollout_ranks, cfg.trainer.tp_size, cfg.run.seed,
                                            ref_ranks=cfg.cluster.ref_ranks)
        self.mailbox = Mailbox(self.topo.store, self.topo.rank)
        self._env_server = None
        self._closers: list[Any] = []
        if self.topo.is_controller:
            self._setup_rank0()
        self.model_path = self._shared(_MODEL_KEY)
        self.env_host, env_port = self._shared(_ENV_KEY).rsplit(":", 1)
        self.env_port = int(env_port)
        if self.topo.is_controller:
            self._say_starting()

    def _say_starting(self) -> None:
        cfg, topo = self.cfg, self.topo
        roles = ", ".join(f"{name} {ranks[0]}" if len(ranks) == 1 else f"{name} {ranks[0]}-{ranks[-1]}"
                          for name, ranks in (("actor", topo.trainer_ranks), ("reference", topo.ref_ranks),
                                              ("rollout", topo.rollout_ranks)) if ranks)
        say(f"tide-megatron: run {cfg.run.name!r}, scheduler.mode={cfg.scheduler.mode}, {topo.world_size} ranks "
            f"({roles}; rank 0 also runs the controller)")
        model = self.model_path if cfg.model.path else f"random {cfg.model.random_init.num_layers}-layer " \
            f"h{cfg.model.random_init.hidden_size} model written to {self.model_path}"
        say(f"model: {model}")
        where = "external" if cfg.envs.external else \
            f"started by this run, log {os.path.join(cfg.run.output_dir, 'env_server.log')}"
        say(f"env server: {cfg.envs.train_env} at {self.env_host}:{self.env_port} ({where})")
        if not cfg.run.verbose:
            say(f"library logs: {os.path.join(cfg.run.output_dir, 'logs')} (run.verbose=true shows them here)")

    # -- start-up -------------------------------------------------------------------
    def _setup_rank0(self) -> None:
        try:
            cfg = self.cfg
            os.makedirs(cfg.run.output_dir, exist_ok=True)
            with open(os.path.join(cfg.run.output_dir, "config.json"), "w") as f:
                json.dump(dataclasses.asdict(cfg), f, indent=2)
            self._check_resume_path()
            model_path = cfg.model.path or self._write_random_checkpoint()
            if not os.path.isfile(os.path.join(model_path, "config.json")):
                raise FileNotFoundError(f"model.path={model_path!r} holds no Hugging Face config.json")
            address = self._start_env_server()
        except BaseException as exc:
            # Tell the waiting ranks why, instead of letting them time out.
            self.topo.store.set(_ERROR_KEY, f"{type(exc).__name__}: {exc}")
            raise
        self.topo.store.set(_MODEL_KEY, model_path)
        self.topo.store.set(_ENV_KEY, address)

    def _shared(self, key: str) -> str:
        while True:
            if self.topo.store.check([_ERROR_KEY]):
                raise RuntimeError(f"rank 0 failed to set up the job: {self.topo.store.get(_ERROR_KEY).decode()}")
            if self.topo.store.check([key]):
                return self.topo.store.get(key).decode()
            import time

            time.sleep(0.05)

    def _check_resume_path(self) -> None:
        from tide_megatron.trainer.checkpoint import latest_checkpoint

        run = self.cfg.run
        if run.resume_from and not os.path.isdir(run.resume_from):
            raise FileNotFoundError(f"run.resume_from={run.resume_from!r} does not exist")
        if run.resume and not run.resume_from:
            latest_checkpoint(self.checkpoint_root)  # raises, naming the path, when there is none

    @property
    def checkpoint_root(self) -> str:
        return os.path.join(self.cfg.run.output_dir, "checkpoints")

    def _write_random_checkpoint(self) -> str:
        from tide_megatron.models.config import ModelConfig
        from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
        from tide_megatron.tokenizer import write_tokenizer

        cfg = self.cfg
        path = os.path.join(cfg.run.output_dir, "initial_model")
        tok_dir = write_tokenizer(os.path.join(cfg.run.output_dir, "tokenizer"), kind=cfg.model.tokenizer)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(tok_dir))
        vocab = -(-vocab // (cfg.trainer.tp_size * 64)) * cfg.trainer.tp_size * 64  # shardable
        arch = cfg.model.random_init
        model_cfg = ModelConfig(vocab_size=vocab, **dataclasses.asdict(arch))
        return write_random_hf_checkpoint(path, model_cfg, seed=cfg.run.seed, tokenizer_dir=tok_dir)

    def _start_env_server(self) -> str:
        envs = self.cfg.envs
        if envs.external:
            return f"{envs.client.host}:{envs.client.port}"
        from tide_megatron.envs.config import EnvServerProcessConfig
        from tide_megatron.envs.server_process import EnvServerProcess

        log = os.path.join(self.cfg.run.output_dir, "env_server.log")
        self._env_server = EnvServerProcess(envs.server, EnvServerProcessConfig(log_path=log)).start()
        return f"{self._env_server.host}:{self._env_server.port}"

    # -- roles ----------------------------------------------------------------------
    def run(self) -> None:
        if self.topo.trains:
            self._run_trainer()
        elif self.topo.rank in self.topo.ref_ranks:
            from tide_megatron.controller.ref_rank import RefRank

            RefRank(self.model_path, self.topo.rank, self.topo.trainer_ranks[0], self.topo.job_group,
                    self.cfg.trainer.pad_to_multiple_of).serve(self.mailbox)
        else:
            self._run_rollout()

    def _client_config(self):
        return dataclasses.replace(self.cfg.envs.client, host=self.env_host, port=self.env_port)

    def _list_tasks(self, split: str = "train") -> list[dict[str, Any]]:
        from tide_megatron.envs.client import EnvClient

        async def fetch():
            async with EnvClient(self._client_config()) as client:
                return await client.list_tasks(self.cfg.envs.train_env, split)

        tasks = asyncio.run(fetch())
        if not tasks:
            raise RuntimeError(f"env {self.cfg.envs.train_env!r} offers no {split} tasks")
        return [t.to_json() for t in tasks]

    def _run_trainer(self) -> None:
        from tide_megatron.controller.trainer_rank import TrainerRank

        trainer = TrainerRank(self.cfg.trainer, self.model_path, self.topo.rank, self.checkpoint_root,
                              self.topo.job_group)
        run = self.cfg.run
        start_step = 0
        if run.resume or run.resume_from:
            start_step = trainer.load(run.resume_from or None)
        if not self.topo.is_controller:
            trainer.serve(self.mailbox)
            return
        from tide_megatron.controller.loop import Controller
        from tide_megatron.utils.metrics import MetricsLogger

        metrics = MetricsLogger(run.output_dir, run.steps, start_step, jsonl=self.cfg.metrics.jsonl,
                                tensorboard=self.cfg.metrics.tensorboard, progress=self.cfg.metrics.progress)
        self._closers.append(metrics)
        if start_step:
            metrics.write(f"resumed from step {start_step}")
        eval_tasks = self._list_tasks("eval") if self.cfg.scheduler.eval_every else []
        controller = Controller(self.cfg, self.topo, self.mailbox, trainer, metrics, self._list_tasks(), start_step,
                                eval_tasks=eval_tasks)
        try:
            controller.run()
        except BaseException:
            controller.shutdown()  # let the other ranks exit instead of waiting forever
            raise
        lines = metrics.summary(self.checkpoint_root)
        metrics.close()  # the progress bar ends before the summary
        for line in lines:
            say(line)

    def _run_rollout(self) -> None:
        from tide_megatron.envs.client import EnvClient
        from tide_megatron.rollout.engine import RolloutEngine
        from tide_megatron.rollout.worker import RolloutWorker, build_chat

        cfg = self.cfg
        engine_cfg = dataclasses.replace(cfg.rollout.engine, seed=cfg.run.seed + self.topo.rank)

        def new_engine() -> RolloutEngine:
            return RolloutEngine(engine_cfg, self.model_path)

        client = EnvClient(self._client_config())
        worker = RolloutWorker(self.topo.rank, new_engine(), cfg.rollout.runner,
                               build_chat(self.model_path, cfg.rollout.runner.system_prompt), client, self.mailbox,
                               self.topo.job_group, heartbeat_interval_s=cfg.scheduler.heartbeat_interval_s,
                               engine_factory=new_engine)
        self._closers.append(worker)  # shuts down whichever engine the worker runs at the end
        engine = worker.engine
        engine.loop.run_until_complete(client.connect())
        try:
            worker.run()
        finally:
            engine.loop.run_until_complete(client.close())

    # -- shutdown -------------------------------------------------------------------
    def close(self) -> None:
        for closer in reversed(self._closers):
            try:
                (getattr(closer, "shutdown", None) or closer.close)()
            except Exception:
                logger.exception("while closing %r", closer)
        if self._env_server is not None:
            self._env_server.stop()
        close_topology(self.topo)
