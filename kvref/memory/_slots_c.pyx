# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Cython twin of the per-cell work of slot placement; same API, results and errors as ``kvref/memory/_slots_py.py``.

The rules are stated in ``_slots_py.py``. This twin walks the cells as llama.cpp's find_slot does, one cell
at a time from the head, reading the KVCells' ``pos`` and ``seq`` arrays through raw pointers: a decode step
tests about as many cells as it places tokens, whatever the cache size. The SWA test asks
``cells.seq_pos_max`` once per sequence it meets (remembered for the rest of the call).

On the Cython KVCells each kernel holds the cells' guard (``KVCells._enter``) while it reads their buffers and asks
``seq_pos_max`` in C: another thread's call cannot move the buffers under it, and a nested call is refused.

``used_targets`` checks the slot in C when it is an int64 array (find_cells' answer, read in place) or every
index is a plain int; anything unusual (a repeated or out-of-range index, a shared target cell, an index that is
not an int) is handed to the Python twin, which changes nothing and raises the error it states.

The batch allocator's kernels (``plain_seq_ids``, ``single_seq_ids``, ``single_seq_batch``, ``seq_lists``,
``seq_flat``, ``single_ubatch``) read Python lists and NumPy buffers in one C pass each, with the answers of the Python
twin.
"""

from libc.stdint cimport INT32_MIN as INT32_MIN_C, INT64_MIN, int8_t, int32_t, int64_t, uint32_t, uint64_t
from libcpp.algorithm cimport sort
from libc.string cimport memset
from libcpp.vector cimport vector
from cpython.dict cimport PyDict_Copy

cimport numpy as cnp

import numpy as np

from kvref.memory._cells_c cimport CellsGuard, KVCells as CKVCells
from kvref.constants cimport LLAMA_MAX_SEQ as MAX_SEQ, N_SEQ_WORDS as N_WORDS

from kvref.memory._slots_py import (
    recurrent_owned_step as _recurrent_owned_step_py,
    single_ubatch as _single_ubatch_py,
    used_targets as _used_targets_py,
)

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
cdef int64_t POS_MAX_C = 2147483647  # llama_pos's largest value (kvref.constants.POS_MAX)


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
    void* kv              # the Cython KVCells (its seq_pos_max in C), else NULL (seq_pos_max is called)
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
        c.pos_max[s] = (<CKVCells>c.kv)._seq_pos_max_c(s) if c.kv != NULL else seq_pos_max(s)
    # seq_pos_max + 1 is an int32 sum in llama.cpp: past INT32_MAX it wraps to INT32_MIN
    return _masked_swa(c.n_swa, c.swa_type, p, <int32_t><uint32_t>(c.pos_max[s] + 1))


cdef cnp.ndarray _array(object a, object dtype, int ndim):
    cdef cnp.ndarray arr = np.asarray(a)
    if arr.dtype != dtype or arr.ndim != ndim or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        arr = np.ascontiguousarray(arr, dtype=dtype)
    return arr


cdef int64_t _init_cells(Cells* c, object cells, object n_swa, object swa_type, list keep) except -1:
    """Point ``c`` at the cells' arrays (the Cython KVCells' own buffers, else its NumPy views, kept alive in
    ``keep``) and set the window; returns the cell count."""
    cdef cnp.ndarray pos, seq
    cdef int64_t size
    if type(cells) is CKVCells:  # the caller holds its guard
        size = (<CKVCells>cells)._n
        _set_cells(c, (<CKVCells>cells)._pos, (<CKVCells>cells)._seq, _clamp_swa(n_swa), swa_type)
        c.kv = <void*>cells
        return size
    size = cells.size()
    pos = _array(cells.pos, np.int32, 1)
    seq = _array(cells.seq, np.uint64, 2)
    if pos.shape[0] != size or seq.shape[0] != size or seq.shape[1] != N_WORDS:
        raise ValueError("find_cells: the cells' pos/seq arrays do not match their size")
    keep += [pos, seq]
    _set_cells(c, <const int32_t*>cnp.PyArray_DATA(pos), <const uint64_t*>cnp.PyArray_DATA(seq), _clamp_swa(n_swa),
               swa_type)
    return size


cdef inline int64_t _clamp_swa(object n_swa) except? -1:
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(n_swa, &overflow)
    if overflow > 0 or (overflow == 0 and v > SWA_CLAMP):
        return SWA_CLAMP
    if overflow < 0 or v < -SWA_CLAMP:
        return -SWA_CLAMP
    return v


cdef inline void _set_cells(Cells* c, const int32_t* pos, const uint64_t* seq, int64_t n_swa, int swa_type) noexcept:
    cdef int k
    c.kv = NULL
    c.pos = pos
    c.seq = seq
    c.swa_type = swa_type
    c.n_swa = n_swa
    c.swa = swa_type != 0 and not (swa_type == 2 and n_swa == 0)
    if c.swa:  # read by _can_use only
        for k in range(MAX_SEQ):
            c.pos_max[k] = UNKNOWN


cdef inline int64_t _search_start(object head, int64_t size, int64_t n_used, int64_t n_tokens) except? -1:
    """Where find_slot starts: the head (at most the size), or cell 0 when the head lies far past the used cells."""
    cdef int64_t h = min(head, size)
    return 0 if h > n_used + 2 * n_tokens else h


cdef bint _find_cells_c(Cells* c, int64_t n, int64_t h, int64_t n_tok, bint cont, object seq_pos_max,
                        int64_t* idxs) except -1:
    """find_slot's walk from cell ``h`` over ``n`` cells: the first ``n_tok`` usable cells into ``idxs`` (in a row
    when ``cont``); False when they do not fit."""
    cdef int64_t n_tested = 0, idx, _i, n_found = 0
    cdef int64_t n_test = n_tok if cont else 1  # cells tested in a row before the checks below
    while True:
        if h + n_test > n:
            n_tested += n - h
            h = 0
            continue
        for _i in range(n_test):
            idx = h
            h += 1
            n_tested += 1
            if (c.pos[idx] == -1) or (c.swa and _can_use(c, idx, seq_pos_max)):
                idxs[n_found] = idx
                n_found += 1
            elif cont:
                break
        if n_found == n_tok:
            return True
        if cont:
            n_found = 0
        if n_tested >= n:
            return False


def find_cells(cells, head, n_tokens, cont, n_swa, swa_type):
    """The cells llama_kv_cache::find_slot picks in one stream for ``n_tokens`` tokens (int64[n_tokens], in the
    order picked); None when they do not fit.

    ``head`` is the stream's head; ``n_swa`` / ``swa_type`` the cache's window (see the module docstring).
    """
    cdef CellsGuard guard
    if type(cells) is CKVCells:
        (<CKVCells>cells)._enter("find_cells", guard)
    size = cells.size()
    if n_tokens > size:
        return None
    if n_tokens == 0:
        return np.empty(0, dtype=np.int64)
    cdef Cells c
    cdef list keep = []
    _init_cells(&c, cells, n_swa, swa_type, keep)
    cdef cnp.npy_intp dim = n_tokens
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT64, 0)
    if _find_cells_c(&c, size, _search_start(head, size, cells.get_used(), n_tokens), n_tokens, bool(cont),
                     cells.seq_pos_max, <int64_t*>cnp.PyArray_DATA(out)):
        return out
    return None


def used_targets(cells, idxs, size):
    """Check one stream's target cells before apply_ubatch writes them; ``(cell, seq_id, pos)`` of each used one.

    CellError when ``idxs`` does not hold ``size`` distinct cells, when a cell index is outside the cells, or
    when a used target holds several sequences (llama.cpp asserts it holds exactly one). Nothing changes.
    """
    cdef cnp.ndarray ia
    cdef list ix
    cdef const int64_t* d
    cdef Py_ssize_t m, j
    cdef vector[int64_t] v
    cdef int overflow = 0
    cdef int64_t n_cells = cells.size(), x
    cdef Py_ssize_t n_distinct = 0
    if cnp.PyArray_CheckExact(idxs) and (<cnp.ndarray>idxs).ndim == 1 and idxs.dtype == np.int64:
        # find_slot's cells (find_cells' int64 array): read in place
        ia = _array(idxs, np.int64, 1)
        d = <const int64_t*>cnp.PyArray_DATA(ia)
        m = ia.shape[0]
        for j in range(m):
            if d[j] < 0 or d[j] >= n_cells:
                return _used_targets_py(cells, idxs, size)
    else:
        ix = idxs if type(idxs) is list else list(idxs)
        m = len(ix)
        v.reserve(m)
        for o in ix:
            if type(o) is not int:
                return _used_targets_py(cells, idxs, size)
            x = PyLong_AsLongLongAndOverflow(o, &overflow)
            if overflow or x < 0 or x >= n_cells:
                return _used_targets_py(cells, idxs, size)
            v.push_back(x)
        d = v.data()
    cdef vector[int64_t] srt
    srt.assign(d, d + m)
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
        x = d[j]
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


# ------------------------------------------------------------------------------ the batch allocator's per-token work
# Same functions as in _slots_py.py (which states the rules): None whenever the batch is not of the one-sequence
# shape or breaks a rule, so the allocator's general path raises llama.cpp's error.

def int32_values(values, lo):
    """A Batch's ``tokens`` or ``pos`` copied as int64 when they are a 1-D int32 or int64 array or a list of plain
    ``int``, every value in ``[lo, 2**31 - 1]``; None otherwise (see _slots_py.py)."""
    cdef int64_t low = lo, x
    cdef cnp.npy_intp n, i
    cdef cnp.ndarray arr, out
    cdef int typ, overflow = 0
    cdef char* src
    cdef cnp.npy_intp stride
    if cnp.PyArray_CheckExact(values):
        arr = <cnp.ndarray>values
        typ = cnp.PyArray_TYPE(arr)
        if arr.ndim != 1 or (typ != cnp.NPY_INT32 and typ != cnp.NPY_INT64):
            return None
        n = arr.shape[0]
        out = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT64, 0)
        src = <char*>cnp.PyArray_DATA(arr)
        stride = arr.strides[0]
        for i in range(n):
            x = (<int32_t*>(src + i * stride))[0] if typ == cnp.NPY_INT32 else (<int64_t*>(src + i * stride))[0]
            if x < low or x > POS_MAX_C:
                return None
            (<int64_t*>cnp.PyArray_DATA(out))[i] = x
        return out
    if type(values) is not list:
        return None
    n = len(<list>values)
    out = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT64, 0)
    for i in range(n):
        o = (<list>values)[i]
        if type(o) is not int:
            return None
        x = PyLong_AsLongLongAndOverflow(o, &overflow)
        if overflow or x < low or x > POS_MAX_C:
            return None
        (<int64_t*>cnp.PyArray_DATA(out))[i] = x
    return out


def token_batch(tokens, pos, seq_ids):
    """A Batch's ``tokens``, ``pos`` and ``seq_ids`` checked and copied in one call, for the common batch (see
    _slots_py.py); None otherwise."""
    t = int32_values(tokens, -(1 << 31))
    if t is None or (<cnp.ndarray>t).shape[0] == 0:
        return None
    cdef Py_ssize_t n = (<cnp.ndarray>t).shape[0]
    p = None
    if pos is not None:
        p = int32_values(pos, 0)
        if p is None or (<cnp.ndarray>p).shape[0] != n:
            return None
    ids = None
    if seq_ids is not None:
        ids = plain_seq_ids(seq_ids)
        if ids is None or len(<list>ids) != n:
            return None
    return t, p, ids


def plain_seq_ids(seq_ids):
    """A Batch's ``seq_ids`` copied as a list of lists, when it is a list (or tuple) of lists (or tuples) of plain
    ``int``; None otherwise (see _slots_py.py)."""
    if type(seq_ids) is not list and type(seq_ids) is not tuple:
        return None
    cdef Py_ssize_t i, j, n = len(seq_ids), m
    cdef list out = [None] * n, row
    for i in range(n):
        ids = seq_ids[i]
        if type(ids) is not list and type(ids) is not tuple:
            return None
        m = len(ids)
        row = [None] * m
        for j in range(m):
            o = ids[j]
            if type(o) is not int:
                return None
            row[j] = o
        out[i] = row
    return out


def single_seq_ids(seq_ids, n_tokens, n_seq_max):
    """The one sequence id of every token as int32[n_tokens], the distinct ids ascending and ``seq_idx`` (see
    _slots_py.py)."""
    cdef Py_ssize_t n = n_tokens, i
    cdef bint seen[MAX_SEQ]
    cdef int s
    if n <= 0:
        return None
    cdef cnp.ndarray out = np.empty(n, dtype=np.int32)
    cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(out)
    if not _one_seq_ids(seq_ids, n, n_seq_max, o):
        return None
    if seq_ids is None:
        return out, [0], _seq_index(seen, 0)
    for s in range(MAX_SEQ):
        seen[s] = False
    for i in range(n):
        seen[o[i]] = True
    return out, [s for s in range(MAX_SEQ) if seen[s]], _seq_index(seen, -1)


cdef bint _one_seq_ids(object seq_ids, Py_ssize_t n, int64_t bound, int32_t* out) except -1:
    """Each of the ``n`` tokens' one sequence id into ``out`` (0 for every token when ``seq_ids`` is None): False
    unless every token has one plain ``int`` id in ``[0, min(bound, LLAMA_MAX_SEQ))``."""
    cdef Py_ssize_t i
    cdef int overflow = 0
    cdef long long v
    cdef list outer
    if bound > MAX_SEQ:
        bound = MAX_SEQ
    if seq_ids is None:
        if bound < 1:
            return False
        for i in range(n):
            out[i] = 0
        return True
    if type(seq_ids) is not list or len(<list>seq_ids) != n:
        return False
    outer = <list>seq_ids
    for i in range(n):
        item = outer[i]
        if type(item) is not list or len(<list>item) != 1 or type((<list>item)[0]) is not int:
            return False
        v = PyLong_AsLongLongAndOverflow((<list>item)[0], &overflow)
        if overflow or v < 0 or v >= bound:
            return False
        out[i] = <int32_t>v
    return True


cdef cnp.ndarray _seq_index(bint* seen, int only):
    """seq_idx of the sequences marked in ``seen`` (or of sequence ``only`` alone when it is >= 0)."""
    cdef cnp.ndarray seq_idx = np.empty(MAX_SEQ, dtype=np.int32)
    cdef int32_t* x = <int32_t*>cnp.PyArray_DATA(seq_idx)
    cdef int s, k = 0
    for s in range(MAX_SEQ):
        if (s == only) if only >= 0 else seen[s]:
            x[s] = k
            k += 1
        else:
            x[s] = -1
    return seq_idx


def single_seq_batch(tokens, pos, seq, present, mem_pos_max, n_vocab, mrope):
    """The positions of a token batch whose tokens have one sequence id each, when it passes llama_batch_allocr::init
    (see _slots_py.py); None when any rule fails."""
    cdef const int32_t[::1] sv = np.ascontiguousarray(seq, dtype=np.int32)
    cdef const int64_t[::1] tv = np.ascontiguousarray(tokens, dtype=np.int64)
    cdef const int64_t[::1] pv
    cdef Py_ssize_t n = sv.shape[0], k
    cdef int64_t last[MAX_SEQ]      # the memory's seq_pos_max
    cdef int s
    if n == 0 or tv.shape[0] != n:
        return None
    if pos is not None:
        pv = np.ascontiguousarray(pos, dtype=np.int64)
        if pv.shape[0] < n:
            return None
    for s in range(MAX_SEQ):
        last[s] = -1
    if len(present) != len(mem_pos_max):
        return None
    for k in range(len(present)):
        s = present[k]
        if s < 0 or s >= MAX_SEQ:
            return None
        last[s] = mem_pos_max[k]
    cdef cnp.ndarray out = np.empty(n, dtype=np.int32)
    if not _single_seq_batch_c(&tv[0], &pv[0] if pos is not None else NULL, &sv[0], n, last, n_vocab, bool(mrope),
                               <int32_t*>cnp.PyArray_DATA(out)):
        return None
    return out


cdef bint _single_seq_batch_c(const int64_t* tv, const int64_t* pv, const int32_t* sv, Py_ssize_t n,
                              const int64_t* last, int64_t vocab, bint mrope, int32_t* o) noexcept nogil:
    """single_seq_batch on C arrays: ``pv`` NULL when the batch gives no positions, ``last[s]`` the memory's
    seq_pos_max of each sequence s of the batch (-1 for none); the positions go to ``o``. Only the sequences met
    are set up and checked, so a call costs O(n_tokens), not O(LLAMA_MAX_SEQ)."""
    cdef int64_t nxt[MAX_SEQ]       # the next automatic position
    cdef int64_t lo[MAX_SEQ]        # smallest position in the batch
    cdef int64_t cur[MAX_SEQ]       # last position met along the batch
    cdef int64_t distinct[MAX_SEQ]
    cdef uint64_t met[N_WORDS]      # the sequences met so far
    cdef int order[MAX_SEQ]         # ... in the order met
    cdef Py_ssize_t i
    cdef int s, k, n_met = 0
    cdef int64_t p
    cdef bint first
    for k in range(N_WORDS):
        met[k] = 0
    for i in range(n):
        if tv[i] < 0 or (vocab >= 0 and tv[i] >= vocab):
            return False
        s = sv[i]
        if s < 0 or s >= MAX_SEQ:
            return False
        first = not ((met[s >> 6] >> (s & 63)) & 1)
        if first:
            met[s >> 6] |= (<uint64_t>1) << (s & 63)
            order[n_met] = s
            n_met += 1
            nxt[s] = last[s] + 1
        if pv != NULL:
            p = pv[i]
        else:
            p = nxt[s]
            nxt[s] += 1
        if p < 0 or p > POS_MAX_C:
            return False
        if first:
            lo[s] = p
            distinct[s] = 1
        elif p < cur[s]:
            return False  # a sequence's positions decrease
        elif p != cur[s]:
            distinct[s] += 1
        cur[s] = p
        o[i] = <int32_t>p
    for k in range(n_met):
        s = order[k]
        if mrope:
            if last[s] >= 0 and last[s] >= lo[s]:
                return False
        elif (last[s] >= 0 and lo[s] != last[s] + 1) or cur[s] - lo[s] + 1 > distinct[s]:
            return False
    return True


def seq_lists(seq):
    """``[[s] for s in seq]`` (a ubatch's ``seq_id`` when every token has one sequence), the distinct ids ascending
    (``seq_id_unq``), and ``seq_idx``: int32[LLAMA_MAX_SEQ], each id's index in that list, -1 for the others."""
    cdef const int32_t[::1] sv = np.ascontiguousarray(seq, dtype=np.int32)
    cdef Py_ssize_t n = sv.shape[0], i
    cdef list out = [None] * n
    cdef list unq = []
    cdef cnp.ndarray seq_idx = np.empty(MAX_SEQ, dtype=np.int32)
    cdef int32_t* x = <int32_t*>cnp.PyArray_DATA(seq_idx)
    cdef int s, k = 0
    cdef int32_t v
    for s in range(MAX_SEQ):
        x[s] = -1
    for i in range(n):
        v = sv[i]
        out[i] = [v]
        if 0 <= v < MAX_SEQ:
            x[v] = 0
    for s in range(MAX_SEQ):
        if x[s] == 0:
            x[s] = k
            k += 1
            unq.append(s)
    return out, unq, seq_idx


def single_ubatch(token, pos, seq, logits):
    """The fields of the ubatch ``split_simple`` makes of a whole batch of one sequence id and one position per token,
    in the dataclass's field order (kvref/memory/_slots_py.py states it); on int32 vectors and bool flags (what a
    decode step's plan holds) in one C pass, else through the Python twin."""
    cdef cnp.npy_intp n = -1
    if cnp.PyArray_CheckExact(token):
        n = (<cnp.ndarray>token).shape[0]
    if n <= 0 or not (_int32_vector(token, n) and _int32_vector(pos, n) and _int32_vector(seq, n)) or not (
            logits is None or _bool_vector(logits, n)):
        return _single_ubatch_py(token, pos, seq, logits)
    return _single_ubatch_c(token, pos, seq, logits, n)


cdef inline bint _bool_vector(object a, cnp.npy_intp n):
    return (cnp.PyArray_CheckExact(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_BOOL
            and (<cnp.ndarray>a).ndim == 1 and (<cnp.ndarray>a).shape[0] == n
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef dict _single_ubatch_c(object token, object pos, object seq, object logits, cnp.npy_intp n):
    # single_ubatch on checked arrays: int32 token, pos and seq of n entries, logits None or n bools
    cdef const int32_t* sv = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>seq)
    cdef cnp.npy_intp n_seq = MAX_SEQ
    cdef cnp.ndarray seq_idx = cnp.PyArray_EMPTY(1, &n_seq, cnp.NPY_INT32, 0)
    cdef cnp.ndarray n_seq_id = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef cnp.ndarray output = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT8, 0)
    cdef cnp.ndarray batch_idxs = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef int32_t* x = <int32_t*>cnp.PyArray_DATA(seq_idx)
    cdef int32_t* ns = <int32_t*>cnp.PyArray_DATA(n_seq_id)
    cdef int8_t* o = <int8_t*>cnp.PyArray_DATA(output)
    cdef int32_t* bi = <int32_t*>cnp.PyArray_DATA(batch_idxs)
    cdef const char* lg = NULL
    cdef list seq_id = [None] * n
    cdef list unq = []
    cdef Py_ssize_t i
    cdef int s, k = 0, lo = MAX_SEQ, hi = -1
    cdef int32_t v
    if logits is not None:
        lg = <const char*>cnp.PyArray_DATA(<cnp.ndarray>logits)
    memset(x, 0xFF, MAX_SEQ * sizeof(int32_t))  # -1 everywhere
    for i in range(n):
        v = sv[i]
        seq_id[i] = [v]
        if 0 <= v < MAX_SEQ:
            x[v] = 0
            if v < lo:
                lo = v
            if v > hi:
                hi = v
        ns[i] = 1
        bi[i] = <int32_t>i
        o[i] = (lg[i] != 0) if lg != NULL else 0
    if lg == NULL:
        o[n - 1] = 1
    for s in range(lo, hi + 1):  # the ids met, ascending
        if x[s] == 0:
            x[s] = k
            k += 1
            unq.append(s)
    cdef dict d = PyDict_Copy(_UBATCH_FIELDS)  # a copy of the keys in order, then the values: half a new dict's cost
    d["n_tokens"] = n
    d["n_seqs"] = n
    d["n_seqs_unq"] = k
    d["token"] = token
    d["pos"] = pos
    d["n_seq_id"] = n_seq_id
    d["seq_id"] = seq_id
    d["seq_id_unq"] = unq
    d["seq_idx"] = seq_idx
    d["output"] = output
    d["batch_idxs"] = batch_idxs
    return d


def recurrent_owned_step(mem, tokens, pos, seq_ids, logits, n_seq_max):
    """A recurrent memory's decode step of one sequence that owns its state's cell alone (kvref/memory/_slots_py.py
    states it): on int64 token and position vectors and a memory whose cells are lists of ints (``seq``: of sets),
    the checks, find_slot's writes and the ubatch's fields in one C pass; otherwise the Python twin."""
    if not (_int64_vector(tokens) and (pos is None or _int64_vector(pos))
            and (logits is None or _bool_vector(logits, (<cnp.ndarray>tokens).shape[0]))):
        return _recurrent_owned_step_py(mem, tokens, pos, seq_ids, logits, n_seq_max)
    lp, lsrc, lsrc0, ltail, lseq = mem.pos, mem.src, mem.src0, mem.tail, mem.seq
    if not (type(lp) is list and type(lsrc) is list and type(lsrc0) is list and type(ltail) is list
            and type(lseq) is list):
        return _recurrent_owned_step_py(mem, tokens, pos, seq_ids, logits, n_seq_max)
    cdef list cpos = <list>lp, csrc = <list>lsrc, csrc0 = <list>lsrc0, ctail = <list>ltail, cseq = <list>lseq
    cdef Py_ssize_t size = len(cseq), i
    cdef cnp.npy_intp n = (<cnp.ndarray>tokens).shape[0]
    if n <= 0 or len(cpos) != size or len(csrc) != size or len(csrc0) != size or len(ctail) != size:
        return None
    cdef cnp.ndarray seq = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef int32_t* sq = <int32_t*>cnp.PyArray_DATA(seq)
    if not _one_seq_ids(seq_ids, n, n_seq_max, sq):
        return None
    cdef int32_t sid = sq[0]
    for i in range(1, n):
        if sq[i] != sid:
            return None
    if sid >= size:
        return None
    cdef long t = ctail[sid]
    if t < 0 or t >= size:
        return None
    cell = cseq[t]
    if type(cell) is not set or len(<set>cell) != 1 or sid not in <set>cell:
        return None
    cdef int64_t last[MAX_SEQ]
    cdef long cp
    last[sid] = -1  # seq_pos_max(sid): llama.cpp's running maximum starts at -1
    for i in range(size):
        if sid in cseq[i]:
            cp = cpos[i]
            if cp > last[sid]:
                last[sid] = cp
    cdef cnp.ndarray p = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef const int64_t* tv = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>tokens)
    cdef const int64_t* pv = NULL
    if pos is not None:
        if (<cnp.ndarray>pos).shape[0] < n:
            return None
        pv = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>pos)
    cdef int32_t* pp = <int32_t*>cnp.PyArray_DATA(p)
    if not _single_seq_batch_c(tv, pv, sq, n, last, -1, False, pp):
        return None
    cdef long pos_t = cpos[t], src_t = csrc[t]
    cdef int32_t last_pos = pp[n - 1]
    if pos_t >= 0 and last_pos != pos_t + n:
        return None  # find_slot warns of non-consecutive positions: the general path says it
    cdef long rs_z = t
    for i in range(size):
        if csrc[i] == t:
            rs_z = -1
            break
    if src_t < 0 and rs_z < 0:
        return None  # find_slot raises: no zeroed state
    cdef cnp.ndarray tok = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef int32_t* t32 = <int32_t*>cnp.PyArray_DATA(tok)
    for i in range(n):
        t32[i] = <int32_t>tv[i]  # as astype(np.int32)
    cdef dict fields = _single_ubatch_c(tok, p, seq, logits, n)
    fields["equal_seqs"] = True
    fields["n_seq_tokens"] = n
    fields["n_seqs"] = 1
    # find_slot's writes (nothing above changed the memory)
    if mem.head > mem.used + 2:
        mem.head = 0
    cpos[t] = last_pos
    cseq[t] = {sid}
    ctail[sid] = t
    mem.rs_z = rs_z
    csrc0[t] = src_t if src_t >= 0 else rs_z
    csrc[t] = t
    mem.head = t
    mem.n = 1
    cdef Py_ssize_t used = 0
    for i in range(size):
        if cseq[i]:
            used += 1
    mem.used = used
    cdef cnp.npy_intp one = 1
    cdef cnp.ndarray s_copy = cnp.PyArray_EMPTY(1, &one, cnp.NPY_INT32, 0)
    (<int32_t*>cnp.PyArray_DATA(s_copy))[0] = <int32_t>(src_t if src_t >= 0 else rs_z)
    return fields, t, s_copy


