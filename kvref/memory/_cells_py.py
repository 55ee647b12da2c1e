"""Pure-Python twin of the KV cell bookkeeping (llama.cpp's ``llama_kv_cells``, src/llama-kv-cells.h).

This module is the readable statement of the semantics; ``_cells_c.pyx`` implements the same API at C
speed. Both keep their arrays in NumPy:

- ``pos``   int32[n]      position of each cell, -1 when empty;
- ``shift`` int32[n]      position delta accumulated since the last ``reset_shift`` (pending K-shift);
- ``ext``   int32[n, 3]   per-cell extension (x, y, tok): M-RoPE 2-D position and the cell's token;
- ``seq``   uint64[n, 4]  bitset of the sequences that see the cell (LLAMA_MAX_SEQ = 256 bits).

Beside them: the number of used cells (pos != -1, with or without sequences) and, per sequence, the
ordered set of (pos, cell) pairs (a sorted list), which gives min/max positions and ``seq_pos_tok_le`` in
O(log n). A per-cell method updates that list entry by entry (bisect). A bulk or range method finds its cells
with NumPy, changes the arrays in one go, and brings each touched sequence's list along in one pass: the
entries of the touched cells are filtered out before the change and merged back, sorted, after it, so no
method is worse than O(n log n) in the cells it touches (a few entries still go in one by one).

Where llama.cpp only asserts (an index out of range, ``seq_add`` on an empty cell, ``pos_set`` on a used
cell, ...), both twins raise ``CellError`` / ``SequenceError`` and leave the cells unchanged. Every method converts
all its arguments first (integers as ``operator.index`` takes them; bulk arguments through
``kvref.args.int64_values``; anything else is an ``ArgumentTypeError``), then checks them, then changes the cells:
a refused call changes nothing, and both twins refuse the same calls with the same error. A resize that fails
(a refused size, MemoryError) leaves the cells as they were.

Threads and re-entry (the contract of both twins): a ``KVCells`` may be shared between threads. Every method but
``size()``, ``len()``, ``get_used()`` and ``get_has_shift()`` (which read one number) runs under the object's
guard, so calls from several threads run one at a time and each is atomic; a thread waits while another's call
runs. A call made while the same thread is already inside a call on the same cells (from an argument's
``__index__``, a ``pos`` property of the ``other`` given to ``set()``, a finalizer, ...) is refused with
``CellError`` and changes nothing; the outer call goes on, or fails, with what that code did. Here the guard is a
``threading.Lock`` and its owner thread; the Cython twin keeps a flag and an owner under the GIL, which its slot
kernels (``_slots_c.pyx``) take too while they read the cells' buffers. The read-only ``pos`` / ``shift`` /
``ext`` / ``seq`` views stay valid arrays after a resize (they keep the old buffers alive).
"""

from __future__ import annotations

import bisect
import functools
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from ..args import check_alloc, int64_values
from ..constants import CELL_BYTES, INT32_MIN, LLAMA_MAX_SEQ, N_SEQ_WORDS, POS_MAX, TOKEN_NULL
from ..errors import ArgumentTypeError, CellError, CorruptionError, KVRefError, SequenceError

IntArray = npt.NDArray[np.int32]
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _as_int(value: object) -> int:
    """``value`` as a Python int, integers only (operator.index), as the Cython twin takes it."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(f"expected an integer, got {type(value).__name__} {value!r}") from None


def _nested(what: str) -> str:
    return (
        f"{what}: these cells are already inside a call in this thread (an argument's __index__, a finalizer, "
        "...): the nested call is refused and nothing changes"
    )


def _cells_arrays(other: object) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.uint64]]:
    """``other``'s (pos, ext, seq) arrays, of the cells' shapes, for set(): integers only (seq words as uint64)."""
    try:
        pos, ext, seq = np.asarray(other.pos), np.asarray(other.ext), np.asarray(other.seq)  # type: ignore[attr-defined]
    except AttributeError:
        raise ArgumentTypeError(f"set: expected cells (pos, ext and seq arrays), got {type(other).__name__}") from None
    if any(a.dtype.kind not in "biu" for a in (pos, ext, seq)):
        raise ArgumentTypeError("set: the other cells' pos/ext/seq are not integer arrays")
    n = pos.shape[0] if pos.ndim == 1 else -1
    if n < 0 or ext.shape != (n, 3) or seq.shape != (n, N_SEQ_WORDS):
        raise CellError("set: the other cells' pos/ext/seq arrays do not have the cells' shapes")
    # read as int64 as the cells' checks read them (a uint64 past int64 saturates), seq words bit for bit
    return int64_values(pos, "pos"), int64_values(ext, "ext").reshape(n, 3), seq.astype(np.uint64)


def _check_seq(seq_id: int) -> int:
    seq_id = _as_int(seq_id)
    if not 0 <= seq_id < LLAMA_MAX_SEQ:
        raise SequenceError(f"seq_id {seq_id} is outside [0, {LLAMA_MAX_SEQ})")
    return seq_id


def _wrap32(v: int) -> int:
    """``v`` as an int32 wraps it: the accumulated shift is an int32 in llama.cpp too."""
    return (v - INT32_MIN) % 2**32 + INT32_MIN


def _wrap32_all(v: npt.NDArray[np.int64]) -> IntArray:
    """``_wrap32`` of every element."""
    return ((v - INT32_MIN) % 2**32 + INT32_MIN).astype(np.int32)


def _div_toward_zero(old: npt.NDArray[np.int64], d: int) -> npt.NDArray[np.int64]:
    """``old / d`` as C divides integers (toward zero), as llama_kv_cells::pos_div does; ``d`` != 0. A divisor past
    int32 divides every int32 position to 0, as 2^32 does (and keeps the arithmetic in int64)."""
    q = np.abs(old) // min(abs(d), 2**32)
    res: npt.NDArray[np.int64] = np.where((old < 0) != (d < 0), -q, q)
    return res


def _check_divisor(what: str, d: int, old: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The positions ``old`` divided by ``d`` (`_div_toward_zero`), or the error kvref raises where llama.cpp dies
    (d = 0: SIGFPE) or corrupts its cells (a position becoming -1: empty, yet still used); nothing is changed."""
    if d == 0:
        raise CellError(f"{what}: division by 0 (llama.cpp dies of SIGFPE)")
    new = _div_toward_zero(old, d)
    if (new == -1).any():
        p = int(old[np.flatnonzero(new == -1)[0]])
        raise CorruptionError(f"{what}: position {p} / {d} is -1, which marks an empty cell (llama.cpp keeps the cell "
                              "used and in its sequences while it reads as empty)")  # fmt: skip
    return new


