# distutils: language = c++
"""Cython twin of the GGUF metadata walk's inner loop; same API and results as ``kvref/_gguf_py.py``, which states
it: stepping over an array of length-prefixed strings (a tokenizer's vocabulary) in one C loop."""

from libc.stdint cimport uint64_t

TRUNCATED_LENGTH = 1
TRUNCATED_STRING = 2


def skip_strings(buf, Py_ssize_t at, Py_ssize_t count, Py_ssize_t end, bint big_endian):
    """See kvref/_gguf_py.py."""
    cdef const unsigned char[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t _i, k
    cdef uint64_t n
    cdef const unsigned char* p
    if end > view.shape[0]:
        end = view.shape[0]
    for _i in range(count):
        if at < 0 or at + 8 > end:
            return at, TRUNCATED_LENGTH
        p = &view[at]
        n = 0
        for k in range(8):  # the length's bytes in the file's byte order, whatever the host's
            n |= (<uint64_t>p[7 - k if big_endian else k]) << (8 * k)
        if n > <uint64_t>(end - at - 8):
            return at + 8 + <object>n, TRUNCATED_STRING
        at += 8 + <Py_ssize_t>n
    return at, 0


__all__ = ["TRUNCATED_LENGTH", "TRUNCATED_STRING", "skip_strings"]
