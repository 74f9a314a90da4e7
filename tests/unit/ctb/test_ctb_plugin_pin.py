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
