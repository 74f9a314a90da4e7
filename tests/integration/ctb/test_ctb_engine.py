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
    from tide_megatron.rollout.engine import RolloutEngine, RolloutEngineConfig

    with ctb_contract.door_game_stack(tmp_path_factory.mktemp("ctb"), lambda ckpt: RolloutEngine(
            RolloutEngineConfig(max_total_tokens=2048, max_running_requests=32), ckpt)) as out:
        yield out


@pytest.mark.parametrize("check", ctb_contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_ctb_contract(stack, check):
    check(stack)


def test_the_report_is_written_inside_the_scheduler_process(stack):
    report = ctb_contract.check_tagged_requests_are_reported(stack)
    assert report["pid"] != os.getpid()  # written by the scheduler subprocess, not this process
    assert report["hooks_called"]["intake"] >= 1 and report["hooks_called"]["add_one_req"] >= 1
