"""qwen4exp's block-sparse attention (QSA) inputs: llama_memory_hybrid_idx::set_input_qsa.

Blocks cut the position line of the indexer cache's cells: a cell at position p belongs to bucket ``p // ratio``
(within a group of cells with the same sequence set, unless the stream holds one sequence); a group whose ``ratio``
slots are all filled is a block, numbered in bucket order (the groups of one bucket newest first, as llama.cpp's
list heads them). For each stream of the ubatch:

- ``cell_blk``  int32 [n_kv]: the block of each cell; cells in no block (empty, incomplete, past the window) point
  at the spare block (``n_bid``, or the last block when every block is full);
- ``blk_cells`` int32 [ratio * n_blocks]: the cell of each slot of each block (0 elsewhere);
- ``blk_pos``   int32 [4 * n_blocks * n_stream] (section-major): each block's first position, in every section;
- ``bias``      f32 [n_tps, n_blocks] (``blk_bias``) or [n_tps, n_kv]: -inf where invisible, 1e9 where always
  visible (the incomplete tail), 0 where the block competes on score.

``n_blocks = ceil(n_kv / ratio)``. When a stream of one sequence holds cells repeating a position under M-RoPE,
the cells are ranked in (pos, y, x) order (libstdc++'s ``std::sort``, `std_sort`, decides the ties) and the rank
takes the position's place; a block's positions are then those of its slot-0 cell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..constants import LLAMA_MAX_SEQ
from ..errors import KVRefError

if TYPE_CHECKING:
    import numpy.typing as npt

    from .batch import UBatch
    from .cells import KVCells
    from .kv_cache import KVCache
    from .slots import SlotInfo

BIG = np.float32(1e9)  # "always visible", finite so that it never meets a -inf
_S_THRESHOLD = 16  # libstdc++'s introsort threshold


def std_sort(a: list[int], less: Callable[[int, int], bool]) -> None:
    """libstdc++'s ``std::sort`` (bits/stl_algo.h: introsort, median-of-three pivot, heap sort past the depth limit,
    final insertion sort), in place. Its order of equivalent elements is what llama.cpp's build gets: the QSA ranked
    layout sorts cells whose keys may tie."""
    n = len(a)
    if n > 1:
        _introsort_loop(a, 0, n, 2 * (n.bit_length() - 1), less)
        _final_insertion_sort(a, 0, n, less)


def _introsort_loop(a: list[int], first: int, last: int, depth: int, less: Callable[[int, int], bool]) -> None:
    while last - first > _S_THRESHOLD:
        if depth == 0:
            _heap_sort(a, first, last, less)
            return
        depth -= 1
        cut = _partition_pivot(a, first, last, less)
        _introsort_loop(a, cut, last, depth, less)
        last = cut


def _partition_pivot(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> int:
    mid = first + (last - first) // 2
    x, y, z = first + 1, mid, last - 1  # __move_median_to_first
    if less(a[x], a[y]):
        m = y if less(a[y], a[z]) else (z if less(a[x], a[z]) else x)
    else:
        m = x if less(a[x], a[z]) else (z if less(a[y], a[z]) else y)
    a[first], a[m] = a[m], a[first]
    lo, hi, pivot = first + 1, last, a[first]  # __unguarded_partition
    while True:
        while less(a[lo], pivot):
            lo += 1
        hi -= 1
        while less(pivot, a[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        a[lo], a[hi] = a[hi], a[lo]
        lo += 1


def _linear_insert(a: list[int], last: int, less: Callable[[int, int], bool]) -> None:
    val = a[last]
    nxt = last - 1
    while less(val, a[nxt]):
        a[last] = a[nxt]
        last = nxt
        nxt -= 1
    a[last] = val


def _insertion_sort(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> None:
    for i in range(first + 1, last):
        if less(a[i], a[first]):
            val = a[i]
            a[first + 1 : i + 1] = a[first:i]
            a[first] = val
        else:
            _linear_insert(a, i, less)


def _final_insertion_sort(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> None:
    if last - first > _S_THRESHOLD:
        _insertion_sort(a, first, first + _S_THRESHOLD, less)
        for i in range(first + _S_THRESHOLD, last):
            _linear_insert(a, i, less)
    else:
        _insertion_sort(a, first, last, less)


def _adjust_heap(a: list[int], first: int, hole: int, n: int, val: int, less: Callable[[int, int], bool]) -> None:
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if less(a[first + child], a[first + child - 1]):
            child -= 1
        a[first + hole] = a[first + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        a[first + hole] = a[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and less(a[first + parent], val):
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = val


def _heap_sort(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> None:
    n = last - first  # __partial_sort(first, last, last): make_heap, then sort_heap
    if n >= 2:
        for parent in range((n - 2) // 2, -1, -1):
            _adjust_heap(a, first, parent, n, a[first + parent], less)
    while last - first > 1:
        last -= 1
        val = a[last]
        a[last] = a[first]
        _adjust_heap(a, first, 0, last - first, val, less)


_Groups = tuple[dict[int, list[int]], list[int], list[int], list[int], "npt.NDArray[np.int64]", bool, bool]


def _group(
    cells: KVCells, cpos: npt.NDArray[np.int32], pos: npt.NDArray[np.int64], r: int, n_blocks: int, one_seq: bool
) -> _Groups:
    """group_cells: per bucket ``pos // r`` a list of groups (newest first; one per sequence set unless the stream
    holds one sequence), each with its first cell, slot bits and slot-0 cell; each cell's group; whether a slot
    repeats (dup) and whether a cell lies past the window (oor). ``pos``: the cells' positions or ranks."""
    heads: dict[int, list[int]] = {}
    g_first: list[int] = []
    g_slots: list[int] = []
    g_slot0: list[int] = []
    g_seqs: list[tuple[int, ...]] = []
    cell_grp = np.full(len(cpos), -1, np.int64)
    dup = oor = False
    for j in np.flatnonzero(cpos >= 0).tolist():
        p = int(pos[j])
        pb = p // r
        if pb >= n_blocks:
            oor = True
            continue
        seqs = () if one_seq else tuple(cells.seq_get_all(j))
        g = -1
        for c in heads.get(pb, ()):
            if one_seq or g_seqs[c] == seqs:
                g = c
                break
        if g < 0:
            g = len(g_first)
            g_first.append(j)
            g_slots.append(0)
            g_slot0.append(-1)
            g_seqs.append(seqs)
            heads.setdefault(pb, []).insert(0, g)
        bit = 1 << (p % r)
        dup = dup or bool(g_slots[g] & bit)
        cell_grp[j] = g
        g_slots[g] |= bit
        if p % r == 0:
            g_slot0[g] = j
    return heads, g_first, g_slots, g_slot0, cell_grp, dup, oor