# single_ubatch's fields in the dataclass's order, with the values every such ubatch has
cdef dict _UBATCH_FIELDS = {
    "equal_seqs": False, "n_tokens": 0, "n_seq_tokens": 1, "n_seqs": 0, "n_seqs_unq": 0, "n_pos": 1, "token": None,
    "embd": None, "pos": None, "n_seq_id": None, "seq_id": None, "seq_id_unq": None, "seq_idx": None, "output": None,
    "batch_idxs": None,
}


def seq_flat(seq_ids):
    """A ubatch's sequence ids for apply_ubatch: (ids per token, all ids in token order, the smallest id, the largest
    id, whether every token has exactly one id); None unless ``seq_ids`` is a list of lists of plain ``int``."""
    if type(seq_ids) is not list:
        return None
    cdef list outer = <list>seq_ids, ids
    cdef Py_ssize_t n = len(outer), i, j, total = 0
    cdef int overflow = 0
    cdef long long v, lo = 0, hi = -1
    cdef bint single = True
    for i in range(n):
        item = outer[i]
        if type(item) is not list:
            return None
        total += len(<list>item)
    cdef cnp.ndarray counts = np.empty(n, dtype=np.int64)
    cdef cnp.ndarray flat = np.empty(total, dtype=np.int64)
    cdef int64_t* c = <int64_t*>cnp.PyArray_DATA(counts)
    cdef int64_t* f = <int64_t*>cnp.PyArray_DATA(flat)
    cdef Py_ssize_t k = 0
    for i in range(n):
        ids = <list>outer[i]
        if len(ids) + k > total:
            return None  # a list grew while it was read
        c[i] = len(ids)
        if c[i] != 1:
            single = False
        for j in range(len(ids)):
            o = ids[j]
            if type(o) is not int:
                return None
            v = PyLong_AsLongLongAndOverflow(o, &overflow)
            if overflow:
                return None
            if k == 0 or v < lo:
                lo = v
            if k == 0 or v > hi:
                hi = v
            f[k] = v
            k += 1
    if k != total:
        return None
    return counts, flat, lo, hi, single


