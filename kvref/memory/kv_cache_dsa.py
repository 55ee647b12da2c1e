"""DeepSeek sparse attention: llama.cpp's ``llama_kv_cache_dsa`` (src/llama-kv-cache-dsa.cpp, October 2026).

Two KVCache objects driven together, both with the context's size, streams, types and window: ``mla`` holds the
MLA latent K of the attention layers (an MLA cache stores no V: the model's ``is_mla``), ``lid`` the keys of the
lightning indexer. The indexer cache is a KVCache over a copy of the model's hparams in which every layer has one
KV head (the indexer is MQA), the full-attention head size is ``indexer_head_size`` and RoPE is NEOX
(`lid_hparams`); it has its own layer filter. Every ubatch is placed in both, so both always hold the same cells;
sequence operations go to both; the sequence positions are the MLA cache's. The state is the MLA section followed by
the indexer section; when the indexer section fails to restore, the MLA part already restored is cleared for the
sequence again (llama_kv_cache_dsa::state_read's state_clear).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from ..args import as_state_args
from ..errors import NoSlotError
from ..ggml.types import GGMLType
from ..hparams import HParams, RopeType, SWAType
from ..profile import DEFAULT, Profile, resolve
from .base import ContextParams, read_parts
from .batch import UBatch
from .cache_pair import CachePair
from .kv_cache import KVCache
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .batch import BatchAllocr

# what graph_input computes: a KQ mask (float16 / float32) or row indices (int64)
GraphInput = npt.NDArray[np.float16] | npt.NDArray[np.float32] | npt.NDArray[np.int64]

# the graph inputs of the indexer cache (llm_graph_input_attn_k_dsa: self_kq_mask_lid, self_k_idxs_lid)
LID_INPUTS = ("kq_mask_lid", "k_idxs_lid")


class DSASlot(NamedTuple):
    """Where one ubatch landed in each cache."""

    mla: SlotInfo
    lid: SlotInfo


def lid_hparams(hparams: HParams) -> HParams:
    """The hparams llama_kv_cache_dsa builds its indexer cache from: the model's, with one KV head in every layer,
    ``n_embd_head_k`` (the full-attention head size) = ``indexer_head_size`` and RoPE NEOX (what its K-shift uses)."""
    return dataclasses.replace(hparams, n_head_kv=1, n_embd_head_k=hparams.indexer_head_size, rope_type=RopeType.NEOX)


class KVCacheDSA(CachePair[DSASlot, DSASlot]):
    """llama_kv_cache_dsa. ``kv_size`` cells in both caches (llama.cpp passes ``n_ctx_seq``); ``filter_mla`` /
    ``filter_lid`` choose the layers of each (None: every layer)."""

    kind = "dsa"

    def __init__(
        self,
        hparams: HParams,
        *,
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        kv_unified: bool = True,
        kv_size: int = 256,
        n_seq_max: int = 1,
        n_pad: int = 1,
        n_swa: int = 0,
        swa_type: SWAType | int = SWAType.NONE,
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
        self.hparams_lid = lid_hparams(hparams)
        common = dict(
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_unified=kv_unified,
            kv_size=kv_size,
            n_seq_max=n_seq_max,
            n_pad=n_pad,
            n_swa=n_swa,
            swa_type=swa_type,
            layer_reuse=layer_reuse,
            compat=self.profile,
        )
        self.mla = KVCache(hparams, layer_filter=filter_mla, **common)  # type: ignore[arg-type]
        self.lid = KVCache(self.hparams_lid, layer_filter=filter_lid, **common)  # type: ignore[arg-type]

    @property
    def parts(self) -> list[KVCache]:
        """The two caches, ``[mla, lid]``."""
        return self._pair()

    def _pair(self) -> list[KVCache]:
        return [self.mla, self.lid]

    def _slot(self, *slots: object) -> DSASlot:
        return DSASlot(*slots)  # type: ignore[arg-type]  # one slot per cache, in the parts' order

    def get_mla(self) -> KVCache:
        """The MLA (latent K) cache (llama_kv_cache_dsa::get_mla)."""
        return self.mla

    def get_lid(self) -> KVCache:
        """The lightning-indexer key cache (llama_kv_cache_dsa::get_lid)."""
        return self.lid

    # --- sizes ---------------------------------------------------------------------------------------------

    def attention_cache(self, sinfo: DSASlot | None = None, *, swa: bool = False) -> tuple[KVCache, SlotInfo | None]:
        """The cache llama.cpp's ``kq_mask`` / ``k_idxs`` inputs are built over: the MLA cache (the indexer cache's
        inputs are `graph_input`'s ``kq_mask_lid`` / ``k_idxs_lid``)."""
        return self.mla.attention_cache(None if sinfo is None else sinfo.mla, swa=swa)

    def get_size(self) -> int:
        """Cells per stream (both caches have the same)."""
        return self.mla.get_size()

    # --- sequence operations -------------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_kv_cache_dsa::seq_pos_min: the MLA cache's."""
        return self.mla.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_kv_cache_dsa::seq_pos_max: the MLA cache's."""
        return self.mla.seq_pos_max(seq_id)

    # --- batches -------------------------------------------------------------------------------------------

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, DSASlot]]:
        """llama_kv_cache_dsa::init_batch: a simple split with one stream, else an equal sequential split; the split
        must fit in both caches."""
        del embd_all  # unused by llama.cpp too
        if self.get_n_stream() == 1:
            ubatches = balloc.split_whole("simple", n_ubatch)
        else:
            ubatches = balloc.split_whole("equal", n_ubatch, sequential=True)
        if ubatches is None:
            raise NoSlotError("the batch could not be split into ubatches for the DSA caches")
        slots = self.prepare(ubatches)
        if not slots:
            raise NoSlotError("the batch does not fit in the DSA caches (failed to prepare)")
        return list(zip(ubatches, slots, strict=True))

    def apply_ubatch(self, slot: DSASlot, ubatch: UBatch) -> None:
        """Write the ubatch into both caches at the slot's cells (MLA, then indexer)."""
        self.mla.apply_ubatch(slot.mla, ubatch)
        self.lid.apply_ubatch(slot.lid, ubatch)

    def _decode_n_seq_max(self) -> int:
        return self.mla.get_n_seq_max()

    def _apply(self, slot: DSASlot, ubatch: UBatch) -> DSASlot:
        self.apply_ubatch(slot, ubatch)
        return slot

    def _owner(self, il: int, slot: DSASlot) -> tuple[KVCache, SlotInfo]:
        # the model's K rows (decode's k=) are the MLA cache's; the indexer keys go through lid.cpy_k
        return self.mla, slot.mla

    # --- graph inputs --------------------------------------------------------------------------------------

    def graph_input(
        self, tensor: str, ub: UBatch, slot: object, *, swa: bool, f16: bool, causal: bool | None
    ) -> GraphInput | None:
        """The indexer cache's graph inputs (llm_graph_input_attn_k_dsa): ``kq_mask_lid`` (f16 with the fused
        lightning indexer, llama.cpp's default) and ``k_idxs_lid``; None for the other inputs."""
        if tensor not in LID_INPUTS or swa or not isinstance(slot, DSASlot):
            return None
        return lid_input(self.lid, slot.lid, tensor, ub, f16=f16, causal=causal)

    # --- state ---------------------------------------------------------------------------------------------

    def _state_parts(self, flags: int) -> list[KVCache]:
        del flags  # llama_kv_cache_dsa hands the flags to both caches, which ignore them
        return [self.mla, self.lid]

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore both sections; a failure leaves both caches untouched. With ``atomic=False``, as llama.cpp: the
        MLA section is restored first; a failing MLA section leaves the MLA cache as llama.cpp does (the sequence
        removed) and the indexer cache untouched; a failing indexer section leaves the indexer cache so and clears
        the restored MLA cache for the sequence again (everything for seq_id -1)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return read_parts(self._state_parts(flags), data, seq_id, flags, undo_before=True, atomic=atomic)

    @property
    def compat(self) -> str:
        """The name of the memory's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        return (
            f"KVCacheDSA(size={self.get_size()}, n_stream={self.get_n_stream()}, "
            f"mla layers={self.mla.get_layer_ids()}, lid layers={self.lid.get_layer_ids()})"
        )


def lid_input(lid: KVCache, sinfo: SlotInfo, tensor: str, ub: UBatch, *, f16: bool, causal: bool | None) -> GraphInput:
    """``kq_mask_lid`` or ``k_idxs_lid`` of an indexer cache for a placed ubatch."""
    from .mask import fill_kq_mask

    if tensor == "kq_mask_lid":
        return fill_kq_mask(lid, ub, sinfo=sinfo, dtype=np.float16 if f16 else np.float32, causal=causal)
    return np.asarray(lid.k_idxs(ub, sinfo), dtype=np.int64)


__all__ = ["LID_INPUTS", "DSASlot", "GraphInput", "KVCacheDSA", "lid_hparams", "lid_input"]
