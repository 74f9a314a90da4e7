"""README.md and docs/*.md against the code.

A page names things that exist in the code: repository paths, config keys, `make` targets,
recipes, modules, and (for the architecture picture) control messages. Each test below reads
every page and fails naming the page and the name that no longer exists, so a rename in the code
or a typo in a page shows up here instead of in a newcomer's terminal.

What counts as a name (in inline code spans, fenced code blocks and link targets):

- a path: a token with a `/` whose first part is a top-level entry of the repository
  (`tide_megatron/...`, `docs/...`), or that ends in `.py` or names a folder of a subpackage
  (`core/ers.py`, `trainer/ra2p/` are read under `tide_megatron/`); `NAME`, `N`, `DIR`, `<...>`
  and `*` are placeholders (a glob that must match);
- a config key: a dotted lowercase token (`scheduler.groups_per_step`, `ers.enabled=true`); its
  first part must be a section of the composed config (the Hydra schema `JobConfig`, composed by
  `launch/hydra_schema.py`) and the whole key one of its fields, or a key inside a free-form
  dict field (`rollout.engine.extra_args.*`). An override (`x.y=value`) whose first part is no
  section fails too, and so does a dotted token whose first part is close to a section's name,
  so a misspelt section does not pass unnoticed (other dotted names, a weight's or a reply
  field's, pass);
- `make TARGET`: a target of the Makefile; `+recipe=NAME`: a file `recipes/recipe/NAME.yaml`;
- `tide_megatron.x.y[.Name]`: a module, and the name defined at its top level;
- a link `[text](target)`: a file next to the page, or a heading of it (`#anchor`).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
PAGE_IDS = [str(p.relative_to(REPO)) for p in PAGES]

PLACEHOLDERS = {"NAME", "N", "DIR", "RECIPE"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "png", "svg", "dot", "log", "lock", "txt", "sh",
                 "toml", "sbatch", "safetensors", "pth", "whl", "csv", "html", "cfg", "ini", "pt", "bin"}
# Dotted names that are Python objects of other packages, not config keys.
FOREIGN_PACKAGES = {"sglang", "torch", "megatron", "transformers", "hydra", "omegaconf", "dist", "os", "sys",
                    "json", "np", "numpy", "asyncio", "concurrent", "threading", "pytest", "torchrun", "gloo",
                    "nccl", "typing", "dataclasses", "pickle", "math", "random", "logging", "subprocess",
                    "safetensors", "tensorboard", "textworld", "zmq", "pip", "setuptools", "hf", "antlr4",
                    "torchvision", "triton", "flashinfer", "uvloop", "psutil", "signal", "time", "functools"}
OWN_PACKAGES = {"tide_megatron", "sglang_patches"}


# ---------------------------------------------------------------- reading a page
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _parts(text: str) -> tuple[str, list[str]]:
    """(the page without its fenced blocks, the fenced blocks' contents)."""
    fences = FENCE.findall(text)
    return FENCE.sub("", text), fences


def _tokens(snippet: str) -> list[str]:
    out = []
    for raw in snippet.split():
        tok = raw.strip("\"'(),;").rstrip(".:")
        if tok:
            out.append(tok)
    return out


def spans(text: str) -> list[str]:
    """Inline code spans of the page (fenced blocks excluded)."""
    prose, _ = _parts(text)
    return SPAN.findall(prose)


def code_tokens(text: str) -> list[str]:
    """Every whitespace-separated token of the page's inline code spans and fenced blocks."""
    prose, fences = _parts(text)
    out = []
    for snippet in SPAN.findall(prose) + fences:
        out += _tokens(snippet)
    return out


# ---------------------------------------------------------------- the code's side
@lru_cache(maxsize=None)
def top_level_entries() -> frozenset[str]:
    return frozenset(p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci")


@lru_cache(maxsize=None)
def subpackages() -> frozenset[str]:
    return frozenset(p.name for p in (REPO / "tide_megatron").iterdir() if p.is_dir() and not p.name.startswith("_"))


@lru_cache(maxsize=None)
def config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(every key of the composed config, the keys of free-form dict fields that take any sub-key)."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        from hydra_schema import compose_job_config
    finally:
        sys.path.remove(str(REPO / "launch"))
    from omegaconf import DictConfig, OmegaConf

    root = OmegaConf.structured(compose_job_config([]))
    keys, open_dicts = set(), set()

    def walk(node, prefix: str) -> None:
        for k in node.keys():
            child = node._get_node(k)
            path = f"{prefix}.{k}" if prefix else str(k)
            keys.add(path)
            if isinstance(child, DictConfig):
                if child._metadata.object_type is dict:
                    open_dicts.add(path)
                walk(child, path)

    walk(root, "")
    return frozenset(keys), frozenset(open_dicts)


def sections() -> frozenset[str]:
    return frozenset(k for k in config_keys()[0] if "." not in k)


@lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(t for t in re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M) if not t.startswith("."))


# ---------------------------------------------------------------- the checks, one name at a time
def path_problem(token: str) -> str | None:
    """Why `token` names no file of the repository; None if it does or is not a repository path."""
    if "/" not in token or "=" in token or "://" in token or token.startswith(("/", "~", "$", "-", "<")):
        return None
    head = token.split("/", 1)[0]
    if head in top_level_entries():
        candidates = [token]
    elif token.endswith(".py") or (head in subpackages() and token.endswith("/")):
        if head in FOREIGN_PACKAGES:
            return None
        candidates = [token, f"tide_megatron/{token}"]
    else:
        return None
    for cand in candidates:
        pattern = re.sub(r"<[^>]+>", "*", cand)
        pattern = "/".join(re.sub(r"^(%s)(?=\.|$)" % "|".join(PLACEHOLDERS), "*", part)
                           for part in pattern.split("/"))
        pattern = pattern.rstrip("/")
        if any(ch in pattern for ch in "*?["):
            if list(REPO.glob(pattern)):
                return None
        elif (REPO / pattern).exists():
            return None
    return f"path {token!r} does not exist"


KEY_TOKEN = re.compile(r"^\+?(?P<key>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?P<rest>[=:].*)?$")


def key_problem(token: str) -> str | None:
    """Why the dotted token is neither a config key nor something else known; None if fine."""
    if re.match(r"^(%s)\.[\w.]+$" % "|".join(OWN_PACKAGES), token):
        return module_problem(token)
    m = KEY_TOKEN.match(token)
    if m is None:
        return None
    key, rest = m.group("key"), m.group("rest")
    parts = key.split(".")
    if parts[0] in sections():
        keys, open_dicts = config_keys()
        if key in keys or any(key.startswith(d + ".") for d in open_dicts):
            return None
        return f"config key {key!r} is not in the composed config (tide_megatron/config.py JobConfig)"
    if parts[0] in FOREIGN_PACKAGES or (rest is None and parts[-1] in FILE_SUFFIXES):
        return None
    near = difflib.get_close_matches(parts[0], sections(), n=1, cutoff=0.75)
    if rest is None and not near:
        return None  # another dotted name (a weight, a field of a reply), not a misspelt key
    return f"{token!r} looks like a config key but {parts[0]!r} is no section of the config " \
           f"({', '.join(sorted(sections()))})"


def module_problem(dotted: str) -> str | None:
    """`tide_megatron.a.b[.Name[.attr]]`: the module exists and defines Name at its top level."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            break
    else:
        return f"module {dotted!r} does not exist"
    if i == len(parts):
        return None
    name = parts[i]
    tree = ast.parse(module.read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if name not in defined:
        return f"{dotted!r}: {module.relative_to(REPO)} defines no {name!r}"
    return None


def make_problems(text: str) -> list[str]:
    prose, fences = _parts(text)
    out = []
    for snippet in SPAN.findall(prose) + fences:
        for target in re.findall(r"(?:^|[\s;&|(])make\s+([A-Za-z0-9_.-]+)", snippet):
            if target not in make_targets():
                out.append(f"make target {target!r} is not in the Makefile ({', '.join(sorted(make_targets()))})")
    return out


def recipe_problem(token: str) -> str | None:
    m = re.match(r"^\+recipe=([\w-]+)$", token)
    if m is None or m.group(1) in PLACEHOLDERS:
        return None
    if not (REPO / "recipes" / "recipe" / f"{m.group(1)}.yaml").exists():
        return f"recipe {m.group(1)!r} is not in recipes/recipe/"
    return None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def link_problems(page: Path, text: str) -> list[str]:
    prose, _ = _parts(text)
    anchors = {slug(h) for h in re.findall(r"^#+\s+(.*)$", prose, re.M)}
    out = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if path:
            dest = (page.parent / path).resolve()
            if not dest.exists():
                out.append(f"link target {target!r} does not exist")
            elif anchor and dest.suffix == ".md":
                dest_anchors = {slug(h) for h in re.findall(r"^#+\s+(.*)$", _parts(dest.read_text())[0], re.M)}
                if anchor not in dest_anchors:
                    out.append(f"link {target!r}: {path} has no heading #{anchor}")
        elif anchor not in anchors:
            out.append(f"link {target!r}: no heading of this page has that anchor")
    return out


def problems(page: Path) -> list[str]:
    text = page.read_text()
    found = []
    for tok in code_tokens(text):
        for check in (path_problem, key_problem, recipe_problem):
            problem = check(tok)
            if problem:
                found.append(problem)
    found += make_problems(text)
    found += link_problems(page, text)
    return sorted(set(found))


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_path_key_target_recipe_module_and_link_a_page_names_exists(page):
    assert problems(page) == [], f"{page.relative_to(REPO)} names what the code does not have"


def test_the_checks_catch_a_wrong_name(tmp_path):
    """Each kind of name, misspelt, is reported (the checks above are not vacuous)."""
    good = "`tide_megatron/core/ers.py` `core/ers.py` `scheduler.groups_per_step=32` `make test` " \
           "`+recipe=tiny_cpu` `rollout.engine.extra_args.enable_memory_saver=true` " \
           "`tide_megatron.core.buffer.GlobalBuffer` `benchmarks/results/NAME.json` [x](README.md)"
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{good}\n")
    (tmp_path / "README.md").write_text("")
    assert problems(page) == []
    for wrong in ("`tide_megatron/core/ers2.py`", "`core/erss.py`", "`scheduler.groups_per_stepp=32`",
                  "`schedular.groups_per_step`", "`cluster.rolout_share`",
                  "`make tinyy`", "`+recipe=tiny_gpu`", "`tide_megatron.core.buffer.GlobalBuffr`",
                  "`benchmarks/results/NAME.jsn`", "[x](missing.md)", "[x](#no-such-heading)",
                  "```bash\npython launch/train.py ers.enabld=true\n```"):
        page.write_text(f"# Page\n\n{good}\n\n{wrong}\n")
        assert problems(page), f"{wrong!r} was not reported"


def test_the_readme_quick_start_runs_the_makefile_commands():
    """The overview's two commands are the Makefile's, as written there."""
    text = README.read_text()
    makefile = (REPO / "Makefile").read_text()
    assert {"tiny", "test"} <= make_targets()
    assert "launch/torchrun.py --nproc-per-node 2 launch/train.py +recipe=tiny_cpu" in makefile
    assert "launch/torchrun.py --nproc-per-node 2 launch/train.py +recipe=tiny_cpu" in text
    quick = text[:text.index("\n## ", text.index("\n## ") + 1)]  # the overview and the first section
    assert "make tiny" in quick and "make test" in quick


def test_the_readme_glossary_defines_the_papers_terms():
    text = README.read_text()
    glossary = text[text.index("## Glossary"):]
    glossary = glossary[:glossary.index("\n## ", 1)]
    rows = {m.group(1) for m in re.finditer(r"^\| \*\*([^*]+)\*\*", glossary, re.M)}
    for term in ("RAS", "TPRM", "TWT", "RWT", "HoL", "VS", "VSO", "CM", "DM", "CTB", "RA2P", "ERS", "goodput",
                 "staleness"):
        assert any(term == r or r.startswith(term + " ") for r in rows), f"glossary lacks {term}: {sorted(rows)}"


# ---------------------------------------------------------------- the architecture picture
def _draw_module():
    spec = importlib.util.spec_from_file_location("draw_architecture", REPO / "scripts" / "draw_architecture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_committed_architecture_picture_is_what_the_script_draws():
    draw = _draw_module()
    assert draw.render() == (REPO / "docs" / "architecture.svg").read_text(), \
        "docs/architecture.svg is out of date: run python scripts/draw_architecture.py"
    assert "docs/architecture.svg" in README.read_text()


def test_the_picture_names_every_control_message_and_only_those():
    """The picture lists the typed control messages by class; each exists, none is left out; every
    file it names exists."""
    from tide_megatron.comm import messages

    draw = _draw_module()
    drawn = draw.message_names()
    real = {name for name, obj in vars(messages).items()
            if isinstance(obj, type) and issubclass(obj, messages.Message) and obj.KIND}
    assert sorted(set(drawn) - real) == [], "the picture names messages comm/messages.py does not define"
    assert sorted(real - set(drawn)) == [], "comm/messages.py defines messages the picture leaves out"
    paths = draw.named_paths()
    assert "controller/loop.py" in paths and "job.py" in paths
    missing = [p for p in paths if not (REPO / p).exists() and not (REPO / "tide_megatron" / p).exists()]
    assert missing == [], "the picture names files that do not exist"
