"""kvref: llama.cpp's memory modules and state files, in Python with Cython hot paths.

Public names are imported lazily so that ``import kvref`` stays cheap: a caller who only reads state files never
imports the memory classes, and ``gguf`` is imported by the first ``HParams.from_gguf``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from . import _backend, _moved, errors
from .about import About, about, about_line, backend
from .about import __version__ as __version__
from .constants import LLAMA_MAX_SEQ
from .errors import BatchError, CellError, FormatError, KVRefError, NoSlotError, SequenceError

if TYPE_CHECKING:  # what __getattr__ hands out, as the type checker sees it (imported on first use at run time)
    from . import cells as cells
    from . import compat as compat
    from . import ggml as ggml
    from . import hparams as hparams
    from . import jobs as jobs
    from . import mask as mask
    from . import memory as memory
    from . import state as state
    from .errors import HParamsError as HParamsError
    from .ggml.types import GGMLType as GGMLType
    from .hparams import HParams as HParams
    from .hparams import RopeType as RopeType
    from .hparams import SWAType as SWAType
    from .jobs.check import check_file as check_file
    from .jobs.convert import convert as convert
    from .jobs.diff import diff as diff
    from .jobs.restore import Restored as Restored
    from .jobs.restore import restore as restore
    from .jobs.save import save_memory as save_memory
    from .memory.batch import Batch as Batch
    from .memory.batch import BatchAllocr as BatchAllocr
    from .memory.batch import UBatch as UBatch
    from .memory.cells import KVCells as KVCells
    from .memory.factory import Memory as Memory
    from .memory.factory import context_params as context_params
    from .memory.factory import create_memory as create_memory
    from .memory.hybrid import HybridMemory as HybridMemory
    from .memory.kv_cache import KVCache as KVCache
    from .memory.kv_cache import SlotInfo as SlotInfo
    from .memory.kv_cache_iswa import KVCacheISWA as KVCacheISWA
    from .memory.recurrent import RecurrentMemory as RecurrentMemory
    from .profile import Profile as Profile

# kvref logs what llama.cpp logs (e.g. a recurrent find_slot refusing a gap) on the "kvref" logger; like any
# library it prints nothing unless the application configures logging.
logging.getLogger("kvref").addHandler(logging.NullHandler())

# an unknown KVREF_BACKEND is an error now, not at the first use of a twin
_backend.requested()
_moved.install()  # the module paths of kvref 0.1 (kvref.kv_cache, ...) still import, with a DeprecationWarning

# public name -> module that defines it
_LAZY = {
    "KVCells": "kvref.memory.cells",
    "GGMLType": "kvref.ggml.types",
    "HParams": "kvref.hparams",
    "SWAType": "kvref.hparams",
    "RopeType": "kvref.hparams",
    "Batch": "kvref.memory.batch",
    "UBatch": "kvref.memory.batch",
    "KVCache": "kvref.memory.kv_cache",
    "SlotInfo": "kvref.memory.kv_cache",
    "RecurrentMemory": "kvref.memory.recurrent",
    "KVCacheISWA": "kvref.memory.kv_cache_iswa",
    "HybridMemory": "kvref.memory.hybrid",
    "create_memory": "kvref.memory.factory",
    "context_params": "kvref.memory.factory",
    "Memory": "kvref.memory.factory",
    "BatchAllocr": "kvref.memory.batch",
    "Profile": "kvref.profile",
    "HParamsError": "kvref.errors",
    "restore": "kvref.jobs.restore",
    "Restored": "kvref.jobs.restore",
    "save_memory": "kvref.jobs.save",
    "convert": "kvref.jobs.convert",
    "diff": "kvref.jobs.diff",
    "check_file": "kvref.jobs.check",
}
_SUBMODULES = ("cells", "mask", "ggml", "state", "memory", "jobs", "hparams", "compat")


def __getattr__(name: str) -> object:  # every public name is typed above; this serves kvref 0.1's moved paths
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once: later lookups are plain attribute reads (kvref.Batch in a loop)
        return value
    if name in _SUBMODULES or f"kvref.{name}" in _moved.MOVED:
        return importlib.import_module(f"kvref.{name}")
    raise AttributeError(f"module 'kvref' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES, "__version__"})


__all__ = [
    "LLAMA_MAX_SEQ",
    "About",
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
