"""Hybrid attention + recurrent memory with an indexer key cache: llama.cpp's ``llama_memory_hybrid_idx``.

llama_memory_hybrid (`HybridMemory`: an attention KVCache and a RecurrentMemory) plus a third cache, a KVCache
holding one indexer key per token (qwen4exp's QSA indexer, glm5-next's k-pool DSA indexer). The indexer cache is a
side buffer over the attention cells: same size, padding and streams, and it takes the attention cache's slots
(a decode places each ubatch in the cells the attention cache chose, a sequence restore puts the indexer's cells
where the attention restore put its own), so cell j is the same token in both.

Its own hparams (llama.cpp's ``hparams_idx``): one key head per layer of ``indexer_head_size`` (three times that with
a k-pool: key, gate and pooled value), no V (the cache is shaped as an MLA cache), no RoPE (the keys are cached raw:
a K-shift leaves them alone, and the indexer section has no cell ext).

What differs from llama_memory_hybrid:

- ``seq_rm``: the recurrent part first (it may refuse: False, nothing changed), then the indexer, then the attention
  part, whose answer is returned; the other sequence operations run the hybrid pair, then the indexer.
- state: the attention section, the recurrent section, then the indexer section (a pure suffix); PARTIAL_ONLY writes
  and reads only the recurrent section. The indexer restore mirrors the attention cache's cells: a stream whose
  indexer cell count differs from the attention one fails. A failed restore (``atomic=False``) drops the sequence
  from all three caches (everything for seq_id -1), whichever section failed (llama_memory_hybrid_idx::state_drop).
- the k-pool bookkeeping of glm5-next (which pooled keys a sequence edit makes stale) is kept as llama.cpp keeps it
  (`stale`); it decides graph inputs only.

Graph inputs of its own (`graph_input`): the indexer cache's row indices (``k_idxs_idx``), qwen4exp's QSA block
inputs (``qsa_cell_blk``, ``qsa_blk_cells``, ``qsa_blk_pos`` and the bias ``kq_mask_qsa_bias``,
llama_memory_hybrid_idx::set_input_qsa, `kvref.memory.qsa`) and glm5-next's k-pool inputs (``kpool_pool_cells``,
``kpool_pool_idxs``, ``kq_mask_kpool_pool``, ``kpool_tail_idxs``, ``kq_mask_kpool_gather``, ``kpool_new_pool_idxs``,
``kpool_new_pool_rep``: set_input_kpool, `kvref.memory.kpool`).

Where llama.cpp dies, kvref refuses before anything changes: a QSA decode that leaves a cell past its ubatch's block
window (set_input_qsa's GGML_ASSERT) is found by a dry run of the split and placement before the memory update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ..args import as_int, as_seq_id, as_state_args
from ..constants import LLAMA_MAX_SEQ
from ..errors import FormatError, KVRefError, NoSlotError, SequenceError
from ..ggml.types import GGMLType
from ..hparams import HParams, RopeType, SWAType
from ..profile import DEFAULT, Profile
from .base import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, ContextParams, clear_seq, decode_batch, stage_parts
from .hybrid import HybridMemory, HybridSlot
from .kpool import KPoolLayout, KPoolState, kpool_build_state, kpool_inputs, kpool_pad, kpool_select
from .kv_cache import KVCache

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer, Unpack

    from .base import MemoryPart
    from .batch import Batch, BatchAllocr, UBatch
    from .kv_cache import YarnParams
    from .kv_cache_iswa import ISWASlot
    from .slots import SlotInfo

POS_CLEAN = 2**31 - 1  # llama_memory_hybrid_idx::POS_CLEAN: no pooled key of the sequence is stale


def idx_hparams(hparams: HParams) -> HParams:
    """llama_memory_hybrid_idx's ``hparams_idx``: the model's, with one key head per layer of ``indexer_head_size``
    (x3 with a k-pool: key | gate | pooled), no RoPE, and MLA head sizes so that the cache keeps no V."""
    ihs = int(hparams.indexer_head_size)
    if ihs <= 0:
        raise KVRefError(f"the indexer cache needs indexer_head_size > 0, got {ihs}")
    return dataclasses.replace(
        hparams,
        n_head_kv=[1] * hparams.n_layer,
        n_embd_head_k=ihs * (3 if hparams.indexer_kpool > 0 else 1),
        n_embd_head_k_mla=ihs,
        n_embd_head_v_mla=ihs,
        rope_type=RopeType.NONE,
    )


class HybridIdxMemory(HybridMemory):
    """llama_memory_hybrid_idx: `HybridMemory` (attention + recurrent) plus an indexer KVCache (``idx``; None when
    llama.cpp gets no ``filter_idx``: the model carries no indexer).

    Constructor arguments follow llama.cpp's (those of HybridMemory without SWA, and ``filter_idx``)."""

    def __init__(
        self,
        hparams: HParams,
        *,
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        kv_size: int = 256,
        n_pad: int = 1,
        n_swa: int = 0,
        swa_type: SWAType | int = SWAType.NONE,
        type_r: GGMLType | int | str = "f32",
        type_s: GGMLType | int | str = "f32",
        rs_size: int = 1,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        filter_attn: Callable[[int], bool] | None = None,
        filter_recr: Callable[[int], bool] | None = None,
        filter_idx: Callable[[int], bool] | None = None,
        n_rs_seq: int = 0,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        super().__init__(
            hparams,
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_size=kv_size,
            n_pad=n_pad,
            n_swa=n_swa,
            swa_type=swa_type,
            type_r=type_r,
            type_s=type_s,
            rs_size=rs_size,
            n_seq_max=n_seq_max,
            kv_unified=kv_unified,
            filter_attn=filter_attn,
            filter_recr=filter_recr,
            n_rs_seq=n_rs_seq,
            swa=False,
            compat=compat,
            cparams=cparams,
        )
        self.kind = "hybrid_idx"  # type: ignore[assignment]  # case.json's memory.type
        self.hparams_idx: HParams | None = None
        self.idx: KVCache | None = None
        if filter_idx is not None:
            self.hparams_idx = idx_hparams(hparams)
            self.idx = KVCache(
                self.hparams_idx,
                type_k=type_k,
                type_v=type_v,
                v_trans=v_trans,
                kv_unified=kv_unified,
                kv_size=kv_size,
                n_seq_max=n_seq_max,
                n_pad=n_pad,
                n_swa=n_swa,
                swa_type=swa_type,
                layer_filter=filter_idx,
                compat=self.profile,
            )
        # every decode goes through decode_batch: the indexer takes the attention cache's slots
        self._one_call = False
        # llama_memory_hybrid_idx::mem_idx_stale: per sequence, the position its pooled keys are stale from
        self.stale: list[int] = [POS_CLEAN] * LLAMA_MAX_SEQ
        # glm5-next's k-pool layout (llama.cpp's kpool_layout: made by the first update, kept across batches) and the
        # pools the last placed ubatch re-pools (kpool_state)
        self.kpool_layout: KPoolLayout | None = None
        self.kpool_state: KPoolState | None = None

    # --- parts ---------------------------------------------------------------------------------------------

    def get_mem_idx(self) -> KVCache | None:
        """The indexer cache, None when the model carries no indexer (llama_memory_hybrid_idx::get_mem_idx)."""
        return self.idx

    def _pair(self) -> Sequence[MemoryPart[object]]:
        # argument checks: the attention and recurrent parts (the indexer cache takes what the attention cache takes)
        return [self.attn, self.recr]

    def total_size(self) -> int:
        """Backing-buffer bytes of the three caches."""
        return super().total_size() + (0 if self.idx is None else self.idx.total_size())

    # --- k-pool staleness (glm5-next) ----------------------------------------------------------------------

    def _stale_set(self, seq_id: int, p0: int) -> None:
        p0 = max(int(p0), 0)
        if seq_id < 0:
            self.stale = [min(p, p0) for p in self.stale]
        else:
            self.stale[seq_id] = min(self.stale[seq_id], p0)

    def _stale_pos(self, seq_id: int, p0: int) -> int:
        # an edit at or below the first position moves pos_min, which regroups the whole sequence
        assert self.idx is not None
        if seq_id < 0 or p0 <= self.idx.seq_pos_min(seq_id):
            return 0
        return p0

    def _stale_shared(self) -> None:
        # kpool_layout_shared(): the layout has a cell shared by sequences, which only a rebuild of every one re-derives
        if self.kpool_layout is not None and not self.kpool_layout.cache_safe:
            self._stale_set(-1, 0)

    def kpool_track(self) -> bool:
        """Does this memory keep glm5-next's k-pool layout (an indexer cache and ``indexer_kpool`` > 0)."""
        return self.idx is not None and self.hparams.indexer_kpool > 0

    def _kpool_update(self) -> KPoolLayout:
        assert self.idx is not None
        if self.kpool_layout is None:
            self.kpool_layout = KPoolLayout()
        self.kpool_layout.update(self.idx, self.hparams.indexer_kpool, self.stale)
        return self.kpool_layout

    # --- sequence operations -------------------------------------------------------------------------------

    def clear(self, data: bool = True) -> None:
        """Clear the three caches (zeroing their buffers too when ``data``)."""
        super().clear(data)
        if self.idx is not None:
            self.idx.clear(data)
            self._stale_set(-1, 0)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """The recurrent part first, which may refuse (False, nothing changed), then the indexer cache, then the
        attention part, whose answer is returned."""
        raw_p0 = as_int(p0, "p0")
        seq_id, p0, p1 = self.recr.check_op("seq_rm", seq_id, p0, p1)
        if self.recr.seq_rm_refused(seq_id, p0, p1):
            return False
        self.attn.check_op("seq_rm", seq_id, p0, p1)
        self.recr.seq_rm(seq_id, p0, p1)
        if self.idx is not None:
            stale = self._stale_pos(seq_id, raw_p0)
            self.idx.seq_rm(seq_id, p0, p1)
            self._stale_set(seq_id, stale)
            self._stale_shared()
        return bool(self.attn.seq_rm(seq_id, p0, p1))

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """seq_cp on the attention and recurrent parts, then on the indexer cache."""
        seq_id_src, seq_id_dst, p0, p1 = self.check_op("seq_cp", seq_id_src, seq_id_dst, p0, p1)
        super().seq_cp(seq_id_src, seq_id_dst, p0, p1)
        if self.idx is not None:
            self.idx.seq_cp(seq_id_src, seq_id_dst, p0, p1)
            self._stale_set(seq_id_src, 0)
            self._stale_set(seq_id_dst, 0)

    def seq_keep(self, seq_id: int) -> None:
        """seq_keep on the attention and recurrent parts, then on the indexer cache."""
        (seq_id,) = self.check_op("seq_keep", seq_id)
        super().seq_keep(seq_id)
        if self.idx is not None:
            self.idx.seq_keep(seq_id)
            self._stale_set(-1, 0)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """seq_add on the attention and recurrent parts, then on the indexer cache."""
        raw_p0 = as_int(p0, "p0")
        seq_id, p0, p1, shift = self.check_op("seq_add", seq_id, p0, p1, shift)
        super().seq_add(seq_id, p0, p1, shift)
        if self.idx is not None:
            # a negative shift moves the cells below p0, so they regroup as well
            # (an int32 sum in llama.cpp: it may wrap)
            stale = self._stale_pos(seq_id, (raw_p0 + shift + 2**31) % 2**32 - 2**31 if shift < 0 else raw_p0)
            self.idx.seq_add(seq_id, p0, p1, shift)
            self._stale_set(seq_id, stale)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """seq_div on the attention and recurrent parts, then on the indexer cache."""
        seq_id, p0, p1, d = self.check_op("seq_div", seq_id, p0, p1, d)
        super().seq_div(seq_id, p0, p1, d)
        if self.idx is not None:
            self.idx.seq_div(seq_id, p0, p1, d)
            self._stale_set(seq_id, 0)

    # --- batches -------------------------------------------------------------------------------------------

    def update(self, **kw: Unpack[YarnParams]) -> bool:
        """Apply the pending updates of the three caches (the indexer's K-shift only resets the cells' shifts: its
        keys are not roped); returns the attention part's result."""
        res = super().update(**kw)
        if self.idx is not None:
            self.idx.update()
            if res and self.kpool_track():
                self._kpool_update()  # llama_context::memory_update reserves a graph on a full context: init_full
        return res

    def init_batch(
        self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False
    ) -> list[tuple[UBatch, SlotInfo | ISWASlot]]:
        """llama_memory_hybrid_idx::init_batch: the hybrid split and prepare (the indexer takes the attention
        slots)."""
        out = super().init_batch(balloc, n_ubatch, embd_all)
        self._stale_batch = list(self.stale)  # mem_idx_stale_batch: what the first ubatch must re-pool
        self._i_cur = 0
        return out

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, HybridSlot], None] | None = None,
    ) -> list[tuple[UBatch, HybridSlot]]:
        """What llama_decode does to the memory (`kvref.memory.base.decode_batch`). With QSA, a decode llama.cpp dies in
        (set_input_qsa's assert on a cell past the block window) is refused first, before the memory update: the
        update changes no cell, so the same ubatches land in the same cells."""
        if self.qsa_ratios() and self._qsa_may_abort(batch):
            self._check_qsa(batch, n_ubatch, embd_all)
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _qsa_may_abort(self, batch: Batch) -> bool:
        """False when no cell can end up past its block window: every position (the cells' and the batch's) below the
        smallest n_kv the indexer cache can have (its padding), so that the dry run can be skipped."""
        idx = self.idx
        assert idx is not None
        floor = min(idx.get_size(), max(idx.n_pad, idx.profile.get_n_kv_pad))
        top = max((int(np.max(c.pos)) for c in idx._cells), default=-1)
        try:
            pos = None if batch.pos is None else np.asarray(batch.pos, dtype=np.int64)
            n = int(batch.n_tokens)
        except (TypeError, ValueError, KVRefError):
            return True  # a malformed batch: decode_batch's checks say what is wrong
        last = (top + n) if pos is None or pos.size == 0 else int(pos.max())
        return max(top, last) >= floor

    def _check_qsa(self, batch: Batch, n_ubatch: int, embd_all: bool) -> None:
        from .base import check_decode, decode_seq_bound
        from .batch import BatchAllocr
        from .qsa import qsa_aborts

        assert self.idx is not None
        n_ubatch = as_int(n_ubatch, "n_ubatch")
        if n_ubatch < 1:
            return  # decode_batch refuses it
        balloc = BatchAllocr(self.hparams.n_pos_per_embd())
        n_seq_max = decode_seq_bound(self.profile, self.kv_unified, self._decode_n_seq_max())
        balloc.init(batch, memory=self, n_seq_max=n_seq_max, output_all=embd_all)
        check_decode(self, balloc)
        attn = cast(KVCache, self.attn)
        heads = list(attn.heads)  # prepare leaves the heads where its trial placements moved them: a dry run must not
        try:
            placed = HybridMemory.init_batch(self, balloc, n_ubatch, embd_all)
        except NoSlotError:
            return  # llama_decode returns 1 after its memory update: decode_batch says so
        finally:
            attn.heads[:] = heads
        trial = self.idx.fork()
        for ub, aslot in placed:
            sinfo = cast("SlotInfo", aslot)
            trial.apply_ubatch(sinfo, ub)
            for r in self.qsa_ratios():
                why = qsa_aborts(trial, ub, sinfo, r)
                if why is not None:
                    raise KVRefError(why)

    def qsa_ratios(self) -> list[int]:
        """The distinct QSA block ratios of the attention layers (qwen4exp; the layers sharing a ratio share one set
        of inputs), in layer order; [] without an indexer cache."""
        if self.idx is None:
            return []
        out: list[int] = []
        ratios = self.hparams.dsv4_compress_ratios
        for layer in cast(KVCache, self.attn).layers:
            r = ratios[layer.il] if layer.il < len(ratios) else 0
            if r > 0 and r not in out:
                out.append(r)
        return out

    _stale_batch: list[int]
    _i_cur = 0

    def _apply(self, aslot: SlotInfo | ISWASlot, ubatch: UBatch) -> HybridSlot:
        # llama_memory_hybrid_idx_context::apply: attention, recurrent, then the indexer in the attention's cells
        slot = super()._apply(aslot, ubatch)
        if self.idx is not None:
            self.idx.apply_ubatch(cast("SlotInfo", aslot), ubatch)
            if self.kpool_track():
                # extend the layout with the ubatch's cells, then pick what it must re-pool
                lay = self._kpool_update()
                stale = self._stale_batch if self._i_cur == 0 else None
                self.kpool_state = kpool_build_state(lay, ubatch, self.hparams.indexer_kpool, stale)
            if self._i_cur == 0:
                # next() after the first ubatch clears the staleness (the batch keeps its own copy)
                self.stale = [POS_CLEAN] * LLAMA_MAX_SEQ
        self._i_cur += 1
        return slot

    # --- state ---------------------------------------------------------------------------------------------

    def _state_parts(self, flags: int) -> Sequence[MemoryPart[object]]:
        if flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
            return [self.recr]
        return [self.attn, self.recr] + ([] if self.idx is None else [self.idx])

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Stage the sections one after the other; the indexer section must hold, stream by stream, as many cells as
        the attention section (its restore takes the attention cache's cells). Changes nothing."""
        seq_id, flags = as_state_args(seq_id, flags)
        parts = self._state_parts(flags)
        if len(parts) < 3:
            return stage_parts(parts, data, seq_id, flags, offset)
        commit_a, end_a = parts[0].stage_state(data, seq_id, flags, offset)
        commit_r, end_r = parts[1].stage_state(data, seq_id, flags, end_a)
        commit_i, end_i = parts[2].stage_state(data, seq_id, flags, end_r)
        self._check_mirror(data, seq_id, offset, end_r)

        def commit() -> None:
            commit_a()
            commit_r()
            commit_i()
            if self.idx is not None:
                self._stale_set(seq_id, 0)
                self._stale_shared()

        return commit, end_i

    def _check_mirror(self, data: Buffer, seq_id: int, at_attn: int, at_idx: int) -> None:
        """llama_kv_cache::state_read_sinfo with the attention cache's slots: per stream the same cell count."""
        from ..state import read_kv_section
        from . import kv_state

        assert self.idx is not None
        attn = cast(KVCache, self.attn)
        sec_a, _ = read_kv_section(data, kv_state.spec(attn), seq_id=seq_id, offset=at_attn, _shared_empty=True)
        sec_i, _ = read_kv_section(data, kv_state.spec(self.idx), seq_id=seq_id, offset=at_idx, _shared_empty=True)
        for s, (a, i) in enumerate(zip(sec_a.streams, sec_i.streams, strict=True)):
            if a.cell_count != i.cell_count:
                raise FormatError(
                    f"stream {s}: the indexer section restores {i.cell_count} cells, the attention section "
                    f"{a.cell_count} (llama.cpp: the mirrored slot layout does not match)",
                    field="cell_count",
                    offset=at_idx,
                )

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore the sections; a failure leaves the memory untouched, or with ``atomic=False`` as llama.cpp
        leaves it: the sequence dropped from the three caches (everything cleared for seq_id -1)."""
        seq_id, flags = as_state_args(seq_id, flags)
        try:
            commit, end = self.stage_state(data, seq_id, flags, 0)
            total = memoryview(data).nbytes
            if end != total:
                raise FormatError(
                    f"{total - end} trailing bytes after the memory sections", field="trailing", offset=end
                )
        except SequenceError:
            raise  # an id the caches cannot hold: llama.cpp asserts (GGML_ASSERT in state_read_sinfo) and dies
        except KVRefError:
            if not atomic:
                self.state_drop(seq_id)
            raise
        commit()
        return end

    def state_drop(self, seq_id: int) -> None:
        """llama_memory_hybrid_idx::state_drop: forget ``seq_id`` in the three caches (everything when < 0)."""
        seq_id = as_seq_id(seq_id)
        if seq_id < 0:
            self.clear(True)
            return
        clear_seq(self.attn, seq_id)
        if not self.recr.seq_rm_refused(seq_id, -1, -1):
            self.recr.seq_rm(seq_id, -1, -1)
        if self.idx is not None:
            clear_seq(self.idx, seq_id)
            self._stale_set(seq_id, 0)
            self._stale_shared()

    # --- graph inputs --------------------------------------------------------------------------------------

    def graph_input(
        self, tensor: str, ub: UBatch, slot: object, *, swa: bool, f16: bool, causal: bool | None
    ) -> npt.NDArray[np.generic[object]] | None:
        """The graph inputs only this memory feeds: ``k_idxs_idx`` (the indexer cache's K row indices) and qwen4exp's
        QSA inputs ``qsa_cell_blk``, ``qsa_blk_cells``, ``qsa_blk_pos`` and ``kq_mask_qsa_bias`` (for the first layer
        with a compress ratio: the layers sharing a ratio share one input set). None for any other name."""
        if self.idx is None or swa:
            return None
        hslot = cast(HybridSlot, slot)
        sinfo = cast("SlotInfo", hslot.attn)
        if tensor == "k_idxs_idx":
            return np.asarray(self.idx.k_idxs(ub, sinfo), dtype=np.int64).reshape(-1)
        if tensor.startswith("kpool_") or tensor.startswith("kq_mask_kpool_"):
            return self._kpool_input(tensor, ub, sinfo, f16)
        if tensor.startswith("qsa_") or tensor == "kq_mask_qsa_bias":
            from .qsa import qsa_inputs

            ratios = self.qsa_ratios()
            if not ratios:
                return None
            if causal is None:
                causal = self.hparams.causal_attn
            got = qsa_inputs(self.idx, ub, sinfo, ratios[0], blk_bias=True, causal=causal)
            name = tensor.removeprefix("qsa_").removeprefix("kq_mask_qsa_")
            return got[name] if name == "bias" else got[name].reshape(-1)
        return None

    def _kpool_input(
        self, tensor: str, ub: UBatch, sinfo: SlotInfo, f16: bool
    ) -> npt.NDArray[np.generic[object]] | None:
        """glm5-next's k-pool inputs of the ubatch just placed (set_input_kpool)."""
        lay, st, idx = self.kpool_layout, self.kpool_state, self.idx
        if lay is None or st is None or idx is None:
            return None
        hp = self.hparams
        kpool = hp.indexer_kpool
        n_sel, gather = kpool_select(
            kpool_pad(st.n_pool_real), idx.get_n_kv(sinfo), int(ub.n_tokens), hp.indexer_top_k, kpool,
            hp.indexer_kpool_select_tail,
        )  # fmt: skip
        got = kpool_inputs(idx, lay, st, ub, sinfo, kpool, n_sel, gather, f16)
        name = tensor.removeprefix("kq_mask_kpool_").removeprefix("kpool_")
        name = {"pool": "pool_mask", "gather": "gather_mask"}.get(name, name)
        if name not in got:
            return None
        a = got[name]
        return a.reshape(1, *a.shape) if a.ndim == 2 else a

    def __repr__(self) -> str:
        return f"HybridIdxMemory(attn={self.attn!r}, recr={self.recr!r}, idx={self.idx!r})"


__all__ = ["POS_CLEAN", "HybridIdxMemory", "idx_hparams"]
