# The C-level declaration of the Cython KVCells (kvref/memory/_cells_c.pyx), so that the slot kernels
# (kvref/memory/_slots_c.pyx) read its arrays and sequence index, and write a decode step's cells, without going
# through Python (holding its guard, _enter, while they do).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libcpp.set cimport set as cset
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from cpython.pythread cimport PyThread_type_lock

cimport numpy as cnp

ctypedef pair[int32_t, uint32_t] PosCell
ctypedef cset[PosCell] PosSet


cdef extern from *:
    """
    #include "pythread.h"
    /* A KVCells' guard (kvref/_cells_c.pyx), given back when the C function that took it returns, on every path:
       a local of each guarded method, armed by KVCells._enter with pointers to the guard's fields. */
    struct kvref_cells_guard {
        int *busy = nullptr;
        long *owner = nullptr;
        int *waiters = nullptr;
        PyThread_type_lock *gate = nullptr;
        ~kvref_cells_guard() {
            if (busy) {
                *busy = 0;
                *owner = 0;
                if (*waiters) PyThread_release_lock(*gate);  /* wake a thread waiting for the cells */
            }
        }
    };
    """
    cppclass CellsGuard "kvref_cells_guard":
        int* busy
        long* owner
        int* waiters
        PyThread_type_lock* gate


cdef class KVCells:
    cdef cnp.ndarray _pos_arr
    cdef cnp.ndarray _shift_arr
    cdef cnp.ndarray _ext_arr
    cdef cnp.ndarray _seq_arr
    cdef int32_t* _pos
    cdef int32_t* _shift
    cdef int32_t* _ext      # [n][3]
    cdef uint64_t* _seq     # [n][4]
    cdef Py_ssize_t _n
    cdef Py_ssize_t _n_used
    cdef Py_ssize_t _lo     # every used cell lies in [_lo, _hi) (tightened lazily)
    cdef Py_ssize_t _hi
    cdef bint _has_shift
    cdef vector[PosSet] _seq_pos
    cdef vector[uint8_t] _mark  # scratch for duplicate detection, all zero between calls
    # the guard: a call is running (owned by thread _owner); threads waiting for it; their lock (made on first wait)
    cdef int _busy
    cdef long _owner
    cdef int _waiters
    cdef PyThread_type_lock _gate

    cdef int _enter(self, str what, CellsGuard& g) except -1
    cdef int _wait(self, str what) except -1
    cdef void _reset(self) noexcept
    cdef void _tighten(self) noexcept nogil
    cdef bint _has(self, Py_ssize_t i, int s) noexcept nogil
    cdef bint _any(self, Py_ssize_t i) noexcept nogil
    cdef void _on_used(self, Py_ssize_t i) noexcept nogil
    cdef void _sp_rm_cell(self, Py_ssize_t i) noexcept nogil
    cdef void _sp_add_cell(self, Py_ssize_t i) noexcept nogil
    cdef void _sp_move_cell(self, Py_ssize_t i, int32_t p_new) noexcept nogil
    cdef void _free(self, Py_ssize_t i, bint reset_ext) noexcept nogil
    cdef bint _pos_add_c(self, Py_ssize_t i, int64_t d) noexcept nogil
    cdef void _pos_div_c(self, Py_ssize_t i, int64_t d) noexcept nogil
    cdef void _shift_cells(self, vector[uint32_t]& cells, int64_t d, bint div, uint8_t* freed) noexcept nogil
    cdef Py_ssize_t _index(self, object i) except -1
    cdef Py_ssize_t _pos_set(self, object i, object p) except -1
    cdef Py_ssize_t _used(self, object i, str what) except -1
    cdef int64_t _delta(self, str what, object d) except? -1
    cdef int64_t _divisor(self, str what, object d, vector[uint32_t]& cells) except? -1
    cdef cnp.ndarray _cp_indices(self, object i, object n)
    cdef list _seqs_of(self, Py_ssize_t v)
    cdef int _mark_dups(self, const int64_t[::1] iv) noexcept nogil
    cdef cnp.ndarray _seq_pos_ends_many(self, object seq_ids, bint last)
    cdef void _range(self, int s, int64_t p0, int64_t p1, PosSet.iterator* first,
                     PosSet.iterator* last) noexcept nogil
    cdef void _collect(self, int s, int64_t p0, int64_t p1, vector[uint32_t]& cells) noexcept nogil
    # for the slot kernels
    cdef int64_t _seq_pos_max_c(self, int s) noexcept nogil
    cdef bint _place_c(self, const int64_t* idxs, const int64_t* pos, const int64_t* seq, const int64_t* x,
                       const int64_t* y, const int64_t* tok, Py_ssize_t m, bint check) noexcept nogil
