"""Build, run and close a training job on this rank (what `launch/train.py` calls).

Rank 0 prepares what every rank needs (the env server, the model checkpoint, the output
directory) and publishes it through the job's store; the other ranks wait for it. Then
each rank takes its role: rank 0 runs the controller and trains, other trainer ranks
serve the controller's commands, rollout ranks run an SGLang engine and their tasks; a rank
that ERS moves switches between the last two at a step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from typing import Any

from tide_megatron.config import JobConfig
from tide_megatron.comm.mailbox import Mailbox
from tide_megatron.comm.topology import Topology, close_topology, init_topology
from tide_megatron.job_plan import machine_from_env, plan_job
from tide_megatron.utils.console import say
from tide_megatron.utils.net import CONTROL_LOOPBACK_ENV

logger = logging.getLogger(__name__)

_MODEL_KEY = "job/model_path"
_ENV_KEY = "job/env_address"
_ERROR_KEY = "job/setup_error"
_RESUME_KEY = "job/resume_path"


class Job:
    def __init__(self, cfg: JobConfig):
        # The plan fixes the rollout count (`cluster.rollout_share`), every rank's GPU and groups.
        self.cfg, plan = plan_job(cfg, *machine_from_env())
        self.topo: Topology = init_topology(plan, cfg.run.seed)
        self.mailbox = Mailbox(self.topo.store, self.topo.rank)
        self._env_server = None
        self._closers: list[Any] = []
        self._cost = None  # the emulated device's cost model, once loaded
        self._resume = None  # rank 0: the checkpoint chosen to resume from (a ResumePoint), if any
        if self.topo.is_controller:
            self._setup_rank0()
        self.model_path = self._shared(_MODEL_KEY)
        self.resume_path = self._shared(_RESUME_KEY)  # "" when the run starts fresh
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
        one_node = os.environ.get("LOCAL_WORLD_SIZE") == str(topo.world_size)
        if one_node and os.environ.get(CONTROL_LOOPBACK_ENV) != "1":
            logger.warning("the torchrun store that carries this job's control messages listens on every network "
                           "interface, unauthenticated; on one node start with `python launch/torchrun.py` "
                           "(loopback only), see docs/threat_model.md")

    # -- start-up -------------------------------------------------------------------
    def _setup_rank0(self) -> None:
        try:
            cfg = self.cfg
            from tide_megatron.utils.metric_sinks import check_available

            check_available(cfg.metrics.active_loggers)  # a missing wandb / mlflow fails here, not after start-up
            os.makedirs(cfg.run.output_dir, exist_ok=True)
            with open(os.path.join(cfg.run.output_dir, "config.json"), "w") as f:
                json.dump(redact_secrets(dataclasses.asdict(cfg)), f, indent=2)
            self._resume = resolve_resume(cfg.run, self.checkpoint_root)
            model_path = cfg.model.path or self._write_random_checkpoint()
            _check_model_dir(model_path)
            address = self._start_env_server()
        except BaseException as exc:
            # Tell the waiting ranks why, instead of letting them time out.
            self.topo.store.set(_ERROR_KEY, f"{type(exc).__name__}: {exc}")
            raise
        self.topo.store.set(_RESUME_KEY, self._resume.path if self._resume else "")
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

    @property
    def continues_earlier_run(self) -> bool:
        """This run continues an earlier one in `output_dir` (or may: `auto` with nothing saved
        yet is the restart of a job that died before its first checkpoint)."""
        return self.cfg.run.resume_mode != "false" or bool(self.cfg.run.resume_from)

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
        if cfg.model.architecture == "qwen3_vl":
            return self._write_random_vl_checkpoint(path, tok_dir, vocab)
        vocab = -(-vocab // (cfg.trainer.tp_size * 64)) * cfg.trainer.tp_size * 64  # shardable
        arch = cfg.model.random_init
        model_cfg = ModelConfig(vocab_size=vocab, **dataclasses.asdict(arch))
        return write_random_hf_checkpoint(path, model_cfg, seed=cfg.run.seed, tokenizer_dir=tok_dir)

    def _write_random_vl_checkpoint(self, path: str, tok_dir: str, base_vocab: int) -> str:
        """A random Qwen3-VL: `random_init` is its language model, `random_vision` the rest."""
        from tide_megatron.models.qwen3_vl_checkpoint import write_random_vl_checkpoint_from

        cfg = self.cfg
        return write_random_vl_checkpoint_from(path, cfg.model.random_init, cfg.model.random_vision, tok_dir,
                                               base_vocab, cfg.trainer.tp_size, cfg.run.seed)

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
        if self.topo.is_controller:
            self._run_controller()
        else:
            self._run_rank()

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

    def _trainer_worker(self):
        """This rank's trainer side (`trainer.worker`): it holds nothing while the rank rolls out."""
        from tide_megatron.controller.modes import mode_policy
        from tide_megatron.trainer.worker import TrainerWorker

        mode = mode_policy(self.cfg.scheduler.mode, ra2p_executor=self.cfg.ra2p.executor,
                           ctb_enabled=self.cfg.ctb.enabled)
        device_time = None
        if self.cfg.cluster.device == "emulated":
            from tide_megatron.emulation.trainer_time import TrainerDeviceTime

            device_time = TrainerDeviceTime(self._emulated_cost(), self.cfg.cluster.emulation.dilation)
        trainer = TrainerWorker.at_startup(
            self.topo, self.cfg.trainer, self.model_path, self.checkpoint_root,
            colocated=mode.colocated_config(self.cfg.ra2p.cost_model.aggregation_limit, self.cfg.ra2p.offload_idle_model),
            device_time=device_time)
        start_step = trainer.load(self.resume_path) if self.resume_path and self.topo.trains else 0
        return trainer, start_step

    def _run_rank(self) -> None:
        """A rank other than 0 serves the trainer or rolls out, as its role says, and switches
        when ERS moves it (at a post-update boundary, told by rank 0): the `SetRoles` message that
        ends its rollout loop is the first its trainer side handles, and a `SetRoles` message that
        makes it ROLLOUT ends the trainer's. Its SGLang engine starts when it first rolls out, or
        at start-up on a trainer rank ERS may move (`ers.standby_engines`)."""
        from tide_megatron.comm.messages import EngineStandby
        from tide_megatron.controller.trainer_roles import may_train, standby_engine_ranks
        from tide_megatron.core.roles import Role

        # A rollout rank holds a trainer side only if ERS may move it (the worker reads the
        # checkpoint's config and, for a VL model, its image processor)
        trainer = self._trainer_worker()[0] if may_train(self.cfg, self.topo.rank, self.topo.world_size) else None
        rollout = None
        pending = None
        if self.topo.rank in standby_engine_ranks(self.cfg, self.topo.trainer_ranks + self.topo.ref_ranks):
            rollout = self._start_rollout()
            rollout.park()
            self.mailbox.post(0, EngineStandby())
        while True:
            if trainer is None or trainer.role is Role.ROLLOUT:
                rollout = rollout or self._start_rollout()
                pending = rollout.run()
                if pending is None:  # Stop
                    return
                trainer = trainer or self._trainer_worker()[0]
            if trainer.serve(self.mailbox, pending) is None:  # Stop
                return
            pending = None

    def _run_controller(self) -> None:
        """Rank 0: an actor that also runs the controller."""
        trainer, start_step = self._trainer_worker()
        run = self.cfg.run
        from tide_megatron.controller.loop import Controller
        from tide_megatron.utils.metric_sinks import SinkSettings
        from tide_megatron.utils.metrics import MetricsLogger

        # a restart before the first checkpoint finds the earlier attempt's records (dropped below)
        earlier = os.path.join(run.output_dir, "metrics.jsonl")
        restarted = self.continues_earlier_run and os.path.isfile(earlier) and os.path.getsize(earlier) > 0
        metrics = MetricsLogger(run.output_dir, run.steps, start_step, progress=self.cfg.metrics.progress,
                                resume_step=start_step if self.continues_earlier_run else None,
                                loggers=self.cfg.metrics.active_loggers,
                                sink_settings=SinkSettings.from_config(self.cfg.metrics, run.name),
                                run_config=redact_secrets(dataclasses.asdict(self.cfg)))
        self._closers.append(metrics)
        if start_step:
            metrics.write(f"resumed from step {start_step}")
            metrics.event("resume", f"resumed from the checkpoint of step {start_step} ({self.resume_path})")
        elif restarted:
            metrics.event("resume", "restarted from scratch (no checkpoint yet)")
        eval_tasks = self._list_tasks("eval") if self.cfg.scheduler.eval_every else []
        controller = Controller(self.cfg, self.topo, self.mailbox, trainer, metrics, self._list_tasks(), start_step,
                                eval_tasks=eval_tasks)
        self._restore_run_state(controller)
        try:
            controller.run()
        except BaseException:
            controller.shutdown()  # let the other ranks exit instead of waiting forever
            raise
        lines = metrics.summary(self.checkpoint_root)
        metrics.close()  # the progress bar ends before the summary
        for line in lines:
            say(line)
        if controller.unstopped:  # a rank that never exits would keep torchrun waiting forever:
            # failing here makes torchrun stop every rank (README, "Faults")
            from tide_megatron.controller.loop import RunError

            raise RunError(f"the run completed, but {len(controller.unstopped)} rollout rank(s) did not stop: "
                           + "; ".join(controller.unstopped))

    def _restore_run_state(self, controller) -> None:
        from tide_megatron.controller import run_state

        if self._resume is None:
            return
        if self._resume.run_state is None:
            say(f"{self._resume.path} holds no run state: the task sampler and the token ledger start afresh")
            return
        for note in run_state.restore(controller, run_state.RunState.from_json(self._resume.run_state)):
            say(note)

    def _emulated_cost(self):
        """The emulated device's cost model (`cluster.device=emulated`), the simulator's."""
        if self._cost is None:
            from tide_megatron.sim.loader import load_hardware_model

            self._cost = load_hardware_model(self.cfg.cluster.emulation.hardware, self.cfg.cluster.emulation.model)
        return self._cost

    def _start_rollout(self):
        """This rank's rollout worker: an SGLang engine and an env connection, kept for the run
        (a rank moved to the trainer and back reuses them)."""
        from tide_megatron.envs.client import EnvClient
        from tide_megatron.rollout.engine import RolloutEngine
        from tide_megatron.rollout.worker import RolloutWorker, build_chat

        cfg = self.cfg
        # Its own GPU (the plan's; torchrun shows every GPU of the node to every rank).
        engine_cfg = dataclasses.replace(cfg.rollout.engine, seed=cfg.run.seed + self.topo.rank,
                                         base_gpu_id=self.topo.gpu)

        chat = build_chat(self.model_path, cfg.rollout.runner.system_prompt)
        if cfg.cluster.device == "emulated":
            from tide_megatron.emulation.engine import EmulatedEngine
            from tide_megatron.envs.workload_env import answer_length_reader

            cost, answer_length = self._emulated_cost(), answer_length_reader(chat.tokenizer)

            def new_engine():
                return EmulatedEngine(engine_cfg, cfg.cluster.emulation, cost, answer_length,
                                      cluster_gpus=self.topo.world_size)
        else:
            def new_engine():
                return RolloutEngine(engine_cfg, self.model_path)

        client = EnvClient(self._client_config())
        worker = RolloutWorker(self.topo.rank, new_engine(), cfg.rollout.runner, chat, client, self.mailbox,
                               self.topo.job_group, heartbeat_interval_s=cfg.scheduler.heartbeat_interval_s,
                               engine_factory=new_engine)
        self._closers.append(worker)  # shuts down whichever engine the worker runs at the end
        worker.engine.loop.run_until_complete(client.connect())
        self._closers.append(_EnvConnection(worker, client))  # closed first (closers run in reverse)
        return worker

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


