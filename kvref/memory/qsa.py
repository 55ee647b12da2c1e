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
the cells are ranked in (pos, y, x) order (libstdc++'s ``std::sort`` decides the ties: ``rank_order`` of the twins
``_qsa_py`` / ``_qsa_c``) and the rank takes the position's place; a block's positions are then those of its slot-0
cell.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._backend import select
from ..constants import LLAMA_MAX_SEQ
from ..errors import KVRefError

if TYPE_CHECKING:
    import numpy.typing as npt

    from .batch import UBatch
    from .cells import KVCells
    from .kv_cache import KVCache
    from .slots import SlotInfo

BIG = np.float32(1e9)  # "always visible", finite so that it never meets a -inf
_twin = select("memory.qsa")


class _Groups(NamedTuple):
    """group_cells' result for one stream (g: a group, numbered in creation order)."""

    g_first: npt.NDArray[np.int64]  # the group's first cell
    g_full: npt.NDArray[np.bool_]  # all ``r`` slots filled
    g_pb: npt.NDArray[np.int64]  # the group's bucket
    g_slot0: npt.NDArray[np.int64]  # its last cell in slot 0, -1 when none
    cell_grp: npt.NDArray[np.int64]  # each cell's group, -1 for none
    dup: bool  # a slot of a group repeats
    oor: bool  # a cell lies past the window


def _group(
    cseq: npt.NDArray[np.uint64], cpos: npt.NDArray[np.int32], pos: npt.NDArray[np.int64], r: int, n_blocks: int,
    one_seq: bool,
) -> _Groups:  # fmt: skip
    """group_cells: walking the used cells in order, a cell joins the group of its bucket ``pos // r`` and its
    sequence set (any set when the stream holds one sequence), opening one when there is none; the group records
    its first cell, its slot bits ``1 << pos % r`` and its slot-0 cell. ``pos``: the cells' positions or ranks;
    ``cseq``: their (n_kv, 4) sequence bit sets. Vectorised: a group is a distinct (bucket, set) key, numbered by
    the cell where it first occurs."""
    n_kv = len(cpos)
    cell_grp = np.full(n_kv, -1, np.int64)
    used = np.flatnonzero(cpos >= 0)
    p = pos[used]
    pb = p // r
    oor = bool((pb >= n_blocks).any())
    keep = pb < n_blocks
    used, p, pb = used[keep], p[keep], pb[keep]
    key = pb.astype(np.uint64)[:, None]
    if not one_seq:
        key = np.concatenate([key, cseq[used]], axis=1)
    _, first, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    made = np.argsort(first, kind="stable")  # creation order: by the cell that opens the group
    g_of_key = np.empty(len(first), np.int64)
    g_of_key[made] = np.arange(len(first))
    g = g_of_key[inv]
    n_g = len(first)
    g_first = used[first[made]].astype(np.int64)
    g_pb = pb[first[made]].astype(np.int64)
    slot = p % r
    filled = np.zeros((n_g, r), np.int64)
    np.add.at(filled, (g, slot), 1)
    g_full: npt.NDArray[np.bool_] = np.asarray((filled > 0).all(axis=1))
    g_slot0 = np.full(n_g, -1, np.int64)
    at0 = slot == 0
    np.maximum.at(g_slot0, g[at0], used[at0])
    cell_grp[used] = g
    return _Groups(g_first, g_full, g_pb, g_slot0, cell_grp, bool((filled > 1).any()), oor)


def _one_seq(cells: KVCells) -> bool:
    """At most one sequence holds a cell of the stream (llama.cpp counts the sequences whose seq_pos is not empty)."""
    return int((np.asarray(cells.seq_pos_min_many(range(LLAMA_MAX_SEQ))) >= 0).sum()) <= 1


