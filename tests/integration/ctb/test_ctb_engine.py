"""CTB on a real SGLang engine (CPU): the `tide_ctb` contract (`ctb_contract.py`: reports, pool
and rows, decode timing, pause and resume, release caching, the row rule, a dispatcher-driven
rollout), and that the plugin runs in the scheduler process. One engine and one env server for
the whole module."""

from __future__ import annotations

import os

import pytest

import ctb_contract

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tide_megatron.envs.client import EnvClient
    from tide_megatron.envs.config import EnvConfig, EnvServerConfig
    from tide_megatron.envs.server_process import EnvServerProcess
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig
    from tide_megatron.rollout.worker import build_chat
    from tide_megatron.tokenizer import write_tokenizer

    root = tmp_path_factory.mktemp("ctb")
    tok = write_tokenizer(str(root / "tok"), kind="tiny_bpe")
    ckpt = write_random_hf_checkpoint(str(root / "hf"), ModelConfig(vocab_size=3072), seed=0, tokenizer_dir=tok)
    with EnvServerProcess(EnvServerConfig(envs=[EnvConfig(name="door_game")])) as server:
        engine = RolloutEngine(RolloutEngineConfig(max_total_tokens=2048, max_running_requests=32), ckpt)
        try:
            yield engine, build_chat(ckpt, None), EnvClient(server.client_config())
        finally:
            engine.shutdown()


@pytest.mark.parametrize("check", ctb_contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_ctb_contract(stack, check):
    check(stack)


def test_the_report_is_written_inside_the_scheduler_process(stack):
    report = ctb_contract.check_tagged_requests_are_reported(stack)
    assert report["pid"] != os.getpid()  # written by the scheduler subprocess, not this process
    assert report["hooks_called"]["intake"] >= 1 and report["hooks_called"]["add_one_req"] >= 1
