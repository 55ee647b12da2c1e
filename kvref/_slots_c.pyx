# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Cython twin of the per-cell work of slot placement; same API, results and errors as ``kvref/_slots_py.py``.

The rules are stated in ``_slots_py.py``. This twin walks the cells as llama.cpp's find_slot does, one cell
at a time from the head, reading the KVCells' ``pos`` and ``seq`` arrays through raw pointers: a decode step
tests about as many cells as it places tokens, whatever the cache size. The SWA test asks
``cells.seq_pos_max`` once per sequence it meets (remembered for the rest of the call).

``used_targets`` checks the slot in C when every index is a plain int; anything unusual (a repeated or
out-of-range index, a shared target cell, an index that is not an int) is handed to the Python twin, which
changes nothing and raises the error it states.
"""

from libc.stdint cimport INT64_MIN, int32_t, int64_t, uint64_t
from libcpp.algorithm cimport sort
from libcpp.vector cimport vector

cimport numpy as cnp

import numpy as np

from kvref.constants cimport LLAMA_MAX_SEQ as MAX_SEQ, N_SEQ_WORDS as N_WORDS

from kvref._slots_py import used_targets as _used_targets_py

cnp.import_array()

cdef extern from *:
    """
    static inline int kvref_slots_popcount(unsigned long long x) { return __builtin_popcountll(x); }
    static inline int kvref_slots_ctz(unsigned long long x) { return __builtin_ctzll(x); }
    """
    int popcount "kvref_slots_popcount"(unsigned long long x) noexcept nogil
    int ctz "kvref_slots_ctz"(unsigned long long x) noexcept nogil

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1

# n_swa is clamped to this: positions are int32, so a window wider than 2^40 in either direction answers as
# the clamped one does, and the arithmetic below cannot overflow
cdef int64_t SWA_CLAMP = 1LL << 40
cdef int64_t UNKNOWN = INT64_MIN


cdef inline int64_t _floordiv(int64_t a, int64_t b) noexcept nogil:
    """Python's a // b (b != 0)."""
    cdef int64_t q = a / b
    if a % b != 0 and ((a < 0) != (b < 0)):
        q -= 1
    return q


cdef inline bint _masked_swa(int64_t n_swa, int swa_type, int64_t p0, int64_t p1) noexcept nogil:
    """llama_hparams::is_masked_swa (a chunked window of 0 never reaches here)."""
    cdef int64_t half, d
    if swa_type == 1:
        return p1 - p0 >= n_swa
    if swa_type == 2:
        return p0 < _floordiv(p1, n_swa) * n_swa
    if swa_type == 3:
        half = _floordiv(n_swa, 2)
        d = p1 - p0
        return d < -half or d > half
    return False


cdef struct Cells:
    const int32_t* pos
    const uint64_t* seq   # [n][N_WORDS]
    int64_t n_swa
    int swa_type
    bint swa              # the window can free a cell
    int64_t pos_max[MAX_SEQ]  # seq_pos_max of each sequence met so far, UNKNOWN before


cdef inline int _can_use(Cells* c, int64_t idx, object seq_pos_max) except -1:
    """Empty, or held by exactly one sequence at a position outside that sequence's next window."""
    cdef int32_t p = c.pos[idx]
    cdef const uint64_t* w
    cdef int k, n = 0, s = 0
    if p == -1:
        return 1
    if not c.swa:
        return 0
    w = c.seq + N_WORDS * idx
    for k in range(N_WORDS):
        if w[k]:
            n += popcount(w[k])
            s = 64 * k + ctz(w[k])
    if n != 1:
        return 0
    if c.pos_max[s] == UNKNOWN:
        c.pos_max[s] = seq_pos_max(s)
    return _masked_swa(c.n_swa, c.swa_type, p, c.pos_max[s] + 1)


cdef cnp.ndarray _array(object a, object dtype, int ndim):
    cdef cnp.ndarray arr = np.asarray(a)
    if arr.dtype != dtype or arr.ndim != ndim or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        arr = np.ascontiguousarray(arr, dtype=dtype)
    return arr


