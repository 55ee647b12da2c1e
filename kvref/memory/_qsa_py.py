"""Python twin of the QSA ranked order (`kvref.memory.qsa`); the Cython twin is ``_qsa_c.pyx``, same results.

``rank_order(cells, pos, y, x)``: the cells sorted by their (pos, y, x) keys with libstdc++'s ``std::sort``
(introsort, median-of-three pivot, heap sort past the depth limit, final insertion sort), whose order of cells with
equal keys is what llama.cpp's build gets. `std_sort` states that algorithm over a list; the Cython twin calls the
C++ library's own ``std::sort`` on (key, cell) records.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

_S_THRESHOLD = 16  # libstdc++'s introsort threshold


def std_sort(a: list[int], less: Callable[[int, int], bool]) -> None:
    """libstdc++'s ``std::sort`` (bits/stl_algo.h: introsort, median-of-three pivot, heap sort past the depth limit,
    final insertion sort), in place."""
    n = len(a)
    if n > 1:
        _introsort_loop(a, 0, n, 2 * (n.bit_length() - 1), less)
        _final_insertion_sort(a, 0, n, less)


def _introsort_loop(a: list[int], first: int, last: int, depth: int, less: Callable[[int, int], bool]) -> None:
    while last - first > _S_THRESHOLD:
        if depth == 0:
            _heap_sort(a, first, last, less)
            return
        depth -= 1
        cut = _partition_pivot(a, first, last, less)
        _introsort_loop(a, cut, last, depth, less)
        last = cut


def _partition_pivot(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> int:
    mid = first + (last - first) // 2
    x, y, z = first + 1, mid, last - 1  # __move_median_to_first
    if less(a[x], a[y]):
        m = y if less(a[y], a[z]) else (z if less(a[x], a[z]) else x)
    else:
        m = x if less(a[x], a[z]) else (z if less(a[y], a[z]) else y)
    a[first], a[m] = a[m], a[first]
    lo, hi, pivot = first + 1, last, a[first]  # __unguarded_partition
    while True:
        while less(a[lo], pivot):
            lo += 1
        hi -= 1
        while less(pivot, a[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        a[lo], a[hi] = a[hi], a[lo]
        lo += 1


def _linear_insert(a: list[int], last: int, less: Callable[[int, int], bool]) -> None:
    val = a[last]
    nxt = last - 1
    while less(val, a[nxt]):
        a[last] = a[nxt]
        last = nxt
        nxt -= 1
    a[last] = val


def _insertion_sort(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> None:
    for i in range(first + 1, last):
        if less(a[i], a[first]):
            val = a[i]
            a[first + 1 : i + 1] = a[first:i]
            a[first] = val
        else:
            _linear_insert(a, i, less)


def _final_insertion_sort(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> None:
    if last - first > _S_THRESHOLD:
        _insertion_sort(a, first, first + _S_THRESHOLD, less)
        for i in range(first + _S_THRESHOLD, last):
            _linear_insert(a, i, less)
    else:
        _insertion_sort(a, first, last, less)


def _adjust_heap(a: list[int], first: int, hole: int, n: int, val: int, less: Callable[[int, int], bool]) -> None:
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if less(a[first + child], a[first + child - 1]):
            child -= 1
        a[first + hole] = a[first + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        a[first + hole] = a[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and less(a[first + parent], val):
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = val


def _heap_sort(a: list[int], first: int, last: int, less: Callable[[int, int], bool]) -> None:
    n = last - first  # __partial_sort(first, last, last): make_heap, then sort_heap
    if n >= 2:
        for parent in range((n - 2) // 2, -1, -1):
            _adjust_heap(a, first, parent, n, a[first + parent], less)
    while last - first > 1:
        last -= 1
        val = a[last]
        a[last] = a[first]
        _adjust_heap(a, first, 0, last - first, val, less)


def rank_order(
    cells: npt.NDArray[np.int64], pos: npt.NDArray[np.int64], y: npt.NDArray[np.int64], x: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """``cells`` (ascending, as llama.cpp lists them) sorted by (pos, y, x) with ``std::sort``; ``pos``, ``y``,
    ``x``: the keys of those cells, in the same order."""
    key = {int(c): (int(p), int(b), int(a)) for c, p, b, a in zip(cells, pos, y, x, strict=True)}
    order = [int(c) for c in cells]

    def less(i: int, j: int) -> bool:
        return key[i] < key[j]

    std_sort(order, less)
    return np.asarray(order, np.int64)


__all__ = ["rank_order", "std_sort"]
