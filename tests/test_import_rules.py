"""The layering of the runtime, checked on its source (docs/architecture.md):

- the core (``core/``), the ops (``ops/``) and the transfer engine (``transfer/``) know no front end: they import
  neither the embedded engine, the models, the drafts, a vLLM front end nor oasisbench;
- the ops do not import the core (each op is a kernel beside its reference, usable alone);
- the drafts do not import the embedded engine;
- no module of the runtime imports itself back through others (no import circle), lazy imports included;
- ``import oasiskv_runtime`` loads no engine and the torch-free bookkeeping imports without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "oasiskv_runtime"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports too); ``from pkg import name`` counts
    as ``pkg.name`` where that is a module of the runtime, else as ``pkg``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if _exists(full) else base)
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p) if i.startswith("oasiskv_runtime") and i != m} for m, p in mods.items()}


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{m} imports {i}" for m, deps in _graph().items() if m.startswith(f"oasiskv_runtime.{layer}")
            for i in deps if any(i == f or i.startswith(f + ".") for f in forbidden)]


FRONT_ENDS = ("oasiskv_runtime.engine", "oasiskv_runtime.models", "oasiskv_runtime.drafts", "oasiskv_runtime.vllm",
              "oasiskv_runtime.pd", "oasiskv_runtime.llm", "oasisbench")


def test_core_ops_and_transfer_know_no_front_end():
    for layer in ("core", "ops", "transfer"):
        assert _violations(layer, FRONT_ENDS) == [], layer


def test_ops_do_not_import_the_core():
    assert _violations("ops", ("oasiskv_runtime.core",)) == []


def test_drafts_do_not_import_the_engine():
    assert _violations("drafts", ("oasiskv_runtime.engine", "oasiskv_runtime.llm")) == []


def test_no_import_circle_in_the_runtime():
    graph = _graph()
    # A package's __init__ is not a module of its own code here: an edge to "pkg" means one of its modules.
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        seen[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if seen.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in seen:
                cycle = visit(d)
                if cycle:
                    return cycle
        stack.pop()
        seen[m] = 2
        return None

    for m in sorted(graph):
        if m not in seen:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_the_checker_sees_a_violation_and_a_circle(tmp_path, monkeypatch):
    """The checks above would fail on a bad tree (so a clean result means something)."""
    pkg = tmp_path / "oasiskv_runtime"
    for rel, text in {"__init__.py": "", "core/__init__.py": "", "ops/__init__.py": "",
                      "core/a.py": "from oasiskv_runtime.engine import llm_engine\n",
                      "engine/__init__.py": "", "engine/llm_engine.py": "def f():\n    import oasiskv_runtime.ops.b\n",
                      "ops/b.py": "from oasiskv_runtime.core.a import x\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    assert _violations("core", FRONT_ENDS) == ["oasiskv_runtime.core.a imports oasiskv_runtime.engine.llm_engine"]
    assert _violations("ops", ("oasiskv_runtime.core",)) == ["oasiskv_runtime.ops.b imports oasiskv_runtime.core.a"]
    try:
        test_no_import_circle_in_the_runtime()
    except AssertionError as e:
        assert "oasiskv_runtime.core.a" in str(e)
    else:
        raise AssertionError("the circle core.a -> engine.llm_engine -> ops.b -> core.a was not found")


def test_package_import_is_light_and_bookkeeping_needs_no_torch(tmp_path):
    """From another directory, with torch made unimportable: the package and the torch-free bookkeeping import."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import oasiskv_runtime\n"
            "assert 'oasiskv_runtime.engine.llm_engine' not in sys.modules\n"
            "from oasiskv_runtime.engine.scheduler import Scheduler\n"
            "from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager\n"
            "from oasiskv_runtime.core.selector import select_head\n"
            "from oasiskv_runtime.config import EngineConfig\n"
            "print('ok')\n")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
