"""Pure-Python twin of the per-cell work of slot placement (llama.cpp's ``llama_kv_cache::find_slot`` and the
checks ``apply_ubatch`` makes on its target cells, src/llama-kv-cache.cpp).

This is the readable statement of the rules; ``_slots_c.pyx`` implements the same functions at C speed.
Both take one stream's ``KVCells`` (either twin: they read its ``pos`` and ``seq`` arrays, ``size()``,
``get_used()`` and ``seq_pos_max``) and never change it. ``kvref/slots.py`` calls them per stream of a
ubatch and does the rest (streams, heads, writing the cells, prepare's rollback).

find_cells, the search of one stream, walks from the head as llama.cpp does and stops as soon as it has
its ``n_tokens`` cells, so its cost grows with the cells it tests, not with the cache size:

- start at ``head``, or at 0 when ``head > used + 2*n_tokens`` (plenty of free cells before the head: fill
  the cache from the front); a head past the end (only when set by hand) counts as the end;
- a cell can be used when it is empty, or when it holds exactly one sequence and its position is SWA-masked
  (``is_masked_swa``) for a query at that sequence's ``seq_pos_max + 1`` (a chunked window of 0 masks nothing);
- not ``cont``: test one cell per step, wrapping at the end, and take the first ``n_tokens`` usable cells;
  give up once ``size`` cells were tested;
- ``cont``: test ``n_tokens`` cells in a row from the current cell, restart after the first unusable one;
  when fewer than ``n_tokens`` cells are left before the end, count them as tested and wrap to 0; give up
  when, after a failed run, the tested count (runs plus skipped tails) reaches ``size``;
- ``n_tokens > size`` fits nowhere (None); ``n_tokens == 0`` gets an empty list (kvref's rule: llama.cpp's
  loop has no defined answer for an empty ubatch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .errors import CellError
from .hparams import SWAType, is_masked_swa

if TYPE_CHECKING:
    from ._cells_py import KVCells

_BLOCK = 256  # cells whose usability is computed together (the walk reads it from the current block)


class Usable:
    """find_slot's "can we use this cell?" for the cells of one stream, computed a block at a time.

    A cell can be used when it is empty, or when it holds exactly one sequence and its position is masked by
    that sequence's sliding window for a query at the sequence's ``seq_pos_max + 1``.
    """

    def __init__(self, cells: KVCells, n_swa: int, swa_type: int, block: int) -> None:
        self.pos = np.asarray(cells.pos)
        self.seq = np.asarray(cells.seq)
        self.seq_pos_max = cells.seq_pos_max
        self.n_swa = int(n_swa)
        self.swa_type = int(swa_type)
        # a chunked window of 0 positions has no chunk start to mask before (and no division to do)
        self.swa = self.swa_type != SWAType.NONE and not (self.swa_type == SWAType.CHUNKED and self.n_swa == 0)
        self.block = block
        self.pos_max: dict[int, int] = {}  # seq_pos_max of the sequences met so far
        self.lo = self.hi = 0
        self.flags: list[bool] = []

    def __call__(self, idx: int) -> bool:
        if not self.lo <= idx < self.hi:
            self.lo = idx - idx % self.block
            self.hi = min(self.lo + self.block, self.pos.shape[0])
            self.flags = self.can_use(self.lo, self.hi).tolist()
        return self.flags[idx - self.lo]

    def can_use(self, lo: int, hi: int) -> npt.NDArray[np.bool_]:
        """The test for cells ``[lo, hi)``."""
        pos = self.pos[lo:hi].astype(np.int64)
        usable: npt.NDArray[np.bool_] = pos == -1
        if not self.swa:
            return usable
        seq = np.ascontiguousarray(self.seq[lo:hi], dtype="<u8")  # little-endian words: byte k holds bits 8k..8k+7
        bits = np.unpackbits(seq.view(np.uint8), axis=1, bitorder="little")  # column 64*w + b: sequence 64*w + b
        single = np.flatnonzero((bits.sum(axis=1) == 1) & ~usable)
        if single.size == 0:
            return usable
        seq_ids = np.argmax(bits[single], axis=1).tolist()
        for s in set(seq_ids) - self.pos_max.keys():
            self.pos_max[s] = int(self.seq_pos_max(s))
        query = np.array([self.pos_max[s] + 1 for s in seq_ids], dtype=np.int64)
        usable[single] = is_masked_swa(self.n_swa, self.swa_type, pos[single], query)
        return usable


def find_cells(cells: KVCells, head: int, n_tokens: int, cont: bool, n_swa: int, swa_type: int) -> list[int] | None:
    """The cells llama_kv_cache::find_slot picks in one stream for ``n_tokens`` tokens; None when they do not fit.

    ``head`` is the stream's head; ``n_swa`` / ``swa_type`` the cache's window (see the module docstring).
    """
    size = cells.size()
    head_cur = min(int(head), size)
    if head_cur > cells.get_used() + 2 * n_tokens:
        head_cur = 0
    if n_tokens > size:
        return None
    if n_tokens == 0:
        return []
    can_use = Usable(cells, n_swa, swa_type, max(_BLOCK, n_tokens))
    idxs: list[int] = []
    n_tested = 0
    n_test = n_tokens if cont else 1  # cells tested in a row before the checks below
    while True:
        if head_cur + n_test > size:
            n_tested += size - head_cur
            head_cur = 0
            continue
        for _ in range(n_test):
            idx = head_cur
            head_cur += 1
            n_tested += 1
            if can_use(idx):
                idxs.append(idx)
            elif cont:
                break
        if len(idxs) == n_tokens:
            return idxs
        if cont:
            idxs.clear()
        if n_tested >= size:
            return None


def used_targets(cells: KVCells, idxs: list[int], size: int) -> list[tuple[int, int, int]]:
    """Check one stream's target cells before apply_ubatch writes them; ``(cell, seq_id, pos)`` of each used one.

    CellError when ``idxs`` does not hold ``size`` distinct cells, when a cell index is outside the cells, or
    when a used target holds several sequences (llama.cpp asserts it holds exactly one). Nothing changes.
    """
    if len(set(idxs)) != size:
        raise CellError("apply_ubatch: a cell index appears twice in the slot")
    used = []
    for idx in idxs:
        if not cells.is_empty(idx):
            if cells.seq_count(idx) != 1:
                raise CellError(f"apply_ubatch: cell {idx} is shared by several sequences")
            used.append((int(idx), cells.seq_get(idx), cells.pos_get(idx)))
    return used


__all__ = ["find_cells", "used_targets"]
