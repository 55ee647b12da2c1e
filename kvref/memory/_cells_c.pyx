# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Cython twin of the KV cell bookkeeping (llama.cpp's ``llama_kv_cells``, src/llama-kv-cells.h).

Same API, semantics, errors and NumPy views as ``kvref/memory/_cells_py.py`` (read that module for the rules).
What differs is only how the work is done:

- the arrays are the same NumPy arrays, reached through raw pointers in ``nogil`` loops;
- the per-sequence index is one ``std::set<pair<pos, cell>>`` per sequence; entries whose position
  changes are re-keyed in place (node extract/insert, no allocation), and new entries are inserted
  with an end hint, which is O(1) when positions arrive in ascending order (the usual case);
- a shift that moves a large share of a sequence's entries (pos_add_many, seq_add_range,
  seq_div_range) re-keys that sequence's set in one ordered walk instead of entry by entry;
- set() skips the index work for a cell whose position and sequences do not change;
- the used set is a count plus bounds [lo, hi) that contain every used cell, tightened lazily when
  used_min()/used_max_p1() are asked (exact, and O(1) amortised);
- bulk and range methods validate everything first, then run in C without touching Python objects.

Every index reaching a C loop has been range-checked before, which is why bounds checks are off.

Threads and re-entry (the contract is the Python twin's): the guard is a busy flag and an owner thread id, set and
cleared under the GIL (a few nanoseconds; an OS lock would double the cost of a one-cell call), taken by every method
but size(), len(), get_used() and get_has_shift(). A second thread that finds it taken waits with the GIL released,
on a lock made the first time anyone has to wait; the thread that holds it refuses a nested call with CellError.
The C loops keep the GIL too (``with nogil(False)``), and the slot kernels (``_slots_c.pyx``) take the same guard
while they read the cells' buffers, so no pointer is used after a Python-level call could have moved it.
"""

from libc.stdint cimport INT64_MAX, INT64_MIN, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref, predecrement as dec, preincrement as inc

cimport numpy as cnp

import numpy as np

from kvref.constants cimport LLAMA_MAX_SEQ as MAX_SEQ, N_SEQ_WORDS as N_WORDS

from cpython.exc cimport PyErr_CheckSignals
from cpython.number cimport PyNumber_Index
from cpython.pythread cimport (
    NOWAIT_LOCK, PY_LOCK_INTR, PyLockStatus, PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock,
    PyThread_get_thread_ident, PyThread_type_lock,
)

from ..args import check_alloc, int64_values
from ..constants import CELL_BYTES, INT32_MIN, LLAMA_MAX_SEQ, N_SEQ_WORDS, POS_MAX, TOKEN_NULL
from ..errors import ArgumentTypeError, CellError, CorruptionError, KVRefError, SequenceError

cnp.import_array()

cdef int32_t C_POS_MAX = 2147483647
cdef int64_t C_INT32_MIN = -2147483648
cdef int64_t C_INT64_MAX = INT64_MAX
cdef int64_t C_INT64_MIN = INT64_MIN


cdef extern from *:
    """
    #include <algorithm>
    #include <cstdint>
    #include <iterator>
    #include <vector>
    #include <set>
    #include <utility>

    typedef std::set<std::pair<int32_t, uint32_t> > kvref_pos_set;

    /* Insert (p, i) with an end hint: constant time when it belongs at the end. */
    static inline void kvref_ps_insert(kvref_pos_set &s, int32_t p, uint32_t i) {
        s.emplace_hint(s.end(), p, i);
    }

    /* Insert (p, i) right before a known neighbour (constant time when the hint is right). */
    static inline kvref_pos_set::iterator kvref_ps_insert_at(kvref_pos_set &s, kvref_pos_set::iterator hint,
                                                             int32_t p, uint32_t i) {
        return s.emplace_hint(hint, p, i);
    }

    static inline void kvref_ps_erase_range(kvref_pos_set &s, kvref_pos_set::iterator first,
                                            kvref_pos_set::iterator last) {
        s.erase(first, last);
    }

    static inline void kvref_ps_erase(kvref_pos_set &s, int32_t p, uint32_t i) {
        s.erase(std::make_pair(p, i));
    }

    /* Change the position of entry (p_old, i) to p_new, reusing its node; the old successor is the hint,
       which is exact whenever the entry keeps its rank (uniform shifts, small moves). */
    static inline void kvref_ps_move(kvref_pos_set &s, int32_t p_old, int32_t p_new, uint32_t i) {
        auto it = s.find(std::make_pair(p_old, i));
        auto hint = std::next(it);
        auto node = s.extract(it);
        node.value().first = p_new;
        s.insert(hint, std::move(node));
    }

    /* The position p + d as llama.cpp's int32 addition leaves it: wrapped past INT32_MAX (to a negative one). */
    static inline int64_t kvref_add32(int64_t p, int64_t d) {
        return (int64_t) (int32_t) (uint32_t) (uint64_t) (p + d);
    }

    /* Re-key, in one ordered walk, every entry of s whose cell is marked: its position becomes p / d
       (div, toward zero) or p + d wrapped to int32, dropped when a sum is negative (the cell is freed; a
       quotient stays, negative or not). When the new keys keep the set's order
       (checked first: the usual case of a uniform shift) they are written in place -- the key is only
       const to protect the ordering, which is preserved here; otherwise the set is rebuilt sorted. */
    static inline void kvref_ps_rekey(kvref_pos_set &s, const uint8_t *mark, int64_t d, int div) {
        bool in_order = true, have_prev = false;
        std::pair<int32_t, uint32_t> prev;
        for (const auto &e : s) {
            int64_t p = e.first;
            if (mark[e.second]) {
                p = div ? p / d : kvref_add32(p, d);
                if (!div && p < 0) continue;
            }
            std::pair<int32_t, uint32_t> cur((int32_t) p, e.second);
            if (have_prev && !(prev < cur)) { in_order = false; break; }
            prev = cur;
            have_prev = true;
        }
        if (in_order) {
            for (auto it = s.begin(); it != s.end();) {
                if (mark[it->second]) {
                    int64_t p = div ? it->first / d : kvref_add32(it->first, d);
                    if (!div && p < 0) { it = s.erase(it); continue; }
                    const_cast<int32_t &>(it->first) = (int32_t) p;
                }
                ++it;
            }
            return;
        }
        std::vector<std::pair<int32_t, uint32_t> > v;
        v.reserve(s.size());
        for (const auto &e : s) {
            int64_t p = e.first;
            if (mark[e.second]) {
                p = div ? p / d : kvref_add32(p, d);
                if (!div && p < 0) continue;
            }
            v.emplace_back((int32_t) p, e.second);
        }
        std::sort(v.begin(), v.end());
        s.clear();
        for (const auto &e : v) s.emplace_hint(s.end(), e);
    }

    static inline int kvref_popcount(uint64_t w) { return __builtin_popcountll(w); }
    static inline int kvref_ctz(uint64_t w) { return __builtin_ctzll(w); }
    """
    void ps_insert "kvref_ps_insert"(PosSet& s, int32_t p, uint32_t i) noexcept nogil
    PosSet.iterator ps_insert_at "kvref_ps_insert_at"(PosSet& s, PosSet.iterator hint, int32_t p,
                                                      uint32_t i) noexcept nogil
    void ps_erase "kvref_ps_erase"(PosSet& s, int32_t p, uint32_t i) noexcept nogil
    void ps_erase_range "kvref_ps_erase_range"(PosSet& s, PosSet.iterator first, PosSet.iterator last) noexcept nogil
    void ps_move "kvref_ps_move"(PosSet& s, int32_t p_old, int32_t p_new, uint32_t i) noexcept nogil
    void ps_rekey "kvref_ps_rekey"(PosSet& s, const uint8_t* mark, int64_t d, int div) noexcept nogil
    int64_t add32 "kvref_add32"(int64_t p, int64_t d) noexcept nogil
    int popcount "kvref_popcount"(uint64_t w) noexcept nogil
    int ctz "kvref_ctz"(uint64_t w) noexcept nogil

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1

cdef extern from "pythread.h":
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds,
                                             int intr_flag) nogil


cdef inline object _as_int(object o):
    """``o`` as a Python int, integers only (operator.index), as the Python twin takes it."""
    if type(o) is int:
        return o
    try:
        return PyNumber_Index(o)
    except TypeError:
        raise ArgumentTypeError(f"expected an integer, got {type(o).__name__} {o!r}") from None


cdef inline int64_t _clamp64(object o) except? -1:
    """int(o) saturated to int64: exact for every range comparison the methods make."""
    cdef int overflow = 0
    cdef long long v
    if type(o) is int:
        v = PyLong_AsLongLongAndOverflow(o, &overflow)
    else:
        v = PyLong_AsLongLongAndOverflow(_as_int(o), &overflow)
    if overflow > 0:
        return C_INT64_MAX
    if overflow < 0:
        return C_INT64_MIN
    return v


cdef inline int _seq_id(object seq_id) except -1:
    cdef int64_t s
    if type(seq_id) is int:
        s = _clamp64(seq_id)
        if 0 <= s < MAX_SEQ:
            return <int>s
    return _seq_id_slow(seq_id)


cdef int _seq_id_slow(object seq_id) except -1:
    """_seq_id of anything: converted once (one __index__ call), refused with that value."""
    seq_id = _as_int(seq_id)
    cdef int64_t s = _clamp64(seq_id)
    if s < 0 or s >= MAX_SEQ:
        raise SequenceError(f"seq_id {seq_id} is outside [0, {LLAMA_MAX_SEQ})")
    return <int>s


cdef Py_ssize_t _index_slow(object i, Py_ssize_t n) except -1:
    """KVCells._index of anything: converted once (one __index__ call), refused with that value."""
    i = _as_int(i)
    cdef int64_t v = _clamp64(i)
    if v < 0 or v >= n:
        raise CellError(f"cell index {i} is outside [0, {n})")
    return <Py_ssize_t>v


cdef inline int32_t _wrap32(int64_t v) noexcept nogil:
    # two's complement wrap, as the int32 shift in llama.cpp
    return <int32_t><uint32_t><uint64_t>v


cdef inline int32_t _clamp_key(int64_t p) noexcept nogil:
    """A position bound as a set key (callers handle bounds beyond int32 separately)."""
    if p < C_INT32_MIN:
        return <int32_t>C_INT32_MIN
    if p > C_POS_MAX:
        return C_POS_MAX
    return <int32_t>p


cdef bint _to_i64(object a, vector[int64_t]& out, Py_ssize_t n) except -1:
    """Fill ``out`` with ``a`` as ``int64_values`` (kvref.args) reads it: flattened when ``n`` < 0, else broadcast
    to ``n`` values (one value repeated). False when it refuses ``a`` (any kvref error)."""
    cdef int overflow = 0
    cdef long long v
    cdef Py_ssize_t k, m
    cdef cnp.ndarray arr
    cdef const int64_t* d
    out.clear()
    if type(a) is int:
        v = PyLong_AsLongLongAndOverflow(a, &overflow)
        if overflow:
            v = C_INT64_MAX if overflow > 0 else C_INT64_MIN  # saturated, as int64_values does
        out.resize(1 if n < 0 else n, v)
        return True
    if type(a) is list:  # plain ints read directly (anything else goes through int64_values below)
        m = len(<list>a)
        if n < 0 or m == n:
            out.reserve(m)
            for k in range(m):
                o = (<list>a)[k]
                if type(o) is not int:
                    break
                v = PyLong_AsLongLongAndOverflow(o, &overflow)
                if overflow:
                    v = C_INT64_MAX if overflow > 0 else C_INT64_MIN
                out.push_back(v)
            if <Py_ssize_t>out.size() == m:
                return True
            out.clear()
    try:
        arr = int64_values(a, "values", None if n < 0 else n)
    except KVRefError:
        return False
    d = <const int64_t*>cnp.PyArray_DATA(arr)
    out.assign(d, d + arr.shape[0])
    return True


cdef inline cnp.ndarray _ro(cnp.ndarray a):
    v = a.view()
    v.flags.writeable = False
    return v


def _cells_arrays(other):
    """``other``'s (pos, ext, seq) as integer arrays of the cells' shapes, for set(); the same checks as the Python
    twin's ``_cells_arrays``."""
    try:
        pos, ext, seq = np.asarray(other.pos), np.asarray(other.ext), np.asarray(other.seq)
    except AttributeError:
        raise ArgumentTypeError(f"set: expected cells (pos, ext and seq arrays), got {type(other).__name__}") from None
    if any(a.dtype.kind not in "biu" for a in (pos, ext, seq)):
        raise ArgumentTypeError("set: the other cells' pos/ext/seq are not integer arrays")
    n = pos.shape[0] if pos.ndim == 1 else -1
    if n < 0 or ext.shape != (n, 3) or seq.shape != (n, N_SEQ_WORDS):
        raise CellError("set: the other cells' pos/ext/seq arrays do not have the cells' shapes")
    return pos, ext, seq


cdef str _nested(str what):
    return (f"{what}: these cells are already inside a call in this thread (an argument's __index__, a finalizer, "
            "...): the nested call is refused and nothing changes")


cdef inline int _take(KVCells c, str what, CellsGuard& g) except -1:
    """KVCells._enter, inlined into the methods."""
    if c._busy:
        c._wait(what)
    else:
        c._busy = 1
        c._owner = PyThread_get_thread_ident()
    g.busy = &c._busy
    g.owner = &c._owner
    g.waiters = &c._waiters
    g.gate = &c._gate
    return 0


cdef class KVCells:
    """The cells of one KV stream: positions, shifts, ext and sequence sets, with llama.cpp's rules."""

    def __cinit__(self, *args, **kwargs):
        self._seq_pos.resize(MAX_SEQ)
        self._n = 0

    def __init__(self, size=0):
        self.resize(size)

    def __dealloc__(self):
        if self._gate != NULL:
            PyThread_free_lock(self._gate)
            self._gate = NULL

    # ------------------------------------------------------------------ the guard (see the module docstring)
    cdef int _enter(self, str what, CellsGuard& g) except -1:
        """Take the guard for a call of method ``what``; ``g`` (a local of the caller) gives it back when the caller
        returns, whatever the path."""
        return _take(self, what, g)

    cdef int _wait(self, str what) except -1:
        """The guard is taken: a nested call from the thread holding it is refused; another thread waits for it."""
        cdef long me = PyThread_get_thread_ident()
        cdef PyLockStatus got
        if self._owner == me:
            raise CellError(_nested(what))
        if self._gate == NULL:  # the first wait: a lock, held except while a returning call signals the waiters
            self._gate = PyThread_allocate_lock()
            if self._gate == NULL:
                raise MemoryError("cannot allocate the cells' lock")
            PyThread_acquire_lock(self._gate, NOWAIT_LOCK)
        self._waiters += 1
        try:
            while self._busy:
                with nogil:
                    got = PyThread_acquire_lock_timed(self._gate, -1, 1)
                if got == PY_LOCK_INTR:
                    PyErr_CheckSignals()  # a KeyboardInterrupt ends the wait
        finally:
            self._waiters -= 1
        self._busy = 1
        self._owner = me
        return 0

    # ------------------------------------------------------------------ whole-array state
    def resize(self, n):
        """Give the cells ``n`` slots, all empty (llama.cpp's resize() ends with reset()).

        Everything is allocated before anything is replaced: a resize that fails (MemoryError, a refused size)
        leaves the cells as they were.
        """
        cdef CellsGuard guard
        _take(self, "resize", guard)
        n = _as_int(n)
        if n < 0:
            raise CellError(f"cannot resize cells to {n}")
        if n > 0xFFFFFFFF:
            raise CellError(f"cannot resize cells to {n} (cell indices are uint32)")
        check_alloc(n * CELL_BYTES, f"{n} KV cells", "use fewer cells")
        cdef cnp.ndarray pos_arr = np.empty(n, dtype=np.int32)
        cdef cnp.ndarray shift_arr = np.empty(n, dtype=np.int32)
        cdef cnp.ndarray ext_arr = np.empty((n, 3), dtype=np.int32)
        cdef cnp.ndarray seq_arr = np.empty((n, N_WORDS), dtype=np.uint64)
        cdef vector[uint8_t] mark
        mark.resize(n)  # zeros; std::bad_alloc is a MemoryError
        self._pos_arr, self._shift_arr, self._ext_arr, self._seq_arr = pos_arr, shift_arr, ext_arr, seq_arr
        self._pos = <int32_t*>cnp.PyArray_DATA(pos_arr)
        self._shift = <int32_t*>cnp.PyArray_DATA(shift_arr)
        self._ext = <int32_t*>cnp.PyArray_DATA(ext_arr)
        self._seq = <uint64_t*>cnp.PyArray_DATA(seq_arr)
        self._n = n
        self._mark.swap(mark)
        self._reset()

    def reset(self):
        """Make every cell empty, with no pending shift and a null ext (llama_kv_cells::reset); the size stays."""
        cdef CellsGuard guard
        _take(self, "reset", guard)
        self._reset()

    cdef void _reset(self) noexcept:
        cdef Py_ssize_t i
        cdef int w, s
        with nogil(False):
            for i in range(self._n):
                self._pos[i] = -1
                self._shift[i] = 0
                self._ext[3 * i] = 0
                self._ext[3 * i + 1] = 0
                self._ext[3 * i + 2] = -1
                for w in range(N_WORDS):
                    self._seq[N_WORDS * i + w] = 0
            for s in range(MAX_SEQ):
                self._seq_pos[s].clear()
        self._has_shift = False
        self._n_used = 0
        self._lo = 0
        self._hi = 0

    def reset_shift(self):
        """Zero every cell's pending shift and clear has_shift (llama_kv_cells::reset_shift)."""
        cdef CellsGuard guard
        _take(self, "reset_shift", guard)
        cdef Py_ssize_t i
        self._has_shift = False
        with nogil(False):
            for i in range(self._n):
                self._shift[i] = 0

    def size(self):
        """The number of cells (llama_kv_cells::size)."""
        return self._n

    def __len__(self):
        return self._n

    def get_used(self):
        """The number of used cells, pos != -1 (llama_kv_cells::get_used)."""
        return self._n_used

    cdef void _tighten(self) noexcept nogil:
        if self._n_used == 0:
            self._lo = 0
            self._hi = 0
            return
        while self._pos[self._lo] == -1:
            self._lo += 1
        while self._pos[self._hi - 1] == -1:
            self._hi -= 1

    def used_min(self):
        """Index of the first used cell, 0 when none is used."""
        cdef CellsGuard guard
        _take(self, "used_min", guard)
        self._tighten()
        return self._lo

    def used_max_p1(self):
        """Index of the last used cell + 1, 0 when none is used."""
        cdef CellsGuard guard
        _take(self, "used_max_p1", guard)
        self._tighten()
        return self._hi

    def n_kv(self, n_pad):
        """This stream's part of llama_kv_cache::get_n_kv: ``used_max_p1`` rounded up to a multiple of ``n_pad``
        (``n_pad`` >= 1), at least ``n_pad``, at most ``size``."""
        cdef CellsGuard guard
        _take(self, "n_kv", guard)
        cdef int64_t pad = _clamp64(n_pad), padded
        if pad < 1:
            raise CellError(f"n_kv: n_pad {_as_int(n_pad)} is below 1")
        if pad >= self._n:  # every cell (and no overflow below)
            return self._n
        self._tighten()
        padded = (self._hi + pad - 1) // pad * pad
        if padded < pad:
            padded = pad
        return padded if padded < self._n else self._n

    def used_cells(self):
        """Indices of the used cells, ascending (llama.cpp's ``used`` set)."""
        cdef CellsGuard guard
        _take(self, "used_cells", guard)
        cdef cnp.ndarray out = np.empty(self._n_used, dtype=np.int32)
        cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(out)
        cdef Py_ssize_t i, k = 0
        self._tighten()
        with nogil(False):
            for i in range(self._lo, self._hi):
                if self._pos[i] != -1:
                    o[k] = <int32_t>i
                    k += 1
        return out

    def get_has_shift(self):
        """True when a position was shifted since the last reset_shift (llama_kv_cells::get_has_shift)."""
        return bool(self._has_shift)

    # read-only NumPy views of the arrays
    @property
    def pos(self):
        """Read-only int32 (n,) view of the cells' positions, -1 for an empty cell."""
        return _ro(self._pos_arr)

    @property
    def shift(self):
        """Read-only int32 (n,) view of the cells' pending shifts (accumulated since reset_shift)."""
        return _ro(self._shift_arr)

    @property
    def ext(self):
        """Read-only int32 (n, 3) view of the cells' ext: x, y (M-RoPE 2-D position) and token."""
        return _ro(self._ext_arr)

    @property
    def seq(self):
        """Read-only uint64 (n, 4) view of the cells' sequence sets: bit s % 64 of word s // 64 is sequence s."""
        return _ro(self._seq_arr)

    # ------------------------------------------------------------------ C helpers (indices already valid)
    cdef inline bint _has(self, Py_ssize_t i, int s) noexcept nogil:
        return (self._seq[N_WORDS * i + (s >> 6)] >> (s & 63)) & 1

    cdef inline bint _any(self, Py_ssize_t i) noexcept nogil:
        cdef uint64_t* w = self._seq + N_WORDS * i
        return (w[0] | w[1] | w[2] | w[3]) != 0

    cdef inline void _on_used(self, Py_ssize_t i) noexcept nogil:
        """Cell i just became used."""
        if self._n_used == 0:
            self._lo = i
            self._hi = i + 1
        else:
            if i < self._lo:
                self._lo = i
            if i >= self._hi:
                self._hi = i + 1
        self._n_used += 1

    cdef void _sp_rm_cell(self, Py_ssize_t i) noexcept nogil:
        """Drop cell i from the index of every sequence it holds."""
        cdef int w
        cdef uint64_t word
        cdef int32_t p = self._pos[i]
        for w in range(N_WORDS):
            word = self._seq[N_WORDS * i + w]
            while word:
                ps_erase(self._seq_pos[w * 64 + ctz(word)], p, <uint32_t>i)
                word &= word - 1

    cdef void _sp_add_cell(self, Py_ssize_t i) noexcept nogil:
        """Enter cell i into the index of every sequence it holds."""
        cdef int w
        cdef uint64_t word
        cdef int32_t p = self._pos[i]
        for w in range(N_WORDS):
            word = self._seq[N_WORDS * i + w]
            while word:
                ps_insert(self._seq_pos[w * 64 + ctz(word)], p, <uint32_t>i)
                word &= word - 1

    cdef void _sp_move_cell(self, Py_ssize_t i, int32_t p_new) noexcept nogil:
        """Re-key cell i from its current position to p_new in every sequence it holds (pos not written)."""
        cdef int w
        cdef uint64_t word
        cdef int32_t p = self._pos[i]
        if p == p_new:
            return
        for w in range(N_WORDS):
            word = self._seq[N_WORDS * i + w]
            while word:
                ps_move(self._seq_pos[w * 64 + ctz(word)], p, p_new, <uint32_t>i)
                word &= word - 1

    cdef inline void _free(self, Py_ssize_t i, bint reset_ext) noexcept nogil:
        """Make cell i empty; its index entries must already be gone."""
        cdef int w
        for w in range(N_WORDS):
            self._seq[N_WORDS * i + w] = 0
        self._pos[i] = -1
        self._shift[i] = 0
        if reset_ext:
            self._ext[3 * i] = 0
            self._ext[3 * i + 1] = 0
            self._ext[3 * i + 2] = -1
        self._n_used -= 1

    cdef bint _pos_add_c(self, Py_ssize_t i, int64_t d) noexcept nogil:
        """pos_add on a used cell with a validated delta (the sum wraps as an int32)."""
        cdef int64_t new_pos = add32(self._pos[i], d)
        self._has_shift = True
        if new_pos < 0:
            self._sp_rm_cell(i)
            self._free(i, False)
            return True
        self._sp_move_cell(i, <int32_t>new_pos)
        self._pos[i] = <int32_t>new_pos
        self._shift[i] = _wrap32(<int64_t>self._shift[i] + d)
        return False

    cdef void _pos_div_c(self, Py_ssize_t i, int64_t d) noexcept nogil:
        """pos_div on a used cell with a validated divisor (not 0, the quotient not -1): toward zero (cdivision)."""
        cdef int64_t old = self._pos[i]
        cdef int64_t new_pos = old // d
        self._sp_move_cell(i, <int32_t>new_pos)
        self._pos[i] = <int32_t>new_pos
        self._shift[i] = _wrap32(<int64_t>self._shift[i] + old - new_pos)
        self._has_shift = True

    cdef void _shift_cells(self, vector[uint32_t]& cells, int64_t d, bint div, uint8_t* freed) noexcept nogil:
        """pos_add(i, d) (or pos_div(i, d) when div) on every listed cell: used, distinct, d validated.

        freed[k] (when not NULL) tells whether cells[k] was freed (a sum that wrapped or went negative; a quotient
        never frees). A sequence whose index has a large
        share of its entries moving is re-keyed in one ordered walk (ps_rekey) instead of entry by entry.
        """
        cdef Py_ssize_t k, m = cells.size()
        cdef uint32_t i
        cdef int w, s
        cdef uint64_t word
        cdef uint32_t cnt[MAX_SEQ]
        cdef uint64_t bulk[N_WORDS]
        cdef uint8_t* mark = self._mark.data()
        cdef int64_t old, new_pos
        cdef bint any_bulk = False, gone
        if m == 0:
            return
        memset(bulk, 0, sizeof(bulk))
        if m >= 16:
            memset(cnt, 0, sizeof(cnt))
            for k in range(m):
                i = cells[k]
                for w in range(N_WORDS):
                    word = self._seq[N_WORDS * i + w]
                    while word:
                        cnt[w * 64 + ctz(word)] += 1
                        word &= word - 1
            for s in range(MAX_SEQ):
                if cnt[s] >= 16 and <size_t>cnt[s] * 8 >= self._seq_pos[s].size():
                    bulk[s >> 6] |= (<uint64_t>1) << (s & 63)
                    any_bulk = True
            if any_bulk:
                for k in range(m):
                    mark[cells[k]] = 1
                for s in range(MAX_SEQ):
                    if (bulk[s >> 6] >> (s & 63)) & 1:
                        ps_rekey(self._seq_pos[s], mark, d, div)
                for k in range(m):
                    mark[cells[k]] = 0
        for k in range(m):
            i = cells[k]
            old = self._pos[i]
            new_pos = old // d if div else add32(old, d)
            gone = not div and new_pos < 0
            if gone or new_pos != old:  # a cell at a negative position (a negative divisor put it there) goes by 0
                for w in range(N_WORDS):
                    word = self._seq[N_WORDS * i + w] & ~bulk[w]
                    while word:
                        s = w * 64 + ctz(word)
                        if gone:
                            ps_erase(self._seq_pos[s], <int32_t>old, i)
                        else:
                            ps_move(self._seq_pos[s], <int32_t>old, <int32_t>new_pos, i)
                        word &= word - 1
            if gone:
                self._free(i, False)  # pos_add keeps ext, as llama.cpp's does
            else:
                self._pos[i] = <int32_t>new_pos
                self._shift[i] = _wrap32(<int64_t>self._shift[i] + (old - new_pos if div else d))
            if freed != NULL:
                freed[k] = gone
        self._has_shift = True

    # ------------------------------------------------------------------ argument checks
    cdef Py_ssize_t _index(self, object i) except -1:
        """A cell index checked against the size."""
        cdef int64_t v
        if type(i) is int:
            v = _clamp64(i)
            if 0 <= v < self._n:
                return <Py_ssize_t>v
        return _index_slow(i, self._n)

    cdef Py_ssize_t _used(self, object i, str what) except -1:
        cdef Py_ssize_t v = self._index(i)
        if self._pos[v] == -1:
            raise CellError(f"{what}: cell {v} is empty")
        return v

    cdef int64_t _delta(self, str what, object d) except? -1:
        """Validate a position delta (int32); a position it moves past POS_MAX wraps (to a negative one: freed)."""
        cdef int64_t v = _clamp64(d)
        if v < C_INT32_MIN or v > C_POS_MAX:
            raise CellError(f"{what}: delta {_as_int(d)} is outside the int32 range")
        return v

    cdef int64_t _divisor(self, str what, object d, vector[uint32_t]& cells) except? -1:
        """Validate a divisor for the listed cells (see the Python twin's _check_divisor): not 0 (llama.cpp's SIGFPE),
        no quotient -1 (an empty cell that stays used: CorruptionError). A divisor past int64 is clamped (every
        int32 position divides to 0 either way)."""
        cdef int64_t v = _clamp64(d)
        cdef Py_ssize_t k
        cdef int64_t old = 0
        cdef bint bad = False
        if cells.size() == 0:
            return v
        if v == 0:
            raise CellError(f"{what}: division by 0 (llama.cpp dies of SIGFPE)")
        with nogil(False):
            for k in range(<Py_ssize_t>cells.size()):
                old = self._pos[cells[k]]
                if old / v == -1:
                    bad = True
                    break
        if bad:
            raise CorruptionError(f"{what}: position {old} / {_as_int(d)} is -1, which marks an empty cell (llama.cpp "
                                  "keeps the cell used and in its sequences while it reads as empty)")
        return v

    cdef cnp.ndarray _cp_indices(self, object i, object n):
        cdef Py_ssize_t size = self._n
        cdef cnp.ndarray idxs
        if n is None:
            idxs = int64_values(i, "i")
            if idxs.size and (idxs.min() < 0 or idxs.max() >= size):
                raise CellError(f"cell index outside [0, {size})")
            return idxs
        i, n = _as_int(i), _as_int(n)
        if i < 0 or n < 0 or i + n > size:
            raise CellError(f"cell range [{i}, {i + n}) is outside [0, {size})")
        return np.arange(i, i + n, dtype=np.int64)

    # ------------------------------------------------------------------ copies (prepare() rollback)
    def cp(self, i, n=None):
        """Copy cells ``[i, i + n)``, or the cells listed in ``i`` when ``n`` is None, into new cells.

        Shifts are not copied: llama.cpp only copies cells with no pending shift (asserted there).
        """
        cdef CellsGuard guard
        _take(self, "cp", guard)
        cdef cnp.ndarray idxs = self._cp_indices(i, n)
        cdef const int64_t[::1] iv = idxs
        cdef Py_ssize_t k = idxs.shape[0]
        cdef Py_ssize_t j, idx
        cdef int w
        for j in range(k):
            if self._shift[iv[j]] != 0:
                raise CellError("cp: a copied cell has a pending shift (apply the K-shift first)")
        res = type(self)(k)
        cdef KVCells r = <KVCells?>res
        if r._n != k:
            raise CellError(f"cp: {type(self).__name__}({k}) made {r._n} cells")
        with nogil(False):
            for j in range(k):
                idx = iv[j]
                r._pos[j] = self._pos[idx]
                memcpy(&r._ext[3 * j], &self._ext[3 * idx], 3 * sizeof(int32_t))
                for w in range(N_WORDS):
                    r._seq[N_WORDS * j + w] = self._seq[N_WORDS * idx + w]
                if r._pos[j] != -1:
                    r._on_used(j)
                    r._sp_add_cell(j)
        return res

    def set(self, i, other):
        """Overwrite cells ``[i, i + len(other))`` (or the cells listed in ``i``) with ``other``'s cells."""
        cdef CellsGuard guard
        _take(self, "set", guard)
        raw_pos, raw_ext, raw_seq = _cells_arrays(other)
        cdef Py_ssize_t n = raw_pos.shape[0]
        cdef cnp.ndarray idxs
        if isinstance(i, (int, np.integer)):
            idxs = self._cp_indices(i, n)
        else:
            idxs = self._cp_indices(i, None)
            if idxs.shape[0] != n:
                raise CellError(f"set: {idxs.shape[0]} indices for {n} cells")
        cdef const int64_t[::1] iv = idxs
        cdef Py_ssize_t j, idx
        for j in range(n):
            if self._shift[iv[j]] != 0:
                raise CellError("set: a target cell has a pending shift (apply the K-shift first)")
        if n and (raw_pos.min() < INT32_MIN or raw_pos.max() > POS_MAX):
            # a position below -1 is a cell seq_div moved there (llama.cpp divides toward zero, by any divisor)
            raise CellError("set: the other cells hold a position outside int32")
        if n and (raw_ext.min() < INT32_MIN or raw_ext.max() > POS_MAX):
            raise CellError("set: the other cells hold an ext value outside the int32 range")
        cdef const int32_t[::1] opos = np.ascontiguousarray(raw_pos, dtype=np.int32)
        cdef const int32_t[:, ::1] oext = np.ascontiguousarray(raw_ext, dtype=np.int32)
        cdef const uint64_t[:, ::1] oseq = np.ascontiguousarray(raw_seq, dtype=np.uint64)
        cdef int w
        cdef bint was, now, same
        for j in range(n):
            if opos[j] == -1 and (oseq[j, 0] | oseq[j, 1] | oseq[j, 2] | oseq[j, 3]) != 0:
                raise CellError("set: the other cells hold an empty cell with sequences")
        with nogil(False):
            for j in range(n):
                idx = iv[j]
                was = self._pos[idx] != -1
                now = opos[j] != -1
                self._ext[3 * idx] = oext[j, 0]
                self._ext[3 * idx + 1] = oext[j, 1]
                self._ext[3 * idx + 2] = oext[j, 2]
                if was and now and self._pos[idx] == opos[j]:
                    same = True
                    for w in range(N_WORDS):
                        if self._seq[N_WORDS * idx + w] != oseq[j, w]:
                            same = False
                    if same:
                        continue  # removing then re-adding the same index entries changes nothing
                if was:
                    self._sp_rm_cell(idx)
                self._pos[idx] = opos[j]
                for w in range(N_WORDS):
                    self._seq[N_WORDS * idx + w] = oseq[j, w]
                if now:
                    self._sp_add_cell(idx)
                    if not was:
                        self._on_used(idx)
                elif was:
                    self._n_used -= 1

    # ------------------------------------------------------------------ per-cell operations
    def is_empty(self, i):
        """True when cell ``i`` holds no position (llama_kv_cells::is_empty)."""
        cdef CellsGuard guard
        _take(self, "is_empty", guard)
        return self._pos[self._index(i)] == -1

    def rm(self, i):
        """Clear a used cell."""
        cdef CellsGuard guard
        _take(self, "rm", guard)
        cdef Py_ssize_t v = self._used(i, "rm")
        self._sp_rm_cell(v)
        self._free(v, True)

    def seq_rm(self, i, seq_id):
        """Remove ``seq_id`` from a cell that has it; True when the cell became empty."""
        cdef CellsGuard guard
        _take(self, "seq_rm", guard)
        i, seq_id = _as_int(i), _as_int(seq_id)
        cdef int s = _seq_id(seq_id)
        cdef Py_ssize_t v = self._used(i, "seq_rm")
        if not self._has(v, s):
            raise CellError(f"seq_rm: cell {v} does not hold sequence {s}")
        ps_erase(self._seq_pos[s], self._pos[v], <uint32_t>v)
        self._seq[N_WORDS * v + (s >> 6)] &= ~((<uint64_t>1) << (s & 63))
        if not self._any(v):
            self._free(v, True)
            return True
        return False

    def seq_keep(self, i, seq_id):
        """Keep only ``seq_id`` in the cell; True when the cell became empty (it did not hold it)."""
        cdef CellsGuard guard
        _take(self, "seq_keep", guard)
        i, seq_id = _as_int(i), _as_int(seq_id)
        cdef int s = _seq_id(seq_id)
        cdef Py_ssize_t v = self._index(i)
        cdef int w
        if self._has(v, s):
            # drop the other sequences' entries; the entry of s stays as it is
            self._seq[N_WORDS * v + (s >> 6)] &= ~((<uint64_t>1) << (s & 63))
            self._sp_rm_cell(v)
            for w in range(N_WORDS):
                self._seq[N_WORDS * v + w] = 0
            self._seq[N_WORDS * v + (s >> 6)] = (<uint64_t>1) << (s & 63)
            return False
        if self._any(v):
            self._sp_rm_cell(v)
            self._free(v, True)
            return True
        return False

    def seq_count(self, i):
        """The number of sequences a used cell belongs to (llama_kv_cells::seq_count)."""
        cdef CellsGuard guard
        _take(self, "seq_count", guard)
        cdef Py_ssize_t v = self._used(i, "seq_count")
        cdef int w, c = 0
        for w in range(N_WORDS):
            c += popcount(self._seq[N_WORDS * v + w])
        return c

    cdef list _seqs_of(self, Py_ssize_t v):
        cdef list out = []
        cdef int w
        cdef uint64_t word
        for w in range(N_WORDS):
            word = self._seq[N_WORDS * v + w]
            while word:
                out.append(w * 64 + ctz(word))
                word &= word - 1
        return out

    def seq_get_all(self, i):
        """The sequence ids that see cell i, ascending."""
        cdef CellsGuard guard
        _take(self, "seq_get_all", guard)
        return self._seqs_of(self._index(i))

    def seq_has(self, i, seq_id):
        """True when cell ``i`` belongs to ``seq_id`` (llama_kv_cells::seq_has)."""
        cdef CellsGuard guard
        _take(self, "seq_has", guard)
        i, seq_id = _as_int(i), _as_int(seq_id)
        cdef Py_ssize_t v = self._index(i)
        return self._has(v, _seq_id(seq_id))

    def seq_add(self, i, seq_id):
        """Add ``seq_id`` to a used cell that does not hold it yet."""
        cdef CellsGuard guard
        _take(self, "seq_add", guard)
        i, seq_id = _as_int(i), _as_int(seq_id)
        cdef int s = _seq_id(seq_id)
        cdef Py_ssize_t v = self._used(i, "seq_add")
        if self._has(v, s):
            raise CellError(f"seq_add: cell {v} already holds sequence {s}")
        self._seq[N_WORDS * v + (s >> 6)] |= (<uint64_t>1) << (s & 63)
        ps_insert(self._seq_pos[s], self._pos[v], <uint32_t>v)

    def seq_get(self, i):
        """The only sequence of a cell that has exactly one."""
        cdef CellsGuard guard
        _take(self, "seq_get", guard)
        i = _as_int(i)
        seqs = self._seqs_of(self._index(i))
        if len(seqs) != 1:
            raise CellError(f"seq_get: cell {i} holds {len(seqs)} sequences, not exactly one")
        return seqs[0]

    def seq_pos_min(self, seq_id):
        """Like llama_kv_cells::seq_pos_min: the smallest position of ``seq_id``, or -1 when it holds no cell."""
        cdef CellsGuard guard
        _take(self, "seq_pos_min", guard)
        cdef int s = _seq_id(seq_id)
        if self._seq_pos[s].empty():
            return -1
        return deref(self._seq_pos[s].begin()).first

    def seq_pos_max(self, seq_id):
        """Like llama_kv_cells::seq_pos_max: the largest position of ``seq_id``, or -1 when it holds no cell."""
        cdef CellsGuard guard
        _take(self, "seq_pos_max", guard)
        return self._seq_pos_max_c(_seq_id(seq_id))

    cdef int64_t _seq_pos_max_c(self, int s) noexcept nogil:
        if self._seq_pos[s].empty():
            return -1
        return deref(self._seq_pos[s].rbegin()).first

    def seq_pos_get(self, seq_id):
        """The (pos, cell) pairs of the sequence, ordered by position then cell."""
        cdef CellsGuard guard
        _take(self, "seq_pos_get", guard)
        cdef int s = _seq_id(seq_id)
        cdef list out = []
        cdef PosSet.iterator it = self._seq_pos[s].begin()
        while it != self._seq_pos[s].end():
            out.append((deref(it).first, deref(it).second))
            inc(it)
        return out

    def seq_pos_tok_le(self, seq_id, p):
        """Token of the sequence's cell at the largest position <= p (highest cell on ties), else -1."""
        cdef CellsGuard guard
        _take(self, "seq_pos_tok_le", guard)
        seq_id, p = _as_int(seq_id), _as_int(p)
        cdef int s = _seq_id(seq_id)
        cdef int64_t pv = _clamp64(p)
        cdef PosSet.iterator it
        if pv < C_INT32_MIN:
            return -1
        it = self._seq_pos[s].upper_bound(PosCell(_clamp_key(pv), 0xFFFFFFFF))
        if it == self._seq_pos[s].begin():
            return -1
        dec(it)
        return self._ext[3 * deref(it).second + 2]

    def pos_get(self, i):
        """The position of a used cell (llama_kv_cells::pos_get)."""
        cdef CellsGuard guard
        _take(self, "pos_get", guard)
        return self._pos[self._used(i, "pos_get")]

    def ext_get(self, i):
        """(x, y, tok) of a used cell."""
        cdef CellsGuard guard
        _take(self, "ext_get", guard)
        cdef Py_ssize_t v = self._used(i, "ext_get")
        return (self._ext[3 * v], self._ext[3 * v + 1], self._ext[3 * v + 2])

    def ext_set(self, i, x=0, y=0, tok=TOKEN_NULL):
        """Set (x, y, tok) of cell i (empty or not, as llama.cpp allows); each value must be an int32."""
        cdef CellsGuard guard
        _take(self, "ext_set", guard)
        i, x, y, tok = _as_int(i), _as_int(x), _as_int(y), _as_int(tok)
        cdef Py_ssize_t v = self._index(i)
        vals = (x, y, tok)
        cdef int64_t xv = _clamp64(vals[0]), yv = _clamp64(vals[1]), tv = _clamp64(vals[2])
        if not (C_INT32_MIN <= xv <= C_POS_MAX and C_INT32_MIN <= yv <= C_POS_MAX and C_INT32_MIN <= tv <= C_POS_MAX):
            raise CellError(f"ext_set: {vals} has a value outside the int32 range")
        self._ext[3 * v] = <int32_t>xv
        self._ext[3 * v + 1] = <int32_t>yv
        self._ext[3 * v + 2] = <int32_t>tv

    def get_shift(self, i):
        """The pending shift of a used cell (llama_kv_cells::get_shift)."""
        cdef CellsGuard guard
        _take(self, "get_shift", guard)
        return self._shift[self._used(i, "get_shift")]

    def pos_in(self, i, p0, p1):
        """True when the cell is used and p0 <= pos < p1."""
        cdef CellsGuard guard
        _take(self, "pos_in", guard)
        i, p0, p1 = _as_int(i), _as_int(p0), _as_int(p1)
        cdef int32_t p = self._pos[self._index(i)]
        return p >= _clamp64(p0) and p < _clamp64(p1) and p != -1

    def pos_set(self, i, p):
        """Place position p in an empty cell (has_shift is not touched): any int32 but -1 (see the Python twin)."""
        cdef CellsGuard guard
        _take(self, "pos_set", guard)
        self._pos_set(_as_int(i), _as_int(p))

    cdef Py_ssize_t _pos_set(self, object i, object p) except -1:
        """pos_set of converted arguments; returns the cell."""
        cdef Py_ssize_t v = self._index(i)
        if self._pos[v] != -1 or self._any(v):
            raise CellError(f"pos_set: cell {v} is not empty")
        cdef int64_t pv = _clamp64(p)
        if pv == -1:
            raise CorruptionError("pos_set: position -1 marks an empty cell")
        if pv < C_INT32_MIN:
            raise CellError(f"pos_set: position {p} is below {INT32_MIN}")
        if pv > C_POS_MAX:
            raise CellError(f"pos_set: position {p} is above {POS_MAX}")
        self._pos[v] = <int32_t>pv
        self._on_used(v)
        return v

    def pos_set_shifted(self, i, p, shift):
        """pos_set(i, p) with a pending shift ``shift`` already recorded (has_shift set when it is not 0).

        llama.cpp's cross-stream seq_cp places ``p - shift`` then pos_add(shift); after a seq_div that
        intermediate position can be negative (only an assert, compiled out, objects), but the cell always
        ends at ``p`` with shift ``shift``: this is that end state.
        """
        cdef CellsGuard guard
        _take(self, "pos_set_shifted", guard)
        i, p, shift = _as_int(i), _as_int(p), _as_int(shift)
        cdef int32_t sh = <int32_t>((shift - C_INT32_MIN) % 4294967296 + C_INT32_MIN)  # wrapped as an int32
        cdef Py_ssize_t v = self._pos_set(i, p)
        if sh != 0:
            self._shift[v] = sh
            self._has_shift = True

    def pos_add(self, i, d):
        """pos += d and shift += d; True when the position went negative and the cell was freed.

        As in llama.cpp, a cell freed here keeps its ext (only rm/seq_rm/seq_keep reset it). ``d`` must be
        an int32 (CellError, cell unchanged); the position and the shift wrap as int32s, like llama.cpp's (a
        position moved past POS_MAX turns negative: the cell is freed).
        """
        cdef CellsGuard guard
        _take(self, "pos_add", guard)
        i, d = _as_int(i), _as_int(d)
        cdef Py_ssize_t v = self._used(i, "pos_add")
        cdef int64_t dv = self._delta("pos_add", d)
        return self._pos_add_c(v, dv)

    def pos_div(self, i, d):
        """pos /= d, dividing toward zero as C does (a negative d gives a negative position); the change goes into
        shift. CellError for d = 0 (llama.cpp's SIGFPE), CorruptionError when the position would become -1."""
        cdef CellsGuard guard
        _take(self, "pos_div", guard)
        i, d = _as_int(i), _as_int(d)
        cdef Py_ssize_t v = self._used(i, "pos_div")
        cdef vector[uint32_t] one
        one.push_back(<uint32_t>v)
        cdef int64_t dv = self._divisor("pos_div", d, one)
        self._pos_div_c(v, dv)

    # ------------------------------------------------------------------ bulk forms
    def pos_set_many(self, idxs, positions):
        """``pos_set(idxs[k], positions[k])`` for every k; all-or-nothing."""
        cdef CellsGuard guard
        _take(self, "pos_set_many", guard)
        ia = int64_values(idxs, "idxs")
        pa = int64_values(positions, "positions")
        if ia.shape != pa.shape:
            raise CellError(f"pos_set_many: {ia.size} indices for {pa.size} positions")
        cdef const int64_t[::1] iv = ia
        cdef const int64_t[::1] pv = pa
        cdef Py_ssize_t k = 0, m = iv.shape[0], n = self._n
        cdef int64_t idx
        cdef int err = 0
        with nogil(False):
            for k in range(m):
                idx = iv[k]
                if idx < 0 or idx >= n:
                    err = 1
                    break
            if not err:
                err = self._mark_dups(iv)
            if not err:
                for k in range(m):
                    idx = iv[k]
                    if self._pos[idx] != -1 or self._any(idx):
                        err = 3
                        break
                    if pv[k] == -1 or pv[k] < C_INT32_MIN or pv[k] > C_POS_MAX:
                        err = 4
                        break
            if not err:
                for k in range(m):
                    idx = iv[k]
                    self._pos[idx] = <int32_t>pv[k]
                    self._on_used(idx)
        if err == 1:
            raise CellError(f"cell index {iv[k]} is outside [0, {n})")
        if err == 2:
            raise CellError("pos_set_many: a cell index appears twice")
        if err == 3:
            raise CellError("pos_set_many: a target cell is not empty")
        if err == 4:
            raise CellError("pos_set_many: a position is -1 (an empty cell) or outside int32")

    cdef int _mark_dups(self, const int64_t[::1] iv) noexcept nogil:
        """2 when an (already range-checked) index appears twice in iv, else 0; leaves _mark all zero."""
        cdef Py_ssize_t k, m = iv.shape[0]
        cdef int err = 0
        cdef uint8_t* mark = self._mark.data()
        for k in range(m):
            if mark[iv[k]]:
                err = 2
                break
            mark[iv[k]] = 1
        for k in range(m):
            mark[iv[k]] = 0
        return err

    def seq_add_many(self, idxs, seq_ids):
        """``seq_add(idxs[k], seq_ids[k])`` (or one seq id for all); all-or-nothing."""
        cdef CellsGuard guard
        _take(self, "seq_add_many", guard)
        ia = int64_values(idxs, "idxs")
        sa = int64_values(seq_ids, "seq_ids", ia.shape[0])
        cdef const int64_t[::1] iv = ia
        cdef const int64_t[:] sv = sa
        cdef Py_ssize_t k = 0, j, m = iv.shape[0], n = self._n
        cdef int64_t idx, s
        cdef int err = 0
        cdef uint64_t bit
        with nogil(False):
            # 1. every element, in order: index, used, sequence id, not held yet
            for k in range(m):
                idx = iv[k]
                s = sv[k]
                if idx < 0 or idx >= n:
                    err = 1
                elif self._pos[idx] == -1:
                    err = 2
                elif s < 0 or s >= MAX_SEQ:
                    err = 3
                elif self._has(idx, <int>s):
                    err = 4
                if err:
                    break
            # 2. a (cell, sequence) pair twice: set the bits, undo them on a repeat
            if not err:
                for k in range(m):
                    idx = iv[k]
                    s = sv[k]
                    bit = (<uint64_t>1) << (s & 63)
                    if self._seq[N_WORDS * idx + (s >> 6)] & bit:
                        err = 5
                        for j in range(k):
                            self._seq[N_WORDS * iv[j] + (sv[j] >> 6)] &= ~((<uint64_t>1) << (sv[j] & 63))
                        break
                    self._seq[N_WORDS * idx + (s >> 6)] |= bit
            if not err:
                for k in range(m):
                    ps_insert(self._seq_pos[sv[k]], self._pos[iv[k]], <uint32_t>iv[k])
        if err == 1:
            raise CellError(f"cell index {iv[k]} is outside [0, {n})")
        if err == 2:
            raise CellError(f"seq_add_many: cell {iv[k]} is empty")
        if err == 3:
            raise SequenceError(f"seq_id {sv[k]} is outside [0, {LLAMA_MAX_SEQ})")
        if err == 4:
            raise CellError(f"seq_add_many: cell {iv[k]} already holds sequence {sv[k]}")
        if err == 5:
            raise CellError("seq_add_many: a (cell, sequence) pair appears twice")

    def ext_set_many(self, idxs, xs, ys, toks):
        """``ext_set(idxs[k], xs[k], ys[k], toks[k])`` for every k (a single value applies to all); all-or-nothing.

        The first element that ``ext_set`` would refuse (an index outside the cells, a value outside int32) is
        named in the error, and no cell changes.
        """
        cdef CellsGuard guard
        _take(self, "ext_set_many", guard)
        ia = int64_values(idxs, "idxs")
        xa = int64_values(xs, "xs", ia.shape[0])
        ya = int64_values(ys, "ys", ia.shape[0])
        ta = int64_values(toks, "toks", ia.shape[0])
        cdef const int64_t[::1] iv = ia
        cdef const int64_t[:] xv = xa
        cdef const int64_t[:] yv = ya
        cdef const int64_t[:] tv = ta
        cdef Py_ssize_t k = 0, m = iv.shape[0], n = self._n
        cdef int64_t idx
        cdef int err = 0
        with nogil(False):
            for k in range(m):
                idx = iv[k]
                if idx < 0 or idx >= n:
                    err = 1
                    break
                if not (C_INT32_MIN <= xv[k] <= C_POS_MAX and C_INT32_MIN <= yv[k] <= C_POS_MAX
                        and C_INT32_MIN <= tv[k] <= C_POS_MAX):
                    err = 2
                    break
            if not err:
                for k in range(m):
                    idx = iv[k]
                    self._ext[3 * idx] = <int32_t>xv[k]
                    self._ext[3 * idx + 1] = <int32_t>yv[k]
                    self._ext[3 * idx + 2] = <int32_t>tv[k]
        if err == 1:
            raise CellError(f"cell index {iv[k]} is outside [0, {n})")
        if err == 2:
            raise CellError(f"ext_set_many: {(xv[k], yv[k], tv[k])} has a value outside the int32 range")

    def place(self, idxs, positions, seq_ids, ext=None, check=False):
        """apply_ubatch's writes of tokens of one sequence each into empty cells, in one call; all-or-nothing.

        True when the writes are done (or, with ``check``, would be); False, and nothing changes, when one of them
        would be refused (see the Python twin).
        """
        cdef CellsGuard guard
        _take(self, "place", guard)
        cdef vector[int64_t] iv, pv, sv, xv, yv, tv
        cdef bint with_ext = ext is not None
        if not (_to_i64(idxs, iv, -1) and _to_i64(positions, pv, -1) and _to_i64(seq_ids, sv, -1)):
            return False
        cdef Py_ssize_t m = iv.size()
        if <Py_ssize_t>pv.size() != m or <Py_ssize_t>sv.size() != m:
            return False
        if with_ext:
            try:
                ext = tuple(ext)
            except TypeError:
                return False
            if len(ext) != 3:
                return False
            if not (_to_i64(ext[0], xv, m) and _to_i64(ext[1], yv, m) and _to_i64(ext[2], tv, m)):
                return False
        return self._place_c(iv.data(), pv.data(), sv.data(), xv.data() if with_ext else NULL,
                             yv.data() if with_ext else NULL, tv.data() if with_ext else NULL, m, check)

    cdef bint _place_c(self, const int64_t* idxs, const int64_t* pos, const int64_t* seq, const int64_t* x,
                       const int64_t* y, const int64_t* tok, Py_ssize_t m, bint check) noexcept nogil:
        """place() on C arrays (``x`` NULL: no ext written)."""
        cdef Py_ssize_t k, n = self._n
        cdef int64_t idx, s
        cdef uint8_t* mark = self._mark.data()
        cdef bint ok = True, with_ext = x != NULL
        for k in range(m):
            idx = idxs[k]
            if idx < 0 or idx >= n or self._pos[idx] != -1 or self._any(idx) or mark[idx]:
                ok = False
                break
            mark[idx] = 1
            if pos[k] == -1 or pos[k] < C_INT32_MIN or pos[k] > C_POS_MAX or seq[k] < 0 or seq[k] >= MAX_SEQ:
                ok = False
                break
            if with_ext and not (C_INT32_MIN <= x[k] <= C_POS_MAX and C_INT32_MIN <= y[k] <= C_POS_MAX
                                 and C_INT32_MIN <= tok[k] <= C_POS_MAX):
                ok = False
                break
        for k in range(m):  # _mark back to all zero (only cells in range were marked)
            idx = idxs[k]
            if 0 <= idx < n:
                mark[idx] = 0
        if ok and not check:
            for k in range(m):
                idx = idxs[k]
                s = seq[k]
                self._pos[idx] = <int32_t>pos[k]
                self._on_used(idx)
                if with_ext:
                    self._ext[3 * idx] = <int32_t>x[k]
                    self._ext[3 * idx + 1] = <int32_t>y[k]
                    self._ext[3 * idx + 2] = <int32_t>tok[k]
                self._seq[N_WORDS * idx + (s >> 6)] |= (<uint64_t>1) << (s & 63)
                ps_insert(self._seq_pos[s], <int32_t>pos[k], <uint32_t>idx)
        return ok

    def pos_add_many(self, idxs, d):
        """``pos_add(i, d)`` for every listed used cell; returns which cells were freed (bool array)."""
        cdef CellsGuard guard
        _take(self, "pos_add_many", guard)
        ia = int64_values(idxs, "idxs")
        d = _as_int(d)
        cdef const int64_t[::1] iv = ia
        cdef Py_ssize_t k = 0, m = iv.shape[0], n = self._n
        cdef int64_t idx
        cdef int err = 0
        with nogil(False):
            for k in range(m):
                idx = iv[k]
                if idx < 0 or idx >= n:
                    err = 1
                    break
                if self._pos[idx] == -1:
                    err = 3
                    break
            if not err:
                err = self._mark_dups(iv)
        if err == 1:
            raise CellError(f"cell index {iv[k]} is outside [0, {n})")
        if err == 2:
            raise CellError("pos_add_many: a cell index appears twice")
        if err == 3:
            raise CellError(f"pos_add_many: cell {iv[k]} is empty")
        cdef int64_t dv = self._delta("pos_add_many", d)
        cdef cnp.ndarray out = np.empty(m, dtype=np.bool_)
        cdef uint8_t* o = <uint8_t*>cnp.PyArray_DATA(out)
        cdef vector[uint32_t] cells
        with nogil(False):
            cells.resize(m)
            for k in range(m):
                cells[k] = <uint32_t>iv[k]
            self._shift_cells(cells, dv, False, o)
        return out

    cdef cnp.ndarray _seq_pos_ends_many(self, object seq_ids, bint last):
        """seq_pos_min (or max when last) of every listed sequence: a LLAMA_MAX_SEQ-entry table, then a gather."""
        cdef int32_t table[MAX_SEQ]
        cdef int s
        cdef Py_ssize_t k, m
        cdef int64_t v
        cdef int bad = -1
        cdef int overflow = 0
        cdef long long q
        cdef list lst
        cdef cnp.ndarray res
        cdef int32_t* r
        if type(seq_ids) is list:  # plain ints in range: read directly (anything else takes the general path)
            lst = <list>seq_ids
            m = len(lst)
            res = np.empty(m, dtype=np.int32)
            r = <int32_t*>cnp.PyArray_DATA(res)
            for k in range(m):
                item = lst[k]
                if type(item) is not int:
                    break
                q = PyLong_AsLongLongAndOverflow(item, &overflow)
                if overflow or q < 0 or q >= MAX_SEQ:
                    break
                if self._seq_pos[q].empty():
                    r[k] = -1
                elif last:
                    r[k] = deref(self._seq_pos[q].rbegin()).first
                else:
                    r[k] = deref(self._seq_pos[q].begin()).first
            else:
                return res
        arr = int64_values(seq_ids, "seq_ids")
        cdef const int64_t[::1] sv = arr
        m = sv.shape[0]
        cdef cnp.ndarray out = np.empty(m, dtype=np.int32)
        cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(out)
        with nogil(False):
            for s in range(MAX_SEQ):
                if self._seq_pos[s].empty():
                    table[s] = -1
                elif last:
                    table[s] = deref(self._seq_pos[s].rbegin()).first
                else:
                    table[s] = deref(self._seq_pos[s].begin()).first
            for k in range(m):
                v = sv[k]
                if v < 0 or v >= MAX_SEQ:
                    bad = k
                    break
                o[k] = table[v]
        if bad >= 0:
            _seq_id(int(arr[bad]))  # raises, naming the value
        return out

    def seq_pos_min_many(self, seq_ids):
        """``seq_pos_min`` of every listed sequence, as an int32 array."""
        cdef CellsGuard guard
        _take(self, "seq_pos_min_many", guard)
        return self._seq_pos_ends_many(seq_ids, False)

    def seq_pos_max_many(self, seq_ids):
        """``seq_pos_max`` of every listed sequence, as an int32 array."""
        cdef CellsGuard guard
        _take(self, "seq_pos_max_many", guard)
        return self._seq_pos_ends_many(seq_ids, True)

    # ------------------------------------------------------------------ range operations
    # See the Python twin: [p0, p1) is already normalised by the caller; each op returns the index of
    # the first cell it freed, or size() when it freed none. The ops that act on one sequence walk that
    # sequence's index over [p0, p1) instead of scanning every cell: the same cells, found in O(log n).

    cdef void _range(self, int s, int64_t p0, int64_t p1, PosSet.iterator* first,
                     PosSet.iterator* last) noexcept nogil:
        """[first, last): the entries of sequence s with p0 <= pos < p1."""
        cdef PosSet* sp = &self._seq_pos[s]
        if p0 >= p1 or p0 > C_POS_MAX or p1 <= C_INT32_MIN:
            first[0] = sp.end()
            last[0] = sp.end()
            return
        first[0] = sp.lower_bound(PosCell(_clamp_key(p0), 0))
        if p1 > C_POS_MAX:
            last[0] = sp.end()
        else:
            last[0] = sp.lower_bound(PosCell(<int32_t>p1, 0))

    cdef void _collect(self, int s, int64_t p0, int64_t p1, vector[uint32_t]& cells) noexcept nogil:
        cdef PosSet.iterator it, last
        self._range(s, p0, p1, &it, &last)
        while it != last:
            cells.push_back(deref(it).second)
            inc(it)

    def seq_rm_range(self, seq_id, p0, p1):
        """Remove ``seq_id`` (every sequence when -1) from the used cells with p0 <= pos < p1."""
        cdef CellsGuard guard
        _take(self, "seq_rm_range", guard)
        seq_id, p0, p1 = _as_int(seq_id), _as_int(p0), _as_int(p1)
        cdef Py_ssize_t i, first = self._n
        cdef int64_t a = _clamp64(p0), b = _clamp64(p1)
        cdef int32_t p
        cdef int s
        cdef uint32_t c
        cdef PosSet.iterator it, last, first_it
        if seq_id == -1:
            with nogil(False):
                for i in range(self._n):
                    p = self._pos[i]
                    if p != -1 and p >= a and p < b:
                        self._sp_rm_cell(i)
                        self._free(i, True)
                        if i < first:
                            first = i
            return first
        s = _seq_id(seq_id)
        with nogil(False):
            self._range(s, a, b, &it, &last)
            first_it = it
            while it != last:
                c = deref(it).second
                self._seq[N_WORDS * c + (s >> 6)] &= ~((<uint64_t>1) << (s & 63))
                if not self._any(c):
                    self._free(c, True)  # s was its only sequence: no other index entry to drop
                    if c < first:
                        first = c
                inc(it)
            ps_erase_range(self._seq_pos[s], first_it, last)
        return first

    def seq_cp_range(self, seq_src, seq_dst, p0, p1):
        """Add ``seq_dst`` to every cell of ``seq_src`` with p0 <= pos < p1.

        A cell that already holds ``seq_dst`` is left as it is (what a release build of llama.cpp does).
        """
        cdef CellsGuard guard
        _take(self, "seq_cp_range", guard)
        seq_src, seq_dst, p0, p1 = _as_int(seq_src), _as_int(seq_dst), _as_int(p0), _as_int(p1)
        cdef int src = _seq_id(seq_src)
        cdef int dst = _seq_id(seq_dst)
        cdef int64_t a = _clamp64(p0), b = _clamp64(p1)
        cdef PosSet.iterator it, last
        cdef uint32_t c
        if src == dst:
            return
        with nogil(False):
            self._range(src, a, b, &it, &last)
            while it != last:
                c = deref(it).second
                if not self._has(c, dst):
                    self._seq[N_WORDS * c + (dst >> 6)] |= (<uint64_t>1) << (dst & 63)
                    ps_insert(self._seq_pos[dst], deref(it).first, c)
                inc(it)

    def seq_keep_all(self, seq_id):
        """``seq_keep(i, seq_id)`` on every cell."""
        cdef CellsGuard guard
        _take(self, "seq_keep_all", guard)
        cdef int s = _seq_id(seq_id)
        cdef Py_ssize_t i, first = self._n
        cdef int t, w
        cdef uint64_t keep = (<uint64_t>1) << (s & 63)
        with nogil(False):
            # afterwards no cell holds any other sequence, so their indexes end up empty
            for t in range(MAX_SEQ):
                if t != s:
                    self._seq_pos[t].clear()
            for i in range(self._n):
                if self._has(i, s):
                    for w in range(N_WORDS):
                        self._seq[N_WORDS * i + w] = 0
                    self._seq[N_WORDS * i + (s >> 6)] = keep
                elif self._any(i):
                    self._free(i, True)
                    if i < first:
                        first = i
        return first

    def seq_add_range(self, seq_id, p0, p1, delta):
        """``pos_add(i, delta)`` on every cell of ``seq_id`` with p0 <= pos < p1; all-or-nothing."""
        cdef CellsGuard guard
        _take(self, "seq_add_range", guard)
        seq_id, p0, p1, delta = _as_int(seq_id), _as_int(p0), _as_int(p1), _as_int(delta)
        cdef int s = _seq_id(seq_id)
        cdef int64_t a = _clamp64(p0), b = _clamp64(p1)
        cdef vector[uint32_t] cells
        cdef int64_t dv
        cdef Py_ssize_t k, first = self._n
        self._collect(s, a, b, cells)
        dv = self._delta("seq_add_range", delta)
        cdef vector[uint8_t] freed
        with nogil(False):
            freed.resize(cells.size())
            self._shift_cells(cells, dv, False, freed.data())
            for k in range(<Py_ssize_t>cells.size()):
                if freed[k] and cells[k] < first:
                    first = cells[k]
        return first

    def seq_div_range(self, seq_id, p0, p1, d, check=False):
        """``pos_div(i, d)`` on every cell of ``seq_id`` with p0 <= pos < p1; all-or-nothing. No cell in range: nothing
        happens, whatever ``d``. With ``check`` nothing is changed, the errors are raised all the same."""
        cdef CellsGuard guard
        _take(self, "seq_div_range", guard)
        seq_id, p0, p1, d = _as_int(seq_id), _as_int(p0), _as_int(p1), _as_int(d)
        cdef int s = _seq_id(seq_id)
        cdef int64_t a = _clamp64(p0), b = _clamp64(p1)
        cdef vector[uint32_t] cells
        self._collect(s, a, b, cells)
        cdef int64_t dv = self._divisor("seq_div_range", d, cells)
        if check or cells.size() == 0:
            return
        with nogil(False):
            self._shift_cells(cells, dv, True, NULL)

    def __repr__(self):
        return f"KVCells(size={self._n}, used={self._n_used}, has_shift={bool(self._has_shift)})"


__all__ = ["INT32_MIN", "LLAMA_MAX_SEQ", "N_SEQ_WORDS", "POS_MAX", "TOKEN_NULL", "KVCells"]
