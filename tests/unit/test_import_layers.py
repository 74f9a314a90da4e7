"""Import layers of the package.

- The job's configuration imports without the ML stack: `launch/` composes and checks a job,
  and tools read its config, on machines without torch, Megatron or SGLang. A config module
  imports only the standard library, other config modules and the scheduling core
  (`tide_megatron.core`, pure Python), and importing it loads nothing else of the package.
- No module imports itself back through others. An import cycle works only as long as every
  import in it stays where it is (inside a function, after the names the other side needs),
  and it makes its modules one unit: none can be imported, tested or replaced without the rest.

The import graph is read from the sources (every `import` of a `tide_megatron` module, at the
top of a module or inside a function), without importing them. Imports under
`if TYPE_CHECKING:` are left out: they never run, and they are how a lower module names a
higher one's type in an annotation.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

import tide_megatron

PKG = pathlib.Path(tide_megatron.__file__).parent
REPO = PKG.parent
FRAMEWORKS = ("torch", "megatron", "sglang", "transformers", "numpy")
CONFIG_MODULES = (
    "tide_megatron.config",
    "tide_megatron.emulation.config",
    "tide_megatron.envs.config",
    "tide_megatron.envs.env_config",
    "tide_megatron.models.config",
    "tide_megatron.models.qwen3_vl_config",
    "tide_megatron.rollout.config",
    "tide_megatron.rollout.ctb_config",
    "tide_megatron.sim.config",
    "tide_megatron.trainer.config",
)
CORE = "tide_megatron.core"


def module_files(root: pathlib.Path, package: str) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module under `root` (the directory of `package`): name -> (file, is a package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree: ast.AST, module: str, is_package: bool, modules) -> dict[str, int]:
    """The modules of `modules` that `module` imports when it runs -> the first line that does.

    Every import counts: top level, in functions, in classes. `import a.b` imports `a.b`;
    `from a import b` imports `a.b` if that is a module, else `a` (b is a name in it). Relative
    imports are resolved against the module's package; a package's `__init__` is the package.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    edges: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.setdefault(name, line)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{source}.{alias.name}"
                add(full if full in modules else source, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return edges


def import_graph(root: pathlib.Path = PKG, package: str = "tide_megatron") -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports -> line}, for every module under `root`."""
    modules = module_files(root, package)
    return {module: imports_of(ast.parse(path.read_text(), str(path)), module, is_package, modules)
            for module, (path, is_package) in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Per group of modules that import each other (a strongly connected component of two or
    more): its modules, and one cycle through them (in import order, the first repeated last)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for component in components:  # the shortest cycle through the component's first module
        start = min(component)
        came_from = {start: None}
        frontier = [start]
        while start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in component and w not in came_from:
                        came_from[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while came_from[path[-1]] is not None:
            path.append(came_from[path[-1]])
        out.append((sorted(component), path[::-1] + [start]))
    return sorted(out)


def describe(group: list[str], cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    path = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
    return f"{path}; modules in the cycle: {', '.join(group)}"


# The rules ---------------------------------------------------------------------------------


def test_every_config_module_is_checked():
    found = {m for m in module_files(PKG, "tide_megatron") if "config" in m.rpartition(".")[2]}
    assert found <= set(CONFIG_MODULES), f"config modules the rules do not cover: {sorted(found - set(CONFIG_MODULES))}"


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_config_module_imports_only_stdlib_configs_and_core(module):
    path, is_package = module_files(PKG, "tide_megatron")[module]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module} line {node.lineno}: a relative import"
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "tide_megatron":
                assert name in CONFIG_MODULES or name == CORE or name.startswith(CORE + "."), \
                    f"{module} line {node.lineno} imports {name}: not a config module nor the core"
            else:
                assert top in sys.stdlib_module_names or top == "__future__", \
                    f"{module} line {node.lineno} imports {name}, not in the standard library"


def test_config_modules_import_without_the_ml_stack():
    """Each config module (and Hydra's schema in launch/, which composes the job from them)
    imports with torch, Megatron, SGLang, transformers and numpy refused, and loads no module
    of the package but config modules, the core, their packages and the packages' lazy-export
    helper."""
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, json, sys

        REFUSED = {FRAMEWORKS!r}

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in REFUSED:
                    raise ImportError(f"{{name}} is refused: a config module must import without it")
                return None

        loaded = [m for m in sys.modules if m.partition(".")[0] in REFUSED]
        assert not loaded, f"loaded before the check: {{loaded}}"
        before = set(sys.modules)
        sys.meta_path.insert(0, Refuse())
        for name in {list(CONFIG_MODULES)!r}:
            importlib.import_module(name)
        ours = sorted(m for m in set(sys.modules) - before if m.partition(".")[0] == "tide_megatron")
        sys.path.insert(0, {str(REPO / "launch")!r})
        import hydra_schema
        hydra_schema.register()
        print(json.dumps(ours))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    packages = {m.rsplit(".", i)[0] for m in CONFIG_MODULES for i in range(1, m.count(".") + 1)}
    # The packages' `__init__`s name their exports through this stdlib-only helper.
    allowed = set(CONFIG_MODULES) | packages | {"tide_megatron.utils", "tide_megatron.utils.lazy_exports"}
    others = [m for m in loaded if m not in allowed and m != CORE and not m.startswith(CORE + ".")]
    assert not others, f"importing the config modules loads implementation modules: {others}"
    assert set(CONFIG_MODULES) <= set(loaded)


def test_sim_missing_is_omegaconfs_marker():
    """`sim.config` spells out OmegaConf's marker instead of importing it."""
    import omegaconf

    from tide_megatron.sim import config

    assert config.MISSING == omegaconf.MISSING


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(g, c, graph) for g, c in found)


# The graph itself --------------------------------------------------------------------------


def test_graph_sees_top_level_and_function_imports_but_not_type_checking_ones():
    graph = import_graph()
    assert "tide_megatron.rollout.ctb_task_runner" in graph["tide_megatron.rollout.task_runner"]  # top level
    assert "tide_megatron.sim.simulator" in graph["tide_megatron.sim"]  # inside `run_simulation`
    assert "tide_megatron.trainer.checkpoint" in graph["tide_megatron.job"]  # `from pkg import submodule`
    # `envs.server_connection` names `EnvServer` for annotations only
    assert "tide_megatron.envs.server" not in graph["tide_megatron.envs.server_connection"]


def test_graph_resolves_relative_imports_and_finds_a_cycle(tmp_path):
    files = {
        "__init__.py": "from . import a\n",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..sub.c import g\n",
        "sub/c.py": "from .. import NAME\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a": 1}, "pkg.a": {"pkg.sub.b": 1}, "pkg.sub": {},
                     "pkg.sub.b": {"pkg.sub.c": 2}, "pkg.sub.c": {"pkg": 1}}
    cycle = ["pkg", "pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg"]
    assert cycles(graph) == [(sorted(cycle[:-1]), cycle)]
    assert describe(*cycles(graph)[0], graph).startswith("pkg (line 1) -> pkg.a (line 1) -> pkg.sub.b (line 2) -> ")
    graph["pkg.sub.c"] = {}
    assert cycles(graph) == []