def qsa_aborts(idx: KVCache, ub: UBatch, sinfo: SlotInfo, ratio: int) -> str | None:
    """Why set_input_qsa would abort for ubatch ``ub`` placed at ``sinfo`` in the indexer cache ``idx`` (already
    applied), or None: a cell of a stream positioned past the window of ``ceil(n_kv / ratio)`` blocks, unless the
    stream is ranked (one sequence repeating a position under M-RoPE, whose ranks stay below n_kv)."""
    r = int(ratio)
    n_kv = idx.get_n_kv(sinfo)
    n_ns = int(sinfo.s1 - sinfo.s0 + 1)
    n_blocks = (n_kv + r - 1) // r
    n_tps = int(ub.n_tokens) // n_ns
    for s in range(n_ns):
        cells = idx.get_cells(ub.seq_id[s * n_tps][0])
        cpos = np.asarray(cells.pos)[:n_kv]
        valid = cpos >= 0
        inside = valid & (cpos // r < n_blocks)
        if not (valid & ~inside).any():
            continue
        n_present = 0
        for sq in range(LLAMA_MAX_SEQ):
            if cells.seq_pos_min(sq) >= 0:
                n_present += 1
                if n_present == 2:
                    break
        p_in = cpos[inside]
        if ub.is_pos_2d() and n_present <= 1 and np.unique(p_in).size < p_in.size:
            continue  # ranked
        return "qsa: cell position runs past the cell window (GGML_ASSERT in llama_memory_hybrid_idx::set_input_qsa)"
    return None


def qsa_inputs(
    idx: KVCache | None, ub: UBatch, sinfo: SlotInfo, ratio: int, *, blk_bias: bool, causal: bool
) -> dict[str, npt.NDArray[np.generic[object]]]:
    """The four QSA inputs of ubatch ``ub`` placed at ``sinfo`` (keys ``cell_blk``, ``blk_cells``, ``blk_pos``,
    ``bias``; shapes (n_stream, n_kv), (n_stream, ratio * n_blocks), (4 * n_blocks * n_stream,),
    (n_stream, n_tps, n_blocks or n_kv))."""
    if idx is None:
        raise KVRefError("set_input_qsa needs the indexer cache (GGML_ASSERT(get_mem_idx() != nullptr))")
    r = int(ratio)
    if not 0 < r <= 64:
        raise KVRefError(f"QSA ratio {r} outside [1, 64] (llama.cpp asserts)")
    n_kv = idx.get_n_kv(sinfo)
    n_ns = int(sinfo.s1 - sinfo.s0 + 1)
    n_blocks = (n_kv + r - 1) // r
    n_tokens = int(ub.n_tokens)
    if n_tokens % n_ns:
        raise KVRefError(f"{n_tokens} tokens do not divide over {n_ns} streams (llama.cpp asserts)")
    n_tps = n_tokens // n_ns
    full = (1 << r) - 1

    cell_blk = np.zeros((n_ns, n_kv), np.int32)
    blk_cells = np.zeros((n_ns, r * n_blocks), np.int32)
    blk_pos = np.zeros((4, n_ns, n_blocks), np.int32)
    bias = np.full((n_ns, n_tps, n_blocks if blk_bias else n_kv), -np.inf, np.float32)
    pos_all = np.asarray(ub.pos)

    for s in range(n_ns):
        cells = idx.get_cells(ub.seq_id[s * n_tps][0])
        one_seq = sum(1 for sq in range(LLAMA_MAX_SEQ) if cells.seq_pos_min(sq) >= 0) <= 1
        cpos = np.asarray(cells.pos)[:n_kv]
        # what places a cell: its position, or its rank in (pos, y, x) order (the ranked layout)
        pos: npt.NDArray[np.int64] = cpos.astype(np.int64)
        order: list[int] = []
        ext = np.asarray(cells.ext)

        heads, g_first, g_slots, g_slot0, cell_grp, dup, oor = _group(cells, cpos, pos, r, n_blocks, one_seq)
        ranked = bool(dup and ub.is_pos_2d() and one_seq)
        if ranked:
            # M-RoPE repeats one position across an image: rank the cells in the mask's order (pos, y, x)
            order = np.flatnonzero(cpos >= 0).tolist()
            key = {j: (int(cpos[j]), int(ext[j, 1]), int(ext[j, 0])) for j in order}

            def less(a: int, b: int, key: dict[int, tuple[int, int, int]] = key) -> bool:
                return key[a] < key[b]

            std_sort(order, less)
            rank = np.full(n_kv, -1, np.int64)
            rank[np.asarray(order, np.int64)] = np.arange(len(order))
            pos = rank
            heads, g_first, g_slots, g_slot0, cell_grp, dup, oor = _group(cells, cpos, pos, r, n_blocks, one_seq)
        if blk_bias and oor:
            raise KVRefError("qsa: cell position runs past the cell window (llama.cpp asserts)")

        g_bid = [-1] * len(g_first)
        bid_idx: list[int] = []
        bid_cell: list[int] = []
        bid_slot0: list[int] = []
        for pb in range(n_blocks):
            for g in heads.get(pb, ()):
                if g_slots[g] != full:
                    continue
                g_bid[g] = len(bid_idx)
                bid_idx.append(pb * r)
                bid_cell.append(g_first[g])
                bid_slot0.append(g_slot0[g])
        n_bid = len(bid_idx)
        blk_pos[:, s, :n_bid] = np.asarray(bid_idx, np.int32)
        if ranked:
            for b, c in enumerate(bid_slot0):
                p_c = int(cpos[c])
                blk_pos[:, s, b] = (p_c, int(ext[c, 1]), int(ext[c, 0]), p_c)

        have_dead = n_bid < n_blocks
        dead = n_bid if have_dead else n_blocks - 1
        bid_of = np.asarray([*g_bid, -1], np.int64)  # index -1: no group
        blk_of = bid_of[cell_grp]
        cell_blk[s] = np.where(blk_of < 0, dead, blk_of)
        inb = np.flatnonzero(blk_of >= 0)
        blk_cells[s, blk_of[inb] * r + pos[inb] % r] = inb

        for ii in range(n_tps):
            i = s * n_tps + ii
            seq = ub.seq_id[i][0]
            q = int(pos_all[i])
            if ranked:
                # the query's place among the ranked cells: the last cell at or before it in (pos, y, x) order
                qk = (q, int(pos_all[i + n_tokens]), int(pos_all[i + 2 * n_tokens]))
                lo, hi = 0, len(order)
                while lo < hi:
                    mid = (lo + hi) // 2
                    c = order[mid]
                    if (int(cpos[c]), int(ext[c, 1]), int(ext[c, 0])) <= qk:
                        lo = mid + 1
                    else:
                        hi = mid
                q = lo - 1
            tail_start = (q + 1) // r * r
            row = bias[s, ii]
            if blk_bias:
                for b in range(n_bid):
                    if cells.seq_has(bid_cell[b], seq):
                        row[b] = BIG if (causal and bid_idx[b] >= tail_start) else 0.0
                if have_dead:
                    row[dead] = BIG
                continue
            mine = np.asarray([p >= 0 and cells.seq_has(j, seq) for j, p in enumerate(pos.tolist())], bool)
            if not causal:
                row[mine] = np.where(blk_of[mine] < 0, BIG, 0.0)
            else:
                vis = mine & (pos <= q)
                row[vis & (pos >= tail_start)] = BIG
                row[vis & (pos < tail_start) & (blk_of >= 0)] = 0.0
    return {"cell_blk": cell_blk, "blk_cells": blk_cells, "blk_pos": blk_pos.reshape(-1), "bias": bias}


__all__ = ["qsa_inputs"]
