"""glm5-next's k-pool DSA indexer inputs: llama_memory_hybrid_idx's ``kpool_layout`` and
``llama_memory_hybrid_idx_context::set_input_kpool``.

The indexer cache holds per token its key | gate | pooled value. Per sequence, runs of ``kpool`` consecutive
positions counted from the sequence's first position form pools; a pool's pooled key lives in its last member's
row. The layout (`KPoolLayout`) belongs to the memory and outlives a batch: a ubatch only appends to it, a sequence
edit makes it stale from some position on (`HybridIdxMemory.stale`), which regroups that sequence. Per ubatch,
`KPoolState` says which pools must be (re)pooled: those a stale edit reached (first ubatch of a batch only) and those
the ubatch's tokens fall in; when a cell is shared by several sequences (``cache_safe`` false) every pool is.

The graph inputs (`kpool_inputs`), in the graph's pool order (sequence by sequence, then by position):
``pool_cells`` (the row holding each pool's pooled key), ``pool_idxs`` (the member cells of each pool; padded pools
on the sentinel), ``pool_mask`` (0 where a pool is visible to the token: its sequence's, ending at or before it),
``tail_idxs`` (the token's incomplete tail: its last ``kpool - 1`` positions), ``gather_mask`` (0 for the live
selection slots), ``new_pool_idxs`` / ``new_pool_rep`` (the pools re-pooled by this ubatch, at least one).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..constants import LLAMA_MAX_SEQ
from ..errors import KVRefError

if TYPE_CHECKING:
    import numpy.typing as npt

    from .batch import UBatch
    from .kv_cache import KVCache
    from .slots import SlotInfo

POS_CLEAN = 2**31 - 1
MAX_UB_GATHER = 16  # build_inp_kpool: small ubatches gather the selected latents


def _i32(x: int) -> int:
    """``x`` as llama.cpp's int32 arithmetic leaves it (a position near INT32_MAX plus the pool size wraps)."""
    return (x + 2**31) % 2**32 - 2**31


def _lower_bound(n: int, before: Callable[[int], bool]) -> int:
    """std::lower_bound's binary search over indices [0, n) with ``before(i)`` = comp(element i, value): its answer
    also where the predicate does not partition the range (an int32 wrap can break the order)."""
    first, length = 0, n
    while length > 0:
        half = length >> 1
        if before(first + half):
            first += half + 1
            length -= half + 1
        else:
            length = half
    return first


def _upper_bound(n: int, after: Callable[[int], bool]) -> int:
    """std::upper_bound's binary search over indices [0, n) with ``after(i)`` = comp(value, element i)."""
    first, length = 0, n
    while length > 0:
        half = length >> 1
        if after(first + half):
            length = half
        else:
            first += half + 1
            length -= half + 1
    return first


