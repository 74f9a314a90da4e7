"""The compat layer's post-import hook: the callback runs once the module body has run."""

from __future__ import annotations

import sys

from tide_megatron.compat.qwen3vl_processor import PostImportHook


def test_callback_sees_the_executed_module(tmp_path, monkeypatch):
    (tmp_path / "tide_hook_probe_mod.py").write_text("REGISTRY = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = PostImportHook({"tide_hook_probe_mod": lambda m: (m.REGISTRY.update(x=1), seen.append(m.__name__))})
    sys.meta_path.insert(0, hook)
    try:
        import tide_hook_probe_mod  # noqa: F401

        assert seen == ["tide_hook_probe_mod"]
        assert tide_hook_probe_mod.REGISTRY == {"x": 1}
    finally:
        sys.meta_path.remove(hook)
        sys.modules.pop("tide_hook_probe_mod", None)


def test_other_modules_are_left_to_the_other_finders():
    hook = PostImportHook({"no.such.module": lambda m: None})
    assert hook.find_spec("json") is None
    assert hook.find_spec("no.such.module") is None  # nobody can load it: nothing to wrap
