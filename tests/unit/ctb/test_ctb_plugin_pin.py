"""The plugin is pinned: every hooked SGLang function must exist with its recorded signature."""

from importlib.metadata import entry_points

import pytest

from sglang_patches import plugin


def test_every_hooked_sglang_function_exists_with_the_recorded_signature():
    assert plugin.installed_sglang_version() == plugin.PINNED_SGLANG_VERSION
    problems = plugin.check_hook_targets()
    assert not problems, "SGLang changed under the tide_ctb plugin:\n" + "\n".join(problems)


def test_plugin_refuses_another_sglang_version(monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.24")
    with pytest.raises(plugin.SGLangVersionMismatch, match="pinned to sglang==0.5.23"):
        plugin.load()


def test_plugin_refuses_a_changed_signature(monkeypatch):
    monkeypatch.setitem(plugin.HOOKED_SIGNATURES, next(iter(plugin.HOOKED_SIGNATURES)), "(self, something_else)")
    with pytest.raises(plugin.SGLangVersionMismatch, match="signature changed"):
        plugin.load()


def test_entry_point_is_registered_in_sglangs_plugin_group():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    eps = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps.get("tide_ctb") == "sglang_patches.plugin:load"


def test_decode_timing_hook_is_pinned_to_the_result_processing_and_the_launch_clock():
    import inspect

    from sglang.srt.managers.scheduler import Scheduler

    target = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
    assert str(inspect.signature(Scheduler.process_batch_result)) == plugin.HOOKED_SIGNATURES[target]
    assert list(inspect.signature(Scheduler.process_batch_result).parameters) == ["self", "batch", "result"]
    assert "batch.launch_ts = time.monotonic()" in inspect.getsource(inspect.unwrap(Scheduler.run_batch))


def test_plugin_refuses_when_run_batch_changes_its_launch_clock(monkeypatch):
    monkeypatch.setitem(plugin._SOURCE_FACTS, next(iter(plugin._SOURCE_FACTS)), "batch.launch_ts = time.perf_counter()")
    with pytest.raises(plugin.SGLangVersionMismatch, match="no longer contains"):
        plugin.load()
