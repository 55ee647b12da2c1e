"""DeepSeek sparse attention under a sliding window: llama.cpp's ``llama_kv_cache_dsa_iswa``
(src/llama-kv-cache-dsa-iswa.cpp, October 2026).

A `KVCacheDSA` over the full-attention layers (no window; its indexer cache keeps the layers of ``filter_lid``) and a
KVCache over the sliding-window layers, sized like llama_kv_cache_iswa's SWA cache (the window of every sequence
that can share the buffer plus a ubatch, padded to 256; the base size with ``swa_full``). Every ubatch is placed in
the three caches; sequence operations go to the DSA pair and then the SWA cache; the sequence positions are the SWA
cache's. The state is the DSA sections (MLA, indexer) then the SWA section; PARTIAL_ONLY keeps the SWA section alone.
A failed restore: the DSA part undoes its own MLA cache when its indexer section fails; a failing SWA section leaves
the DSA part restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..args import as_state_args
from ..errors import NoSlotError
from ..ggml.types import GGMLType
from ..hparams import HParams, SWAType
from ..profile import DEFAULT, Profile, resolve
from .base import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, ContextParams, read_parts
from .batch import UBatch
from .cache_pair import CachePair
from .kv_cache import KVCache
from .kv_cache_dsa import LID_INPUTS, DSASlot, GraphInput, KVCacheDSA, lid_input
from .kv_cache_iswa import swa_cache_size
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .base import MemoryPart
    from .batch import BatchAllocr


class DSAISWASlot(NamedTuple):
    """Where one ubatch landed in each cache."""

    dsa: DSASlot
    swa: SlotInfo


class KVCacheDSAISWA(CachePair[DSAISWASlot, DSAISWASlot]):
    """llama_kv_cache_dsa_iswa. ``kv_size`` is the DSA caches' size (llama.cpp passes ``n_ctx_seq``); ``filter_mla``
    is chained with "not SWA" for the DSA pair and "SWA" for the SWA cache; ``filter_lid`` is the indexer cache's."""

    kind = "dsa_iswa"

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
        filter_mla: Callable[[int], bool] | None = None,
        filter_lid: Callable[[int], bool] | None = None,
        layer_reuse: Callable[[int], int] | None = None,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        self.hparams = hparams
        self.kv_unified = bool(kv_unified)
        self.cparams = cparams  # the context create_memory built this for (None when built directly)
        self.profile = resolve(compat)
        self.swa_full = bool(swa_full)

        def filter_dsa(il: int) -> bool:
            return (filter_mla is None or filter_mla(il)) and not hparams.is_swa(il)

        def filter_swa(il: int) -> bool:
            return (filter_mla is None or filter_mla(il)) and hparams.is_swa(il)

        size_dsa = int(kv_size)
        # the SWA cache is always padded to 256 here (llama_kv_cache_dsa_iswa has no older form)
        size_swa = swa_cache_size(size_dsa, hparams.n_swa, n_seq_max, n_ubatch, self.kv_unified, self.swa_full, 256)
        self.dsa = KVCacheDSA(
            hparams,
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_unified=kv_unified,
            kv_size=size_dsa,
            n_seq_max=n_seq_max,
            n_pad=n_pad,
            n_swa=0,
            swa_type=SWAType.NONE,
            filter_mla=filter_dsa,
            filter_lid=filter_lid,
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
    def parts(self) -> list[MemoryPart[object]]:
        """The two parts, ``[dsa, swa]``."""
        return self._pair()

    def _pair(self) -> list[MemoryPart[object]]:
        return [self.dsa, self.swa]

    def _slot(self, *slots: object) -> DSAISWASlot:
        return DSAISWASlot(*slots)  # type: ignore[arg-type]  # one slot per cache, in the parts' order

    def get_dsa(self) -> KVCacheDSA:
        """The DSA pair over the full-attention layers (llama_kv_cache_dsa_iswa::get_dsa)."""
        return self.dsa

    def get_swa(self) -> KVCache:
        """The sliding-window cache (llama_kv_cache_dsa_iswa::get_swa)."""
        return self.swa

    # --- sizes ---------------------------------------------------------------------------------------------

    def attention_cache(
        self, sinfo: DSAISWASlot | None = None, *, swa: bool = False
    ) -> tuple[KVCache, SlotInfo | None]:
        """The cache a KQ mask is built over: the MLA cache of the DSA pair (``kq_mask``), or with ``swa=True`` the
        SWA cache (``kq_mask_swa``)."""
        if swa:
            return self.swa, None if sinfo is None else sinfo.swa
        return self.dsa.attention_cache(None if sinfo is None else sinfo.dsa)

    # --- sequence operations -------------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_kv_cache_dsa_iswa::seq_pos_min: the SWA cache's."""
        return self.swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_kv_cache_dsa_iswa::seq_pos_max: the SWA cache's."""
        return self.swa.seq_pos_max(seq_id)

    # --- batches -------------------------------------------------------------------------------------------

    def init_batch(
        self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False
    ) -> list[tuple[UBatch, DSAISWASlot]]:
        """llama_kv_cache_dsa_iswa::init_batch: a simple split first (unified only), then an equal split (sequential
        when not unified); each tried split must fit in the three caches."""
        del embd_all
        for kind in ("simple", "equal"):
            if kind == "simple" and not self.kv_unified:
                continue  # several streams need equal splits
            ubatches = balloc.split_whole(kind, n_ubatch, sequential=not self.kv_unified)
            if ubatches is None:
                continue
            slots = self.prepare(ubatches)
            if slots:
                return list(zip(ubatches, slots, strict=True))
        raise NoSlotError("the batch does not fit in the DSA-iSWA caches (failed to prepare)")

    def apply_ubatch(self, slot: DSAISWASlot, ubatch: UBatch) -> None:
        """Write the ubatch into the DSA pair, then the SWA cache."""
        self.dsa.apply_ubatch(slot.dsa, ubatch)
        self.swa.apply_ubatch(slot.swa, ubatch)

    def _decode_n_seq_max(self) -> int:
        return self.swa.get_n_seq_max()

    def _apply(self, slot: DSAISWASlot, ubatch: UBatch) -> DSAISWASlot:
        self.apply_ubatch(slot, ubatch)
        return slot

    def _owner(self, il: int, slot: DSAISWASlot) -> tuple[KVCache, SlotInfo]:
        return (self.swa, slot.swa) if self.hparams.is_swa(il) else (self.dsa.mla, slot.dsa.mla)

    # --- graph inputs --------------------------------------------------------------------------------------

    def graph_input(
        self, tensor: str, ub: UBatch, slot: object, *, swa: bool, f16: bool, causal: bool | None
    ) -> GraphInput | None:
        """The indexer cache's graph inputs (``kq_mask_lid``, ``k_idxs_lid``); None for the others."""
        if tensor not in LID_INPUTS or swa or not isinstance(slot, DSAISWASlot):
            return None
        return lid_input(self.dsa.lid, slot.dsa.lid, tensor, ub, f16=f16, causal=causal)

    # --- state ---------------------------------------------------------------------------------------------

    def _state_parts(self, flags: int) -> list[MemoryPart[object]]:
        # PARTIAL_ONLY: only the SWA cache is written / read
        if flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
            return [self.swa]
        return [self.dsa, self.swa]

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore the sections; a failure leaves every cache untouched. With ``atomic=False``, as llama.cpp: the
        caches are restored one after the other (MLA, indexer, SWA); a failing indexer section clears the restored
        MLA cache for the sequence again (llama_kv_cache_dsa), a failing SWA section keeps the DSA pair restored."""
        seq_id, flags = as_state_args(seq_id, flags)
        if flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
            return read_parts([self.swa], data, seq_id, flags, atomic=atomic)
        parts = [self.dsa.mla, self.dsa.lid, self.swa]
        return read_parts(parts, data, seq_id, flags, undo_before=(False, True, False), atomic=atomic)

    @property
    def compat(self) -> str:
        """The name of the memory's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        return f"KVCacheDSAISWA(dsa={self.dsa.get_size()} cells, swa={self.swa.get_size()} cells)"


__all__ = ["DSAISWASlot", "KVCacheDSAISWA"]
