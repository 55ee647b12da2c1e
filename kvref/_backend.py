"""Choose between the Cython and the pure-Python twin of each hot-path module.

``KVREF_BACKEND`` (checked when ``kvref`` is imported): ``auto`` (default) takes the compiled twin when it was
built and the Python twin otherwise, with one warning saying why unless the package was installed without
extensions on purpose (``KVREF_PUREPYTHON=1 pip install .``); ``cython`` fails loudly when the extension is
missing; ``python`` always takes the Python twin. Only the selector modules (``kvref/memory/cells.py``,
``kvref/memory/mask_kernels.py``, ``kvref/memory/slot_kernels.py``, ``kvref/memory/qsa.py``, and ``kvref/hparams.py``
for its GGUF walk) call `select`.
A twin is named by its stem under ``kvref``: ``"memory.cells"`` is ``kvref.memory._cells_c`` / ``_cells_py``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

from .errors import BackendError, BackendWarning

CHOICES = ("auto", "cython", "python")
# Written into the package by ``KVREF_PUREPYTHON=1 pip install .`` (see setup.py): the Python twins were chosen.
PUREPYTHON_MARKER = "PUREPYTHON"
PACKAGE_DIR = Path(__file__).resolve().parent
_warned: list[bool] = []


def requested() -> str:
    """The backend ``KVREF_BACKEND`` asks for; an unknown value is a `BackendError` naming the allowed ones."""
    value = os.environ.get("KVREF_BACKEND", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise BackendError(f"KVREF_BACKEND={value!r} is not a backend: set it to one of {', '.join(CHOICES)}")
    return value


def purepython_install() -> bool:
    """The package was installed with ``KVREF_PUREPYTHON=1``: it has no extensions by choice."""
    return (PACKAGE_DIR / PUREPYTHON_MARKER).exists()


def source_tree() -> bool:
    """kvref is imported from a source checkout (the directory holding setup.py), not from an install."""
    return (PACKAGE_DIR.parent / "setup.py").exists() and (PACKAGE_DIR / "memory" / "_cells_c.pyx").exists()


def _twin(stem: str, suffix: str) -> str:
    """``("memory.cells", "c")`` -> ``"kvref.memory._cells_c"``."""
    package, _, leaf = stem.rpartition(".")
    return ".".join(["kvref", *([package] if package else []), f"_{leaf}_{suffix}"])


def compiled_elsewhere(stem: str) -> Path | None:
    """An installed copy of kvref on ``sys.path``, other than this one, that has the compiled twin."""
    for entry in sys.path:
        pkg = Path(entry or ".").resolve() / "kvref"
        where = pkg.joinpath(*_twin(stem, "c").split(".")[1:-1])
        name = _twin(stem, "c").rpartition(".")[2]
        if pkg != PACKAGE_DIR and (any(where.glob(f"{name}.*.so")) or any(where.glob(f"{name}.*.pyd"))):
            return pkg
    return None


def _load_compiled(stem: str) -> ModuleType | None:
    try:
        return importlib.import_module(_twin(stem, "c"))
    except ModuleNotFoundError as exc:
        if exc.name != _twin(stem, "c"):
            raise  # the extension exists but something it needs does not: never hide that
        return None


def why_not_compiled(stem: str) -> str:
    """Why the compiled twin of ``stem`` cannot be imported here, and the command that fixes it."""
    ext = _twin(stem, "c")
    if source_tree():
        other = compiled_elsewhere(stem)
        if other is not None:
            return (
                f"the source tree {PACKAGE_DIR} shadows the installed build at {other}: {ext} is not built in the "
                "source tree. Run from outside the checkout, or build in place with `pip install -e .`"
            )
        return f"{ext} is not built in the source tree {PACKAGE_DIR}: build it in place with `pip install -e .`"
    if purepython_install():
        return f"kvref at {PACKAGE_DIR} was installed with KVREF_PUREPYTHON=1: reinstall with `pip install kvref`"
    return f"{ext} is missing from {PACKAGE_DIR}: reinstall with `pip install --force-reinstall kvref`"


def select(stem: str) -> ModuleType:
    """Return the twin module ``kvref[.<package>]._<leaf>_c`` or ``_<leaf>_py`` per ``KVREF_BACKEND``."""
    choice = requested()
    if choice != "python":
        mod = _load_compiled(stem)
        if mod is not None:
            return mod
        if choice == "cython":
            raise BackendError(f"KVREF_BACKEND=cython but {why_not_compiled(stem)}")
        if not purepython_install() and not _warned:
            _warned.append(True)
            warnings.warn(
                f"kvref uses its pure-Python twins (10-170x slower): {why_not_compiled(stem)}. "
                "Set KVREF_BACKEND=python to choose them without this warning.",
                BackendWarning,
                stacklevel=3,
            )
    return importlib.import_module(_twin(stem, "py"))
