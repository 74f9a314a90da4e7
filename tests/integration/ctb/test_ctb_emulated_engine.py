"""The `tide_ctb` contract (`ctb_contract.py`) on the emulated engine (`cluster.device=emulated`):
the same checks as on SGLang with the plugin, with the engine's time modelled. Prefix reuse at
SGLang's granularity (one token per page) so that cache hits compare exactly."""

from __future__ import annotations


import pytest

import ctb_contract

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tide_megatron.emulation.config import EmulationConfig
    from tide_megatron.emulation.engine import EmulatedEngine
    from tide_megatron.rollout.config import RolloutEngineConfig
    from tide_megatron.sim.loader import load_hardware_model

    with ctb_contract.door_game_stack(tmp_path_factory.mktemp("ctb_emulated"), lambda _ckpt: EmulatedEngine(
            RolloutEngineConfig(max_total_tokens=2048, max_running_requests=32),
            EmulationConfig(page_tokens=1, gen_tokens=[6, 0.5]), load_hardware_model("h100_sxm", "qwen2_5_7b"))) as out:
        yield out


@pytest.mark.parametrize("check", ctb_contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_ctb_contract(stack, check):
    check(stack)


def test_device_time_follows_the_cost_model(stack):
    """A lone request's modelled time is its prefill plus one decode iteration per later token."""
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    engine, _chat, _env = stack
    engine.loop.run_until_complete(engine.flush_cache())
    before = engine.device_s
    prompt = list(range(500, 600))
    engine.loop.run_until_complete(generate_tagged(engine, prompt, {"max_new_tokens": 5, "ignore_eos": True},
                                                   None, None))
    cost = engine.cost
    expected = cost.prefill_s(100, 0) + sum(cost.decode_iteration_s(1, 101 + i) for i in range(4))
    assert engine.device_s - before == pytest.approx(expected, rel=1e-9)


def test_a_ctb_rollout_of_the_workload_env_replays_the_simulators_trajectories(tmp_path):
    """The emulated engine answers as long as the `workload` env's trajectory says: a CTB rollout
    of its tasks generates exactly the simulator's turns and tokens per trajectory, and its
    observations are the simulator's, give or take the chat template's tokens per turn."""
    from tide_megatron.core.ctb import CTBConfig
    from tide_megatron.emulation.config import EmulationConfig
    from tide_megatron.emulation.engine import EmulatedEngine
    from tide_megatron.envs.client import EnvClient
    from tide_megatron.envs.config import EnvConfig, EnvServerConfig, WorkloadEnvConfig
    from tide_megatron.envs.server_process import EnvServerProcess
    from tide_megatron.envs.workload_env import answer_length_reader
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.rollout.config import RolloutEngineConfig
    from tide_megatron.rollout.ctb_config import CTBDispatchConfig
    from tide_megatron.rollout.ctb_rollout import LocalCTBRollout
    from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner
    from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunnerConfig
    from tide_megatron.rollout.worker import build_chat
    from tide_megatron.sim.loader import load_hardware_model, load_workload
    from tide_megatron.sim.workload import WorkloadModel
    from tide_megatron.tokenizer import write_tokenizer

    tok = write_tokenizer(str(tmp_path / "tok"), kind="tiny_bpe")
    ckpt = write_random_hf_checkpoint(str(tmp_path / "hf"), ModelConfig(vocab_size=3072), seed=0, tokenizer_dir=tok)
    chat = build_chat(ckpt, None)
    workload = WorkloadEnvConfig(seed=3, time_scale=0.0)
    sim = WorkloadModel(load_workload(workload.workload), seed=3)
    with EnvServerProcess(EnvServerConfig(envs=[EnvConfig(name="workload", workload=workload)])) as server:
        engine = EmulatedEngine(RolloutEngineConfig(max_total_tokens=200_000, max_running_requests=64),
                                EmulationConfig(dilation=0.02), load_hardware_model("h100_sxm", "qwen2_5_7b"),
                                answer_length_reader(chat.tokenizer))
        env = EnvClient(server.client_config())
        try:
            runner = CTBTaskRunner(TaskRunnerConfig(max_turns=60, max_context_tokens=32768, max_new_tokens=1024),
                                   {0: engine}, chat, env)
            rollout = LocalCTBRollout(CTBDispatchConfig(max_resident_tasks_per_rank=16,
                                                        policy=CTBConfig(staleness_throttle=False)), runner)

            async def go():
                await env.connect()
                specs = await env.list_tasks("workload", "train", limit=3)
                assignments = [TaskAssignment(task=s.to_json(), group_id=f"g{i}", index=j)
                               for i, s in enumerate(specs) for j in range(4)]
                trajs = await rollout.run(assignments, prompt_tokens=1000)
                await env.close()
                return trajs

            trajs = engine.loop.run_until_complete(go())
        finally:
            engine.shutdown()
    assert len(trajs) == 12
    for t in trajs:
        want = sim.trajectory(int(t.task_id.split("/")[1]), t.index)
        assert (t.turns, t.generated_tokens, t.truncated) == (want.n_turns, sum(want.gen), False), t.task_id
        context = want.prompt_tokens + sum(want.gen) + sum(want.obs[:-1])
        overhead = len(t.token_ids) - context  # the template's tokens and the answer directives
        assert 0 < overhead <= 40 * want.n_turns, (t.task_id, overhead)
    assert engine.device_s > 0 and sum(t.cached_tokens for t in trajs) > 0
