"""KV cell bookkeeping: the public selector between the Cython and the Python twin.

Callers import from here only (``from kvref.memory.cells import KVCells``); ``KVREF_BACKEND`` decides which twin
(see ``kvref._backend``). The semantics are documented in ``kvref/memory/_cells_py.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._backend import select
from ..constants import LLAMA_MAX_SEQ, N_SEQ_WORDS, POS_MAX, TOKEN_NULL

_impl = select("memory.cells")

if TYPE_CHECKING:  # type checkers see the Python twin's class (the twins share one API, see _cells_c.pyi)
    from ._cells_py import KVCells
else:
    KVCells = _impl.KVCells
BACKEND = "cython" if _impl.__name__.endswith("_c") else "python"

__all__ = ["BACKEND", "LLAMA_MAX_SEQ", "N_SEQ_WORDS", "POS_MAX", "TOKEN_NULL", "KVCells"]
