"""llama.cpp's memory modules, named after llama.cpp's own files (see README's Layout).

The names of `kvref.memory.factory` (``create_memory``, ``context_params``, ``Memory``, ...) stay reachable here,
imported on first use so that a module of this wing (the cells, say) never pulls in every memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the type checker sees as kvref.memory.<name>
    from .factory import (
        CONTEXT_TYPES,
        LLAMA_STATE_SEQ_FLAGS_NONE,
        LLAMA_STATE_SEQ_FLAGS_ON_DEVICE,
        LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
        LLAMA_STATE_SEQ_FLAGS_SWA_ONLY,
        NO_MEMORY_ARCHS,
        UNSUPPORTED_ARCHS,
        ContextParams,
        Memory,
        PairedMemory,
        check_cache_types,
        context_params,
        create_memory,
        kv_pad,
    )

# kvref.memory.factory.__all__ (a test keeps the two equal); listed here so that looking up a submodule of this
# package while it is still importing never imports the factory
__all__ = [
    "CONTEXT_TYPES",
    "LLAMA_STATE_SEQ_FLAGS_NONE",
    "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE",
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "LLAMA_STATE_SEQ_FLAGS_SWA_ONLY",
    "NO_MEMORY_ARCHS",
    "UNSUPPORTED_ARCHS",
    "ContextParams",
    "Memory",
    "PairedMemory",
    "check_cache_types",
    "context_params",
    "create_memory",
    "kv_pad",
]
FACTORY_NAMES = tuple(__all__)


def __getattr__(name: str) -> object:
    if name in FACTORY_NAMES:
        return getattr(importlib.import_module("kvref.memory.factory"), name)
    raise AttributeError(f"module 'kvref.memory' has no attribute {name!r}")
