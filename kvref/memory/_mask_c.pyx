# distutils: language = c++
"""Cython twin of the graph inputs a KV cache fills; same API and results as ``kvref/memory/_mask_py.py``.

The rules are stated in ``_mask_py.py``. This twin gets its speed from the shape of the problem rather
than from a faster per-cell test:

- a sequence with one token in the ubatch (a decode step: one token per sequence) needs no sorted list: its
  row is filled with -inf, then one pass over the stream's cells writes the attended ones in place (the
  cell's position against the token's interval, the 2-D rule at the token's own position, the ALiBi value);
  when the rows are a multiple of 64 KiB long (their starts share cache sets, so rows written column by column
  evict each other) the pass lists the attended cells instead and each row is written in 8 KiB pieces, each
  filled with -inf and patched while it is still in L1;
- for every other sequence of the ubatch, the same pass lists its member cells as (pos, cell) keys, sorted by
  position (usually already sorted: then no sort);
- every rule (causal, the three windows, the SWA_FULL span) attends an *interval* of positions, so a
  token's attended cells are a contiguous range of that sorted list, found by binary search; only the
  M-RoPE 2-D rule cuts holes, and only among the cells at exactly the token's position;
- a sequence held in consecutive cells in position order (a prompt; one sequence per stream) has rows
  made of three runs (-inf, 0, -inf): each row is three fills, as cheap as the floor;
- otherwise a token's row is the previous row of the same sequence (memcpy, it is still in cache)
  patched where the two ranges differ; a first row is a fill of -inf plus the attended cells; ALiBi
  rows differ everywhere and are always built afresh.

The kernels hold no Python objects and run without the GIL; values are written as bit patterns
(float32 -inf = 0xFF800000, float16 -inf = 0xFC00) so fills are wmemset calls (glibc picks the widest
vector stores at run time; the extension is compiled without -march).
Argument checking is shared with the Python twin (``_check_kq_args``), so both raise the same errors.
"""

from libc.stdint cimport INT32_MIN, int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy
from libc.stdlib cimport free, realloc
from libc.math cimport logf, floorf, log
from libcpp.algorithm cimport sort

import numpy as np
cimport numpy as cnp
from kvref.constants cimport LLAMA_MAX_SEQ as MAX_SEQ, N_SEQ_WORDS as N_WORDS

from kvref.memory._mask_py import (
    LLAMA_MAX_SEQ,
    N_SWA_MAX,
    NonCausalType,
    _as_i32_1d,
    _check_kq_args,
    first_seq_ids as _first_seq_ids_py,
    is_masked_swa,
)
from kvref.errors import ArgumentError, ArgumentTypeError

cnp.import_array()

cdef extern from *:
    """
    #include <string.h>
    static inline int kvref_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    static inline int kvref_clz64(unsigned long long x) { return __builtin_clzll(x); }
    static inline int kvref_popcount64(unsigned long long x) { return __builtin_popcountll(x); }
    #include <wchar.h>
    #include <stdint.h>
    /* Fill n 32-bit / 16-bit slots with v. glibc's wmemset is dispatched at run time to the widest
       vector stores the CPU has (the extension is built without -march), so on Linux, where wchar_t is
       32 bits, it does the fills; elsewhere a plain loop does. */
    static inline void kvref_fill32(uint32_t* p, uint32_t v, size_t n) {
    #if WCHAR_MAX > 0xFFFF
        wmemset((wchar_t*)p, (wchar_t)v, n);
    #else
        for (size_t i = 0; i < n; ++i) p[i] = v;
    #endif
    }
    static inline void kvref_fill16(uint16_t* p, uint16_t v, size_t n) {
        if (n && ((uintptr_t)p & 2)) { *p++ = v; --n; }
        kvref_fill32((uint32_t*)p, ((uint32_t)v << 16) | v, n / 2);
        if (n & 1) p[n - 1] = v;
    }
    static inline unsigned int kvref_f32_bits(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
    """
    int kvref_ctz64(unsigned long long x) nogil
    int kvref_clz64(unsigned long long x) nogil
    int kvref_popcount64(unsigned long long x) nogil
    void kvref_fill32(uint32_t* p, uint32_t v, size_t n) nogil
    void kvref_fill16(uint16_t* p, uint16_t v, size_t n) nogil
    uint32_t kvref_f32_bits(float f) nogil

ctypedef fused elem_t:
    uint16_t
    uint32_t

cdef enum:
    MAX_STREAMS = 64
    SEG_BYTES = 8192  # a one-token row is written in pieces of this size (see _kq_rows)
    BLOCK_BYTES = 262144  # the rows of a decode step are filled and patched in column blocks of this size

cdef int64_t POS_INF = 2147483648  # one past the largest int32 position

cdef struct KQArgs:
    int64_t n_tokens
    int64_t n_kv
    const int32_t* tok_pos
    const int32_t* tok_seq
    const int32_t* tok_x
    const int32_t* tok_y
    int causal
    int swa_type
    int64_t n_swa
    int span
    int alibi
    int is_2d


# ------------------------------------------------------------------------------------------ helpers

