# distutils: language = c++
"""Cython twin of the QSA ranked order; same API and results as ``kvref/memory/_qsa_py.py`` (which states them).

``rank_order`` sorts (pos, y, x, cell) records with the C++ library's own ``std::sort`` and a comparator on the key
alone: the order of cells with equal keys is libstdc++'s, as in llama.cpp's build.
"""

from libc.stdint cimport int64_t
from libcpp.algorithm cimport sort
from libcpp.vector cimport vector

import numpy as np

cimport numpy as cnp

cnp.import_array()

__all__ = ["rank_order", "std_sort"]

from kvref.memory._qsa_py import std_sort  # noqa: E402  the statement of the algorithm, shared


cdef struct Rec:
    int64_t p
    int64_t y
    int64_t x
    int64_t cell


cdef bint _less(Rec a, Rec b) noexcept nogil:
    if a.p != b.p:
        return a.p < b.p
    if a.y != b.y:
        return a.y < b.y
    return a.x < b.x


def rank_order(cells, pos, y, x):
    """``cells`` sorted by (pos, y, x) with ``std::sort`` (see ``_qsa_py.rank_order``)."""
    cdef const int64_t[::1] c = np.ascontiguousarray(cells, np.int64)
    cdef const int64_t[::1] p = np.ascontiguousarray(pos, np.int64)
    cdef const int64_t[::1] b = np.ascontiguousarray(y, np.int64)
    cdef const int64_t[::1] a = np.ascontiguousarray(x, np.int64)
    cdef Py_ssize_t n = c.shape[0], i
    if p.shape[0] != n or b.shape[0] != n or a.shape[0] != n:
        raise ValueError("rank_order: cells, pos, y and x differ in length")
    cdef vector[Rec] recs
    recs.resize(n)
    out = np.empty(n, np.int64)
    cdef int64_t[::1] o = out
    with nogil:
        for i in range(n):
            recs[i].p = p[i]
            recs[i].y = b[i]
            recs[i].x = a[i]
            recs[i].cell = c[i]
        sort(recs.begin(), recs.end(), _less)
        for i in range(n):
            o[i] = recs[i].cell
    return out
