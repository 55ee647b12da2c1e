"""Backend selection: KVREF_BACKEND picks the twin, and a Cython run really runs the extension.

Each environment variation runs in a fresh interpreter, since the choice is made once at import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CELLS_C, NOT_BUILT, cython_requested

import kvref

# Run the probes where they import the same kvref this test run imported (the checkout in development,
# site-packages in CI), never a different copy that happens to sit in the working directory.
ROOT = Path(kvref.__file__).resolve().parents[1]

PROBE = """
import kvref, kvref.memory.cells
print(kvref.backend())
print(kvref.memory.cells.KVCells.__module__)
"""


def run(backend: str | None, code: str = PROBE) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVREF_BACKEND"}
    if backend is not None:
        env["KVREF_BACKEND"] = backend
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_python_backend() -> None:
    out = run("python")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "kvref.memory._cells_py"]


def test_cython_backend() -> None:
    out = run("cython")
    if CELLS_C is None:
        assert out.returncode != 0 and "BackendError" in out.stderr  # fails loudly, never falls back
        pytest.skip(NOT_BUILT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cython", "kvref.memory._cells_c"]


@pytest.mark.parametrize("value", [None, "auto", "", " AUTO "])
def test_auto_backend_prefers_the_extension(value: str | None) -> None:
    out = run(value)
    assert out.returncode == 0, out.stderr
    expected = ["cython", "kvref.memory._cells_c"] if CELLS_C is not None else ["python", "kvref.memory._cells_py"]
    assert out.stdout.split() == expected


def test_unknown_backend_is_an_error_at_import() -> None:
    code = """
try:
    import kvref
except ImportError as exc:
    print(type(exc).__name__, exc)
"""
    out = run("cythn", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("BackendError KVREF_BACKEND='cythn' is not a backend")
    assert "auto, cython, python" in out.stdout


def copy_package(dest: Path, *, marker: bool = False, checkout: bool = False) -> Path:
    """A copy of the imported kvref without its compiled twins: an install that lost them, a
    ``KVREF_PUREPYTHON=1`` install (``marker``), or a source checkout that was never built (``checkout``)."""
    src = Path(kvref.__file__).resolve().parent
    shutil.copytree(src, dest / "kvref", ignore=shutil.ignore_patterns("*.so", "*.pyd", "conformance_data", "*.cpp"))
    if marker:
        (dest / "kvref" / "PUREPYTHON").write_text("")
    if checkout:
        (dest / "setup.py").write_text("")
    return dest


# an editable install (`pip install -e .`) maps `kvref` to its checkout whatever sys.path says: drop its finder
UNEDITABLE = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
WARN_PROBE = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    import kvref, kvref.memory.cells, kvref.memory.mask
print(kvref.backend(), kvref.__file__)
for w in seen:
    print(w.category.__name__, w.message)
"""


def run_copy(root: Path, backend: str | None, code: str = WARN_PROBE) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVREF_BACKEND", "PYTHONPATH")}
    if backend is not None:
        env["KVREF_BACKEND"] = backend
    # the copy first, then where the test run's kvref lives (an installed build the copy may shadow)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-c", UNEDITABLE + code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_auto_fallback_warns_once_with_the_fix(tmp_path: Path) -> None:
    out = run_copy(copy_package(tmp_path), None)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"python {tmp_path}")
    assert len(lines) == 2 and lines[1].startswith("BackendWarning kvref uses its pure-Python twins")
    assert "reinstall" in lines[1]


@pytest.mark.parametrize("backend", [None, "python"])
def test_no_warning_when_the_python_twins_were_chosen(tmp_path: Path, backend: str | None) -> None:
    out = run_copy(copy_package(tmp_path, marker=backend is None), backend)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"python {tmp_path / 'kvref' / '__init__.py'}"]


def test_unbuilt_checkout_warns_to_build_in_place(tmp_path: Path) -> None:
    out = run_copy(copy_package(tmp_path, checkout=True), "auto")
    assert out.returncode == 0, out.stderr
    assert "BackendWarning" in out.stdout and "pip install -e ." in out.stdout


def test_cython_from_a_shadowing_checkout_names_the_shadowed_build(tmp_path: Path) -> None:
    if CELLS_C is None:
        pytest.skip(NOT_BUILT)
    out = run_copy(copy_package(tmp_path, checkout=True), "cython", "import kvref.memory.cells")
    assert out.returncode != 0
    assert "BackendError" in out.stderr
    assert f"the source tree {tmp_path / 'kvref'} shadows the installed build at {ROOT / 'kvref'}" in out.stderr


def test_compiled_extension_loaded_when_cython_requested() -> None:
    """CI sets KVREF_BACKEND=cython: then this session must be running the compiled twin."""
    if not cython_requested():
        pytest.skip("this run did not ask for Cython (KVREF_BACKEND != cython)")
    import kvref.memory.cells
    from kvref.memory import _cells_c  # must import: a missing extension fails here

    assert kvref.backend() == "cython"
    assert kvref.memory.cells.KVCells is _cells_c.KVCells
    assert _cells_c.__file__ is not None and not _cells_c.__file__.endswith(".py")


def test_session_backend_matches_request() -> None:
    """In this very session, ``kvref.backend()`` reflects KVREF_BACKEND."""
    import kvref.memory.cells

    requested = os.environ.get("KVREF_BACKEND", "auto").strip().lower() or "auto"
    if requested == "python":
        assert kvref.backend() == "python" and kvref.memory.cells.KVCells.__module__ == "kvref.memory._cells_py"
    elif requested == "cython" or CELLS_C is not None:
        assert kvref.backend() == "cython" and kvref.memory.cells.KVCells.__module__ == "kvref.memory._cells_c"
    else:
        assert kvref.backend() == "python"


def test_twins_export_the_same_names() -> None:
    if CELLS_C is None:
        pytest.skip(NOT_BUILT)
    from kvref.memory import _cells_py

    assert CELLS_C.__all__ == _cells_py.__all__
    for name in _cells_py.__all__:
        if name != "KVCells":
            assert getattr(CELLS_C, name) == getattr(_cells_py, name), name
    public = {n for n in dir(_cells_py.KVCells) if not n.startswith("_")}
    assert public == {n for n in dir(CELLS_C.KVCells) if not n.startswith("_")}
    assert kvref.LLAMA_MAX_SEQ == CELLS_C.LLAMA_MAX_SEQ == 256
