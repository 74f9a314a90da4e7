"""The SGLang engine's own torch.distributed world meets in a private FileStore, not in a
TCPStore listening on every interface (checked end to end by the e2e listener tests)."""

from __future__ import annotations

import os

from tide_megatron.rollout.engine import (DIST_INIT_OVERRIDE_ENV, RolloutEngineConfig, _scheduler_environment,
                                          _wants_file_rendezvous)


def test_scheduler_environment_points_sglang_at_a_file_and_restores(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv(DIST_INIT_OVERRIDE_ENV, raising=False)
    with _scheduler_environment(str(tmp_path)):
        assert os.environ[DIST_INIT_OVERRIDE_ENV] == f"file://{tmp_path}/dist_init"
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    assert DIST_INIT_OVERRIDE_ENV not in os.environ and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_a_users_own_rendezvous_is_left_alone(monkeypatch):
    monkeypatch.delenv(DIST_INIT_OVERRIDE_ENV, raising=False)
    kwargs = RolloutEngineConfig().engine_kwargs("/m")
    assert _wants_file_rendezvous(kwargs)
    assert not _wants_file_rendezvous({**kwargs, "dist_init_addr": "10.0.0.5:5000"})
    assert not _wants_file_rendezvous({**kwargs, "nnodes": 2})
    monkeypatch.setenv(DIST_INIT_OVERRIDE_ENV, "env://")
    assert not _wants_file_rendezvous(kwargs)


def test_an_idle_scheduler_sleeps_on_cpu_unless_told_otherwise():
    import inspect

    from sglang.srt.server_args import ServerArgs

    assert "sleep_on_idle" in inspect.signature(ServerArgs).parameters  # drift: the pinned SGLang has it
    assert RolloutEngineConfig().engine_kwargs("/m")["sleep_on_idle"] is True
    assert "sleep_on_idle" not in RolloutEngineConfig(device="cuda").engine_kwargs("/m")
    assert "sleep_on_idle" not in RolloutEngineConfig(sleep_on_idle=False).engine_kwargs("/m")
    assert RolloutEngineConfig(device="cuda", sleep_on_idle=True).engine_kwargs("/m")["sleep_on_idle"] is True


def test_sglang_children_are_forked_on_a_cpu_engine_unless_turned_off():
    assert RolloutEngineConfig().forks_children()
    assert not RolloutEngineConfig(device="cuda").forks_children()
    assert not RolloutEngineConfig(fork_children=False).forks_children()
    assert "fork_children" not in RolloutEngineConfig().engine_kwargs("/m")  # ours, not an SGLang argument