cdef inline uint16_t _half_of_int(uint64_t v) noexcept nogil:
    # float16 bits of the non-negative integer v, rounded to nearest even (as the fp32->fp16 conversion
    # llama.cpp uses does for integer-valued floats); overflow gives +inf
    cdef int e, shift
    cdef uint64_t q, r, halfway
    if v == 0:
        return 0
    e = 63 - kvref_clz64(v)
    if e <= 10:
        return <uint16_t>(((e + 15) << 10) | ((v << (10 - e)) & 0x3FF))
    shift = e - 10
    q = v >> shift
    r = v & ((<uint64_t>1 << shift) - 1)
    halfway = <uint64_t>1 << (shift - 1)
    if r > halfway or (r == halfway and (q & 1)):
        q += 1
        if q == 2048:
            q = 1024
            e += 1
    if e + 15 >= 31:
        return 0x7C00
    return <uint16_t>(((e + 15) << 10) | (q & 0x3FF))


cdef inline elem_t _alibi_value(elem_t dummy, int64_t d) noexcept nogil:
    # llama.cpp stores float(-|p0 - p1|): the int distance becomes a float first, then maybe a half
    cdef float f = <float>(-d if d >= 0 else d)
    if elem_t is uint32_t:
        return kvref_f32_bits(f)
    else:
        if f == 0:
            return 0
        return <uint16_t>(0x8000 | _half_of_int(<uint64_t>(-f)))


cdef inline elem_t _neg_inf(elem_t* out) noexcept nogil:
    """-inf as the bit pattern of the output's element type (``out`` only picks the type)."""
    cdef elem_t v
    if elem_t is uint32_t:
        v = <uint32_t>0xFF800000u
    else:
        v = 0xFC00
    return v


cdef inline void _fill(elem_t* row, int64_t n, elem_t v) noexcept nogil:
    if elem_t is uint32_t:
        kvref_fill32(row, v, <size_t>n)
    else:
        kvref_fill16(row, v, <size_t>n)


cdef inline int64_t _lower_bound(const uint64_t* keys, int64_t n, uint64_t key) noexcept nogil:
    # first index whose key is >= key
    cdef int64_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline uint64_t _key(int64_t p, int64_t j) noexcept nogil:
    # a cell's key: (pos + 2^31) << 32 | cell, ordered by position (any int32: a seq_div by a negative divisor
    # leaves cells below 0), then by cell
    return (<uint64_t>(p + POS_INF) << 32) | <uint64_t>j


cdef inline int64_t _key_pos(uint64_t key) noexcept nogil:
    return <int64_t>(key >> 32) - POS_INF


cdef inline int64_t _cell(uint64_t key) noexcept nogil:
    return <int64_t>((key << 32) >> 32)


cdef inline int _is_2d_later(const int32_t* ext, int64_t cell, int32_t x, int32_t y) noexcept nogil:
    # the cell's (x, y) comes after the token's in raster order
    cdef int32_t cx = ext[cell * 3], cy = ext[cell * 3 + 1]
    return cy > y or (cy == y and cx > x)


# ------------------------------------------------------------------------------------------ the cell pass

cdef struct Members:
    # one sequence's member cells as keys (`_key`), sorted by key once listed
    uint64_t* keys
    int64_t n
    int64_t cap
    int unsorted


cdef struct Direct:
    # a sequence with one token in the ubatch: the cell pass writes (or lists) only the cells that token attends
    int64_t lo  # the attended interval of positions [lo, hi]
    int64_t hi
    int64_t row  # offset of the token's row in the output
    int32_t p1  # the token's position and 2-D position
    int32_t x
    int32_t y


cdef inline int _push(Members* m, uint64_t key) noexcept nogil:
    # append a key; 0 when out of memory
    cdef uint64_t* grown
    cdef int64_t cap
    if m.n == m.cap:
        cap = m.cap * 2 if m.cap > 0 else 64
        grown = <uint64_t*>realloc(m.keys, <size_t>cap * sizeof(uint64_t))
        if grown == NULL:
            return 0
        m.keys = grown
        m.cap = cap
    m.keys[m.n] = key
    m.n += 1
    return 1


