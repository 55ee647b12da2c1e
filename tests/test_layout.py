"""The package's folders are its layers (README's Layout): a small root, one wing per layer, and the module paths
of kvref 0.1 still importable, with a warning naming the new home."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

import kvref
from kvref._moved import MOVED

PKG = Path(kvref.__file__).resolve().parent
WINGS = {"ggml", "memory", "state", "store", "jobs"}


def test_the_root_holds_at_most_22_modules() -> None:
    root = sorted(p.name for p in PKG.iterdir() if p.suffix in (".py", ".pyx"))
    assert len(root) <= 22, root


def test_every_folder_is_a_wing() -> None:
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"conformance_data"} == WINGS


def test_memory_and_job_modules_live_in_their_wings() -> None:
    memory = {p.stem for p in (PKG / "memory").glob("*.py")}
    jobs = {p.stem for p in (PKG / "jobs").glob("*.py")}
    assert {"kv_cache", "kv_cache_iswa", "recurrent", "hybrid", "base", "factory", "batch", "slots"} <= memory
    assert {"restore", "save", "convert", "check", "diff", "export", "tensors", "plot", "conformance", "cli"} <= jobs


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_kvref_0_1_path_imports_the_moved_module_with_a_warning(old: str) -> None:
    if old.endswith("_c") and importlib.util.find_spec(MOVED[old]) is None:
        pytest.skip("the compiled twins are not built in this run")
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {MOVED[old]}; import it from there"
    ]


def test_the_public_paths_import_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvref.cells import KVCells
        from kvref.ggml import GGMLType
        from kvref.mask import fill_kq_mask
        from kvref.memory import create_memory

    assert KVCells is importlib.import_module("kvref.memory.cells").KVCells
    assert fill_kq_mask is importlib.import_module("kvref.memory.mask").fill_kq_mask
    assert create_memory is kvref.create_memory and GGMLType is kvref.GGMLType


def test_the_memory_wing_names_the_factory_exports() -> None:
    from kvref import memory
    from kvref.memory import factory

    assert tuple(factory.__all__) == memory.FACTORY_NAMES
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        memory.nothing  # noqa: B018


# the wings in import order: a module may import its own wing and the ones before it, never one after
WING_ORDER = ["kvref", "kvref.ggml", "kvref.state", "kvref.memory", "kvref.store", "kvref.jobs"]
# the package's face and entry points stand above every wing
ABOVE_THE_WINGS = ("kvref", "kvref.__main__", "kvref.about", "kvref.cells", "kvref.mask", "kvref._moved")


def _wing(module: str) -> int:
    parts = module.split(".")
    name = ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else "kvref"
    return WING_ORDER.index(name)


def test_imports_go_one_way_between_wings() -> None:
    from test_import_graph import import_graph

    wrong = [
        f"{src} -> {dst}"
        for src, dsts in import_graph().items()
        if src.startswith("kvref") and src not in ABOVE_THE_WINGS
        for dst in dsts
        if dst.startswith("kvref") and _wing(dst) > _wing(src)
    ]
    assert not wrong, wrong


def test_the_conformance_runner_finds_the_goldens_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From another directory, the checkout's conformance/ beside kvref/ (a wheel: kvref/conformance_data/): the
    runner moved into kvref/jobs/ and once looked one floor too low."""
    from kvref.jobs.conformance import find_root

    monkeypatch.chdir(tmp_path)
    found = find_root()
    assert (found / "golden").is_dir() and found in (PKG.parent / "conformance", PKG / "conformance_data")
