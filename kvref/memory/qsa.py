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

``n_blocks = ceil(n_kv / ratio)``. The M-RoPE "ranked" layout (an image's cells repeating a position) is not
modelled: kvref refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import KVRefError

if TYPE_CHECKING:
    import numpy.typing as npt

    from .batch import UBatch
    from .hybrid_idx import HybridIdxMemory
    from .slots import SlotInfo

BIG = np.float32(1e9)  # "always visible", finite so that it never meets a -inf


def qsa_inputs(
    mem: HybridIdxMemory, ub: UBatch, sinfo: SlotInfo, ratio: int, *, blk_bias: bool, causal: bool
) -> dict[str, npt.NDArray[np.generic]]:
    """The four QSA inputs of ubatch ``ub`` placed at ``sinfo`` (keys ``cell_blk``, ``blk_cells``, ``blk_pos``,
    ``bias``; shapes (n_stream, n_kv), (n_stream, ratio * n_blocks), (4 * n_blocks * n_stream,),
    (n_stream, n_tps, n_blocks or n_kv))."""
    idx = mem.idx
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
        one_seq = sum(1 for sq in range(len(mem.stale)) if cells.seq_pos_min(sq) >= 0) <= 1
        pos = np.asarray(cells.pos)[:n_kv]

        # group_cells: per bucket a list of groups (newest first), each with its first cell, slot bits, slot-0 cell
        heads: dict[int, list[int]] = {}
        g_first: list[int] = []
        g_slots: list[int] = []
        g_seqs: list[tuple[int, ...]] = []
        cell_grp = np.full(n_kv, -1, np.int64)
        dup = False
        oor = False
        for j in np.flatnonzero(pos >= 0).tolist():
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
                g_seqs.append(seqs)
                heads.setdefault(pb, []).insert(0, g)
            bit = 1 << (p % r)
            dup = dup or bool(g_slots[g] & bit)
            cell_grp[j] = g
            g_slots[g] |= bit
        if dup and ub.is_pos_2d() and one_seq:
            raise KVRefError("QSA over cells repeating a position (an M-RoPE image): the ranked layout is not modelled")
        if blk_bias and oor:
            raise KVRefError("qsa: cell position runs past the cell window (llama.cpp asserts)")

        g_bid = [-1] * len(g_first)
        bid_idx: list[int] = []
        bid_cell: list[int] = []
        for pb in range(n_blocks):
            for g in heads.get(pb, ()):
                if g_slots[g] != full:
                    continue
                g_bid[g] = len(bid_idx)
                bid_idx.append(pb * r)
                bid_cell.append(g_first[g])
        n_bid = len(bid_idx)
        blk_pos[:, s, :n_bid] = np.asarray(bid_idx, np.int32)

        have_dead = n_bid < n_blocks
        dead = n_bid if have_dead else n_blocks - 1
        bid_of = np.asarray(g_bid + [-1], np.int64)  # index -1: no group
        blk_of = bid_of[cell_grp]
        cell_blk[s] = np.where(blk_of < 0, dead, blk_of)
        inb = np.flatnonzero(blk_of >= 0)
        blk_cells[s, blk_of[inb] * r + pos[inb] % r] = inb

        for ii in range(n_tps):
            i = s * n_tps + ii
            seq = ub.seq_id[i][0]
            q = int(pos_all[i])
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