class _EnvConnection:
    """Closes a rollout worker's env connection on its engine's event loop."""

    def __init__(self, worker, client):
        self.worker, self.client = worker, client

    def close(self) -> None:
        self.worker.engine.loop.run_until_complete(self.client.close())


def redact_secrets(value: Any) -> Any:
    """The resolved config as written to `config.json`, every non-empty `auth_token` replaced:
    the output directory is shared with whoever reads the run's results."""
    if isinstance(value, dict):
        return {k: "<redacted>" if k == "auth_token" and v else redact_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    return value


def resolve_resume(run, checkpoint_root: str):
    """The verified checkpoint a run continues from (a `ResumePoint`), or None to start fresh.

    `run.resume=auto|true`: the newest good checkpoint under `checkpoint_root`, falling back
    past corrupt ones (one line each, on the console); `true` fails when there is none.
    `run.resume_from`: one directory, checked, no fallback; `auto` uses it only while the run
    has no checkpoint of its own (a restarted job continues from its own progress)."""
    from tide_megatron.controller.run_state import RunState
    from tide_megatron.trainer import checkpoint as ckpt

    mode = run.resume_mode
    point = None
    if run.resume_from and mode != "auto":
        point = _explicit_checkpoint(run.resume_from)
    elif mode in ("auto", "true"):
        point = ckpt.find_resumable(checkpoint_root, RunState.from_json)
        if point is None and run.resume_from:
            point = _explicit_checkpoint(run.resume_from)
        elif point is None and mode == "true":
            raise FileNotFoundError(f"run.resume=true: no checkpoint to resume under {checkpoint_root} "
                                    "(run.resume=auto starts fresh when there is none)")
        elif point is None:
            say(f"run.resume=auto: no checkpoint under {checkpoint_root} yet, starting fresh")
    if point is not None:
        for note in point.notes:
            say(note)
        say(f"resuming from {point.path} (step {point.step})")
    return point


def _explicit_checkpoint(path: str):
    """`run.resume_from`: one checkpoint directory, verified (no fallback: the user chose it)."""
    from tide_megatron.controller.run_state import RunState
    from tide_megatron.trainer import checkpoint as ckpt

    key = f"run.resume_from={path!r}"
    if os.path.isfile(path):
        raise ValueError(f"{key} is a file, expected a checkpoint directory (a step_NNNNNN directory)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key} does not exist")
    if os.path.isfile(os.path.join(path, ckpt.LATEST_MARKER)):
        raise ValueError(f"{key} holds checkpoints, expected one of them (e.g. {os.path.join(path, 'step_NNNNNN')})")
    try:
        return ckpt.open_resumable(path, RunState.from_json)
    except ckpt.CheckpointCorrupt as exc:
        raise ckpt.CheckpointError(f"{key}: {exc}") from None


def _check_model_dir(model_path: str) -> None:
    """A Hugging Face model directory with a readable config.json, or one line saying what is wrong."""
    key = f"model.path={model_path!r}"
    config = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"{key} does not exist" if not os.path.exists(model_path)
                                else f"{key} is a file, expected a Hugging Face model directory")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{key} holds no Hugging Face config.json")
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}: config.json is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{key}: config.json is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{key}: config.json is not a Hugging Face model config (no model_type)")
