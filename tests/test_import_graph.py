"""kvref's modules import each other without a cycle, function-level imports counted (issue 12).

Imports under ``if TYPE_CHECKING:`` are left out: they never run. A function-level import is an edge like any
other, so a cycle cannot be hidden by moving an import into a function.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvref"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in [*ROOT.rglob("*.py"), *ROOT.rglob("*.pyx")]:
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        source = path.read_text()
        if path.suffix == ".pyx":  # Cython: keep the import statements, read cimport as import
            lines = [ln.split("#")[0].strip() for ln in source.splitlines()]
            lines = [
                re.sub(r"\bcimport\b", "import", ln) for ln in lines if re.match(r"from \S+ c?import |c?import ", ln)
            ]
            source = "\n".join(ln.rstrip("(") + ("_" if ln.endswith("(") else "") for ln in lines)
        tree = ast.parse(source)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package[: len(package) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                    if target in mods and target != name:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in mods and a.name != name)
    return graph


def test_graph_sees_function_level_imports() -> None:
    # a function-level import is an edge: files.py imports summary inside StateObject.summary
    assert "kvref.state.summary" in import_graph()["kvref.state.files"]


def test_no_import_cycle() -> None:
    graph = import_graph()
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")
