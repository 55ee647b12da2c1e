"""Backend selection: KVREF_BACKEND picks the twin, and a Cython run really runs the extension.

Each environment variation runs in a fresh interpreter, since the choice is made once at import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CELLS_C, cython_requested

import kvref

# Run the probes where they import the same kvref this test run imported (the checkout in development,
# site-packages in CI), never a different copy that happens to sit in the working directory.
ROOT = Path(kvref.__file__).resolve().parents[1]

PROBE = """
import kvref, kvref.cells
print(kvref.backend())
print(kvref.cells.KVCells.__module__)
"""


def run(backend: str | None, code: str = PROBE) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVREF_BACKEND"}
    if backend is not None:
        env["KVREF_BACKEND"] = backend
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_python_backend() -> None:
    out = run("python")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "kvref._cells_py"]


def test_cython_backend() -> None:
    out = run("cython")
    if CELLS_C is None:
        assert out.returncode != 0 and "BackendError" in out.stderr  # fails loudly, never falls back
        if cython_requested():
            pytest.fail("KVREF_BACKEND=cython but kvref._cells_c is not built")
        pytest.skip("kvref._cells_c is not built")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cython", "kvref._cells_c"]


@pytest.mark.parametrize("value", [None, "auto", "", " AUTO "])
def test_auto_backend_prefers_the_extension(value: str | None) -> None:
    out = run(value)
    assert out.returncode == 0, out.stderr
    expected = ["cython", "kvref._cells_c"] if CELLS_C is not None else ["python", "kvref._cells_py"]
    assert out.stdout.split() == expected


def test_unknown_backend_is_an_error() -> None:
    code = """
from kvref._backend import BackendError
try:
    import kvref.cells
except BackendError as exc:
    print("BackendError", isinstance(exc, ImportError))
"""
    out = run("bogus", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["BackendError", "True"]


def test_compiled_extension_loaded_when_cython_requested() -> None:
    """CI sets KVREF_BACKEND=cython: then this session must be running the compiled twin."""
    if not cython_requested():
        pytest.skip("this run did not ask for Cython (KVREF_BACKEND != cython)")
    import kvref.cells
    from kvref import _cells_c  # must import: a missing extension fails here

    assert kvref.backend() == "cython"
    assert kvref.cells.KVCells is _cells_c.KVCells
    assert _cells_c.__file__ is not None and not _cells_c.__file__.endswith(".py")


def test_session_backend_matches_request() -> None:
    """In this very session, ``kvref.backend()`` reflects KVREF_BACKEND."""
    import kvref.cells

    requested = os.environ.get("KVREF_BACKEND", "auto").strip().lower() or "auto"
    if requested == "python":
        assert kvref.backend() == "python" and kvref.cells.KVCells.__module__ == "kvref._cells_py"
    elif requested == "cython" or CELLS_C is not None:
        assert kvref.backend() == "cython" and kvref.cells.KVCells.__module__ == "kvref._cells_c"
    else:
        assert kvref.backend() == "python"


def test_twins_export_the_same_names() -> None:
    if CELLS_C is None:
        pytest.skip("kvref._cells_c is not built")
    from kvref import _cells_py

    assert CELLS_C.__all__ == _cells_py.__all__
    for name in _cells_py.__all__:
        if name != "KVCells":
            assert getattr(CELLS_C, name) == getattr(_cells_py, name), name
    public = {n for n in dir(_cells_py.KVCells) if not n.startswith("_")}
    assert public == {n for n in dir(CELLS_C.KVCells) if not n.startswith("_")}
    assert kvref.LLAMA_MAX_SEQ == CELLS_C.LLAMA_MAX_SEQ == 256