def plan_single(cells, head, tokens, pos, seq_ids, n_seq_max, n_swa, swa_type):
    """A decode step of the common batch on one stream's cells, planned but not written (kvref/memory/_slots_py.py
    states it). On the Cython KVCells with int64 token and position arrays, one C pass; otherwise the parts in
    turn. None when any part declines."""
    cdef CellsGuard guard
    if type(cells) is CKVCells and _int64_vector(tokens) and (pos is None or _int64_vector(pos)):
        (<CKVCells>cells)._enter("plan_single", guard)
        return _plan_single_c(<CKVCells>cells, head, tokens, pos, seq_ids, n_seq_max, n_swa, swa_type)
    cdef Py_ssize_t n = tokens.shape[0]
    ids = single_seq_ids(seq_ids, n, n_seq_max) if 0 < n <= cells.size() else None
    if ids is None:
        return None
    seq, present, _seq_idx = ids
    try:
        mem_pos_max = [cells.seq_pos_max(s) for s in present]
    except Exception:
        return None  # the general path asks again, where llama.cpp would
    p = single_seq_batch(tokens, pos, seq, present, mem_pos_max, -1, False)
    if p is None or tokens.min() < INT32_MIN_C or tokens.max() > POS_MAX_C:
        return None
    idxs = find_cells(cells, head, n, False, n_swa, swa_type)
    if idxs is None:
        return None
    return idxs, p, seq, tokens.astype(np.int32)