def kpool_pad(n_pool: int) -> int:
    """The padded pool count: at least 64, a multiple of 64, the last pool always unused."""
    return max(64, (n_pool + 1 + 63) // 64 * 64)


@dataclass
class KPoolSeq:
    """llama_memory_hybrid_idx::kpool_layout::seq."""

    pos_min: int = 0
    strm: int = 0
    cells: list[tuple[int, int]] = field(default_factory=list)  # (pos, stream-local cell), by position
    pools: list[int] = field(default_factory=list)  # index into ``cells`` of each pool's first member
    j_next: int = 0  # where the pool scan stopped
    shared: bool = False  # a cell also carries another sequence


class KPoolLayout:
    """llama_memory_hybrid_idx::kpool_layout and kpool_layout_update."""

    def __init__(self) -> None:
        self.seqs = [KPoolSeq() for _ in range(LLAMA_MAX_SEQ)]
        self.n_pool_real = 0
        self.cache_safe = True

    def update(self, idx: KVCache, kpool: int, stale: list[int]) -> None:
        """Extend the layout with the cells appended since, rebuilding the stale sequences."""
        n_stream = idx.get_n_stream()
        unified = n_stream == 1
        self.n_pool_real = 0
        self.cache_safe = True
        for s in range(LLAMA_MAX_SEQ):
            if not unified and s >= n_stream:
                self.seqs[s] = KPoolSeq()
                continue
            sq = self.seqs[s]
            cells = idx.get_cells(0 if unified else s)
            if not sq.cells and cells.seq_pos_min(s) < 0:
                continue  # empty before and after: nothing to group (a later cell rebuilds it from scratch)
            sp = cells.seq_pos_get(s)
            sq.strm = 0 if unified else idx.get_stream(s)
            n_kept = 0
            if stale[s] == POS_CLEAN and sq.cells and sp and sq.pos_min == sp[0][0]:
                n_kept = len(sq.cells)
                sq.cells.extend(sp[bisect.bisect_right(sp, sq.cells[-1]) :])
            if len(sq.cells) != len(sp) or stale[s] != POS_CLEAN:
                sq.cells = list(sp)
                sq.pools = []
                sq.j_next = 0
                sq.shared = False
                sq.pos_min = sp[0][0] if sp else 0
                n_kept = 0
            arr = np.asarray(sq.cells, np.int64).reshape(-1, 2)
            if unified and not sq.shared and len(arr) > n_kept:
                w = np.asarray(cells.seq)[arr[n_kept:, 1]]  # a cell with more than one sequence bit
                sq.shared = bool(((w & (w - np.uint64(1))) != 0).any() or ((w != 0).sum(axis=1) > 1).any())
            sq.j_next = self._scan(sq, arr[:, 0], kpool)
            self.n_pool_real += len(sq.pools)
            self.cache_safe = self.cache_safe and not sq.shared

    @staticmethod
    def _scan(sq: KPoolSeq, cpos: npt.NDArray[np.int64], kpool: int) -> int:
        """The pool scan from ``sq.j_next``: a cell starts a pool when its position is aligned on ``kpool`` from
        the sequence's first and the next ``kpool - 1`` cells hold the next positions (int32 arithmetic); the scan
        then skips the pool's cells, else the next cell. Returns where it stopped, having appended the pools."""
        j0, n = sq.j_next, len(cpos)
        if j0 + kpool > n:
            return j0
        starts = np.arange(j0, n - kpool + 1)
        p0 = cpos[starts]
        ok = (p0 - sq.pos_min) % kpool == 0  # Python's modulo, as the scalar scan
        for k in range(1, kpool):
            ok &= cpos[starts + k] == (p0 + k + 2**31) % 2**32 - 2**31
        j = j0
        for c in starts[ok].tolist():  # the greedy walk, over the candidates only
            if c >= j:
                sq.pools.append(c)
                j = c + kpool
        return max(j, n - kpool + 1)


@dataclass
class KPoolState:
    """llama_memory_hybrid_idx_context::kpool_state: the pools (global indices, layout order) this ubatch re-pools."""

    n_pool_real: int = 0
    cache_safe: bool = True
    new: list[bool] = field(default_factory=list)

    @property
    def n_new(self) -> int:
        return sum(self.new)


def kpool_build_state(lay: KPoolLayout, ub: UBatch, kpool: int, stale_from: list[int] | None) -> KPoolState:
    """kpool_build_state for ubatch ``ub``; ``stale_from``: the batch's stale positions (first ubatch only)."""
    st = KPoolState(lay.n_pool_real, lay.cache_safe, [False] * lay.n_pool_real)
    if not st.cache_safe:
        st.new = [True] * lay.n_pool_real
        return st
    start = []
    ip = 0
    for s in range(LLAMA_MAX_SEQ):
        sq = lay.seqs[s]
        start.append(ip)
        ip += len(sq.pools)
        p = POS_CLEAN if stale_from is None else stale_from[s]
        if p == POS_CLEAN:
            continue
        # the first pool that ends after the stale position, and every later one (int32 ends: one may wrap)
        ends = [_i32(sq.cells[j][0] + kpool) for j in sq.pools]

        def ends_before(k: int, ends: list[int] = ends, p: int = p) -> bool:
            return ends[k] <= p

        first = _lower_bound(len(ends), ends_before)
        for k in range(first, len(sq.pools)):
            st.new[start[s] + k] = True
    # every pool a token falls in: per sequence, the last pool starting at or before the token (the pools' first
    # positions ascend), if the token lies before its int32 end
    pos = np.asarray(ub.pos)
    tok = np.fromiter((i for i, ids in enumerate(ub.seq_id) for _ in ids), np.int64)
    sid = np.fromiter((s for ids in ub.seq_id for s in ids), np.int64)
    new = np.asarray(st.new, bool)
    for s in np.unique(sid).tolist():
        sq = lay.seqs[s]
        if not sq.pools:
            continue
        firsts = np.asarray(sq.cells, np.int64).reshape(-1, 2)[np.asarray(sq.pools, np.int64), 0]
        p = pos[tok[sid == s]].astype(np.int64)
        k = np.searchsorted(firsts, p, side="right") - 1
        inside = k >= 0
        k, p = k[inside], p[inside]
        ends = (firsts[k] + kpool + 2**31) % 2**32 - 2**31
        new[start[s] + k[p < ends]] = True
    st.new = new.tolist()
    return st


def kpool_inputs(
    idx: KVCache, lay: KPoolLayout, st: KPoolState, ub: UBatch, sinfo: SlotInfo, kpool: int, n_sel: int, gather: bool,
    f16: bool,
) -> dict[str, npt.NDArray[np.generic[object]]]:  # fmt: skip
    """set_input_kpool: ``pool_cells``, ``pool_idxs``, ``pool_mask`` (n_tokens, n_pool), ``tail_idxs``,
    ``gather_mask`` (n_tokens, n_sel), ``new_pool_idxs``, ``new_pool_rep`` (absent when not ``cache_safe``)."""
    n_kv = idx.get_n_kv(sinfo)
    kv_size = idx.get_size()
    n_stream_kv = idx.get_n_stream()
    n_tokens = int(ub.n_tokens)
    n_pool = kpool_pad(st.n_pool_real)
    n_new = st.n_new
    n_new_g = max(n_new, 1)
    pos = np.asarray(ub.pos)

    def cells_of(sq: KPoolSeq) -> npt.NDArray[np.int64]:
        """(n, 2): the sequence's (pos, cell) pairs, by position."""
        return np.asarray(sq.cells, np.int64).reshape(-1, 2)

    def find(sq: KPoolSeq, p: int) -> int | None:
        k = bisect.bisect_left(sq.cells, (p, 0))
        return sq.cells[k][1] if k < len(sq.cells) and sq.cells[k][0] == p else None

    seq_in_ub = {s for ids in ub.seq_id for s in ids}
    sq0 = lay.seqs[ub.seq_id[0][0]]
    c0 = find(sq0, int(pos[0]))
    if c0 is None:
        raise KVRefError("set_input_kpool: the ubatch's first token has no cell in the layout (llama.cpp asserts)")
    dummy = sq0.strm * kv_size + c0
    sentinel = dummy if gather else n_kv
    n_top = n_sel // kpool
    if not (n_sel % kpool == 0 or n_sel % kpool == kpool - 1):
        raise KVRefError(f"set_input_kpool: n_sel {n_sel} with k-pool {kpool} (llama.cpp asserts)")

    # the pools, sequence by sequence (each sequence's pools at once: members are kpool consecutive cells)
    pcell = np.zeros(n_pool, np.int64)
    pidx = np.zeros((n_pool, kpool), np.int64)
    nidx = np.zeros((n_new_g, kpool), np.int64)
    nrep = np.zeros(n_new_g, np.int64)
    new = np.asarray(st.new, bool)
    seq_start = [0] * LLAMA_MAX_SEQ
    seq_cells: dict[int, npt.NDArray[np.int64]] = {}
    ends: list[npt.NDArray[np.int64]] = []
    n_real = i_new = 0
    for s in range(LLAMA_MAX_SEQ):
        sq = lay.seqs[s]
        seq_start[s] = n_real
        if not sq.pools:
            continue
        cs = seq_cells[s] = cells_of(sq)
        m = len(sq.pools)
        if n_real + m >= n_pool:
            raise KVRefError("set_input_kpool: more pools than the padded count (llama.cpp asserts)")
        at = np.asarray(sq.pools, np.int64)[:, None] + np.arange(kpool)
        members = cs[at, 1]  # (m, kpool) stream-local cells
        g_members = sq.strm * kv_size + members
        sl = slice(n_real, n_real + m)
        pcell[sl] = g_members[:, -1]
        if not gather and n_stream_kv > 1 and s not in seq_in_ub:
            pidx[sl] = sentinel  # inert: another stream's sequence
        else:
            pidx[sl] = g_members if gather else members
        fresh = new[sl]
        k_new = int(fresh.sum())
        nidx[i_new : i_new + k_new] = g_members[fresh]
        nrep[i_new : i_new + k_new] = g_members[fresh, -1]
        i_new += k_new
        ends.append(cs[at[:, -1], 0])
        n_real += m
    if n_new == 0:
        nidx[0] = dummy
        nrep[0] = dummy
    pool_end = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    pcell[n_real:] = dummy
    pidx[n_real:] = sentinel

    # per token, sequence by sequence: the visible pools (those ending at or before it) and its tail cells
    mask = np.full((n_tokens, n_pool), -np.inf, np.float32)
    gm = np.full((n_tokens, n_sel), -np.inf, np.float32)
    tidx = np.full((n_tokens, kpool - 1), sentinel, np.int64)
    seq_of = np.fromiter((ids[0] for ids in ub.seq_id), np.int64, n_tokens)
    tok_pos = pos[:n_tokens].astype(np.int64)
    cols = np.arange(n_pool)
    gcols = np.arange(n_sel)
    for s in np.unique(seq_of).tolist():
        sq = lay.seqs[s]
        rows = np.flatnonzero(seq_of == s)
        p = tok_pos[rows]
        p0 = seq_start[s]
        nv = np.searchsorted(pool_end[p0 : p0 + len(sq.pools)], p, side="right")
        mask[rows] = np.where((cols >= p0) & (cols < p0 + nv[:, None]), np.float32(0.0), np.float32(-np.inf))
        nvc = np.minimum(nv, n_top)
        gm[rows] = np.where(gcols < (nvc * kpool)[:, None], np.float32(0.0), gm[rows])
        v = (p - sq.pos_min + 1 + 2**31) % 2**32 - 2**31  # int32 arithmetic
        n_tail = (np.abs(v) % kpool * np.where(v >= 0, 1, -1)) & 0xFFFFFFFF  # C's remainder, as uint32
        cs = seq_cells[s] if s in seq_cells else cells_of(sq)
        for k in range(kpool - 1):  # kpool - 1 tail slots, each for all the sequence's tokens at once
            want = p - k
            at = np.searchsorted(cs[:, 0], want, side="left")
            ok = at < len(cs)
            hit = np.zeros(len(rows), bool)
            hit[ok] = cs[at[ok], 0] == want[ok]
            real = hit & (k < n_tail)
            c = cs[np.minimum(at, max(len(cs) - 1, 0)), 1] if len(cs) else np.zeros(len(rows), np.int64)
            tidx[rows, k] = np.where(real, sq.strm * kv_size + c if gather else c, sentinel)
            if n_sel % kpool:
                gm[rows, n_top * kpool + k] = np.where(real, np.float32(0.0), np.float32(-np.inf))
    out: dict[str, npt.NDArray[np.generic[object]]] = {
        "pool_cells": pcell.astype(np.int32),
        "pool_idxs": pidx.astype(np.int32).reshape(-1),
        "pool_mask": mask.astype(np.float16) if f16 else mask,
        "tail_idxs": tidx.astype(np.int32).reshape(-1),
        "gather_mask": gm,
        "new_pool_idxs": nidx.astype(np.int32).reshape(-1),
    }
    if st.cache_safe:
        out["new_pool_rep"] = nrep
    return out


def kpool_select(n_pool: int, n_kv: int, n_tokens: int, top_k: int, kpool: int, select_tail: bool) -> tuple[int, bool]:
    """build_inp_kpool's ``n_sel`` (selection slots per token) and ``gather`` (small ubatches gather the selected
    latents when the cache holds more cells than that)."""
    n_top = min(n_pool, top_k // kpool)
    n_sel = kpool * n_top + (kpool - 1 if select_tail else 0)
    return n_sel, n_tokens <= MAX_UB_GATHER and n_kv > n_sel


__all__ = ["KPoolLayout", "KPoolSeq", "KPoolState", "kpool_build_state", "kpool_inputs", "kpool_pad", "kpool_select"]
