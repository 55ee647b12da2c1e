"""What llama.cpp's compositions of attention caches share: llama_kv_cache_iswa, _dsa, _dsa_iswa and _msa drive
their caches together. Every ubatch is placed in each cache in turn, a sequence removal and an update reach each,
the sizes add up, and a shift needs every cache to allow it at one size (the K-shift graph is shared).

The subclasses say what differs: which cache's positions are the memory's, how a batch is split, the slot type
(``_slot``), and what a failed restore leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from .base import PairedMemory

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .batch import UBatch
    from .kv_cache import YarnParams

_P = TypeVar("_P")
_S = TypeVar("_S")


class _Cache(Protocol):
    """What a composition asks of each of its caches (a KVCache, or a composition of them)."""

    def total_size(self) -> int: ...
    def size_k_bytes(self) -> int: ...
    def size_v_bytes(self) -> int: ...
    def get_size(self) -> int: ...
    def get_n_stream(self) -> int: ...
    def get_can_shift(self) -> bool: ...
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...
    def update(self, **kw: Unpack[YarnParams]) -> bool: ...
    def prepare(self, ubatches: Sequence[UBatch]) -> Sequence[object]: ...


class CachePair(PairedMemory[_P, _S]):
    """Attention caches driven together (the parts, ``_pair()``, in llama.cpp's order); ``_slot`` makes the
    memory's slot of one ubatch from each cache's."""

    def _caches(self) -> Sequence[_Cache]:
        return cast("Sequence[_Cache]", self._pair())  # every part is an attention cache (or a composition of them)

    def _slot(self, *slots: object) -> _P:
        raise NotImplementedError

    def total_size(self) -> int:
        """Backing-buffer bytes of every cache (see KVCache.total_size)."""
        return sum(c.total_size() for c in self._caches())

    def size_k_bytes(self) -> int:
        """Bytes of the K tensors of every cache."""
        return sum(c.size_k_bytes() for c in self._caches())

    def size_v_bytes(self) -> int:
        """Bytes of the V tensors of every cache (0 for a cache without V: MLA, an indexer)."""
        return sum(c.size_v_bytes() for c in self._caches())

    def get_n_stream(self) -> int:
        """The number of streams of each cache (all have the same)."""
        return self._caches()[0].get_n_stream()

    def get_can_shift(self) -> bool:
        """True when every cache can shift and all have the same size (the K-shift graph is shared)."""
        caches = self._caches()
        return all(c.get_can_shift() for c in caches) and len({c.get_size() for c in caches}) == 1

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """seq_rm on every cache (always all: a bitwise and in llama.cpp); True when all succeed."""
        seq_id, p0, p1 = self.check_op("seq_rm", seq_id, p0, p1)
        return all([c.seq_rm(seq_id, p0, p1) for c in self._caches()])  # a list: every cache is called

    def update(self, **kw: Unpack[YarnParams]) -> bool:
        """init_update on every cache in turn (K-shift, stream copies); True when any did something."""
        return any([c.update(**kw) for c in self._caches()])  # a list: every cache is updated

    def prepare(self, ubatches: Sequence[UBatch]) -> list[_P]:
        """Slots in every cache in turn, or [] when one cannot place the ubatches (its cells restored)."""
        per_cache = []
        for c in self._caches():
            slots = c.prepare(ubatches)
            if not slots:
                return []
            per_cache.append(slots)
        return [self._slot(*s) for s in zip(*per_cache, strict=True)]


__all__ = ["CachePair"]