def place_single(cells, head, tokens, pos, seq_ids, n_seq_max, n_swa, swa_type):
    """A whole decode step of the common batch on one stream's cells (kvref/memory/_slots_py.py states it): plan_single,
    then place_planned. None, with nothing changed, when any part declines."""
    cdef tuple planned
    cdef CellsGuard guard
    if type(cells) is CKVCells and _int64_vector(tokens) and (pos is None or _int64_vector(pos)):
        (<CKVCells>cells)._enter("place_single", guard)
        planned = _plan_single_c(<CKVCells>cells, head, tokens, pos, seq_ids, n_seq_max, n_swa, swa_type)
        if planned is None or not _place_planned_c(<CKVCells>cells, planned[0], planned[1], planned[2], planned[3]):
            return None
        return planned
    plan = plan_single(cells, head, tokens, pos, seq_ids, n_seq_max, n_swa, swa_type)
    if plan is None or not place_planned(cells, plan):
        return None
    return plan


def place_planned(cells, plan):
    """apply_ubatch's writes of a plan_single plan into its cells, when they are all empty (kvref/memory/_slots_py.py
    states it); on the Cython KVCells straight from the plan's buffers. False, with nothing changed, otherwise."""
    idxs, p, seq, tok = plan
    cdef cnp.npy_intp n = idxs.shape[0]
    cdef CellsGuard guard
    if type(cells) is CKVCells and _int64_vector(idxs) and _int32_vector(p, n) and _int32_vector(seq, n) \
            and _int32_vector(tok, n):
        (<CKVCells>cells)._enter("place_planned", guard)
        return _place_planned_c(<CKVCells>cells, idxs, p, seq, tok)
    return cells.place(idxs, p, seq, (0, 0, tok))


