"""The package's shape: one definition per public name, no import cycle, the benchmark kept apart."""
from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_utils"
BENCH = PACKAGE / "bench"
#: Names that every module of a kind defines by convention: ``rows(ctx)`` in each of the benchmark's
#: per-chapter modules, and ``main(argv)``, the entry point of each ``python -m course_utils.<tool>``.
CONVENTIONS = {"rows": lambda path: path.parent == BENCH, "main": lambda path: True}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of course_utils."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _public_definitions(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def test_every_public_name_is_defined_in_one_module():
    where = defaultdict(list)
    for name, path in _modules().items():
        for defined in _public_definitions(path):
            if defined in CONVENTIONS and CONVENTIONS[defined](path):
                continue
            where[defined].append(name)
    twice = {n: mods for n, mods in where.items() if len(mods) > 1}
    assert not twice, f"one name, several homes: {twice}"


def _imports(module: str, path: Path) -> set[str]:
    """The course_utils modules ``module`` imports (at any depth of the file, lazy imports included)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("course_utils")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("course_utils"):
                continue
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}        # ``from . import x`` may name a module
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {t for t in _imports(m, p) if t in modules and t != m} for m, p in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ importing its own submodules is not a cycle with them
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_chapter_modules_never_import_the_benchmark():
    offenders = {m: sorted(t for t in ts if t.startswith("course_utils.bench"))
                 for m, ts in _graph().items() if not m.startswith("course_utils.bench")}
    assert not {m: t for m, t in offenders.items() if t}


def test_every_benchmark_section_has_its_module():
    from course_utils.bench import SECTIONS
    modules = _modules()
    for _name, module in SECTIONS:
        assert module in modules and modules[module].parent == BENCH


def test_the_stated_minimum_python_is_the_one_the_tests_run_on():
    text = (ROOT / "pyproject.toml").read_text()
    minimum = re.search(r'requires-python = ">=(\d+)\.(\d+)"', text)
    assert minimum, "pyproject.toml states no minimum Python"
    major, minor = int(minimum[1]), int(minimum[2])
    assert sys.version_info[:2] >= (major, minor)
    assert f"Python {major}.{minor} or newer" in (ROOT / "README.md").read_text()
    assert f"Python ({major}.{minor} or newer)" in (ROOT / "tasks.py").read_text()
    assert (ROOT / "binder" / "runtime.txt").read_text().strip() == f"python-{major}.{minor}"
    assert f"python={major}.{minor}" in (ROOT / "environment.yml").read_text()
