"""kvref: llama.cpp's memory modules and state files, in Python with Cython hot paths.

Public names are imported lazily so that ``import kvref`` stays cheap: a caller who only reads state files never
imports the memory classes, and ``gguf`` is imported by the first ``HParams.from_gguf``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from . import _backend, errors
from .constants import LLAMA_MAX_SEQ
from .errors import BatchError, CellError, FormatError, KVRefError, NoSlotError, SequenceError

__version__ = "0.1.0"

# kvref logs what llama.cpp logs (e.g. a recurrent find_slot refusing a gap) on the "kvref" logger; like any
# library it prints nothing unless the application configures logging.
logging.getLogger("kvref").addHandler(logging.NullHandler())

# an unknown KVREF_BACKEND is an error now, not at the first use of a twin
_backend.requested()

# public name -> module that defines it
_LAZY = {
    "KVCells": "kvref.cells",
    "GGMLType": "kvref.ggml",
    "HParams": "kvref.hparams",
    "SWAType": "kvref.hparams",
    "RopeType": "kvref.hparams",
    "Batch": "kvref.batch",
    "UBatch": "kvref.batch",
    "KVCache": "kvref.kv_cache",
    "SlotInfo": "kvref.kv_cache",
    "RecurrentMemory": "kvref.recurrent",
    "KVCacheISWA": "kvref.kv_cache_iswa",
    "HybridMemory": "kvref.hybrid",
    "create_memory": "kvref.memory",
    "context_params": "kvref.memory",
    "Memory": "kvref.memory",
    "BatchAllocr": "kvref.batch",
    "Profile": "kvref.profile",
    "HParamsError": "kvref.errors",
    "restore": "kvref.from_file",
    "Restored": "kvref.from_file",
    "save_memory": "kvref.to_file",
    "convert": "kvref.conversion",
    "diff": "kvref.state_diff",
    "check_file": "kvref.load_check",
}
_SUBMODULES = ("cells", "mask", "ggml", "state", "batch", "hparams", "kv_cache", "memory", "compat", "conformance")


def backend() -> str:
    """``"cython"`` or ``"python"``: the twin the selector modules picked (see ``KVREF_BACKEND``)."""
    from .cells import BACKEND

    return BACKEND


def about() -> dict[str, str]:
    """What this kvref is: its version, the active backend, and the llama.cpp it follows by default."""
    from .compat import DEFAULT, NAMED, REFERENCE_COMMIT

    return {
        "kvref": __version__,
        "backend": backend(),
        "compat": DEFAULT,
        "llama_cpp_python": NAMED[DEFAULT],
        "llama_cpp": REFERENCE_COMMIT,
    }


def about_line() -> str:
    """`about` as one line, as ``kvref --version`` and ``kvref conformance`` print it."""
    a = about()
    return (
        f"kvref {a['kvref']} ({a['backend']} backend), following llama.cpp {a['llama_cpp']} "
        f"(llama-cpp-python {a['llama_cpp_python']}, compat {a['compat']!r})"
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once: later lookups are plain attribute reads (kvref.Batch in a loop)
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"kvref.{name}")
    raise AttributeError(f"module 'kvref' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES, "__version__"})


__all__ = [
    "LLAMA_MAX_SEQ",
    "BatchError",
    "CellError",
    "FormatError",
    "KVRefError",
    "NoSlotError",
    "SequenceError",
    "about",
    "about_line",
    "backend",
    "errors",
    *_LAZY,
]
