"""The test-only engine fault injector's spec (`TIDE_FAULT_KILL_ENGINE=<moment>:<n>[:<which>]`):
which rank it names, which moment, once only; a bad spec is refused."""

from __future__ import annotations

import pytest

from tide_megatron.utils import fault_injection
from tide_megatron.utils.fault_injection import EngineFault


def test_unset_is_inert(monkeypatch):
    monkeypatch.delenv(fault_injection.KILL_ENGINE_ENV, raising=False)
    fault = EngineFault(1)
    assert fault.moment is None and not fault.fires("after_version", 1) and not fault.poll(1e9)


def test_which_names_the_ranks():
    assert EngineFault(1, "after_version:2").moment == "after_version"  # self: rank 1
    assert EngineFault(2, "after_version:2").moment is None
    assert EngineFault(2, "after_version:2:self").moment is None
    assert EngineFault(2, "after_version:2:2").moment == "after_version"
    assert all(EngineFault(r, "during_weight_sync:3:all").moment == "during_weight_sync" for r in (1, 2, 5))


def test_fires_once_at_its_moment(monkeypatch):
    killed = []
    monkeypatch.setattr(fault_injection, "kill_scheduler", lambda: killed.append(1))
    fault = EngineFault(1, "at_step_boundary:2")
    assert not fault.at("at_step_boundary", 1) and not fault.at("after_version", 2)
    assert fault.at("at_step_boundary", 2) and killed == [1]
    assert not fault.at("at_step_boundary", 2) and killed == [1]


def test_after_checkpoint_watches_the_latest_marker(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(fault_injection, "kill_scheduler", lambda: killed.append(1))
    monkeypatch.setenv(fault_injection.RUN_DIR_ENV, str(tmp_path))
    fault = EngineFault(1, "after_checkpoint:2")
    assert not fault.poll(1.0)  # no checkpoint yet
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000001\n")
    assert not fault.poll(2.0)
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    assert not fault.poll(2.1)  # looks at most 5 times a second
    assert fault.poll(2.3) and killed == [1] and not fault.poll(9.0)


@pytest.mark.parametrize("spec", ["after_version", "soon:2", "after_version:2:some", "a:b:c:d"])
def test_a_bad_spec_is_refused(spec):
    with pytest.raises(ValueError):
        EngineFault(1, spec)


def test_after_checkpoint_needs_the_run_dir(monkeypatch):
    monkeypatch.delenv(fault_injection.RUN_DIR_ENV, raising=False)
    with pytest.raises(ValueError):
        EngineFault(1, "after_checkpoint:2")
    assert EngineFault(2, "after_checkpoint:2").moment is None  # not this rank: nothing to watch