def find_cells(cells, head, n_tokens, cont, n_swa, swa_type):
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
    cdef cnp.ndarray pos = _array(cells.pos, np.int32, 1)
    cdef cnp.ndarray seq = _array(cells.seq, np.uint64, 2)
    if pos.shape[0] != size or seq.shape[0] != size or seq.shape[1] != N_WORDS:
        raise ValueError("find_cells: the cells' pos/seq arrays do not match their size")
    cdef Cells c
    cdef int k
    c.pos = <const int32_t*>cnp.PyArray_DATA(pos)
    c.seq = <const uint64_t*>cnp.PyArray_DATA(seq)
    c.swa_type = int(swa_type)
    c.n_swa = max(-SWA_CLAMP, min(SWA_CLAMP, int(n_swa)))
    c.swa = c.swa_type != 0 and not (c.swa_type == 2 and c.n_swa == 0)
    for k in range(MAX_SEQ):
        c.pos_max[k] = UNKNOWN
    seq_pos_max = cells.seq_pos_max

    cdef int64_t n = size, n_tok = n_tokens, h = head_cur, n_tested = 0, idx, _i
    cdef int64_t n_test = n_tok if cont else 1  # cells tested in a row before the checks below
    cdef bint c_cont = bool(cont)
    cdef vector[int64_t] idxs
    idxs.reserve(n_tok)
    while True:
        if h + n_test > n:
            n_tested += n - h
            h = 0
            continue
        for _i in range(n_test):
            idx = h
            h += 1
            n_tested += 1
            if (c.pos[idx] == -1) or (c.swa and _can_use(&c, idx, seq_pos_max)):
                idxs.push_back(idx)
            elif c_cont:
                break
        if <int64_t>idxs.size() == n_tok:
            return idxs
        if c_cont:
            idxs.clear()
        if n_tested >= n:
            return None


def used_targets(cells, idxs, size):
    """Check one stream's target cells before apply_ubatch writes them; ``(cell, seq_id, pos)`` of each used one.

    CellError when ``idxs`` does not hold ``size`` distinct cells, when a cell index is outside the cells, or
    when a used target holds several sequences (llama.cpp asserts it holds exactly one). Nothing changes.
    """
    cdef list ix = idxs if type(idxs) is list else list(idxs)
    cdef Py_ssize_t m = len(ix), j
    cdef vector[int64_t] v
    cdef int overflow = 0
    cdef int64_t n_cells = cells.size(), x
    cdef Py_ssize_t n_distinct = 0
    v.reserve(m)
    for o in ix:
        if type(o) is not int:
            return _used_targets_py(cells, idxs, size)
        x = PyLong_AsLongLongAndOverflow(o, &overflow)
        if overflow or x < 0 or x >= n_cells:
            return _used_targets_py(cells, idxs, size)
        v.push_back(x)
    cdef vector[int64_t] srt = v
    sort(srt.begin(), srt.end())
    for j in range(m):
        if j == 0 or srt[j] != srt[j - 1]:
            n_distinct += 1
    if n_distinct != size:
        return _used_targets_py(cells, idxs, size)
    cdef cnp.ndarray pos = _array(cells.pos, np.int32, 1)
    cdef cnp.ndarray seq = _array(cells.seq, np.uint64, 2)
    cdef const int32_t* p = <const int32_t*>cnp.PyArray_DATA(pos)
    cdef const uint64_t* w
    cdef int k, cnt, s
    cdef list used = []
    for j in range(m):
        x = v[j]
        if p[x] == -1:
            continue
        w = <const uint64_t*>cnp.PyArray_DATA(seq) + N_WORDS * x
        cnt = 0
        s = 0
        for k in range(N_WORDS):
            if w[k]:
                cnt += popcount(w[k])
                s = 64 * k + ctz(w[k])
        if cnt != 1:
            return _used_targets_py(cells, idxs, size)
        used.append((x, s, p[x]))
    return used


__all__ = ["find_cells", "used_targets"]
