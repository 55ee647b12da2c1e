"""MiniMax-M3 sparse attention (MSA): llama.cpp's ``llama_kv_cache_msa`` (src/llama-kv-cache-msa.*).

Two KVCache objects driven together, like an iSWA pair but without a window: ``base`` holds the K/V of every
attention layer; ``idx`` the MSA indexer's keys of the sparse layers (``il >= n_layer_dense_lead``), one key head of
``indexer_head_size`` per cell. llama.cpp builds the indexer cache from a copy of the model's hyper-parameters with
one KV head per layer and that key length; the value length is left alone, so the indexer cache also allocates
(and saves) V rows of ``n_embd_head_v``, which nothing ever writes. Every ubatch is placed in both caches (same
size, same operations: their cells stay identical); sequence operations go to both; positions are the base cache's;
the state is the base section followed by the indexer section, and restoring reads them in that order (a failing
indexer section leaves the base section restored, as llama.cpp).

The graph inputs beyond the base cache's (``kq_mask``, ``k_idxs``, ``v_idxs``) are the indexer cache's row indices
(``k_idxs_idx``) and, when the model runs MSA (flash attention on, and one sequence or one stream per sequence), the
position <-> cell maps of llm_graph_input_msa (src/models/minimax-m3.cpp), computed by `graph_input`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from ..args import as_state_args
from ..errors import KVRefError, NoSlotError
from ..ggml.types import GGMLType
from ..hparams import HParams, SWAType, is_masked_swa
from ..profile import DEFAULT, Profile, resolve
from .base import (
    ContextParams,
    check_decode,
    decode_batch,
    decode_seq_bound,
    over_n_batch,
    read_parts,
    store_rows,
)
from .batch import BatchAllocr, UBatch
from .cache_pair import CachePair
from .kv_cache import KVCache
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .batch import Batch

MSA_POS_PAD = 256  # llama_kv_cache_msa_context::get_n_pos pads to at least this
MSA_LOCAL_BIAS = np.float32(1e30)  # what the local-force bias puts on a token's own (and preceding local) blocks


class MSASlot(NamedTuple):
    """Where one ubatch landed in each cache (the same cells in both)."""

    base: SlotInfo
    idx: SlotInfo


def indexer_hparams(hparams: HParams) -> HParams:
    """llama_kv_cache_msa's ``hparams_idx``: the model's, with one KV head per layer and the indexer key length as the
    (full-attention) key head size; everything else (value length, RoPE) as the model's."""
    return dataclasses.replace(hparams, n_head_kv=1, n_embd_head_k=hparams.indexer_head_size)