def _bits(words: Iterable[int]) -> list[int]:
    """The sequence ids whose bits are set in a cell's bitset words, ascending."""
    out = []
    for w, word in enumerate(words):
        word = int(word)
        while word:
            low = word & -word
            out.append(w * 64 + low.bit_length() - 1)
            word ^= low
    return out


def _clamp_bound(p: int) -> int:
    """A range bound clamped into the int64 range NumPy compares with, where it still orders every int32 the same."""
    return min(max(p, INT32_MIN - 1), POS_MAX + 1)


# a bulk change that touches at most this many entries of a sequence updates its list entry by entry (bisect,
# each O(log n) plus a memmove); above it, the list is rebuilt in one O(n + m log m) pass
_FEW = 32


# cell indices: one index, or a list / integer array of them
CellIndices = int | Sequence[int] | npt.NDArray[np.int64] | npt.NDArray[np.int32]
_Arr = TypeVar("_Arr", npt.NDArray[np.int32], npt.NDArray[np.uint64])


def _ro(a: _Arr) -> _Arr:
    v: _Arr = a.view()
    v.flags.writeable = False
    return v


class KVCells:
    """The cells of one KV stream: positions, shifts, ext and sequence sets, with llama.cpp's rules."""

    def __init__(self, size: int = 0) -> None:
        # the guard of the public methods (see `_atomic_methods` and the module docstring): a lock and its owner
        self._lock = threading.Lock()
        self._owner: int | None = None
        # public calls that may have changed the cells (`_atomic_methods` counts every call but the readers'), and
        # used_max_p1's answer at a count: it is found again only after a change
        self._mutations = 0
        self._hi_at = (-1, 0)
        self.resize(size)

    # ------------------------------------------------------------------ whole-array state
    def resize(self, n: int) -> None:
        """Give the cells ``n`` slots, all empty (llama.cpp's resize() ends with reset()).

        Everything is allocated before anything is replaced: a resize that fails (MemoryError, a refused size)
        leaves the cells as they were.
        """
        n = _as_int(n)
        if n < 0:
            raise CellError(f"cannot resize cells to {n}")
        if n > 0xFFFFFFFF:
            raise CellError(f"cannot resize cells to {n} (cell indices are uint32)")
        check_alloc(n * CELL_BYTES, f"{n} KV cells", "use fewer cells")
        pos = np.empty(n, dtype=np.int32)
        shift = np.empty(n, dtype=np.int32)
        ext = np.empty((n, 3), dtype=np.int32)
        seq = np.empty((n, N_SEQ_WORDS), dtype=np.uint64)
        seq_pos: list[list[tuple[int, int]]] = [[] for _ in range(LLAMA_MAX_SEQ)]
        self._pos, self._shift, self._ext, self._seq, self._seq_pos = pos, shift, ext, seq, seq_pos
        self._reset()

    def reset(self) -> None:
        """Make every cell empty, with no pending shift and a null ext (llama_kv_cells::reset); the size stays."""
        self._reset()

    def _reset(self) -> None:
        seq_pos: list[list[tuple[int, int]]] = [[] for _ in range(LLAMA_MAX_SEQ)]
        self._pos.fill(-1)
        self._shift.fill(0)
        self._ext[:, :2] = 0
        self._ext[:, 2] = TOKEN_NULL
        self._seq.fill(0)
        self._has_shift = False
        self._n_used = 0
        self._seq_pos = seq_pos

    def reset_shift(self) -> None:
        """Zero every cell's pending shift and clear has_shift (llama_kv_cells::reset_shift)."""
        self._has_shift = False
        self._shift.fill(0)

    def size(self) -> int:
        """The number of cells (llama_kv_cells::size)."""
        return int(self._pos.shape[0])

    def __len__(self) -> int:
        return self.size()

    def get_used(self) -> int:
        """The number of used cells, pos != -1 (llama_kv_cells::get_used)."""
        return self._n_used

    def used_min(self) -> int:
        """Index of the first used cell, 0 when none is used."""
        idx = np.flatnonzero(self._pos != -1)
        return int(idx[0]) if idx.size else 0

    def used_max_p1(self) -> int:
        """Index of the last used cell + 1, 0 when none is used."""
        return self._used_max_p1()

    def _used_max_p1(self) -> int:
        seen, value = self._hi_at
        if seen == self._mutations:  # nothing changed since it was last found (get_n_kv asks every ubatch and layer)
            return value
        idx = np.flatnonzero(self._pos != -1)
        value = int(idx[-1]) + 1 if idx.size else 0
        self._hi_at = (self._mutations, value)
        return value

    def n_kv(self, n_pad: int) -> int:
        """This stream's part of llama_kv_cache::get_n_kv: ``used_max_p1`` rounded up to a multiple of ``n_pad``
        (``n_pad`` >= 1), at least ``n_pad``, at most ``size``."""
        n_pad = _as_int(n_pad)
        if n_pad < 1:
            raise CellError(f"n_kv: n_pad {n_pad} is below 1")
        return min(max(-(-self._used_max_p1() // n_pad) * n_pad, n_pad), self.size())

    def used_cells(self) -> IntArray:
        """Indices of the used cells, ascending (llama.cpp's ``used`` set)."""
        return np.flatnonzero(self._pos != -1).astype(np.int32)

    def get_has_shift(self) -> bool:
        """True when a position was shifted since the last reset_shift (llama_kv_cells::get_has_shift)."""
        return self._has_shift

    # read-only NumPy views of the arrays
    @property
    def pos(self) -> npt.NDArray[np.int32]:
        """Read-only int32 (n,) view of the cells' positions, -1 for an empty cell."""
        return _ro(self._pos)

    @property
    def shift(self) -> npt.NDArray[np.int32]:
        """Read-only int32 (n,) view of the cells' pending shifts (accumulated since reset_shift)."""
        return _ro(self._shift)

    @property
    def ext(self) -> npt.NDArray[np.int32]:
        """Read-only int32 (n, 3) view of the cells' ext: x, y (M-RoPE 2-D position) and token."""
        return _ro(self._ext)

    @property
    def seq(self) -> npt.NDArray[np.uint64]:
        """Read-only uint64 (n, 4) view of the cells' sequence sets: bit s % 64 of word s // 64 is sequence s."""
        return _ro(self._seq)

    # ------------------------------------------------------------------ helpers
    def _check_index(self, i: int) -> int:
        i = _as_int(i)
        if not 0 <= i < self._pos.shape[0]:
            raise CellError(f"cell index {i} is outside [0, {self._pos.shape[0]})")
        return i

    def _check_used(self, i: int, what: str) -> int:
        i = self._check_index(i)
        if self._pos[i] == -1:
            raise CellError(f"{what}: cell {i} is empty")
        return i

    def _check_delta(self, what: str, d: int) -> int:
        """Validate a position delta (a llama_pos: int32). A position it moves past POS_MAX wraps as llama.cpp's int32
        does (to a negative one: the cell is freed)."""
        d = _as_int(d)
        if not INT32_MIN <= d <= POS_MAX:
            raise CellError(f"{what}: delta {d} is outside the int32 range")
        return d

    def _has(self, i: int, s: int) -> bool:
        return bool((int(self._seq[i, s >> 6]) >> (s & 63)) & 1)

    def _seqs_of(self, i: int) -> list[int]:
        return _bits(self._seq[i].tolist())

    def _has_all(self, s: int) -> npt.NDArray[np.bool_]:
        """For every cell: does it hold sequence s?"""
        has: npt.NDArray[np.bool_] = (self._seq[:, s >> 6] & np.uint64(1 << (s & 63))) != 0
        return has

    def _in_range(self, p0: int, p1: int) -> npt.NDArray[np.bool_]:
        """For every cell: is it used with p0 <= pos < p1? (``pos_in`` of every cell)"""
        inside: npt.NDArray[np.bool_] = (
            (self._pos != -1) & (self._pos >= _clamp_bound(p0)) & (self._pos < _clamp_bound(p1))
        )
        return inside

    def _seq_pos_insert(self, s: int, i: int) -> None:
        bisect.insort(self._seq_pos[s], (int(self._pos[i]), i))

    def _seq_pos_erase(self, s: int, i: int) -> None:
        lst = self._seq_pos[s]
        key = (int(self._pos[i]), i)
        k = bisect.bisect_left(lst, key)
        assert k < len(lst) and lst[k] == key, "per-sequence index out of step with the cells"
        del lst[k]

    def _seq_pos_rm_cell(self, i: int) -> None:
        for s in self._seqs_of(i):
            self._seq_pos_erase(s, i)

    def _seq_pos_add_cell(self, i: int) -> None:
        for s in self._seqs_of(i):
            self._seq_pos_insert(s, i)

    # the same for many cells at once: `cells` are distinct cell indices
    def _by_seq(self, cells: npt.NDArray[np.int64]) -> list[tuple[int, npt.NDArray[np.int64]]]:
        """(s, the cells of ``cells`` that hold s) for every sequence held by one of ``cells``."""
        if not cells.size:
            return []
        rows = self._seq[cells]
        held = np.bitwise_or.reduce(rows, axis=0).tolist()
        return [(s, cells[(rows[:, s >> 6] & np.uint64(1 << (s & 63))) != 0]) for s in _bits(held)]

    def _seq_pos_drop(self, s: int, cells: npt.NDArray[np.int64]) -> None:
        """Take the entries of ``cells`` (which hold s, at their current positions) out of sequence s's list."""
        if cells.size <= _FEW:
            for i in cells.tolist():
                self._seq_pos_erase(s, i)
            return
        gone = set(cells.tolist())
        self._seq_pos[s] = [e for e in self._seq_pos[s] if e[1] not in gone]

    def _seq_pos_put(self, s: int, cells: npt.NDArray[np.int64]) -> None:
        """Put the entries of ``cells`` (which hold s, at their current positions) into sequence s's list."""
        if cells.size <= _FEW:
            for i in cells.tolist():
                self._seq_pos_insert(s, i)
            return
        lst = self._seq_pos[s]
        lst += sorted(zip(self._pos[cells].tolist(), cells.tolist(), strict=True))
        lst.sort()  # two sorted runs: the sort merges them in one linear pass

    def _seq_pos_rm_cells(self, cells: npt.NDArray[np.int64]) -> None:
        for s, cs in self._by_seq(cells):
            self._seq_pos_drop(s, cs)

    def _seq_pos_add_cells(self, cells: npt.NDArray[np.int64]) -> None:
        for s, cs in self._by_seq(cells):
            self._seq_pos_put(s, cs)

    def _free(self, i: int, reset_ext: bool) -> None:
        """Make cell i empty; its per-sequence entries must already be gone."""
        self._seq[i] = 0
        self._pos[i] = -1
        self._shift[i] = 0
        if reset_ext:
            self._ext[i] = (0, 0, TOKEN_NULL)
        self._n_used -= 1

    def _free_all(self, cells: npt.NDArray[np.int64], reset_ext: bool) -> None:
        """``_free`` of every one of ``cells`` (distinct)."""
        self._seq[cells] = 0
        self._pos[cells] = -1
        self._shift[cells] = 0
        if reset_ext:
            self._ext[cells] = (0, 0, TOKEN_NULL)
        self._n_used -= int(cells.size)

    def _pos_add_all(self, cells: npt.NDArray[np.int64], d: int) -> npt.NDArray[np.bool_]:
        """``pos_add(i, d)`` of every one of ``cells`` (distinct, used, d checked); which ones were freed."""
        if not cells.size:
            return np.zeros(0, dtype=bool)
        self._seq_pos_rm_cells(cells)
        new_pos = _wrap32_all(self._pos[cells].astype(np.int64) + d)
        freed = new_pos < 0
        kept = cells[~freed]
        self._has_shift = True
        self._free_all(cells[freed], reset_ext=False)
        self._pos[kept] = new_pos[~freed]
        self._shift[kept] = _wrap32_all(self._shift[kept].astype(np.int64) + d)
        self._seq_pos_add_cells(kept)
        return freed

    # ------------------------------------------------------------------ copies (prepare() rollback)
    def cp(self, i: CellIndices, n: int | None = None) -> KVCells:
        """Copy cells ``[i, i + n)``, or the cells listed in ``i`` when ``n`` is None, into new cells.

        Shifts are not copied: llama.cpp only copies cells with no pending shift (asserted there).
        """
        idxs = self._cp_indices(i, n)
        if np.any(self._shift[idxs] != 0):
            raise CellError("cp: a copied cell has a pending shift (apply the K-shift first)")
        res = type(self)(len(idxs))
        if res.size() != len(idxs):
            raise CellError(f"cp: {type(self).__name__}({len(idxs)}) made {res.size()} cells")
        res._pos[:] = self._pos[idxs]
        res._ext[:] = self._ext[idxs]
        res._seq[:] = self._seq[idxs]
        res._n_used = int(np.count_nonzero(res._pos != -1))
        res._seq_pos_add_cells(np.flatnonzero(res._pos != -1))
        return res

    def _cp_indices(self, i: CellIndices, n: int | None) -> npt.NDArray[np.int64]:
        size = self._pos.shape[0]
        if n is None:
            idxs = int64_values(i, "i")
            if idxs.size and (idxs.min() < 0 or idxs.max() >= size):
                raise CellError(f"cell index outside [0, {size})")
            return idxs
        i, n = _as_int(i), _as_int(n)  # with a count, ``i`` is the first cell (cp / set pass an int)
        if i < 0 or n < 0 or i + n > size:
            raise CellError(f"cell range [{i}, {i + n}) is outside [0, {size})")
        return np.arange(i, i + n, dtype=np.int64)

    def set(self, i: CellIndices, other: KVCells) -> None:
        """Overwrite cells ``[i, i + len(other))`` (or the cells listed in ``i``) with ``other``'s cells."""
        other_pos, other_ext, other_seq = _cells_arrays(other)
        n = other_pos.shape[0]
        if isinstance(i, (int, np.integer)):
            idxs = self._cp_indices(i, n)
        else:
            idxs = self._cp_indices(i, None)
            if idxs.shape[0] != n:
                raise CellError(f"set: {idxs.shape[0]} indices for {n} cells")
        if np.any(self._shift[idxs] != 0):
            raise CellError("set: a target cell has a pending shift (apply the K-shift first)")
        if n and (other_pos.min() < INT32_MIN or other_pos.max() > POS_MAX):
            # a position below -1 is a cell seq_div moved there (llama.cpp divides toward zero, by any divisor)
            raise CellError("set: the other cells hold a position outside int32")
        if n and (other_ext.min() < INT32_MIN or other_ext.max() > POS_MAX):
            raise CellError("set: the other cells hold an ext value outside the int32 range")
        if np.any(other_seq[other_pos == -1] != 0):
            raise CellError("set: the other cells hold an empty cell with sequences")
        # other cell j is written to cell idxs[j], j = 0, 1, ...: what each target cell holds in the end
        targets, sources = self._set_sources(idxs, other is self)
        was = targets[self._pos[targets] != -1]
        self._seq_pos_rm_cells(was)
        self._pos[targets] = other_pos[sources]
        self._ext[targets] = other_ext[sources]
        self._seq[targets] = other_seq[sources]
        now = targets[self._pos[targets] != -1]
        self._seq_pos_add_cells(now)
        self._n_used += int(now.size) - int(was.size)

    @staticmethod
    def _set_sources(idxs: npt.NDArray[np.int64], aliased: bool) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(targets, sources) of set(): cell ``targets[k]`` ends up with what other cell ``sources[k]`` held.

        The last write to a cell listed twice wins. When the other cells are these cells (``c.set(idxs, c)``),
        the write of cell j reads cell j as the earlier writes left it, so it passes on that cell's source.
        """
        last: dict[int, int] = {}  # target cell -> the last j written to it
        src = np.arange(idxs.size, dtype=np.int64)
        for j, t in enumerate(idxs.tolist()):
            if aliased and j in last:
                src[j] = src[last[j]]
            last[t] = j
        return np.fromiter(last.keys(), np.int64, len(last)), src[np.fromiter(last.values(), np.int64, len(last))]

    # ------------------------------------------------------------------ per-cell operations
    def is_empty(self, i: int) -> bool:
        """True when cell ``i`` holds no position (llama_kv_cells::is_empty)."""
        return bool(self._pos[self._check_index(i)] == -1)

    def rm(self, i: int) -> None:
        """Clear a used cell."""
        i = self._check_used(i, "rm")
        self._seq_pos_rm_cell(i)
        self._free(i, reset_ext=True)

    def seq_rm(self, i: int, seq_id: int) -> bool:
        """Remove ``seq_id`` from a cell that has it; True when the cell became empty."""
        i, seq_id = _as_int(i), _as_int(seq_id)
        s = _check_seq(seq_id)
        i = self._check_used(i, "seq_rm")
        if not self._has(i, s):
            raise CellError(f"seq_rm: cell {i} does not hold sequence {s}")
        self._seq_pos_erase(s, i)
        self._seq[i, s >> 6] &= ~np.uint64(1 << (s & 63))
        if not self._seq[i].any():
            self._free(i, reset_ext=True)
            return True
        return False

    def seq_keep(self, i: int, seq_id: int) -> bool:
        """Keep only ``seq_id`` in the cell; True when the cell became empty (it did not hold it)."""
        i, seq_id = _as_int(i), _as_int(seq_id)
        s = _check_seq(seq_id)
        i = self._check_index(i)
        if self._has(i, s):
            self._seq_pos_rm_cell(i)
            self._seq[i] = 0
            self._seq[i, s >> 6] = np.uint64(1 << (s & 63))
            self._seq_pos_insert(s, i)
            return False
        if self._seq[i].any():
            self._seq_pos_rm_cell(i)
            self._free(i, reset_ext=True)
            return True
        return False

    def seq_count(self, i: int) -> int:
        """The number of sequences a used cell belongs to (llama_kv_cells::seq_count)."""
        i = self._check_used(i, "seq_count")
        return sum(int(w).bit_count() for w in self._seq[i])

    def seq_get_all(self, i: int) -> list[int]:
        """The sequence ids that see cell i, ascending."""
        return self._seqs_of(self._check_index(i))

    def seq_has(self, i: int, seq_id: int) -> bool:
        """True when cell ``i`` belongs to ``seq_id`` (llama_kv_cells::seq_has)."""
        i, seq_id = _as_int(i), _as_int(seq_id)
        return self._has(self._check_index(i), _check_seq(seq_id))

    def seq_add(self, i: int, seq_id: int) -> None:
        """Add ``seq_id`` to a used cell that does not hold it yet."""
        i, seq_id = _as_int(i), _as_int(seq_id)
        s = _check_seq(seq_id)
        i = self._check_used(i, "seq_add")
        if self._has(i, s):
            raise CellError(f"seq_add: cell {i} already holds sequence {s}")
        self._seq[i, s >> 6] |= np.uint64(1 << (s & 63))
        self._seq_pos_insert(s, i)

    def seq_get(self, i: int) -> int:
        """The only sequence of a cell that has exactly one."""
        i = _as_int(i)
        seqs = self._seqs_of(self._check_index(i))
        if len(seqs) != 1:
            raise CellError(f"seq_get: cell {i} holds {len(seqs)} sequences, not exactly one")
        return seqs[0]

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_kv_cells::seq_pos_min: the smallest position of ``seq_id``, or -1 when it holds no cell."""
        lst = self._seq_pos[_check_seq(seq_id)]
        return lst[0][0] if lst else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_kv_cells::seq_pos_max: the largest position of ``seq_id``, or -1 when it holds no cell."""
        lst = self._seq_pos[_check_seq(seq_id)]
        return lst[-1][0] if lst else -1

    def seq_pos_get(self, seq_id: int) -> list[tuple[int, int]]:
        """The (pos, cell) pairs of the sequence, ordered by position then cell."""
        return list(self._seq_pos[_check_seq(seq_id)])

    def seq_pos_tok_le(self, seq_id: int, p: int) -> int:
        """Token of the sequence's cell at the largest position <= p (highest cell on ties), else -1."""
        seq_id, p = _as_int(seq_id), _as_int(p)
        lst = self._seq_pos[_check_seq(seq_id)]
        k = bisect.bisect_right(lst, (p, 2**32))
        if k == 0:
            return TOKEN_NULL
        return int(self._ext[lst[k - 1][1], 2])

    def pos_get(self, i: int) -> int:
        """The position of a used cell (llama_kv_cells::pos_get)."""
        return int(self._pos[self._check_used(i, "pos_get")])

    def ext_get(self, i: int) -> tuple[int, int, int]:
        """(x, y, tok) of a used cell."""
        x, y, tok = self._ext[self._check_used(i, "ext_get")]
        return int(x), int(y), int(tok)

    def ext_set(self, i: int, x: int = 0, y: int = 0, tok: int = TOKEN_NULL) -> None:
        """Set (x, y, tok) of cell i (empty or not, as llama.cpp allows); each value must be an int32."""
        i, x, y, tok = _as_int(i), _as_int(x), _as_int(y), _as_int(tok)
        i = self._check_index(i)
        vals = (x, y, tok)
        if not all(INT32_MIN <= v <= POS_MAX for v in vals):
            raise CellError(f"ext_set: {vals} has a value outside the int32 range")
        self._ext[i] = vals

    def get_shift(self, i: int) -> int:
        """The pending shift of a used cell (llama_kv_cells::get_shift)."""
        return int(self._shift[self._check_used(i, "get_shift")])

    def pos_in(self, i: int, p0: int, p1: int) -> bool:
        """True when the cell is used and p0 <= pos < p1."""
        i, p0, p1 = _as_int(i), _as_int(p0), _as_int(p1)
        p = self._pos[self._check_index(i)]
        return bool(p >= p0 and p < p1 and p != -1)

    def pos_set(self, i: int, p: int) -> None:
        """Place position p in an empty cell (has_shift is not touched). Any int32 but -1, which marks an empty cell
        (llama.cpp would keep the cell used while it reads as empty: CorruptionError); a position below -1 is one a
        seq_div by a negative divisor left, as a state restores it."""
        self._pos_set(_as_int(i), _as_int(p))

    def _pos_set(self, i: int, p: int) -> int:
        """pos_set of converted arguments; returns the cell."""
        i = self._check_index(i)
        if self._pos[i] != -1 or self._seq[i].any():
            raise CellError(f"pos_set: cell {i} is not empty")
        if p == -1:
            raise CorruptionError("pos_set: position -1 marks an empty cell")
        if p < INT32_MIN:
            raise CellError(f"pos_set: position {p} is below {INT32_MIN}")
        if p > POS_MAX:
            raise CellError(f"pos_set: position {p} is above {POS_MAX}")
        self._pos[i] = p
        self._n_used += 1
        return i

    def pos_set_shifted(self, i: int, p: int, shift: int) -> None:
        """pos_set(i, p) with a pending shift ``shift`` already recorded (has_shift set when it is not 0).

        llama.cpp's cross-stream seq_cp places ``p - shift`` then pos_add(shift); after a seq_div that
        intermediate position can be negative (only an assert, compiled out, objects), but the cell always
        ends at ``p`` with shift ``shift``: this is that end state.
        """
        i, p, shift = _as_int(i), _as_int(p), _as_int(shift)
        sh = _wrap32(shift)
        i = self._pos_set(i, p)
        if sh != 0:
            self._shift[i] = sh
            self._has_shift = True

    def pos_add(self, i: int, d: int) -> bool:
        """pos += d and shift += d; True when the position went negative and the cell was freed.

        As in llama.cpp, a cell freed here keeps its ext (only rm/seq_rm/seq_keep reset it). ``d`` must be
        an int32 (CellError, cell unchanged); the position and the shift wrap as int32s, like llama.cpp's (a
        position moved past POS_MAX turns negative: the cell is freed).
        """
        i, d = _as_int(i), _as_int(d)
        i = self._check_used(i, "pos_add")
        d = self._check_delta("pos_add", d)
        self._seq_pos_rm_cell(i)
        new_pos = _wrap32(int(self._pos[i]) + d)
        self._has_shift = True
        if new_pos < 0:
            self._free(i, reset_ext=False)
            return True
        self._pos[i] = new_pos
        self._shift[i] = _wrap32(int(self._shift[i]) + d)
        self._seq_pos_add_cell(i)
        return False

    def pos_div(self, i: int, d: int) -> None:
        """pos /= d, dividing toward zero as C does (a negative d gives a negative position); the change goes into
        shift. CellError for d = 0 (llama.cpp's SIGFPE), CorruptionError when the position would become -1."""
        i, d = _as_int(i), _as_int(d)
        i = self._check_used(i, "pos_div")
        old = int(self._pos[i])
        new = int(_check_divisor("pos_div", d, np.array([old], dtype=np.int64))[0])
        self._seq_pos_rm_cell(i)
        self._pos[i] = new
        self._shift[i] = _wrap32(int(self._shift[i]) + old - new)
        self._seq_pos_add_cell(i)
        self._has_shift = True

    # ------------------------------------------------------------------ bulk forms
    def pos_set_many(self, idxs: Iterable[int], positions: Iterable[int]) -> None:
        """``pos_set(idxs[k], positions[k])`` for every k; all-or-nothing."""
        ia = int64_values(idxs, "idxs")
        pa = int64_values(positions, "positions")
        if ia.shape != pa.shape:
            raise CellError(f"pos_set_many: {ia.size} indices for {pa.size} positions")
        for k in range(ia.size):
            self._check_index(int(ia[k]))
        if np.unique(ia).size != ia.size:
            raise CellError("pos_set_many: a cell index appears twice")
        # the first element pos_set would refuse: its cell is not empty, or its position is -1 or outside int32
        taken = (self._pos[ia] != -1) | self._seq[ia].any(axis=1)
        bad = taken | (pa == -1) | (pa < INT32_MIN) | (pa > POS_MAX)
        if bad.any():
            if taken[np.flatnonzero(bad)[0]]:
                raise CellError("pos_set_many: a target cell is not empty")
            raise CellError("pos_set_many: a position is -1 (an empty cell) or outside int32")
        self._pos[ia] = pa  # pos_set of every listed cell, all checked above
        self._n_used += int(ia.size)

    def seq_add_many(self, idxs: Iterable[int], seq_ids: int | Iterable[int]) -> None:
        """``seq_add(idxs[k], seq_ids[k])`` (or one seq id for all); all-or-nothing."""
        ia = int64_values(idxs, "idxs")
        sa = int64_values(seq_ids, "seq_ids", ia.size)
        for k in range(ia.size):
            i, s = self._check_used(int(ia[k]), "seq_add_many"), _check_seq(int(sa[k]))
            if self._has(i, s):
                raise CellError(f"seq_add_many: cell {i} already holds sequence {s}")
        if len(set(zip(ia.tolist(), sa.tolist(), strict=True))) != ia.size:
            raise CellError("seq_add_many: a (cell, sequence) pair appears twice")
        for s in np.unique(sa).tolist():
            cells = ia[sa == s]
            self._seq[cells, s >> 6] |= np.uint64(1 << (s & 63))
            self._seq_pos_put(s, cells)

    def ext_set_many(
        self, idxs: Iterable[int], xs: int | Iterable[int], ys: int | Iterable[int], toks: int | Iterable[int]
    ) -> None:
        """``ext_set(idxs[k], xs[k], ys[k], toks[k])`` for every k (a single value applies to all); all-or-nothing.

        The first element that ``ext_set`` would refuse (an index outside the cells, a value outside int32) is
        named in the error, and no cell changes.
        """
        ia = int64_values(idxs, "idxs")
        vals = [int64_values(v, name, ia.size) for v, name in ((xs, "xs"), (ys, "ys"), (toks, "toks"))]
        bad = (ia < 0) | (ia >= self.size())
        for v in vals:
            bad |= (v < INT32_MIN) | (v > POS_MAX)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            self._check_index(int(ia[k]))  # an index outside the cells is named first
            raise CellError(f"ext_set_many: {tuple(int(v[k]) for v in vals)} has a value outside the int32 range")
        # a cell listed twice gets its last (x, y, tok), as ext_set one after the other leaves it
        last = ia.size - 1 - np.unique(ia[::-1], return_index=True)[1]
        self._ext[ia[last]] = np.stack([v[last] for v in vals], axis=1)

    def place(
        self,
        idxs: Iterable[int],
        positions: Iterable[int],
        seq_ids: Iterable[int],
        ext: tuple[int | Iterable[int], int | Iterable[int], int | Iterable[int]] | None = None,
        check: bool = False,
    ) -> bool:
        """apply_ubatch's writes of tokens of one sequence each into empty cells, in one call: ``pos_set(idxs[k],
        positions[k])``, ``ext_set(idxs[k], *ext[k])`` when ``ext`` (x, y, tok; a single value applies to all) is
        given, ``seq_add(idxs[k], seq_ids[k])``; all-or-nothing. With ``check`` nothing is written.

        True when the writes are done (or, with ``check``, would be); False, and nothing changes, when one of them
        would be refused: an index outside the cells or listed twice, a target cell that is not empty, a position
        outside ``[0, POS_MAX]``, an ext value outside int32, a sequence id outside ``[0, LLAMA_MAX_SEQ)``, or
        values that are not integers. The caller then makes the writes one kind at a time, which raise the error.
        """
        try:
            ia = int64_values(idxs, "idxs")
            pa = int64_values(positions, "positions")
            sa = int64_values(seq_ids, "seq_ids")
            if ext is not None:
                ext = tuple(ext)  # type: ignore[assignment]
        except (KVRefError, TypeError):  # TypeError: an ext that is not a sequence
            return False
        if ext is not None and len(ext) != 3:
            return False
        if pa.shape != ia.shape or sa.shape != ia.shape:
            return False
        try:
            vals = [int64_values(v, "ext", ia.size) for v in ext] if ext is not None else []
        except KVRefError:
            return False
        if ia.size == 0:
            return True
        if ia.min() < 0 or ia.max() >= self.size() or np.unique(ia).size != ia.size:
            return False
        if np.any(self._pos[ia] != -1) or np.any(self._seq[ia] != 0):
            return False
        if (pa == -1).any() or pa.min() < INT32_MIN or pa.max() > POS_MAX or sa.min() < 0 or sa.max() >= LLAMA_MAX_SEQ:
            return False
        if any(v.min() < INT32_MIN or v.max() > POS_MAX for v in vals):
            return False
        if check:
            return True
        self._pos[ia] = pa  # pos_set of every cell
        self._n_used += int(ia.size)
        if vals:
            self._ext[ia] = np.stack(vals, axis=1)
        for s in np.unique(sa).tolist():  # seq_add of every cell
            cells = ia[sa == s]
            self._seq[cells, s >> 6] |= np.uint64(1 << (s & 63))
            self._seq_pos_put(s, cells)
        return True

    def pos_add_many(self, idxs: Iterable[int], d: int) -> npt.NDArray[np.bool_]:
        """``pos_add(i, d)`` for every listed used cell; returns which cells were freed (bool array)."""
        ia = int64_values(idxs, "idxs")
        d = _as_int(d)
        for k in range(ia.size):
            self._check_used(int(ia[k]), "pos_add_many")
        if np.unique(ia).size != ia.size:
            raise CellError("pos_add_many: a cell index appears twice")
        d = self._check_delta("pos_add_many", d)
        return self._pos_add_all(ia, d)

    def seq_pos_min_many(self, seq_ids: Iterable[int]) -> IntArray:
        """``seq_pos_min`` of every listed sequence, as an int32 array."""
        lists = [self._seq_pos[_check_seq(s)] for s in int64_values(seq_ids, "seq_ids").tolist()]
        return np.array([lst[0][0] if lst else -1 for lst in lists], dtype=np.int32)

    def seq_pos_max_many(self, seq_ids: Iterable[int]) -> IntArray:
        """``seq_pos_max`` of every listed sequence, as an int32 array."""
        lists = [self._seq_pos[_check_seq(s)] for s in int64_values(seq_ids, "seq_ids").tolist()]
        return np.array([lst[-1][0] if lst else -1 for lst in lists], dtype=np.int32)

    # ------------------------------------------------------------------ range operations
    # The loops of llama_kv_cache's sequence operations over one stream. Positions are a half-open
    # range [p0, p1) already normalised by the caller (llama.cpp maps p0 < 0 to 0 and p1 < 0 to
    # POS_MAX). Each returns the index of the first cell it freed, or size() when it freed none,
    # which is what the cache needs to move its head.
    def seq_rm_range(self, seq_id: int, p0: int, p1: int) -> int:
        """Remove ``seq_id`` (every sequence when -1) from the used cells with p0 <= pos < p1."""
        seq_id, p0, p1 = _as_int(seq_id), _as_int(p0), _as_int(p1)
        size = self.size()
        if seq_id == -1:
            cells = np.flatnonzero(self._in_range(p0, p1))
            self._seq_pos_rm_cells(cells)
            self._free_all(cells, reset_ext=True)
            return int(cells[0]) if cells.size else size
        s = _check_seq(seq_id)
        cells = np.flatnonzero(self._in_range(p0, p1) & self._has_all(s))
        self._seq_pos_drop(s, cells)
        self._seq[cells, s >> 6] &= ~np.uint64(1 << (s & 63))
        emptied = cells[~self._seq[cells].any(axis=1)]
        self._free_all(emptied, reset_ext=True)
        return int(emptied[0]) if emptied.size else size

    def seq_cp_range(self, seq_src: int, seq_dst: int, p0: int, p1: int) -> None:
        """Add ``seq_dst`` to every cell of ``seq_src`` with p0 <= pos < p1.

        A cell that already holds ``seq_dst`` is left as it is (what a release build of llama.cpp does).
        """
        seq_src, seq_dst, p0, p1 = _as_int(seq_src), _as_int(seq_dst), _as_int(p0), _as_int(p1)
        src, dst = _check_seq(seq_src), _check_seq(seq_dst)
        if src == dst:
            return
        cells = np.flatnonzero(self._in_range(p0, p1) & self._has_all(src) & ~self._has_all(dst))
        self._seq[cells, dst >> 6] |= np.uint64(1 << (dst & 63))
        self._seq_pos_put(dst, cells)

    def seq_keep_all(self, seq_id: int) -> int:
        """``seq_keep(i, seq_id)`` on every cell."""
        s = _check_seq(seq_id)
        keep = self._has_all(s)
        gone = np.flatnonzero(~keep & self._seq.any(axis=1))
        only_s = np.zeros(N_SEQ_WORDS, dtype=np.uint64)
        only_s[s >> 6] = np.uint64(1 << (s & 63))
        self._seq[keep] = only_s
        self._free_all(gone, reset_ext=True)
        # no cell holds another sequence now; sequence s keeps its cells, at their positions
        for t in range(LLAMA_MAX_SEQ):
            if t != s:
                self._seq_pos[t] = []
        return int(gone[0]) if gone.size else self.size()

    def seq_add_range(self, seq_id: int, p0: int, p1: int, delta: int) -> int:
        """``pos_add(i, delta)`` on every cell of ``seq_id`` with p0 <= pos < p1; all-or-nothing."""
        seq_id, p0, p1, delta = _as_int(seq_id), _as_int(p0), _as_int(p1), _as_int(delta)
        s = _check_seq(seq_id)
        cells = np.flatnonzero(self._in_range(p0, p1) & self._has_all(s))
        delta = self._check_delta("seq_add_range", delta)
        freed = cells[self._pos_add_all(cells, delta)]
        return int(freed[0]) if freed.size else self.size()

    def seq_div_range(self, seq_id: int, p0: int, p1: int, d: int, check: bool = False) -> None:
        """``pos_div(i, d)`` on every cell of ``seq_id`` with p0 <= pos < p1; all-or-nothing. No cell in range: nothing
        happens, whatever ``d`` (llama.cpp divides nothing). With ``check`` nothing is changed, the errors are raised
        all the same (a composite memory checks every cache before changing any)."""
        seq_id, p0, p1, d = _as_int(seq_id), _as_int(p0), _as_int(p1), _as_int(d)
        s = _check_seq(seq_id)
        cells = np.flatnonzero(self._in_range(p0, p1) & self._has_all(s))
        if not cells.size:
            return
        old = self._pos[cells].astype(np.int64)
        new = _check_divisor("seq_div_range", d, old)
        if check:
            return
        self._seq_pos_rm_cells(cells)
        self._pos[cells] = new
        self._shift[cells] = _wrap32_all(self._shift[cells].astype(np.int64) + old - new)
        self._seq_pos_add_cells(cells)
        self._has_shift = True

    def __repr__(self) -> str:
        return f"KVCells(size={self.size()}, used={self._n_used}, has_shift={self._has_shift})"


# the methods that read one number run without the guard (as in the Cython twin)
_UNGUARDED = frozenset({"size", "get_used", "get_has_shift"})
# the public methods that never change the cells; a call of any other one counts as a change (`_mutations`)
_READERS = _UNGUARDED | {
    "used_min", "used_max_p1", "n_kv", "used_cells", "cp", "is_empty", "seq_count", "seq_get_all", "seq_has",
    "seq_get", "seq_pos_min", "seq_pos_max", "seq_pos_get", "seq_pos_tok_le", "pos_get", "ext_get", "get_shift",
    "pos_in", "seq_pos_min_many", "seq_pos_max_many",
}  # fmt: skip


def _atomic_methods(cls: type) -> type:
    """Run every public method of ``cls`` but those in ``_UNGUARDED`` under the object's guard (the module docstring
    states the contract): a call waits for another thread's call to end; a nested call from the thread already inside
    a call is refused with CellError before it does anything."""

    def guarded(f: Callable[Concatenate[KVCells, _P], _R]) -> Callable[Concatenate[KVCells, _P], _R]:
        what = f.__name__
        changes = 0 if what in _READERS else 1

        @functools.wraps(f)
        def run(self: KVCells, *args: _P.args, **kw: _P.kwargs) -> _R:
            me = threading.get_ident()
            if not self._lock.acquire(blocking=False):
                if self._owner == me:  # only this thread sets it to its id, and clears it before it lets go
                    raise CellError(_nested(what))
                self._lock.acquire()
            self._owner = me
            try:
                return f(self, *args, **kw)
            finally:
                self._mutations += changes  # after an error too: counting a call that changed nothing is safe
                self._owner = None
                self._lock.release()

        return run

    for name, f in list(vars(cls).items()):
        if not name.startswith("_") and callable(f) and name not in _UNGUARDED:
            setattr(cls, name, guarded(f))
    return cls


_atomic_methods(KVCells)


__all__ = ["INT32_MIN", "LLAMA_MAX_SEQ", "N_SEQ_WORDS", "POS_MAX", "TOKEN_NULL", "KVCells"]