cdef inline bint _int32_vector(object a, cnp.npy_intp n):
    return (cnp.PyArray_CheckExact(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_INT32
            and (<cnp.ndarray>a).ndim == 1 and (<cnp.ndarray>a).shape[0] == n
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef bint _place_planned_c(CKVCells cells, cnp.ndarray idxs, cnp.ndarray p, cnp.ndarray seq, cnp.ndarray tok):
    # a plan's arrays (int64 cells, int32 positions, sequences and tokens) widened to what _place_c writes
    cdef cnp.npy_intp n = idxs.shape[0]
    cdef vector[int64_t] buf  # positions, sequences, zeros for x and y, tokens
    buf.resize(5 * n)
    cdef int64_t* b = buf.data()
    cdef const int32_t* pp = <const int32_t*>cnp.PyArray_DATA(p)
    cdef const int32_t* sq = <const int32_t*>cnp.PyArray_DATA(seq)
    cdef const int32_t* tk = <const int32_t*>cnp.PyArray_DATA(tok)
    cdef Py_ssize_t i
    for i in range(n):
        b[i] = pp[i]
        b[n + i] = sq[i]
        b[4 * n + i] = tk[i]
    return cells._place_c(<const int64_t*>cnp.PyArray_DATA(idxs), b, b + n, b + 2 * n, b + 3 * n, b + 4 * n, n,
                          False)


cdef inline bint _int64_vector(object a):
    return (cnp.PyArray_CheckExact(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_INT64
            and (<cnp.ndarray>a).ndim == 1 and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef tuple _plan_single_c(CKVCells cells, object head, cnp.ndarray tokens, object pos, object seq_ids,
                          object n_seq_max, object n_swa, object swa_type):
    cdef cnp.npy_intp n = tokens.shape[0]
    cdef int64_t size = cells._n
    cdef int64_t last[MAX_SEQ]
    cdef Py_ssize_t i
    if n <= 0 or n > size:
        return None
    cdef cnp.ndarray seq = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef int32_t* sq = <int32_t*>cnp.PyArray_DATA(seq)
    if not _one_seq_ids(seq_ids, n, n_seq_max, sq):
        return None
    for i in range(n):  # the cells' seq_pos_max of each sequence of the batch (the only ones read)
        last[sq[i]] = cells._seq_pos_max_c(sq[i])
    cdef cnp.ndarray p = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef const int64_t* tv = <const int64_t*>cnp.PyArray_DATA(tokens)
    cdef const int64_t* pv = NULL
    if pos is not None:
        if (<cnp.ndarray>pos).shape[0] < n:
            return None
        pv = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>pos)
    if not _single_seq_batch_c(tv, pv, sq, n, last, -1, False, <int32_t*>cnp.PyArray_DATA(p)):
        return None
    cdef cnp.ndarray tok = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)
    cdef int32_t* t32 = <int32_t*>cnp.PyArray_DATA(tok)
    for i in range(n):
        if tv[i] < INT32_MIN_C or tv[i] > POS_MAX_C:
            return None
        t32[i] = <int32_t>tv[i]
    # find_cells from the head: empty cells, or window-freed ones of a sliding-window cache
    cdef Cells c
    _set_cells(&c, cells._pos, cells._seq, _clamp_swa(n_swa), swa_type)
    c.kv = <void*>cells
    cdef cnp.ndarray idxs = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT64, 0)
    if not _find_cells_c(&c, size, _search_start(head, size, cells._n_used, n), n, False, None,
                         <int64_t*>cnp.PyArray_DATA(idxs)):
        return None
    return idxs, p, seq, tok


__all__ = [
    "find_cells", "int32_values", "place_planned", "place_single", "plain_seq_ids", "plan_single",
    "recurrent_owned_step", "seq_flat",
    "seq_lists", "single_seq_batch", "single_seq_ids", "single_ubatch", "token_batch", "used_targets",
]