class KVCacheMSA(CachePair[MSASlot, MSASlot]):
    """llama_kv_cache_msa. ``kv_size`` is the size of both caches (llama.cpp passes ``n_ctx_seq``)."""

    kind = "msa"

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
        layer_filter: Callable[[int], bool] | None = None,
        layer_filter_idx: Callable[[int], bool] | None = None,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        if hparams.indexer_head_size <= 0:
            raise KVRefError("an MSA cache needs hparams.indexer_head_size > 0 (the indexer key length)")
        self.hparams = hparams
        self.hparams_idx = indexer_hparams(hparams)
        self.kv_unified = bool(kv_unified)
        self.cparams = cparams
        self.profile = resolve(compat)
        self.n_seq_max = int(n_seq_max)
        self.n_pad = int(n_pad)
        self.n_swa = int(n_swa)
        self.swa_type = SWAType(int(swa_type))
        if layer_filter_idx is None:
            n_dense = hparams.n_layer_dense_lead

            def layer_filter_idx(il: int) -> bool:
                return il >= n_dense  # create_memory's filter_idx: the sparse layers

        common = dict(
            type_k=type_k, type_v=type_v, v_trans=v_trans, kv_unified=kv_unified, kv_size=kv_size,
            n_seq_max=n_seq_max, n_pad=n_pad, n_swa=n_swa, swa_type=swa_type, compat=self.profile,
        )  # fmt: skip
        self.base = KVCache(hparams, layer_filter=layer_filter, **common)  # type: ignore[arg-type]
        self.idx = KVCache(self.hparams_idx, layer_filter=layer_filter_idx, **common)  # type: ignore[arg-type]

    @property
    def parts(self) -> list[KVCache]:
        """The two caches, ``[base, idx]``."""
        return self._pair()

    def _pair(self) -> list[KVCache]:
        return [self.base, self.idx]

    def _slot(self, *slots: object) -> MSASlot:
        return MSASlot(*slots)  # type: ignore[arg-type]  # one slot per cache, in the parts' order

    # --- sizes ---------------------------------------------------------------------------------------------

    def attention_cache(self, sinfo: MSASlot | None = None, *, swa: bool = False) -> tuple[KVCache, SlotInfo | None]:
        """The cache the KQ mask is built over, with its part of ``sinfo``: the base cache (it has no SWA cache)."""
        if swa:
            raise KVRefError("swa=True: an MSA memory has no SWA cache")
        return self.base, None if sinfo is None else sinfo.base

    def get_base(self) -> KVCache:
        """The K/V cache (llama_kv_cache_msa::get_base)."""
        return self.base

    def get_idx(self) -> KVCache:
        """The indexer key cache (llama_kv_cache_msa::get_idx)."""
        return self.idx

    # --- sequence operations -------------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_kv_cache_msa::seq_pos_min: the base cache's."""
        return self.base.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_kv_cache_msa::seq_pos_max: the base cache's."""
        return self.base.seq_pos_max(seq_id)

    # --- batches -------------------------------------------------------------------------------------------

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, MSASlot]]:
        """llama_kv_cache_msa::init_batch: one split only, simple with one stream, else equal (sequential); it
        must fit in both caches."""
        several = self.get_n_stream() != 1
        ubatches = balloc.split_whole("equal" if several else "simple", n_ubatch, sequential=several)
        slots = self.prepare(ubatches) if ubatches is not None else []
        if not slots or ubatches is None:
            raise NoSlotError("the batch does not fit in the MSA caches (failed to prepare)")
        return list(zip(ubatches, slots, strict=True))

    def apply_ubatch(self, slot: MSASlot, ubatch: UBatch) -> None:
        """Write the ubatch into both caches at the slot's cells (base, then indexer)."""
        self.base.apply_ubatch(slot.base, ubatch)
        self.idx.apply_ubatch(slot.idx, ubatch)

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, MSASlot], None] | None = None,
    ) -> list[tuple[UBatch, MSASlot]]:
        """What llama_decode does to the memory (`decode_batch`); ``k`` / ``v`` rows go to the base cache. The
        common one-stream step is planned in both caches and written only when both plans hold (as
        `kvref.memory.kv_cache_iswa.KVCacheISWA.decode`)."""
        if self.msa_enabled() and batch.n_tokens > 1:
            # a batch graph of MSA may abort in llama.cpp: checked on the ubatches before anything changes
            balloc = self._check_msa_batch(batch, n_ubatch, balloc, embd_all)
        elif balloc is None and not embd_all and self.base.n_stream == 1 and not over_n_batch(self.cparams, batch):
            step = self._decode_single(batch, n_ubatch)
            if step is not None:
                ub, slot = step
                if k or v or on_ubatch is not None:
                    store_rows(self, ub, slot, k, v, on_ubatch)
                return [(ub, slot)]
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _check_msa_batch(self, batch: Batch, n_ubatch: int, balloc: BatchAllocr | None, embd_all: bool) -> BatchAllocr:
        """What llama.cpp's MSA batch graph (a ubatch of more than one token per stream) aborts on, refused before
        the memory changes: its cell -> position block map (set_input_cell_pos, C division) is a row index of a
        GET_ROWS, so a cell of the stream's sequence at a position <= -indexer_block_size (block < 0) fails
        ``GGML_ASSERT(i01 >= 0 && i01 < ne01)`` (ggml-cpu ops.cpp). The batch is validated and split as decode does
        (its errors first, in llama.cpp's order); the allocator is returned for decode to use."""
        if balloc is None:
            balloc = BatchAllocr(self.hparams.n_pos_per_embd())
        n_seq_max = decode_seq_bound(self.profile, self.kv_unified, self._decode_n_seq_max())
        balloc.init(batch, memory=self, n_seq_max=n_seq_max, output_all=embd_all)
        check_decode(self, balloc)
        several = self.get_n_stream() != 1
        ubatches = balloc.split_whole("equal" if several else "simple", n_ubatch, sequential=several) or []
        balloc.split_reset()
        blk = self.hparams.indexer_block_size
        lowest: dict[int, int] = {}  # per sequence, its lowest position among the cells and the tokens so far
        for ub in ubatches:
            pos = np.asarray(ub.pos[: ub.n_tokens]).astype(np.int64)
            seq_of = self._token_seqs(ub)
            for s in np.unique(seq_of).tolist():
                if s not in lowest:
                    cpos, has = self._seq_cells(s)
                    lowest[s] = int(cpos[has].min()) if has.any() else 0
                lowest[s] = min(lowest[s], int(pos[seq_of == s].min()))
            n_stream = int(np.unique(np.asarray(self.base.seq_to_stream)[seq_of]).size)
            if ub.n_tokens // max(n_stream, 1) <= 1:
                continue  # a decode graph (one token per stream): no cell -> block map
            for s in self._stream_seqs(ub, n_stream):
                if -(-lowest[s] // blk) < 0:  # C division toward zero: pos / blk < 0
                    raise KVRefError(
                        f"sequence {s} holds position {lowest[s]} <= -{blk} (indexer_block_size): the MSA batch "
                        "graph's cell -> block map gets a negative row index and llama.cpp aborts "
                        "(GGML_ASSERT(i01 >= 0 && i01 < ne01) in ggml-cpu's get_rows)"
                    )
        return balloc

    def _decode_single(self, batch: Batch, n_ubatch: int) -> tuple[UBatch, MSASlot] | None:
        """The common step in both caches (see `KVCacheISWA._decode_single`); None, with nothing changed, when
        either plan does not hold."""
        plan_b = self.base._single(batch, n_ubatch, False)
        if plan_b is None:
            return None
        plan_i = self.idx._single(batch, n_ubatch, False)
        if plan_i is None or (batch.pos is None and plan_b[1].tobytes() != plan_i[1].tobytes()):
            return None
        logits: npt.NDArray[np.bool_] | None = batch.logits  # type: ignore[assignment]  # _single checked it
        ub = UBatch.whole_single(plan_b[3], plan_b[1], plan_b[2], logits if logits is None else logits.copy())
        return ub, MSASlot(self.base._commit_single(plan_b), self.idx._commit_single(plan_i))

    def _decode_n_seq_max(self) -> int:
        return self.base.get_n_seq_max()

    def _apply(self, slot: MSASlot, ubatch: UBatch) -> MSASlot:
        self.apply_ubatch(slot, ubatch)
        return slot

    def _owner(self, il: int, slot: MSASlot) -> tuple[KVCache, SlotInfo]:
        return self.base, slot.base

    # --- graph inputs --------------------------------------------------------------------------------------

    def msa_enabled(self, flash_attn: bool | None = None) -> bool:
        """Does the model graph run MSA (llm_graph_input_msa and the indexer's row indices): flash attention on,
        and one sequence or one stream per sequence (a unified cache of several falls back to dense attention)."""
        fa = self.cparams.flash_attn if flash_attn is None and self.cparams is not None else bool(flash_attn)
        return fa and (self.n_seq_max == 1 or not self.kv_unified)

    def get_n_pos(self) -> int:
        """llama_kv_cache_msa_context::get_n_pos: the largest position of sequences [0, n_seq_max) plus one, padded
        to max(n_pad, 256), at least that padding (the position axis of the MSA inputs before block padding)."""
        pad = max(self.n_pad, MSA_POS_PAD)
        pos_max = max([-1, *self.base.seq_pos_max_many(range(self.n_seq_max))])
        return max(pad, -(-(pos_max + 1) // pad) * pad)

    def n_ps(self) -> int:
        """The MSA position axis: `get_n_pos` padded to whole indexer blocks."""
        blk = self.hparams.indexer_block_size
        if blk <= 0:
            raise KVRefError("hparams.indexer_block_size must be > 0 for the MSA graph inputs")
        return -(-self.get_n_pos() // blk) * blk

    def _stream_seqs(self, ub: UBatch, n_stream: int) -> list[int]:
        """The sequence of each stream group of the ubatch (``ubatch->seq_id[s * n_tps][0]``)."""
        n_tps = ub.n_tokens // n_stream
        return [int(ub.seq_id[s * n_tps][0]) for s in range(n_stream)]

    @staticmethod
    def _token_seqs(ub: UBatch) -> npt.NDArray[np.int64]:
        """Each token's first sequence (``ubatch->seq_id[i][0]``), (n_tokens,)."""
        return np.fromiter((ids[0] for ids in ub.seq_id[: ub.n_tokens]), np.int64, ub.n_tokens)

    def _seq_cells(self, seq_id: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_]]:
        """The positions of the base cells of ``seq_id``'s stream, and which of them hold ``seq_id`` (not empty: a
        cell at a negative position other than -1 is used, as llama_kv_cells::is_empty says)."""
        cells = self.base.get_cells(seq_id)
        pos = np.asarray(cells.pos)
        has = (np.asarray(cells.seq)[:, seq_id >> 6] & np.uint64(1 << (seq_id & 63))) != 0
        return pos, has & (pos != -1)

    def pos_slot(self, ub: UBatch, n_stream: int) -> npt.NDArray[np.int32]:
        """set_input_pos_slot: per stream of the ubatch, position -> the last cell holding it (0 where none);
        (n_stream, n_ps)."""
        n_ps = self.n_ps()
        out = np.zeros((n_stream, n_ps), np.int32)
        for s, seq_id in enumerate(self._stream_seqs(ub, n_stream)):
            pos, has = self._seq_cells(seq_id)
            cells = np.flatnonzero(has & (pos >= 0) & (pos < n_ps))  # llama.cpp skips p0 < 0 and p0 >= n_pos
            out[s, pos[cells]] = cells  # ascending cells: the last one of a position wins, as llama.cpp's loop
        return out

    def cell_pos_block(self, ub: UBatch, n_stream: int, n_kv: int) -> npt.NDArray[np.int32]:
        """set_input_cell_pos with div = the indexer block: per stream, cell j -> its position's block (0 for an
        empty cell or one of another sequence); (n_stream, n_kv)."""
        blk = self.hparams.indexer_block_size
        out = np.zeros((n_stream, n_kv), np.int32)
        for s, seq_id in enumerate(self._stream_seqs(ub, n_stream)):
            pos, has = self._seq_cells(seq_id)
            p, h = pos[:n_kv].astype(np.int64), has[:n_kv]
            q = np.sign(p) * (np.abs(p) // blk)  # C division (truncates toward zero)
            out[s, : len(p)] = np.where(h, q, 0)
        return out

    def pos_mask(self, ub: UBatch) -> npt.NDArray[np.float32]:
        """set_input_pos_mask: token i sees position p0 (0, else -inf) when a cell of its sequence holds p0 < n_ps,
        p0 <= its position and the window (the cache's) allows it; (1, n_tokens, n_ps). Always causal."""
        n_ps = self.n_ps()
        out = np.full((ub.n_tokens, n_ps), -np.inf, np.float32)
        ub_pos = np.asarray(ub.pos[: ub.n_tokens])
        seq_of = self._token_seqs(ub)
        for seq_id in np.unique(seq_of).tolist():
            toks = np.flatnonzero(seq_of == seq_id)
            pos, has = self._seq_cells(seq_id)
            p0 = np.unique(pos[has & (pos >= 0) & (pos < n_ps)]).astype(np.int64)
            p1 = ub_pos[toks].astype(np.int64)
            ok = p0[None, :] <= p1[:, None]
            if self.swa_type != SWAType.NONE:
                ok &= ~is_masked_swa(self.n_swa, self.swa_type, p0[None, :], p1[:, None])
            rows = out[toks]
            sub = rows[:, p0]
            sub[ok] = 0.0
            rows[:, p0] = sub
            out[toks] = rows
        return out[None]

    def local_bias(self, ub: UBatch) -> npt.NDArray[np.float32]:
        """llm_graph_input_msa's bias: token i's position block L = pos // blk and the ``indexer_local_blocks - 1``
        blocks before it get 1e30 (forced into the top-k), the others 0; (1, n_tokens, n_ps / blk)."""
        blk, local = self.hparams.indexer_block_size, self.hparams.indexer_local_blocks
        nblk = self.n_ps() // blk
        out = np.zeros((ub.n_tokens, nblk), np.float32)
        p = np.asarray(ub.pos[: ub.n_tokens]).astype(np.int64)
        big = np.sign(p) * (np.abs(p) // blk)  # C division (toward zero): positions -blk < p < 0 are block 0
        for l_ in range(local):
            b = big - l_
            ok = (b >= 0) & (b < nblk)
            out[np.flatnonzero(ok), b[ok]] = MSA_LOCAL_BIAS
        return out[None]

    def graph_input(
        self, tensor: str, ub: UBatch, slot: MSASlot | None, *, swa: bool, f16: bool, causal: bool | None
    ) -> npt.NDArray[np.float32] | npt.NDArray[np.int32] | npt.NDArray[np.int64] | None:
        """The MSA inputs llama.cpp's graph reads beyond the base cache's (None for the others):

        - ``k_idxs_idx``: the indexer cache's row indices (set_input_k_idxs);
        - ``kq_mask_msa_pos``: ``pos_mask``, position visibility per token (0 / -inf);
        - ``kq_mask_msa_bias``: the local-force bias per token and position block (0 / 1e30, a float input
          compared like a mask);
        - ``msa_pos_slot`` / ``msa_pos_slot_f``: ``pos_slot_i`` / ``pos_slot_f`` (the same map, i32 / f32);
        - ``msa_cell_blk``: ``cell_blk`` (batch graphs: more than one token per stream).
        """
        del swa, f16, causal
        if tensor == "k_idxs_idx":
            if slot is None:
                raise KVRefError("k_idxs_idx needs the ubatch's slot")
            return np.asarray(self.idx.k_idxs(ub, slot.idx), dtype=np.int64)
        if tensor not in ("kq_mask_msa_pos", "kq_mask_msa_bias", "msa_pos_slot", "msa_pos_slot_f", "msa_cell_blk"):
            return None
        base_slot = None if slot is None else slot.base
        n_stream = 1 if base_slot is None else base_slot.n_stream()
        if tensor == "kq_mask_msa_pos":
            return self.pos_mask(ub)
        if tensor == "kq_mask_msa_bias":
            return self.local_bias(ub)
        if tensor == "msa_pos_slot":
            return self.pos_slot(ub, n_stream).reshape(-1)
        if tensor == "msa_pos_slot_f":
            return self.pos_slot(ub, n_stream).astype(np.float32).reshape(-1)
        if base_slot is None:
            raise KVRefError("msa_cell_blk needs the ubatch's slot")
        return self.cell_pos_block(ub, n_stream, self.base.get_n_kv(base_slot)).reshape(-1)

    # --- state ---------------------------------------------------------------------------------------------

    def _state_parts(self, flags: int) -> list[KVCache]:
        return [self.base, self.idx]  # the flags are handed to both caches, which ignore them

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore both sections; a failure leaves both caches untouched. With ``atomic=False``, as llama.cpp: the
        base section is restored before the indexer one is read; a failing section leaves its cache as llama.cpp
        does (the sequence removed), the base cache keeps what it had read."""
        seq_id, flags = as_state_args(seq_id, flags)
        return read_parts(self._state_parts(flags), data, seq_id, flags, atomic=atomic)

    @property
    def compat(self) -> str:
        """The name of the memory's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        return f"KVCacheMSA(size={self.base.get_size()} cells, idx layers={self.idx.get_layer_ids()})"


__all__ = ["MSA_POS_PAD", "KVCacheMSA", "MSASlot", "indexer_hparams"]
