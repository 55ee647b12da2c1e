"""kvref's modules, and the conformance scripts, import each other without a cycle (issues 12 and 21).

Every import counts: a function-level import is an edge like any other, so a cycle cannot be hidden by moving an
import into a function, and so is an import under ``if TYPE_CHECKING:``, so a cycle cannot be hidden in the types
either (the interface states what it needs as protocols instead of naming the concrete memories).
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "kvref"
CONFORMANCE = REPO / "conformance"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in [*ROOT.rglob("*.py"), *ROOT.rglob("*.pyx")]:
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _scripts() -> dict[str, Path]:
    """The conformance scripts: top-level modules of their folder (each puts it on sys.path and imports the others
    by their bare names)."""
    return {p.stem: p for p in CONFORMANCE.glob("*.py")}


def _tree(path: Path) -> ast.Module:
    source = path.read_text()
    if path.suffix == ".pyx":  # Cython: keep the import statements, read cimport as import
        lines = [ln.split("#")[0].strip() for ln in source.splitlines()]
        lines = [re.sub(r"\bcimport\b", "import", ln) for ln in lines if re.match(r"from \S+ c?import |c?import ", ln)]
        source = "\n".join(ln.rstrip("(") + ("_" if ln.endswith("(") else "") for ln in lines)
    return ast.parse(source)


def _targets(name: str, path: Path, nodes: list[ast.AST], mods: dict[str, Path]) -> set[str]:
    """The modules of ``mods`` that the import statements among ``nodes`` (and everything under them) import."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                if target in mods and target != name:
                    out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods and a.name != name)
    return out


def import_graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports, every import statement counted (module level, function level,
    ``TYPE_CHECKING``)."""
    mods = _modules() if mods is None else mods
    return {name: _targets(name, path, [_tree(path)], mods) for name, path in mods.items()}


def _module_level(name: str, mods: dict[str, Path], *, type_checking: bool) -> set[str]:
    """The imports of ``name``'s module-level statements, with or without its ``if TYPE_CHECKING:`` blocks."""
    path = mods[name]
    body = [
        stmt
        for stmt in _tree(path).body
        if type_checking or not (isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test))
    ]
    nodes: list[ast.AST] = [s for s in body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return _targets(name, path, nodes, mods)


def test_graph_sees_function_level_imports() -> None:
    # a function-level import is an edge: KVCache.k_shift_input imports mask_kernels on first use (the mask twin is
    # not loaded with the cache), and nothing at kv_cache's module level does
    mods = _modules()
    assert "kvref.memory.mask_kernels" not in _module_level("kvref.memory.kv_cache", mods, type_checking=True)
    assert "kvref.memory.mask_kernels" in import_graph(mods)["kvref.memory.kv_cache"]


def test_graph_sees_type_checking_imports() -> None:
    # an import under ``if TYPE_CHECKING:`` is an edge: the interface names SlotInfo (decode's row store takes it)
    # for the type checker only
    mods = _modules()
    assert "kvref.memory.slots" not in _module_level("kvref.memory.base", mods, type_checking=False)
    assert "kvref.memory.slots" in _module_level("kvref.memory.base", mods, type_checking=True)
    assert "kvref.memory.slots" in import_graph(mods)["kvref.memory.base"]


def test_graph_sees_the_conformance_scripts() -> None:
    graph = import_graph(_scripts())
    assert {"driver", "generate", "shim_2024"} <= graph["generate_legacy"]
    assert "shim_2024" in graph["generate"]  # a function-level import: only bindings of 2024 take the shim


@pytest.mark.parametrize("tree", ["kvref", "conformance"])
def test_no_import_cycle(tree: str) -> None:
    graph = import_graph(_modules() if tree == "kvref" else _scripts())
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle in {tree}/: {' -> '.join(e.args[1])}")