def _has_seq(cseq: npt.NDArray[np.uint64], seqs: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """(len(seqs), n): cell j belongs to sequence seqs[t] (worked out once per distinct sequence)."""
    uniq, inv = np.unique(seqs, return_inverse=True)
    words = cseq[:, uniq >> 6].T  # (n_uniq, n)
    bits = ((words >> (uniq & 63).astype(np.uint64)[:, None]) & np.uint64(1)).astype(bool)
    got: npt.NDArray[np.bool_] = bits[inv.reshape(-1)]
    return got


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
        p_in = cpos[inside]
        if ub.is_pos_2d() and _one_seq(cells) and np.unique(p_in).size < p_in.size:
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

    cell_blk = np.zeros((n_ns, n_kv), np.int32)
    blk_cells = np.zeros((n_ns, r * n_blocks), np.int32)
    blk_pos = np.zeros((4, n_ns, n_blocks), np.int32)
    bias = np.full((n_ns, n_tps, n_blocks if blk_bias else n_kv), -np.inf, np.float32)
    pos_all = np.asarray(ub.pos)

    seq0 = np.fromiter((sq[0] for sq in ub.seq_id), np.int64, n_tokens)

    for s in range(n_ns):
        cells = idx.get_cells(ub.seq_id[s * n_tps][0])
        one_seq = _one_seq(cells)
        cpos = np.asarray(cells.pos)[:n_kv]
        cseq = np.asarray(cells.seq)[:n_kv]
        ext = np.asarray(cells.ext)[:n_kv]
        # what places a cell: its position, or its rank in (pos, y, x) order (the ranked layout)
        pos: npt.NDArray[np.int64] = cpos.astype(np.int64)
        q = pos_all[s * n_tps : (s + 1) * n_tps].astype(np.int64)  # each token's place on that line

        grp = _group(cseq, cpos, pos, r, n_blocks, one_seq)
        ranked = bool(grp.dup and ub.is_pos_2d() and one_seq)
        if ranked:
            # M-RoPE repeats one position across an image: rank the cells in the mask's order (pos, y, x)
            used = np.flatnonzero(cpos >= 0).astype(np.int64)
            o = _twin.rank_order(used, cpos[used].astype(np.int64), ext[used, 1].astype(np.int64),
                                 ext[used, 0].astype(np.int64))  # fmt: skip
            rank = np.full(n_kv, -1, np.int64)
            rank[o] = np.arange(len(o))
            pos = rank
            grp = _group(cseq, cpos, pos, r, n_blocks, one_seq)
            # a query's place among the ranked cells: the last cell at or before it in (pos, y, x) order
            kt = np.dtype([("p", np.int64), ("y", np.int64), ("x", np.int64)])
            ck = np.empty(len(o), kt)
            ck["p"], ck["y"], ck["x"] = cpos[o], ext[o, 1], ext[o, 0]
            qk = np.empty(n_tps, kt)
            i0 = s * n_tps
            qk["p"] = q
            qk["y"] = pos_all[n_tokens + i0 : n_tokens + i0 + n_tps]
            qk["x"] = pos_all[2 * n_tokens + i0 : 2 * n_tokens + i0 + n_tps]
            q = np.searchsorted(ck, qk, side="right").astype(np.int64) - 1
        if blk_bias and grp.oor:
            raise KVRefError("qsa: cell position runs past the cell window (llama.cpp asserts)")

        # blocks: the full groups, by bucket, the groups of one bucket newest first
        n_g = len(grp.g_first)
        full_g = np.flatnonzero(grp.g_full)
        full_g = full_g[np.lexsort((-full_g, grp.g_pb[full_g]))]
        n_bid = len(full_g)
        g_bid = np.full(n_g + 1, -1, np.int64)  # index -1 (the last): no group
        g_bid[full_g] = np.arange(n_bid)
        bid_idx = grp.g_pb[full_g] * r
        bid_cell = grp.g_first[full_g]
        blk_pos[:, s, :n_bid] = bid_idx.astype(np.int32)
        if ranked:
            c = grp.g_slot0[full_g]
            blk_pos[:, s, :n_bid] = np.stack([cpos[c], ext[c, 1], ext[c, 0], cpos[c]]).astype(np.int32)

        have_dead = n_bid < n_blocks
        dead = n_bid if have_dead else n_blocks - 1
        blk_of = g_bid[grp.cell_grp]
        cell_blk[s] = np.where(blk_of < 0, dead, blk_of)
        inb = np.flatnonzero(blk_of >= 0)
        blk_cells[s, blk_of[inb] * r + pos[inb] % r] = inb

        has = _has_seq(cseq, seq0[s * n_tps : (s + 1) * n_tps])  # (n_tps, n_kv)
        tail_start = ((q + 1) // r * r)[:, None]
        rows = bias[s]
        if blk_bias:
            val = np.where(causal & (bid_idx[None, :] >= tail_start), BIG, np.float32(0.0))
            rows[:, :n_bid] = np.where(has[:, bid_cell], val, rows[:, :n_bid])
            if have_dead:
                rows[:, dead] = BIG
            continue
        mine = has & (pos >= 0)[None, :]
        if not causal:
            rows[mine] = np.broadcast_to(np.where(blk_of < 0, BIG, np.float32(0.0)), mine.shape)[mine]
        else:
            vis = mine & (pos[None, :] <= q[:, None])
            rows[vis & (pos[None, :] >= tail_start)] = BIG
            rows[vis & (pos[None, :] < tail_start) & (blk_of >= 0)[None, :]] = 0.0
    return {"cell_blk": cell_blk, "blk_cells": blk_cells, "blk_pos": blk_pos.reshape(-1), "bias": bias}


__all__ = ["qsa_inputs"]
