"""Choose between the Cython and the pure-Python twin of each hot-path module.

``KVREF_BACKEND`` (read once, at import): ``auto`` (default) takes the compiled twin when it was built
and the Python twin otherwise; ``cython`` fails loudly when the extension is missing; ``python`` always
takes the Python twin. Only the selector modules (``kvref/cells.py``, ``kvref/mask.py``) call this.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from .errors import KVRefError

_CHOICES = ("auto", "cython", "python")


class BackendError(KVRefError, ImportError):
    """The requested backend cannot be used (unknown name, or Cython asked for but not built)."""


def requested() -> str:
    value = os.environ.get("KVREF_BACKEND", "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise BackendError(f"KVREF_BACKEND={value!r}: expected one of {', '.join(_CHOICES)}")
    return value


def _load_compiled(stem: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"kvref._{stem}_c")
    except ModuleNotFoundError as exc:
        if exc.name != f"kvref._{stem}_c":
            raise  # the extension exists but something it needs does not: never hide that
        return None


def select(stem: str) -> ModuleType:
    """Return the twin module ``kvref._<stem>_c`` or ``kvref._<stem>_py`` per ``KVREF_BACKEND``."""
    choice = requested()
    if choice != "python":
        mod = _load_compiled(stem)
        if mod is not None:
            return mod
        if choice == "cython":
            raise BackendError(
                f"KVREF_BACKEND=cython but the extension kvref._{stem}_c is not built; "
                "reinstall with `pip install .` (without KVREF_PUREPYTHON)"
            )
    return importlib.import_module(f"kvref._{stem}_py")
