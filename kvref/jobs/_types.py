"""The types the jobs share: the memories ``create_memory`` builds, what a job reads a state or a model from.

Aliases for the type checker only (their names are imported under ``TYPE_CHECKING``); nothing here runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import os

    from ..hparams import HParams
    from ..memory.hybrid import HybridMemory, HybridSlot
    from ..memory.kv_cache import KVCache
    from ..memory.kv_cache_iswa import ISWASlot, KVCacheISWA
    from ..memory.recurrent import RecurrentMemory, RecurrentSlot
    from ..memory.slots import SlotInfo
    from ..state import StateObject
    from ..state.load import Source

# a memory as create_memory builds it (`kvref.memory.factory`): what the jobs restore into, save from and draw
AnyMemory: TypeAlias = "KVCache | KVCacheISWA | RecurrentMemory | HybridMemory"
# a single-section memory: what a composite memory's state is made of (`kvref.jobs.restore.leaf_caches`)
LeafMemory: TypeAlias = "KVCache | RecurrentMemory"
# where decode placed a ubatch, per memory kind
AnySlot: TypeAlias = "SlotInfo | ISWASlot | HybridSlot | RecurrentSlot"
# a state a job reads: a path, the bytes of a blob, or a state loaded already
StateSource: TypeAlias = "Source | StateObject"
# a model: a GGUF file, or its hyper-parameters
ModelSource: TypeAlias = "str | os.PathLike[str] | HParams"

__all__ = ["AnyMemory", "AnySlot", "LeafMemory", "ModelSource", "StateSource"]