cdef inline void _interval(const KQArgs* a, int64_t p1, int64_t pos_min,
                           int64_t* lo_out, int64_t* hi_out) noexcept nogil:
    # the interval [lo, hi] of positions a token at p1 attends (empty when hi < lo)
    cdef int64_t lo = -POS_INF, hi = POS_INF - 1, wlo, whi, half
    if a.causal:
        hi = p1
    if a.swa_type != 0:
        whi = POS_INF - 1
        if a.swa_type == 1:
            wlo = p1 - a.n_swa + 1
        elif a.swa_type == 2:
            wlo = (p1 // a.n_swa) * a.n_swa
        else:
            half = a.n_swa // 2
            wlo = p1 - half
            whi = p1 + half
        if a.span:
            # non-causal SWA_FULL: the window cannot hide the ubatch's own positions, and
            # p1 + half >= pos_min, so the union is still one interval
            if pos_min < wlo:
                wlo = pos_min
            whi = POS_INF - 1
        if wlo > lo:
            lo = wlo
        if whi < hi:
            hi = whi
    lo_out[0] = lo
    hi_out[0] = hi


cdef inline int _put(elem_t* out, Members* m, const Direct* t, const int32_t* ext, int64_t j, int32_t p0,
                     int check_2d, int alibi) noexcept nogil:
    """Cell j (position p0) of a one-token sequence, when the token attends it: written into the token's row
    (``out``), or without ``out`` appended to the sequence's list. 0 when out of memory."""
    cdef elem_t KEEP = 0
    if p0 < t.lo or p0 > t.hi:
        return 1
    if check_2d and p0 == t.p1 and _is_2d_later(ext, j, t.x, t.y):
        return 1
    if out != NULL:
        out[t.row + j] = _alibi_value(KEEP, <int64_t>p0 - t.p1) if alibi else KEEP
        return 1
    if m.n < m.cap:
        m.keys[m.n] = _key(p0, j)
        m.n += 1
        return 1
    return _push(m, _key(p0, j))


cdef int _cell_pass(elem_t* out, const KQArgs* a, const int32_t* pos, const uint64_t* seq, const int32_t* ext,
                    const uint64_t* direct, const uint64_t* listed, const Direct* d, Members* mem,
                    int fill_rows) noexcept nogil:
    """One pass over a stream's cells: each cell goes to the key lists of the ``listed`` sequences it holds; for
    the one-token sequences (``direct``) the cells their token attends are written into its row (``out``, filled
    with -inf beforehand, or here when ``fill_rows``: every row of the output is a one-token row) or, without
    ``out``, listed too.

    Keys are appended in cell order, so cells laid out by position need no sort. Returns 0 when out of
    memory.
    """
    cdef elem_t DROP = _neg_inf(out)
    cdef int64_t n_kv = a.n_kv
    cdef int64_t j, cap, i, j0, j1, blk
    cdef int w, k, s, n_words = 0, n_listed = 0, n_all = 0
    cdef int words[N_WORDS]
    cdef uint64_t bits, b, key
    cdef uint64_t* grown
    cdef int32_t p0
    cdef int check_2d = a.is_2d and a.causal
    cdef Members* m
    cdef int64_t lo[64]
    cdef int64_t row[64]
    cdef uint64_t span[64]
    cdef uint64_t* wp[64]
    cdef uint64_t* wend[64]
    for w in range(N_WORDS):
        if direct[w] | listed[w]:
            words[n_words] = w
            n_words += 1
            n_listed += kvref_popcount64(listed[w])
            n_all += kvref_popcount64(direct[w] | listed[w])
    # each list starts with room for its share of the cells (all of them when there is one sequence)
    if out != NULL:
        n_all = n_listed
    cap = n_kv if n_all == 1 else n_kv // max(n_all, 1) + 64
    for k in range(n_words):
        bits = (direct[words[k]] if out == NULL else 0) | listed[words[k]]
        while bits:
            m = &mem[words[k] * 64 + kvref_ctz64(bits)]
            if m.cap < cap:
                grown = <uint64_t*>realloc(m.keys, <size_t>max(cap, 1) * sizeof(uint64_t))
                if grown == NULL:
                    return 0
                m.keys = grown
                m.cap = cap
            bits &= bits - 1
    cdef int tight = n_words == 1 and n_listed == 0 and out != NULL and not check_2d and not a.alibi
    if fill_rows and not tight:
        _fill(out, a.n_tokens * n_kv, DROP)
    if tight:
        # only one-token sequences, all in one word, written in place, 0 or -inf (a decode step): the tightest loop.
        # With fill_rows the rows are filled and patched a block of columns at a time, small enough to stay in L2:
        # filled first in full, a large mask is out of cache again when the pass patches it
        w = words[0]
        bits = direct[w]
        for k in range(64):
            # p0 is attended when p0 - lo, read unsigned, is at most hi - lo; an empty interval (or no token) gets
            # lo = 2^31, above every position, so that p0 - lo is negative: never
            lo[k] = POS_INF
            span[k] = 0
            row[k] = 0
            if (bits >> k) & 1 and d[w * 64 + k].hi >= d[w * 64 + k].lo:
                lo[k] = d[w * 64 + k].lo
                span[k] = <uint64_t>(d[w * 64 + k].hi - d[w * 64 + k].lo)
                row[k] = d[w * 64 + k].row
        blk = max(64, BLOCK_BYTES // (<int64_t>sizeof(elem_t) * a.n_tokens)) if fill_rows else n_kv
        j0 = 0
        while j0 < n_kv:
            j1 = min(n_kv, j0 + blk)
            if fill_rows:
                for i in range(a.n_tokens):
                    _fill(out + i * n_kv + j0, j1 - j0, DROP)
            for j in range(j0, j1):
                b = seq[j * N_WORDS + w] & bits
                if b == 0:
                    continue
                p0 = pos[j]
                if p0 == -1:
                    continue
                while b:
                    k = kvref_ctz64(b)
                    b &= b - 1
                    if <uint64_t>(p0 - lo[k]) <= span[k]:
                        out[row[k] + j] = 0
            j0 = j1
        return 1
    if n_words == 1 and n_listed == 0 and out == NULL and not check_2d:
        # only one-token sequences, all in one word, listed (their rows share cache sets; a server's decode step):
        # each cell's key goes to the lists of the sequences whose token attends it, through per-sequence write
        # pointers held in arrays (the test as in the loop above)
        w = words[0]
        bits = direct[w]
        for k in range(64):
            lo[k] = POS_INF
            span[k] = 0
            wp[k] = NULL
            wend[k] = NULL
            if (bits >> k) & 1:
                m = &mem[w * 64 + k]
                wp[k] = m.keys + m.n
                wend[k] = m.keys + m.cap
                if d[w * 64 + k].hi >= d[w * 64 + k].lo:
                    lo[k] = d[w * 64 + k].lo
                    span[k] = <uint64_t>(d[w * 64 + k].hi - d[w * 64 + k].lo)
        for j in range(n_kv):
            b = seq[j * N_WORDS + w] & bits
            if b == 0:
                continue
            p0 = pos[j]
            if p0 == -1:
                continue
            key = _key(p0, j)
            while b:
                k = kvref_ctz64(b)
                b &= b - 1
                if <uint64_t>(p0 - lo[k]) <= span[k]:
                    if wp[k] != wend[k]:
                        wp[k][0] = key
                        wp[k] += 1
                        continue
                    m = &mem[w * 64 + k]
                    m.n = wp[k] - m.keys
                    if not _push(m, key):
                        return 0
                    wp[k] = m.keys + m.n
                    wend[k] = m.keys + m.cap
        for k in range(64):
            if (bits >> k) & 1:
                m = &mem[w * 64 + k]
                m.n = wp[k] - m.keys
        return 1
    if n_words == 1 and n_listed == 0:
        # only one-token sequences, all in one word (a decode step of up to 64 sequences)
        w = words[0]
        for j in range(n_kv):
            bits = seq[j * N_WORDS + w] & direct[w]
            if bits == 0:
                continue
            p0 = pos[j]
            if p0 == -1:
                continue
            while bits:
                s = w * 64 + kvref_ctz64(bits)
                bits &= bits - 1
                if not _put(out, &mem[s], &d[s], ext, j, p0, check_2d, a.alibi):
                    return 0
        return 1
    if n_words == 1 and n_listed == 1 and direct[words[0]] == 0:
        # one listed sequence (a prompt): one bit to test, and room for every cell
        w = words[0]
        m = &mem[w * 64 + kvref_ctz64(listed[w])]
        bits = listed[w]
        for j in range(n_kv):
            p0 = pos[j]
            if p0 != -1 and (seq[j * N_WORDS + w] & bits):
                key = _key(p0, j)
                if m.n > 0 and m.keys[m.n - 1] > key:
                    m.unsorted = 1
                m.keys[m.n] = key
                m.n += 1
        return 1
    for j in range(n_kv):
        p0 = pos[j]
        if p0 == -1:
            continue
        for k in range(n_words):
            w = words[k]
            b = seq[j * N_WORDS + w]
            bits = b & direct[w]
            while bits:
                s = w * 64 + kvref_ctz64(bits)
                bits &= bits - 1
                if not _put(out, &mem[s], &d[s], ext, j, p0, check_2d, a.alibi):
                    return 0
            bits = b & listed[w]
            if bits == 0:
                continue
            key = _key(p0, j)
            s = w * 64 + kvref_ctz64(bits)
            if (bits & (bits - 1)) == 0 and mem[s].n < mem[s].cap:
                # one listed sequence in this word and room in its list (the usual case): plain append
                mem[s].keys[mem[s].n] = key
                mem[s].n += 1
                continue
            while bits:
                if not _push(&mem[w * 64 + kvref_ctz64(bits)], key):
                    return 0
                bits &= bits - 1
    # keys went in by cell; a list needs sorting only when its positions go down somewhere
    for k in range(n_words):
        bits = listed[words[k]]
        while bits:
            m = &mem[words[k] * 64 + kvref_ctz64(bits)]
            for j in range(1, m.n):
                if m.keys[j - 1] > m.keys[j]:
                    m.unsorted = 1
                    break
            bits &= bits - 1
    return 1


# ------------------------------------------------------------------------------------------ rows

cdef void _kq_rows(elem_t* out, const KQArgs* a, const Members* mem, const int32_t* n_tok, int direct_written,
                   const int32_t** cext, const int32_t* seq_stream, const int64_t* pos_min) noexcept nogil:
    # the rows from the key lists (the one-token rows too, unless the cell pass wrote them: direct_written)
    cdef elem_t KEEP = 0
    cdef elem_t DROP = _neg_inf(out)
    cdef int64_t n_kv = a.n_kv
    cdef int64_t last_row[MAX_SEQ]
    cdef int64_t prev_a[MAX_SEQ]
    cdef int64_t prev_b[MAX_SEQ]
    cdef int64_t prev_e[MAX_SEQ]  # start of the previous token's 2-D exception range
    cdef int64_t first_cell[MAX_SEQ]  # when the sorted list is cells c, c+1, c+2, ...: c; else -1
    cdef int64_t i, k, m, ra, rb, e0, p1, c0, c1
    cdef int64_t lo = 0, hi = -1
    cdef int s
    cdef int check_2d = a.is_2d and a.causal
    cdef const uint64_t* ks
    cdef const int32_t* ext = NULL
    cdef elem_t* row
    cdef int32_t x = 0, y = 0
    cdef size_t row_bytes = <size_t>n_kv * sizeof(elem_t)
    cdef int64_t seg = SEG_BYTES // <int64_t>sizeof(elem_t)
    for s in range(MAX_SEQ):
        last_row[s] = -1
        first_cell[s] = -2  # not looked at yet

    for i in range(a.n_tokens):
        s = a.tok_seq[i]
        p1 = a.tok_pos[i]
        ks = mem[s].keys
        m = mem[s].n
        row = out + i * n_kv
        if n_tok[s] == 1:
            if direct_written:
                continue
            # the only token of its sequence: the list holds exactly the cells it attends, in cell order (the cell
            # pass appends them so); the row is written in pieces of 8 KiB, each filled with -inf and then patched
            # while it is still in L1 (a whole row filled first would be out of L1 again before it is patched)
            k = 0
            c0 = 0
            while c0 < n_kv:
                c1 = min(n_kv, c0 + seg)
                _fill(row + c0, c1 - c0, DROP)
                if a.alibi:
                    while k < m and _cell(ks[k]) < c1:
                        row[_cell(ks[k])] = _alibi_value(KEEP, _key_pos(ks[k]) - p1)
                        k += 1
                else:
                    while k < m and _cell(ks[k]) < c1:
                        row[_cell(ks[k])] = KEEP
                        k += 1
                c0 = c1
            continue
        if check_2d:
            ext = cext[seq_stream[s]]
            x = a.tok_x[i]
            y = a.tok_y[i]

        _interval(a, p1, pos_min[s], &lo, &hi)
        if hi < lo:
            ra = rb = 0
        else:
            ra = _lower_bound(ks, m, _key(lo, 0))
            rb = m if hi >= POS_INF - 1 else _lower_bound(ks, m, _key(hi + 1, 0))
        # with the 2-D rule the cells at exactly p1 (the top of the range) are tested one by one
        e0 = rb
        if check_2d and rb > ra:
            e0 = _lower_bound(ks + ra, rb - ra, _key(p1, 0)) + ra

        if first_cell[s] == -2:
            # a sequence laid out in position order in consecutive cells (a prompt, one stream per
            # sequence) has rows made of three runs: write them directly, no copy needed
            first_cell[s] = _cell(ks[0]) if m > 0 else -1
            for k in range(1, m):
                if _cell(ks[k]) != first_cell[s] + k:
                    first_cell[s] = -1
                    break
        if first_cell[s] >= 0 and not a.alibi:
            _fill(row, first_cell[s] + ra, DROP)
            _fill(row + first_cell[s] + ra, rb - ra, KEEP)
            _fill(row + first_cell[s] + rb, n_kv - first_cell[s] - rb, DROP)
        elif a.alibi or last_row[s] < 0:
            _fill(row, n_kv, DROP)
            if a.alibi:
                for k in range(ra, rb):
                    row[_cell(ks[k])] = _alibi_value(KEEP, _key_pos(ks[k]) - p1)
            else:
                for k in range(ra, rb):
                    row[_cell(ks[k])] = KEEP
        else:
            memcpy(row, out + last_row[s] * n_kv, row_bytes)
            # only the cells between the old and the new range ends change
            for k in range(min(ra, prev_a[s]), max(ra, prev_a[s])):
                row[_cell(ks[k])] = KEEP if (k >= ra and k < rb) else DROP
            for k in range(min(rb, prev_b[s]), max(rb, prev_b[s])):
                row[_cell(ks[k])] = KEEP if (k >= ra and k < rb) else DROP
            if check_2d:
                # undo the previous token's 2-D holes
                for k in range(prev_e[s], prev_b[s]):
                    row[_cell(ks[k])] = KEEP if (k >= ra and k < rb) else DROP
        if check_2d:
            for k in range(e0, rb):
                if _is_2d_later(ext, _cell(ks[k]), x, y):
                    row[_cell(ks[k])] = DROP
        last_row[s] = i
        prev_a[s] = ra
        prev_b[s] = rb
        prev_e[s] = e0


cdef int _kq_mask(elem_t* out, const KQArgs* a, int n_cstream, const int32_t** cpos, const uint64_t** cseq,
                  const int32_t** cext, const uint64_t* want, const int32_t* n_tok, const int32_t* seq_stream,
                  const int64_t* pos_min, Members* mem) noexcept nogil:
    """The whole mask: the cell pass per stream, then the rows from the key lists. Returns 0 when out of memory.

    The rows of one-token sequences are filled with -inf and written during the pass, unless rows that far
    apart share cache sets (a row of a multiple of 64 KiB: many rows written column by column then evict each
    other); then their attended cells are listed and written row by row like the others."""
    cdef elem_t DROP = _neg_inf(out)
    cdef Direct d[MAX_SEQ]
    cdef uint64_t direct[MAX_STREAMS * N_WORDS]
    cdef uint64_t listed[MAX_STREAMS * N_WORDS]
    cdef int64_t i, i0, n_direct = 0
    cdef uint64_t row_bytes = <uint64_t>a.n_kv * sizeof(elem_t)
    cdef uint64_t apart = 65536 // min(row_bytes & (~row_bytes + 1), <uint64_t>65536)  # distinct row starts mod 64 KiB
    cdef int s, st, w, write_direct, fill_rows
    for w in range(n_cstream * N_WORDS):
        direct[w] = 0
        listed[w] = want[w]
    for i in range(a.n_tokens):
        s = a.tok_seq[i]
        if n_tok[s] != 1:
            continue
        n_direct += 1
        st = seq_stream[s]
        direct[st * N_WORDS + (s >> 6)] |= (<uint64_t>1) << (s & 63)
        listed[st * N_WORDS + (s >> 6)] &= ~((<uint64_t>1) << (s & 63))
        d[s].p1 = a.tok_pos[i]
        d[s].row = i * a.n_kv
        d[s].x = a.tok_x[i] if a.is_2d else 0
        d[s].y = a.tok_y[i] if a.is_2d else 0
        _interval(a, d[s].p1, pos_min[s], &d[s].lo, &d[s].hi)
    write_direct = n_direct > 0 and <uint64_t>n_direct <= 8 * apart
    # every row a one-token row of the one stream: the pass fills them as it goes
    fill_rows = write_direct and n_direct == a.n_tokens and n_cstream == 1
    if write_direct and not fill_rows:
        # the one-token rows start as -inf; consecutive ones are one fill
        i0 = -1
        for i in range(a.n_tokens + 1):
            if i < a.n_tokens and n_tok[a.tok_seq[i]] == 1:
                if i0 < 0:
                    i0 = i
            elif i0 >= 0:
                _fill(out + i0 * a.n_kv, (i - i0) * a.n_kv, DROP)
                i0 = -1
    for st in range(n_cstream):
        w = st * N_WORDS
        if want[w] | want[w + 1] | want[w + 2] | want[w + 3]:
            if not _cell_pass(out if write_direct else <elem_t*>NULL, a, cpos[st], cseq[st], cext[st], &direct[w],
                              &listed[w], d, mem, fill_rows):
                return 0
    if write_direct and n_direct == a.n_tokens:
        return 1
    for s in range(MAX_SEQ):
        if mem[s].unsorted:
            sort(mem[s].keys, mem[s].keys + mem[s].n)
    _kq_rows(out, a, mem, n_tok, write_direct, cext, seq_stream, pos_min)
    return 1


cdef inline const int32_t* _i32_ptr(cnp.ndarray arr):
    return <const int32_t*>cnp.PyArray_DATA(arr)


def fill_kq_mask_raw(
    out,
    cell_pos,
    cell_seq,
    cell_ext,
    seq_to_stream,
    tok_pos,
    tok_seq,
    *,
    tok_x=None,
    tok_y=None,
    n_swa=0,
    swa_type=0,
    causal=True,
    non_causal_type=0,
    alibi=False,
):
    """Fill ``out`` (float32 or float16, ``(n_stream, n_tps, n_kv)``) with the KQ mask; return ``out``.

    Same arguments and result as ``kvref.memory._mask_py.fill_kq_mask_raw``.
    """
    (tok_pos, tok_seq, tok_stream, tok_x, tok_y, n_kv, pos, seq, ext, n_swa, swa_type) = _check_kq_args(
        out, cell_pos, cell_seq, cell_ext, seq_to_stream, tok_pos, tok_seq, tok_x, tok_y, n_swa, swa_type,
        non_causal_type,
    )
    cdef KQArgs a
    cdef int64_t n_tokens = tok_pos.shape[0]
    if not causal and non_causal_type == NonCausalType.SWA_ONLY:
        causal = swa_type == 0
    a.n_tokens = n_tokens
    a.n_kv = n_kv
    a.causal = 1 if causal else 0
    a.swa_type = swa_type
    a.n_swa = n_swa
    a.span = 1 if (swa_type != 0 and not causal and non_causal_type == NonCausalType.SWA_FULL) else 0
    a.alibi = 1 if alibi else 0
    a.is_2d = 1 if tok_x is not None else 0
    if n_tokens == 0 or n_kv == 0:
        return out

    cdef cnp.ndarray tp = tok_pos, tsq = tok_seq, tst = tok_stream, tx, ty
    a.tok_pos = _i32_ptr(tp)
    a.tok_seq = _i32_ptr(tsq)
    a.tok_x = NULL
    a.tok_y = NULL
    if a.is_2d:
        tx = tok_x
        ty = tok_y
        a.tok_x = _i32_ptr(tx)
        a.tok_y = _i32_ptr(ty)

    cdef int64_t pos_min[MAX_SEQ]
    cdef int32_t seq_stream[MAX_SEQ]
    cdef int32_t n_tok[MAX_SEQ]  # tokens of each sequence in the ubatch
    cdef uint64_t want[MAX_STREAMS * N_WORDS]  # per stream: the ubatch's sequences it holds
    cdef Members mem[MAX_SEQ]
    cdef int64_t i
    cdef int s, st, w
    cdef int n_cstream = len(pos)
    if n_cstream > MAX_STREAMS:
        raise ArgumentError(f"cell_pos: at most {MAX_STREAMS} streams")
    cdef const int32_t* tposp = a.tok_pos
    cdef const int32_t* tseqp = a.tok_seq
    cdef const int32_t* tstp = _i32_ptr(tst)
    for s in range(MAX_SEQ):
        pos_min[s] = POS_INF
        seq_stream[s] = 0
        n_tok[s] = 0
        mem[s].keys = NULL
        mem[s].n = 0
        mem[s].cap = 0
        mem[s].unsorted = 0
    for w in range(MAX_STREAMS * N_WORDS):
        want[w] = 0
    for i in range(n_tokens):
        s = tseqp[i]
        if tposp[i] < pos_min[s]:
            pos_min[s] = tposp[i]
        seq_stream[s] = tstp[i]
        n_tok[s] += 1
        want[tstp[i] * N_WORDS + (s >> 6)] |= (<uint64_t>1) << (s & 63)

    # pointers to each stream's cells (the arrays stay referenced by pos / seq / ext)
    cdef const int32_t* cpos[MAX_STREAMS]
    cdef const uint64_t* cseq[MAX_STREAMS]
    cdef const int32_t* cext[MAX_STREAMS]
    cdef cnp.ndarray arr
    for st in range(n_cstream):
        arr = pos[st]
        cpos[st] = <const int32_t*>cnp.PyArray_DATA(arr)
        arr = seq[st]
        cseq[st] = <const uint64_t*>cnp.PyArray_DATA(arr)
        cext[st] = NULL
        if ext is not None:
            arr = ext[st]
            cext[st] = <const int32_t*>cnp.PyArray_DATA(arr)

    cdef cnp.ndarray out_arr = out
    cdef void* outp = cnp.PyArray_DATA(out_arr)
    cdef int f16 = out.dtype == np.float16
    cdef int ok = 1
    try:
        with nogil:
            if f16:
                ok = _kq_mask(<uint16_t*>outp, &a, n_cstream, cpos, cseq, cext, want, n_tok, seq_stream, pos_min, mem)
            else:
                ok = _kq_mask(<uint32_t*>outp, &a, n_cstream, cpos, cseq, cext, want, n_tok, seq_stream, pos_min, mem)
    finally:
        for s in range(MAX_SEQ):
            free(mem[s].keys)
    if not ok:
        raise MemoryError("fill_kq_mask_raw: no memory for the per-sequence cell lists")
    return out


# ------------------------------------------------------------------------------------------ T5 buckets

cdef inline int32_t _bucket(int32_t x, int32_t y, uint64_t n_buckets, int bidirectional) noexcept nogil:
    cdef int64_t max_distance = 128
    if bidirectional:
        n_buckets >>= 1
    cdef int64_t max_exact = <int64_t>(n_buckets >> 1)
    cdef int32_t rel = <int32_t>(<uint32_t>x - <uint32_t>y)  # int32 subtraction, wrapping
    cdef int32_t bucket = 0
    cdef int32_t large
    cdef float t, f
    cdef double u
    if bidirectional:
        bucket = <int32_t>(<uint64_t>bucket + <uint64_t>(rel > 0) * n_buckets)
        if rel < 0:
            rel = <int32_t>(0 - <uint32_t>rel)
    else:
        if rel > 0:
            rel = 0
        rel = <int32_t>(0 - <uint32_t>rel)
    if rel < max_exact:
        return <int32_t>(<uint32_t>bucket + <uint32_t>rel)
    # the mix of float and double steps is llama.cpp's
    t = logf(<float>((1.0 * rel) / max_exact)) * <float>(n_buckets - <uint64_t>max_exact)
    u = max_exact + t / log((1.0 * max_distance) / max_exact)
    f = floorf(<float>u)
    if f >= -2147483648.0 and f < 2147483648.0:
        large = <int32_t>f
    else:
        large = INT32_MIN  # NaN / out of range: what x86 gives for llama.cpp's undefined conversion
    if large > <int64_t>n_buckets - 1:
        large = <int32_t>(<int64_t>n_buckets - 1)
    return <int32_t>(<uint32_t>bucket + <uint32_t>large)


def relative_position_bucket(x, y, n_buckets, bidirectional):
    """llama_relative_position_bucket, elementwise; same result as the Python twin."""
    xb, yb = np.broadcast_arrays(np.asarray(x, dtype=np.int32), np.asarray(y, dtype=np.int32))
    n_buckets = int(n_buckets)
    if n_buckets < 0 or n_buckets >= 2**32:
        raise ArgumentError(f"n_buckets: {n_buckets} is outside [0, 2**32)")
    if ((n_buckets >> 1) if bidirectional else n_buckets) >> 1 == 0:
        raise ArgumentError("n_buckets: needs at least 2 buckets (4 when bidirectional)")
    cdef cnp.ndarray xa = np.ascontiguousarray(xb), ya = np.ascontiguousarray(yb)
    cdef cnp.ndarray res = np.empty(xb.shape, dtype=np.int32)
    cdef const int32_t* xp = _i32_ptr(xa)
    cdef const int32_t* yp = _i32_ptr(ya)
    cdef int32_t* rp = <int32_t*>cnp.PyArray_DATA(res)
    cdef int64_t i, n = xa.size
    cdef uint64_t nb = n_buckets
    cdef int bi = 1 if bidirectional else 0
    with nogil:
        for i in range(n):
            rp[i] = _bucket(xp[i], yp[i], nb, bi)
    return res


def fill_pos_bucket_raw(out, key_pos, tok_pos, n_buckets, bidirectional=False):
    """``out[i, j] = relative_position_bucket(key_pos[j], tok_pos[i], n_buckets, bidirectional)``."""
    key_pos = _as_i32_1d("key_pos", key_pos)
    tok_pos = _as_i32_1d("tok_pos", tok_pos)
    if not isinstance(out, np.ndarray) or out.dtype != np.int32:
        raise ArgumentTypeError("out: expected an int32 NumPy array")
    if out.shape != (tok_pos.shape[0], key_pos.shape[0]) or not out.flags.c_contiguous or not out.flags.writeable:
        shape = (tok_pos.shape[0], key_pos.shape[0])
        raise ArgumentError(f"out: expected a writeable C-contiguous array of shape {shape}")
    n_buckets = int(n_buckets)
    if n_buckets < 0 or n_buckets >= 2**32:
        raise ArgumentError(f"n_buckets: {n_buckets} is outside [0, 2**32)")
    if ((n_buckets >> 1) if bidirectional else n_buckets) >> 1 == 0:
        raise ArgumentError("n_buckets: needs at least 2 buckets (4 when bidirectional)")
    cdef cnp.ndarray ka = key_pos, ta = tok_pos, oa = out
    cdef const int32_t* kp = _i32_ptr(ka)
    cdef const int32_t* tp = _i32_ptr(ta)
    cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(oa)
    cdef int64_t i, j, n_t = ta.shape[0], n_k = ka.shape[0]
    cdef uint64_t nb = n_buckets
    cdef int bi = 1 if bidirectional else 0
    with nogil:
        for i in range(n_t):
            for j in range(n_k):
                op[i * n_k + j] = _bucket(kp[j], tp[i], nb, bi)
    return out


# ------------------------------------------------------------------------------------------ K-shift

def fill_k_shift_raw(out, cell_pos, cell_shift):
    """set_input_k_shift: ``out[st, j]`` = the pending shift of cell j of stream st, 0 for an empty cell."""
    if not isinstance(out, np.ndarray) or out.dtype != np.int32:
        raise ArgumentTypeError("out: expected an int32 NumPy array")
    if len(cell_pos) != len(cell_shift) or out.ndim != 2 or out.shape[0] != len(cell_pos):
        raise ArgumentError("out: expected shape (n_stream, size) with one cell_pos and cell_shift per stream")
    cdef int64_t j, n = out.shape[1]
    cdef const int32_t* pp
    cdef const int32_t* sp
    cdef int32_t* op
    cdef cnp.ndarray pa, sa, oa
    for st in range(len(cell_pos)):
        p = np.asarray(cell_pos[st])
        sh = np.asarray(cell_shift[st])
        if p.dtype != np.int32 or sh.dtype != np.int32 or p.shape != (n,) or sh.shape != p.shape:
            raise ArgumentTypeError(f"cell_pos[{st}], cell_shift[{st}]: expected int32 arrays of {n} cells")
        pa = np.ascontiguousarray(p)
        sa = np.ascontiguousarray(sh)
        oa = out[st]
        if not oa.flags.c_contiguous or not oa.flags.writeable:
            raise ArgumentError("out: expected a writeable C-contiguous array")
        pp = _i32_ptr(pa)
        sp = _i32_ptr(sa)
        op = <int32_t*>cnp.PyArray_DATA(oa)
        with nogil:
            for j in range(n):
                op[j] = 0 if pp[j] == -1 else sp[j]
    return out


def first_seq_ids(seq_id, n_tokens):
    """Each token's first sequence id as int32 (see _mask_py.py); read from lists at C speed."""
    cdef Py_ssize_t i, n = n_tokens
    if type(seq_id) is not list or len(<list>seq_id) < n:
        return _first_seq_ids_py(seq_id, n_tokens)
    cdef cnp.npy_intp dim = n
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)
    cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(out)
    for i in range(n):
        ids = (<list>seq_id)[i]
        if type(ids) is not list or len(<list>ids) == 0 or type((<list>ids)[0]) is not int:
            return _first_seq_ids_py(seq_id, n_tokens)
        o[i] = (<list>ids)[0]
    return out


__all__ = [
    "LLAMA_MAX_SEQ",
    "N_SWA_MAX",
    "NonCausalType",
    "fill_k_shift_raw",
    "fill_kq_mask_raw",
    "fill_pos_bucket_raw",
    "first_seq_ids",
    "is_masked_swa",
    "relative_position_bucket",
]
