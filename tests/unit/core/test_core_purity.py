"""The scheduling core must stay importable without any ML framework (simulator, CI, controller)."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

import tide_megatron.core as core

CORE_DIR = pathlib.Path(core.__file__).parent
FORBIDDEN = ("torch", "megatron", "sglang", "transformers", "transformer_engine", "numpy", "vllm", "triton")
MODULES = sorted(p.stem for p in CORE_DIR.glob("*.py") if p.stem != "__init__")


def test_expected_components_exist():
    assert {"signals", "buffer", "ctb", "ra2p", "ers", "roles"} <= set(MODULES)


def test_importing_every_core_module_loads_no_framework():
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {MODULES!r}:
            importlib.import_module("tide_megatron.core." + name)
        bad = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})
        print(",".join(bad))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("module", MODULES + ["__init__"])
def test_sources_import_only_stdlib_and_core(module):
    tree = ast.parse((CORE_DIR / f"{module}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else ["tide_megatron.core"]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert top not in FORBIDDEN, f"{module}.py imports {name}"
            if top == "tide_megatron":
                assert name.startswith("tide_megatron.core"), f"{module}.py imports {name} outside core"
            else:
                assert top in sys.stdlib_module_names or top == "__future__", f"{module}.py imports non-stdlib {name}"


@pytest.mark.parametrize("module", MODULES)
def test_decisions_never_read_the_wall_clock_or_spawn_threads(module):
    src = (CORE_DIR / f"{module}.py").read_text()
    for needle in ("time.time(", "time.monotonic(", "datetime.now(", "import threading", "import random", "open("):
        assert needle not in src, f"{module}.py uses {needle}"


def test_every_config_field_has_a_docstring():
    import dataclasses

    configs = [core.SignalsConfig, core.BufferConfig, core.CTBConfig, core.RA2PConfig, core.ERSConfig]
    for cls in configs:
        src = (CORE_DIR / f"{sys.modules[cls.__module__].__name__.rsplit('.', 1)[1]}.py").read_text()
        tree = ast.parse(src)
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
        documented = set()
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) \
                    and isinstance(b.value.value, str):
                documented.add(a.target.id)
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields <= documented, f"{cls.__name__}: undocumented {fields - documented}"
