"""Interleaved sliding-window attention: llama.cpp's ``llama_kv_cache_iswa``.

Two KVCache objects driven together: ``base`` holds the full-attention layers (no window), ``swa`` the
sliding-window layers (the model's ``n_swa`` / ``swa_type``). Every ubatch is placed in both; sequence
operations go to both; the state is the base section followed by the SWA section.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from ..args import as_state_args
from ..errors import NoSlotError
from ..ggml.types import GGMLType
from ..hparams import HParams, SWAType
from ..profile import DEFAULT, Profile, resolve
from .base import (
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    ContextParams,
    decode_batch,
    over_n_batch,
    read_parts,
    store_rows,
)
from .batch import UBatch
from .cache_pair import CachePair
from .kv_cache import KVCache
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .batch import Batch, BatchAllocr

SWA_PAD = 256  # the SWA cache padding of llama.cpp issue #17037 (Profile.swa_size_pad; kept for callers)


class ISWASlot(NamedTuple):
    """Where one ubatch landed in each cache."""

    base: SlotInfo
    swa: SlotInfo


def swa_cache_size(
    size_base: int, n_swa: int, n_seq_max: int, n_ubatch: int, unified: bool, swa_full: bool, n_pad: int = SWA_PAD
) -> int:
    """llama_kv_cache_iswa's SWA cache size: the window of every sequence that can share the buffer plus a
    ubatch, at most the base size, padded to ``n_pad`` (``Profile.swa_size_pad``, or the cache's n_pad); with
    ``swa_full`` the base size."""
    if swa_full:
        return size_base
    want = min(size_base, n_swa * (n_seq_max if unified else 1) + n_ubatch)
    return (want + n_pad - 1) // n_pad * n_pad


class KVCacheISWA(CachePair[ISWASlot, ISWASlot]):
    """llama_kv_cache_iswa. ``kv_size`` is the base size (llama.cpp passes ``n_ctx_seq``)."""

    kind = "iswa"

    def __init__(
        self,
        hparams: HParams,
        *,
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        swa_full: bool = False,
        kv_unified: bool = True,
        kv_size: int = 256,
        n_seq_max: int = 1,
        n_ubatch: int = 512,
        n_pad: int = 1,
        layer_filter: Callable[[int], bool] | None = None,
        layer_reuse: Callable[[int], int] | None = None,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        self.hparams = hparams
        self.kv_unified = bool(kv_unified)
        self.cparams = cparams  # the context create_memory built this for (None when built directly)
        self.profile = resolve(compat)
        self.swa_full = bool(swa_full)

        # chained filters: the caller's filter first, then full-attention vs sliding layers
        def filter_base(il: int) -> bool:
            return (layer_filter is None or layer_filter(il)) and not hparams.is_swa(il)

        def filter_swa(il: int) -> bool:
            return (layer_filter is None or layer_filter(il)) and hparams.is_swa(il)

        size_base = int(kv_size)
        # Profile.swa_size_pad: the SWA size is padded to it (0: to the cache's n_pad)
        pad = self.profile.swa_size_pad or int(n_pad)
        size_swa = swa_cache_size(size_base, hparams.n_swa, n_seq_max, n_ubatch, self.kv_unified, self.swa_full, pad)
        self.base = KVCache(
            hparams,
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_unified=kv_unified,
            kv_size=size_base,
            n_seq_max=n_seq_max,
            n_pad=n_pad,
            n_swa=0,
            swa_type=SWAType.NONE,
            layer_filter=filter_base,
            layer_reuse=layer_reuse,
            compat=self.profile,
        )
        self.swa = KVCache(
            hparams,
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_unified=kv_unified,
            kv_size=size_swa,
            n_seq_max=n_seq_max,
            n_pad=n_pad,
            n_swa=hparams.n_swa,
            swa_type=hparams.swa_type,
            layer_filter=filter_swa,
            layer_reuse=layer_reuse,
            compat=self.profile,
        )

    @property
    def parts(self) -> list[KVCache]:
        """The two caches, ``[base, swa]``."""
        return self._pair()

    def _pair(self) -> list[KVCache]:
        return [self.base, self.swa]

    def _slot(self, *slots: object) -> ISWASlot:
        return ISWASlot(*slots)  # type: ignore[arg-type]  # one slot per cache, in the parts' order

    # --- sizes ---------------------------------------------------------------------------------------------

    def attention_cache(self, sinfo: ISWASlot | None = None, *, swa: bool = False) -> tuple[KVCache, SlotInfo | None]:
        """The cache a KQ mask is built over, with its part of ``sinfo``: the base cache (llama.cpp's
        ``kq_mask``), or with ``swa=True`` the SWA cache (``kq_mask_swa``)."""
        if swa:
            return self.swa, None if sinfo is None else sinfo.swa
        return self.base, None if sinfo is None else sinfo.base

    def get_base(self) -> KVCache:
        """The full-attention cache (llama_kv_cache_iswa::get_base)."""
        return self.base

    def get_swa(self) -> KVCache:
        """The sliding-window cache (llama_kv_cache_iswa::get_swa)."""
        return self.swa

    # --- sequence operations -------------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_kv_cache_iswa::seq_pos_min: the SWA cache's, whose range is the memory's."""
        # the SWA cache holds a suffix of what the base holds: its range is the memory's
        return self.swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_kv_cache_iswa::seq_pos_max: the SWA cache's, whose range is the memory's."""
        return self.swa.seq_pos_max(seq_id)

    # --- batches -------------------------------------------------------------------------------------------

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, ISWASlot]]:
        """llama_kv_cache_iswa::init_batch: a simple split first (one stream only), then an equal split
        (sequential with several streams); each tried split must fit in both caches."""
        several = self.get_n_stream() != 1
        for kind in ("simple", "equal"):
            if kind == "simple" and several:
                continue  # several streams need equal splits
            ubatches = balloc.split_whole(kind, n_ubatch, sequential=several)
            if ubatches is None:
                continue
            slots = self.prepare(ubatches)
            if slots:
                return list(zip(ubatches, slots, strict=True))
        raise NoSlotError("the batch does not fit in the iSWA caches (failed to prepare)")

    def apply_ubatch(self, slot: ISWASlot, ubatch: UBatch) -> None:
        """Write the ubatch into both caches at the slot's cells (base, then SWA)."""
        self.base.apply_ubatch(slot.base, ubatch)
        self.swa.apply_ubatch(slot.swa, ubatch)

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, ISWASlot], None] | None = None,
    ) -> list[tuple[UBatch, ISWASlot]]:
        """What llama_decode does to the memory (`decode_batch`); ``k`` / ``v`` rows go to the cache that owns
        each layer. The common step of a one-stream memory (`KVCache._single`) is planned in both caches and
        then written, with nothing changed unless both plans hold: what prepare and apply_ubatch of both caches do
        to a single ubatch (`_decode_single`)."""
        if balloc is None and not embd_all and self.base.n_stream == 1 and not over_n_batch(self.cparams, batch):
            step = self._decode_single(batch, n_ubatch)
            if step is not None:
                ub, slot = step
                if k or v or on_ubatch is not None:
                    store_rows(self, ub, slot, k, v, on_ubatch)
                return [(ub, slot)]
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _decode_single(self, batch: Batch, n_ubatch: int) -> tuple[UBatch, ISWASlot] | None:
        """The common step in both caches: planned in each (``plan_single``: the allocator's checks against the
        cells' positions, find_slot), written only when both plans hold and agree on the positions, base then SWA
        (`KVCache._commit_single`: reused window cells as apply_ubatch writes them, purging below). A single ubatch
        prepared, then applied, ends the same way: prepare's trial apply only leaves its purge, which the apply
        makes again. None, with nothing changed, otherwise."""
        plan_b = self.base._single(batch, n_ubatch, False)
        if plan_b is None:
            return None
        plan_s = self.swa._single(batch, n_ubatch, False)
        # given positions are both plans' positions; computed ones come from each cache's seq_pos_max
        if plan_s is None or (batch.pos is None and plan_b[1].tobytes() != plan_s[1].tobytes()):
            return None
        logits: npt.NDArray[np.bool_] | None = batch.logits  # type: ignore[assignment]  # _single checked it
        ub = UBatch.whole_single(plan_b[3], plan_b[1], plan_b[2], logits if logits is None else logits.copy())
        return ub, ISWASlot(self.base._commit_single(plan_b), self.swa._commit_single(plan_s))

    def _decode_n_seq_max(self) -> int:
        return self.base.get_n_seq_max()

    def _apply(self, slot: ISWASlot, ubatch: UBatch) -> ISWASlot:
        self.apply_ubatch(slot, ubatch)
        return slot

    def _owner(self, il: int, slot: ISWASlot) -> tuple[KVCache, SlotInfo]:
        return (self.swa, slot.swa) if self.hparams.is_swa(il) else (self.base, slot.base)

    # --- state ---------------------------------------------------------------------------------------------

    def _state_parts(self, flags: int) -> list[KVCache]:
        # PARTIAL_ONLY (formerly SWA_ONLY): only the SWA cache is written / read
        return [self.swa] if flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY else [self.base, self.swa]

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore both sections; a failure leaves both caches untouched. With ``atomic=False``, as llama.cpp:
        the base section is restored before the SWA one is read; a failing section leaves its cache as
        llama.cpp does (the sequence removed), the other cache keeps what it had read."""
        seq_id, flags = as_state_args(seq_id, flags)
        return read_parts(self._state_parts(flags), data, seq_id, flags, atomic=atomic)

    @property
    def compat(self) -> str:
        """The name of the memory's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        return f"KVCacheISWA(base={self.base.get_size()} cells, swa={self.swa.get_size()} cells)"


__all__ = ["SWA_PAD", "ISWASlot", "KVCacheISWA", "swa_cache_size"]
