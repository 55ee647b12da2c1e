"""KVCells, on both twins: every method against what llama_kv_cells (src/llama-kv-cells.h) does.

Expected values are worked out by hand from the C++; where llama.cpp only asserts, kvref raises
CellError / SequenceError and the cells must be unchanged afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvref.errors import ArgumentTypeError, CellError, CorruptionError, SequenceError

POS_MAX = 2**31 - 1
TOKEN_NULL = -1


# ------------------------------------------------------------------ helpers
def build(cls: type, n: int, cells: dict[int, tuple[int, list[int]]]) -> Any:
    """KVCells of size n with cells {index: (pos, [seq ids])}, placed with pos_set + seq_add."""
    c = cls(n)
    for i, (p, seqs) in cells.items():
        c.pos_set(i, p)
        for s in seqs:
            c.seq_add(i, s)
    return c


def snapshot(c: Any) -> dict[str, Any]:
    return {
        "pos": c.pos.copy(),
        "shift": c.shift.copy(),
        "ext": c.ext.copy(),
        "seq": c.seq.copy(),
        "used": c.used_cells().tolist(),
        "n_used": c.get_used(),
        "min": c.used_min(),
        "max_p1": c.used_max_p1(),
        "has_shift": c.get_has_shift(),
        "seq_pos": [c.seq_pos_get(s) for s in range(256)],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


def raises_unchanged(c: Any, exc: type[Exception], fn: Any, *args: Any) -> None:
    """fn(*args) raises exc and leaves c exactly as it was."""
    before = snapshot(c)
    with pytest.raises(exc):
        fn(*args)
    assert_same(before, snapshot(c))


def seq_bits(*seqs: int) -> list[int]:
    words = [0, 0, 0, 0]
    for s in seqs:
        words[s >> 6] |= 1 << (s & 63)
    return words


# ------------------------------------------------------------------ construction and whole-array state
def test_new_cells_are_empty(cells_cls: type) -> None:
    c = cells_cls(5)
    assert c.size() == 5 and len(c) == 5
    assert c.get_used() == 0
    assert c.used_min() == 0 and c.used_max_p1() == 0  # llama.cpp returns 0 for both when nothing is used
    assert c.used_cells().dtype == np.int32 and c.used_cells().size == 0
    assert c.get_has_shift() is False
    assert c.pos.dtype == np.int32 and c.pos.tolist() == [-1] * 5
    assert c.shift.dtype == np.int32 and c.shift.tolist() == [0] * 5
    assert c.ext.dtype == np.int32 and c.ext.shape == (5, 3)
    assert c.ext.tolist() == [[0, 0, TOKEN_NULL]] * 5  # llama_kv_cell_ext{}: x = y = 0, tok = LLAMA_TOKEN_NULL
    assert c.seq.dtype == np.uint64 and c.seq.shape == (5, 4) and not c.seq.any()
    assert all(c.is_empty(i) for i in range(5))
    assert all(c.seq_pos_min(s) == -1 and c.seq_pos_max(s) == -1 for s in (0, 1, 255))
    assert cells_cls().size() == 0


def test_n_kv_pads_used_max_p1_and_follows_every_change(cells_cls: type) -> None:
    """n_kv(n_pad): used_max_p1 rounded up to n_pad, at least n_pad, at most the size; asked again after each change
    (the Python twin keeps its answer until a call changes the cells); a bad n_pad is refused alike."""
    c = cells_cls(10)
    assert [c.n_kv(p) for p in (1, 4, 256, 2**70)] == [1, 4, 10, 10]
    c.pos_set(6, 0)
    assert [c.n_kv(p) for p in (1, 4, 3)] == [7, 8, 9]
    c.place(np.array([8], np.int64), [1], [0])
    assert c.n_kv(4) == 10 and c.n_kv(1) == 9
    c.rm(8)
    assert c.n_kv(1) == 7
    c.seq_add(6, 2)
    c.seq_rm_range(2, -1, -1)  # the cell had no sequence before: it stays used
    assert c.n_kv(1) == 7
    c.rm(6)
    assert c.n_kv(1) == 1 and c.used_max_p1() == 0
    c.set(0, build(cells_cls, 10, {9: (5, [1])}))
    assert c.n_kv(2) == 10
    c.resize(4)
    assert c.n_kv(3) == 3
    for bad, err in ((0, CellError), (-5, CellError), (1.0, ArgumentTypeError), ("2", ArgumentTypeError)):
        with pytest.raises(err):
            c.n_kv(bad)


def test_views_are_read_only(cells_cls: type) -> None:
    c = build(cells_cls, 3, {1: (4, [0])})
    for name in ("pos", "shift", "ext", "seq"):
        view = getattr(c, name)
        with pytest.raises(ValueError):
            view[0] = 1
    assert c.pos.tolist() == [-1, 4, -1]


def test_views_follow_later_changes(cells_cls: type) -> None:
    c = cells_cls(2)
    view = c.pos
    c.pos_set(1, 9)
    assert view.tolist() == [-1, 9]  # a view, not a copy


def test_resize_resets(cells_cls: type) -> None:
    c = build(cells_cls, 4, {0: (1, [0]), 3: (2, [1])})
    c.pos_add(0, 1)
    c.resize(6)
    assert c.size() == 6 and c.get_used() == 0 and not c.get_has_shift()
    assert c.pos.tolist() == [-1] * 6 and c.seq_pos_get(0) == [] and c.seq_pos_get(1) == []
    c.resize(0)
    assert c.size() == 0 and c.used_max_p1() == 0
    with pytest.raises(CellError):
        c.resize(-1)


def test_reset(cells_cls: type) -> None:
    c = build(cells_cls, 4, {0: (1, [0, 7]), 2: (5, [])})
    c.ext_set(1, 3, 4, 5)
    c.pos_add(0, 2)
    c.reset()
    assert_same(snapshot(c), snapshot(cells_cls(4)))


def test_reset_shift_keeps_positions(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (10, [0]), 1: (20, [0])})
    c.pos_add(0, 5)
    c.pos_div(1, 2)
    assert c.get_has_shift()
    c.reset_shift()
    assert not c.get_has_shift()
    assert c.shift.tolist() == [0, 0, 0]
    assert c.pos.tolist() == [15, 10, -1]
    assert c.seq_pos_get(0) == [(10, 1), (15, 0)]


# ------------------------------------------------------------------ used set
def test_used_bounds_follow_holes(cells_cls: type) -> None:
    c = build(cells_cls, 10, {3: (0, [0]), 7: (1, [0])})
    assert (c.used_min(), c.used_max_p1(), c.get_used()) == (3, 8, 2)
    assert c.used_cells().tolist() == [3, 7]
    c.pos_set(9, 2)  # a used cell without any sequence still counts (llama.cpp's `used` set)
    assert (c.used_min(), c.used_max_p1(), c.get_used()) == (3, 10, 3)
    c.rm(3)
    assert (c.used_min(), c.used_max_p1()) == (7, 10)
    c.rm(9)
    assert (c.used_min(), c.used_max_p1()) == (7, 8)
    c.pos_set(0, 5)
    assert (c.used_min(), c.used_max_p1()) == (0, 8)
    c.rm(0)
    c.rm(7)
    assert (c.used_min(), c.used_max_p1(), c.get_used()) == (0, 0, 0)
    assert c.used_cells().tolist() == []


# ------------------------------------------------------------------ pos_set
def test_pos_set(cells_cls: type) -> None:
    c = cells_cls(3)
    c.pos_set(1, 7)
    assert c.pos_get(1) == 7 and not c.is_empty(1) and c.get_used() == 1
    assert c.get_has_shift() is False  # pos_set does not touch has_shift
    assert c.seq_count(1) == 0 and c.seq_get_all(1) == []
    c.pos_set(2, POS_MAX)  # the largest llama_pos
    c.pos_set(0, 0)
    assert c.pos.tolist() == [0, 7, POS_MAX]


@pytest.mark.parametrize(
    ("i", "p"), [(1, 3), (0, -1), (0, -(2**31) - 1), (0, POS_MAX + 1), (3, 0), (-1, 0), (2**70, 0)]
)
def test_pos_set_misuse(cells_cls: type, i: int, p: int) -> None:
    c = build(cells_cls, 3, {1: (2, [0])})
    raises_unchanged(c, CellError, c.pos_set, i, p)


def test_numpy_integers_are_accepted(cells_cls: type) -> None:
    c = cells_cls(4)
    c.pos_set(np.int64(2), np.int32(5))
    c.seq_add(np.uint8(2), np.int16(255))
    assert c.seq_has(np.int64(2), np.uint64(255)) is True
    assert c.seq_pos_get(255) == [(5, 2)]


def test_pos_set_shifted(cells_cls):
    # the end state of llama.cpp's pos_set(p - shift) + pos_add(shift) (cross-stream seq_cp), even when
    # p - shift < 0 (a seq_div shift); shift 0 leaves has_shift alone
    c = cells_cls(4)
    c.pos_set_shifted(0, 2, 0)
    assert not c.get_has_shift()
    c.pos_set_shifted(1, 2, 5)
    c.seq_add(1, 0)
    assert (c.pos_get(1), c.get_shift(1), c.get_has_shift(), c.seq_pos_max(0)) == (2, 5, True, 2)
    with pytest.raises(CellError):
        c.pos_set_shifted(1, 3, 1)  # not empty
    with pytest.raises(CellError):
        c.pos_set_shifted(2, -1, 0)


# ------------------------------------------------------------------ sequences of a cell
def test_seq_add_has_count_get(cells_cls: type) -> None:
    c = build(cells_cls, 2, {0: (3, [])})
    c.seq_add(0, 255)
    c.seq_add(0, 0)
    c.seq_add(0, 64)
    assert c.seq.tolist()[0] == seq_bits(0, 64, 255)
    assert c.seq_count(0) == 3
    assert c.seq_get_all(0) == [0, 64, 255]  # ascending, like iterating the bitset
    assert c.seq_has(0, 64) is True and c.seq_has(0, 63) is False and c.seq_has(1, 0) is False
    assert c.seq_pos_get(0) == c.seq_pos_get(64) == c.seq_pos_get(255) == [(3, 0)]
    with pytest.raises(CellError):
        c.seq_get(0)  # three sequences: llama.cpp asserts count() == 1
    c2 = build(cells_cls, 1, {0: (3, [200])})
    assert c2.seq_get(0) == 200


@pytest.mark.parametrize("s", [256, -2, -1, 2**40])
def test_bad_seq_ids_are_rejected(cells_cls: type, s: int) -> None:
    c = build(cells_cls, 2, {0: (3, [0])})
    for fn, args in (
        (c.seq_add, (0, s)),
        (c.seq_rm, (0, s)),
        (c.seq_keep, (0, s)),
        (c.seq_has, (0, s)),
        (c.seq_pos_min, (s,)),
        (c.seq_pos_max, (s,)),
        (c.seq_pos_get, (s,)),
        (c.seq_pos_tok_le, (s, 5)),
        (c.seq_pos_min_many, ([0, s],)),
        (c.seq_pos_max_many, ([s],)),
        (c.seq_add_many, ([0], [s])),
        (c.seq_cp_range, (0, s, 0, 10)),
        (c.seq_cp_range, (s, 0, 0, 10)),
        (c.seq_keep_all, (s,)),
        (c.seq_add_range, (s, 0, 10, 1)),
        (c.seq_div_range, (s, 0, 10, 2)),
    ):
        raises_unchanged(c, SequenceError, fn, *args)
    if s != -1:  # -1 means "every sequence" for seq_rm_range
        raises_unchanged(c, SequenceError, c.seq_rm_range, s, 0, 10)


def test_seq_id_checked_before_the_cell(cells_cls: type) -> None:
    c = cells_cls(2)
    # an invalid sequence id wins over an empty / out-of-range cell (the Python twin checks it first)
    for fn in (c.seq_add, c.seq_rm, c.seq_keep):
        with pytest.raises(SequenceError):
            fn(5, 300)
    with pytest.raises(CellError):
        c.seq_has(5, 300)  # seq_has checks the cell first


def test_seq_add_misuse(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (3, [1])})
    raises_unchanged(c, CellError, c.seq_add, 1, 0)  # empty cell: llama.cpp asserts pos != -1
    raises_unchanged(c, CellError, c.seq_add, 0, 1)  # already holds it
    raises_unchanged(c, CellError, c.seq_add, 3, 0)


def test_seq_rm(cells_cls: type) -> None:
    c = build(cells_cls, 3, {1: (4, [2, 9])})
    c.ext_set(1, 5, 6, 77)
    assert c.seq_rm(1, 9) is False  # still holds sequence 2
    assert c.seq_get_all(1) == [2] and c.pos_get(1) == 4 and c.ext_get(1) == (5, 6, 77)
    assert c.seq_pos_get(9) == []
    assert c.seq_rm(1, 2) is True  # last sequence gone: the cell is freed
    assert c.is_empty(1) and c.get_used() == 0
    assert c.ext.tolist()[1] == [0, 0, TOKEN_NULL]  # ext reset with the cell
    assert c.seq_pos_get(2) == [] and c.seq_pos_max(2) == -1


def test_seq_rm_misuse(cells_cls: type) -> None:
    c = build(cells_cls, 3, {1: (4, [2])})
    raises_unchanged(c, CellError, c.seq_rm, 1, 3)  # llama.cpp asserts the cell has the sequence
    raises_unchanged(c, CellError, c.seq_rm, 0, 2)  # empty cell
    raises_unchanged(c, CellError, c.seq_rm, 3, 2)


def test_seq_keep(cells_cls: type) -> None:
    c = build(cells_cls, 4, {0: (1, [1, 2, 3]), 1: (2, [2]), 2: (3, [])})
    c.ext_set(1, 8, 8, 8)
    assert c.seq_keep(0, 2) is False  # holds 2: keeps only 2
    assert c.seq_get_all(0) == [2]
    assert c.seq_pos_get(1) == [] and c.seq_pos_get(3) == [] and c.seq_pos_get(2) == [(1, 0), (2, 1)]
    assert c.seq_keep(1, 5) is True  # does not hold 5 but holds others: freed
    assert c.is_empty(1) and c.ext.tolist()[1] == [0, 0, TOKEN_NULL]
    assert c.seq_keep(3, 5) is False  # empty cell: nothing happens
    # a used cell with no sequence: llama.cpp's release build returns false and leaves it used
    assert c.seq_keep(2, 5) is False
    assert c.pos_get(2) == 3 and c.get_used() == 2


# ------------------------------------------------------------------ per-sequence index
def test_seq_pos_order_and_duplicates(cells_cls: type) -> None:
    c = build(cells_cls, 6, {4: (7, [0]), 0: (7, [0]), 2: (3, [0, 1]), 5: (9, [1]), 1: (1, [])})
    # ordered by position, then by cell index (the same position can appear in two cells)
    assert c.seq_pos_get(0) == [(3, 2), (7, 0), (7, 4)]
    assert c.seq_pos_get(1) == [(3, 2), (9, 5)]
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (3, 7)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (3, 9)
    assert (c.seq_pos_min(2), c.seq_pos_max(2)) == (-1, -1)
    assert all(isinstance(v, int) for pair in c.seq_pos_get(0) for v in pair)


def test_seq_pos_tok_le(cells_cls: type) -> None:
    c = build(cells_cls, 6, {0: (5, [0]), 3: (5, [0]), 1: (9, [0]), 4: (2, [1])})
    for i, tok in ((0, 100), (3, 103), (1, 101), (4, 104)):
        c.ext_set(i, 0, 0, tok)
    assert c.seq_pos_tok_le(0, 1) == TOKEN_NULL  # nothing at or before 1
    assert c.seq_pos_tok_le(0, -5) == TOKEN_NULL
    assert c.seq_pos_tok_le(0, 5) == 103  # two cells at 5: the higher cell index wins
    assert c.seq_pos_tok_le(0, 8) == 103
    assert c.seq_pos_tok_le(0, 9) == 101
    assert c.seq_pos_tok_le(0, 2**40) == 101
    assert c.seq_pos_tok_le(1, 2) == 104
    assert c.seq_pos_tok_le(2, 100) == TOKEN_NULL


# ------------------------------------------------------------------ cell getters / setters
def test_getters_on_empty_cells(cells_cls: type) -> None:
    c = build(cells_cls, 2, {0: (1, [0])})
    for fn in (c.pos_get, c.ext_get, c.get_shift, c.seq_count, c.rm):
        raises_unchanged(c, CellError, fn, 1)  # llama.cpp asserts pos != -1
    for fn in (c.is_empty, c.seq_get_all, c.seq_get):
        raises_unchanged(c, CellError, fn, 2)  # out of range
    assert c.seq_get_all(1) == [] and c.is_empty(1) is True


def test_ext(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (1, [0])})
    c.ext_set(0, 4, 5, 99)
    assert c.ext_get(0) == (4, 5, 99)
    c.ext_set(0)  # defaults: llama_kv_cell_ext{}
    assert c.ext_get(0) == (0, 0, TOKEN_NULL)
    c.ext_set(2, -(2**31), POS_MAX, 7)  # llama.cpp's ext_set accepts an empty cell
    assert c.ext.tolist()[2] == [-(2**31), POS_MAX, 7]
    raises_unchanged(c, CellError, c.ext_get, 2)
    raises_unchanged(c, CellError, c.ext_set, 0, 1, 2, 2**31)  # not an int32: nothing written
    raises_unchanged(c, CellError, c.ext_set, 1, -(2**31) - 1, 0, 0)
    raises_unchanged(c, CellError, c.ext_set, 3, 0, 0, 0)


def test_pos_in(cells_cls: type) -> None:
    c = build(cells_cls, 2, {0: (5, [0])})
    assert c.pos_in(0, 5, 6) is True
    assert c.pos_in(0, 0, 5) is False  # half-open
    assert c.pos_in(0, 6, 10) is False
    assert c.pos_in(0, -(2**70), 2**70) is True
    assert c.pos_in(1, -5, 10) is False  # an empty cell is never in a range
    raises_unchanged(c, CellError, c.pos_in, 2, 0, 1)


# ------------------------------------------------------------------ pos_add / pos_div
def test_pos_add(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (10, [0, 1]), 1: (20, [1])})
    assert c.pos_add(0, 5) is False
    assert c.pos_get(0) == 15 and c.get_shift(0) == 5 and c.get_has_shift() is True
    assert c.pos_add(0, -3) is False
    assert c.pos_get(0) == 12 and c.get_shift(0) == 2  # shift accumulates the deltas
    assert c.seq_pos_get(0) == [(12, 0)] and c.seq_pos_get(1) == [(12, 0), (20, 1)]
    assert c.pos_add(1, -20) is False  # exactly 0 stays
    assert c.pos_get(1) == 0 and c.get_shift(1) == -20
    assert c.pos_add(1, 0) is False
    assert c.get_shift(1) == -20


def test_pos_add_below_zero_frees_the_cell(cells_cls: type) -> None:
    c = build(cells_cls, 3, {1: (4, [0, 3]), 2: (9, [3])})
    c.ext_set(1, 7, 8, 42)
    assert c.pos_add(1, -5) is True
    assert c.is_empty(1) and c.get_used() == 1
    assert c.seq.tolist()[1] == [0, 0, 0, 0] and c.shift.tolist()[1] == 0
    assert c.get_has_shift() is True  # set before the cell is freed
    assert c.ext.tolist()[1] == [7, 8, 42]  # llama.cpp's pos_add does not reset ext
    assert c.seq_pos_get(0) == [] and c.seq_pos_get(3) == [(9, 2)]
    assert (c.used_min(), c.used_max_p1()) == (2, 3)


def test_pos_add_misuse(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (10, [0]), 1: (POS_MAX - 1, [0])})
    raises_unchanged(c, CellError, c.pos_add, 2, 1)  # empty
    raises_unchanged(c, CellError, c.pos_add, 3, 1)
    raises_unchanged(c, CellError, c.pos_add, 0, 2**31)  # not an int32 delta
    raises_unchanged(c, CellError, c.pos_add, 0, -(2**31) - 1)
    assert c.pos_add(1, 1) is False and c.pos_get(1) == POS_MAX
    assert c.pos_add(0, -(2**31)) is True
    # past the largest llama_pos the int32 sum wraps negative, as llama.cpp's does: the cell is freed
    assert c.pos_add(1, 1) is True and c.is_empty(1)


def test_pos_div(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (10, [0]), 1: (7, [0])})
    c.pos_div(0, 3)
    assert c.pos_get(0) == 3
    assert c.get_shift(0) == 7  # llama.cpp: shift += p_old - p_new
    assert c.get_has_shift() is True
    assert c.seq_pos_get(0) == [(3, 0), (7, 1)]
    c.pos_div(0, 2)
    assert c.pos_get(0) == 1 and c.get_shift(0) == 9
    c.pos_add(1, 3)  # shift: +3 then, dividing 10 by 4, += 10 - 2
    c.pos_div(1, 4)
    assert c.pos_get(1) == 2 and c.get_shift(1) == 11
    c.pos_div(1, 2**40)
    assert c.pos_get(1) == 0 and c.get_shift(1) == 13


def test_pos_div_misuse(cells_cls: type) -> None:
    c = build(cells_cls, 2, {0: (10, [0])})
    raises_unchanged(c, CellError, c.pos_div, 0, 0)  # llama.cpp dies of SIGFPE
    raises_unchanged(c, CorruptionError, c.pos_div, 0, -10)  # -1: an empty cell's mark
    raises_unchanged(c, CellError, c.pos_div, 1, 2)
    c.pos_div(0, -2)  # toward zero, as C divides
    assert c.pos_get(0) == -5 and c.get_shift(0) == 15


def test_shift_wraps_as_int32(cells_cls: type) -> None:
    c = build(cells_cls, 1, {0: (0, [0])})
    c.pos_add(0, POS_MAX)  # shift = 2^31 - 1
    c.pos_div(0, 2)  # shift += (2^31 - 1) - (2^30 - 1) = 2^30: past int32, wraps like llama.cpp's int32
    assert c.pos_get(0) == 2**30 - 1
    assert c.get_shift(0) == POS_MAX + 2**30 - 2**32


# ------------------------------------------------------------------ cp / set
def _populated(cls: type) -> Any:
    c = build(cls, 8, {0: (0, [0]), 1: (1, [0, 5]), 2: (2, [255]), 4: (4, []), 6: (6, [0, 64, 128])})
    for i in range(8):
        c.ext_set(i, i, 2 * i, 100 + i)
    return c


def test_cp_range_and_list(cells_cls: type) -> None:
    c = _populated(cells_cls)
    r = c.cp(1, 4)  # cells 1..4
    assert type(r) is cells_cls and r.size() == 4
    assert r.pos.tolist() == [1, 2, -1, 4]
    assert r.ext.tolist() == [[1, 2, 101], [2, 4, 102], [3, 6, 103], [4, 8, 104]]
    assert r.seq.tolist() == [seq_bits(0, 5), seq_bits(255), seq_bits(), seq_bits()]
    assert r.get_used() == 3 and (r.used_min(), r.used_max_p1()) == (0, 4)
    assert r.seq_pos_get(0) == [(1, 0)] and r.seq_pos_get(255) == [(2, 1)]
    assert not r.get_has_shift() and not r.shift.any()
    r2 = c.cp([6, 0, 6])  # any order, repeats allowed
    assert r2.pos.tolist() == [6, 0, 6]
    assert r2.seq_pos_get(0) == [(0, 1), (6, 0), (6, 2)] and r2.seq_pos_get(64) == [(6, 0), (6, 2)]
    assert c.cp([]).size() == 0 and c.cp(8, 0).size() == 0


def test_cp_misuse(cells_cls: type) -> None:
    c = _populated(cells_cls)
    for args in ((5, 4), (-1, 2), (0, -1), ([0, 8],), ([-1],)):
        raises_unchanged(c, CellError, c.cp, *args)
    c.pos_add(1, 1)
    raises_unchanged(c, CellError, c.cp, 0, 2)  # llama.cpp asserts shift == 0 on every copied cell
    raises_unchanged(c, CellError, c.cp, [1])
    assert c.cp(2, 3).size() == 3  # the other cells still copy


def test_cp_set_round_trip_restores_exactly(cells_cls: type) -> None:
    c = _populated(cells_cls)
    before = snapshot(c)
    idxs = [1, 3, 6, 2]
    saved = c.cp(idxs)
    saved_range = c.cp(0, 8)
    # what prepare() does to those cells: overwrite, free, place new positions
    c.seq_rm(1, 0)
    c.pos_set(3, 50)
    c.seq_add(3, 9)
    c.rm(6)
    c.seq_keep(2, 7)
    c.set(idxs, saved)
    assert_same(before, snapshot(c))
    c.rm(0)
    c.pos_set(5, 3)
    c.seq_add(5, 1)
    c.set(0, saved_range)
    assert_same(before, snapshot(c))


def test_set_across_twins(cells_twins: tuple[type, type]) -> None:
    py_cls, c_cls = cells_twins
    for src_cls, dst_cls in ((py_cls, c_cls), (c_cls, py_cls)):
        src = _populated(src_cls)
        dst = dst_cls(8)
        dst.set(0, src.cp(0, 8))
        assert_same(snapshot(src), snapshot(dst))
        part = dst_cls(3)
        part.set([2, 0, 1], src.cp([6, 1, 2]))
        assert part.pos.tolist() == [1, 2, 6]
        assert part.seq_pos_get(0) == [(1, 0), (6, 2)]


def test_set_misuse(cells_cls: type) -> None:
    c = _populated(cells_cls)
    other = c.cp(0, 3)
    raises_unchanged(c, CellError, c.set, 6, other)  # [6, 9) past the end
    raises_unchanged(c, CellError, c.set, -1, other)
    raises_unchanged(c, CellError, c.set, [0, 1], other)  # 2 indices for 3 cells
    raises_unchanged(c, CellError, c.set, [0, 1, 8], other)
    c.pos_add(4, 1)
    raises_unchanged(c, CellError, c.set, 3, other)  # target cell 4 has a pending shift
    raises_unchanged(c, CellError, c.set, [5, 4, 7], other)


def test_set_rejects_foreign_cells_breaking_invariants(cells_cls: type) -> None:
    class Fake:
        def __init__(self, pos: list[int], seq: list[list[int]], ext_cols: int = 3) -> None:
            self.pos = np.array(pos, dtype=np.int32)
            self.ext = np.zeros((len(pos), ext_cols), dtype=np.int32)
            self.seq = np.array(seq, dtype=np.uint64).reshape(len(pos), 4)

    c = _populated(cells_cls)
    raises_unchanged(c, CellError, c.set, 0, Fake([-1], [[1, 0, 0, 0]]))  # an empty cell with a sequence
    raises_unchanged(c, CellError, c.set, 0, Fake([3], [[1, 0, 0, 0]], ext_cols=2))
    c.set(3, Fake([7], [[2, 0, 0, 0]]))
    assert c.pos_get(3) == 7 and c.seq_get_all(3) == [1] and c.seq_pos_get(1) == [(7, 3)]


# ------------------------------------------------------------------ bulk forms = their per-cell loops
def test_pos_set_many_equals_loop(cells_cls: type) -> None:
    a, b = cells_cls(10), cells_cls(10)
    idxs, pos = [7, 2, 9, 0], [5, 5, 0, POS_MAX]
    a.pos_set_many(np.array(idxs), pos)
    for i, p in zip(idxs, pos, strict=True):
        b.pos_set(i, p)
    assert_same(snapshot(a), snapshot(b))
    a.pos_set_many([], [])
    assert_same(snapshot(a), snapshot(b))


@pytest.mark.parametrize(
    ("idxs", "pos"),
    [([1, 2], [1]), ([1, 10], [1, 2]), ([1, 1], [1, 2]), ([1, 3], [1, 2]), ([1, 2], [1, -1]), ([1, 2], [0, 2**31])],
)
def test_pos_set_many_is_all_or_nothing(cells_cls: type, idxs: list[int], pos: list[int]) -> None:
    c = build(cells_cls, 10, {3: (0, [0])})
    raises_unchanged(c, CellError, c.pos_set_many, idxs, pos)


def test_seq_add_many_equals_loop(cells_cls: type) -> None:
    spec = {i: (i // 2, []) for i in range(6)}
    a, b = build(cells_cls, 6, spec), build(cells_cls, 6, spec)
    idxs, seqs = [0, 1, 2, 0, 5, 3], [0, 255, 7, 64, 0, 0]
    a.seq_add_many(idxs, seqs)
    for i, s in zip(idxs, seqs, strict=True):
        b.seq_add(i, s)
    assert_same(snapshot(a), snapshot(b))
    a.seq_add_many([1, 2, 4], 9)  # one sequence for all
    for i in (1, 2, 4):
        b.seq_add(i, 9)
    assert_same(snapshot(a), snapshot(b))


@pytest.mark.parametrize(
    ("idxs", "seqs", "exc"),
    [
        ([0, 1], [1, 1], CellError),  # cell 1 is empty
        ([0, 2], [1, 0], CellError),  # cell 2 already holds 0
        ([0, 0], [1, 1], CellError),  # the same pair twice
        ([0, 5], [1, 1], CellError),
        ([0, 2], [1, 256], SequenceError),
        ([0, 0, 2], [3, 3, -1], SequenceError),  # every element is checked before duplicates
    ],
)
def test_seq_add_many_is_all_or_nothing(cells_cls: type, idxs: list[int], seqs: list[int], exc: type) -> None:
    c = build(cells_cls, 5, {0: (0, []), 2: (1, [0])})
    raises_unchanged(c, exc, c.seq_add_many, idxs, seqs)


def test_pos_add_many_equals_loop(cells_cls: type) -> None:
    spec = {0: (3, [0]), 1: (10, [0, 1]), 2: (0, [1]), 4: (7, [])}
    a, b = build(cells_cls, 5, spec), build(cells_cls, 5, spec)
    freed = a.pos_add_many([4, 0, 1, 2], -5)
    assert freed.dtype == np.bool_ and freed.tolist() == [False, True, False, True]
    assert [b.pos_add(i, -5) for i in (4, 0, 1, 2)] == [False, True, False, True]
    assert_same(snapshot(a), snapshot(b))
    assert a.pos_add_many([], 3).tolist() == []


@pytest.mark.parametrize(("idxs", "d"), [([0, 3], 1), ([0, 0], 1), ([0, 9], 1), ([0, 1], 2**31)])
def test_pos_add_many_is_all_or_nothing(cells_cls: type, idxs: list[int], d: int) -> None:
    c = build(cells_cls, 5, {0: (3, [0]), 1: (POS_MAX - 4, [1])})
    raises_unchanged(c, CellError, c.pos_add_many, idxs, d)


def test_seq_pos_min_max_many(cells_cls: type) -> None:
    c = build(cells_cls, 4, {0: (3, [0, 255]), 1: (8, [0]), 3: (1, [255])})
    seqs = [0, 255, 1, 0]
    mins, maxs = c.seq_pos_min_many(seqs), c.seq_pos_max_many(np.array(seqs, dtype=np.uint8))
    assert mins.dtype == np.int32 and maxs.dtype == np.int32
    assert mins.tolist() == [3, 1, -1, 3] and maxs.tolist() == [8, 3, -1, 8]
    assert mins.tolist() == [c.seq_pos_min(s) for s in seqs]
    assert c.seq_pos_max_many([]).tolist() == []


# ------------------------------------------------------------------ range operations = llama_kv_cache's loops
# The loops below restate llama_kv_cache::seq_rm / seq_cp / seq_keep / seq_add / seq_div (one stream,
# p0/p1 already normalised) with the per-cell methods; the range ops must do exactly the same.
def ref_seq_rm(c: Any, s: int, p0: int, p1: int) -> int:
    first = c.size()
    for i in range(c.size()):
        if not c.pos_in(i, p0, p1):
            continue
        if s == -1:
            c.rm(i)
            first = min(first, i)
        elif c.seq_has(i, s) and c.seq_rm(i, s):
            first = min(first, i)
    return first


def ref_seq_cp(c: Any, src: int, dst: int, p0: int, p1: int) -> None:
    for i in range(c.size()):
        if src != dst and c.pos_in(i, p0, p1) and c.seq_has(i, src) and not c.seq_has(i, dst):
            c.seq_add(i, dst)


def ref_seq_keep(c: Any, s: int) -> int:
    first = c.size()
    for i in range(c.size()):
        if c.seq_keep(i, s):
            first = min(first, i)
    return first


def ref_seq_add(c: Any, s: int, p0: int, p1: int, d: int) -> int:
    first = c.size()
    for i in range(c.size()):
        if c.pos_in(i, p0, p1) and c.seq_has(i, s) and c.pos_add(i, d):
            first = min(first, i)
    return first


def ref_seq_div(c: Any, s: int, p0: int, p1: int, d: int) -> None:
    for i in range(c.size()):
        if c.pos_in(i, p0, p1) and c.seq_has(i, s):
            c.pos_div(i, d)


def _ranged(cls: type) -> Any:
    c = build(
        cls,
        12,
        {
            0: (0, [0]),
            1: (1, [0, 1]),
            2: (2, [1]),
            3: (3, [0, 255]),
            5: (5, [0]),
            6: (5, [1, 2]),
            7: (7, []),
            8: (8, [0, 1, 2]),
            10: (POS_MAX - 1, [0]),
            11: (10, [255]),
        },
    )
    for i in range(12):
        c.ext_set(i, 1, 1, i)
    return c


RANGES = [(0, POS_MAX), (0, 5), (3, 9), (5, 6), (6, 6), (9, 3), (POS_MAX - 1, POS_MAX), (2, POS_MAX)]


@pytest.mark.parametrize("s", [-1, 0, 1, 2, 255, 7])
@pytest.mark.parametrize(("p0", "p1"), RANGES)
def test_seq_rm_range(cells_cls: type, s: int, p0: int, p1: int) -> None:
    a, b = _ranged(cells_cls), _ranged(cells_cls)
    assert a.seq_rm_range(s, p0, p1) == ref_seq_rm(b, s, p0, p1)
    assert_same(snapshot(a), snapshot(b))


def test_seq_rm_range_values(cells_cls: type) -> None:
    c = _ranged(cells_cls)
    assert c.seq_rm_range(0, 0, 4) == 0  # cell 0 held only 0: freed; 1 and 3 keep their other sequence
    assert c.seq_get_all(1) == [1] and c.seq_get_all(3) == [255] and c.is_empty(0)
    assert c.seq_rm_range(1, 6, 9) == 12  # cell 8 keeps 0 and 2: nothing freed -> size()
    assert c.seq_rm_range(-1, 5, 6) == 5  # every sequence: cells 5 and 6 freed, the first is 5
    assert c.is_empty(5) and c.is_empty(6)


@pytest.mark.parametrize(("src", "dst"), [(0, 1), (1, 0), (0, 200), (2, 2), (255, 0), (9, 0)])
@pytest.mark.parametrize(("p0", "p1"), RANGES)
def test_seq_cp_range(cells_cls: type, src: int, dst: int, p0: int, p1: int) -> None:
    a, b = _ranged(cells_cls), _ranged(cells_cls)
    a.seq_cp_range(src, dst, p0, p1)
    ref_seq_cp(b, src, dst, p0, p1)
    assert_same(snapshot(a), snapshot(b))


def test_seq_cp_range_values(cells_cls: type) -> None:
    c = _ranged(cells_cls)
    c.seq_cp_range(0, 1, 0, 4)  # cells 0 and 3 gain 1; cell 1 already has it (left as is)
    assert c.seq_pos_get(1) == [(0, 0), (1, 1), (2, 2), (3, 3), (5, 6), (8, 8)]


@pytest.mark.parametrize("s", [0, 1, 2, 255, 7])
def test_seq_keep_all(cells_cls: type, s: int) -> None:
    a, b = _ranged(cells_cls), _ranged(cells_cls)
    assert a.seq_keep_all(s) == ref_seq_keep(b, s)
    assert_same(snapshot(a), snapshot(b))


def test_seq_keep_all_values(cells_cls: type) -> None:
    c = _ranged(cells_cls)
    assert c.seq_keep_all(1) == 0  # cell 0 (only sequence 0) is the first freed
    assert c.used_cells().tolist() == [1, 2, 6, 7, 8]  # cell 7 had no sequence: stays used
    assert all(c.seq_get_all(i) == [1] for i in (1, 2, 6, 8))
    assert [s for s in range(256) if c.seq_pos_get(s)] == [1]


@pytest.mark.parametrize("s", [0, 1, 255])
@pytest.mark.parametrize("d", [-3, -1, 2, 100, -(2**31)])
@pytest.mark.parametrize(("p0", "p1"), RANGES[:6])
def test_seq_add_range(cells_cls: type, s: int, d: int, p0: int, p1: int) -> None:
    a, b = _ranged(cells_cls), _ranged(cells_cls)
    # cell 10 (POS_MAX - 1) passes the largest llama_pos when s == 0 and d > 1: it wraps negative and is freed
    assert a.seq_add_range(s, p0, p1, d) == ref_seq_add(b, s, p0, p1, d)
    assert_same(snapshot(a), snapshot(b))


def test_seq_add_range_values(cells_cls: type) -> None:
    c = _ranged(cells_cls)
    assert c.seq_add_range(1, 0, 6, -2) == 1  # cells 1 (pos 1) and 2 (pos 2) go to -1 / 0: 1 is freed
    assert c.is_empty(1) and c.pos_get(2) == 0 and c.pos_get(6) == 3
    assert c.ext.tolist()[1] == [1, 1, 1]  # freed by pos_add: ext kept
    assert c.shift.tolist()[:7] == [0, 0, -2, 0, 0, 0, -2] and c.get_has_shift()
    assert c.seq_add_range(2, 100, 200, 5) == 12  # no cell in range: nothing freed -> size()
    raises_unchanged(c, CellError, c.seq_add_range, 0, 0, 3, 2**31)
    assert c.seq_add_range(0, 0, POS_MAX, 2) == 10  # cell 10 passes POS_MAX: wraps negative, freed (llama.cpp)
    assert c.is_empty(10) and c.seq_pos_max(0) == 10


@pytest.mark.parametrize("s", [0, 1, 255])
@pytest.mark.parametrize("d", [2, 3, 2**31])
@pytest.mark.parametrize(("p0", "p1"), RANGES)
def test_seq_div_range(cells_cls: type, s: int, d: int, p0: int, p1: int) -> None:
    a, b = _ranged(cells_cls), _ranged(cells_cls)
    a.seq_div_range(s, p0, p1, d)
    ref_seq_div(b, s, p0, p1, d)
    assert_same(snapshot(a), snapshot(b))


def test_seq_div_range_values(cells_cls: type) -> None:
    c = _ranged(cells_cls)
    c.seq_div_range(1, 2, 9, 2)  # cells 2 (2 -> 1), 6 (5 -> 2), 8 (8 -> 4)
    assert [c.pos_get(i) for i in (2, 6, 8)] == [1, 2, 4]
    assert [c.get_shift(i) for i in (2, 6, 8)] == [1, 3, 4]
    raises_unchanged(c, CellError, c.seq_div_range, 1, 0, 9, 0)


def test_range_ops_on_empty_and_zero_size_cells(cells_cls: type) -> None:
    for n in (0, 4):
        c = cells_cls(n)
        assert c.seq_rm_range(-1, 0, POS_MAX) == n
        assert c.seq_rm_range(0, 0, POS_MAX) == n
        assert c.seq_keep_all(0) == n
        assert c.seq_add_range(0, 0, POS_MAX, 5) == n
        c.seq_cp_range(0, 1, 0, POS_MAX)
        c.seq_div_range(0, 0, POS_MAX, 2)
        assert_same(snapshot(c), snapshot(cells_cls(n)))


def test_repr(cells_cls: type) -> None:
    c = build(cells_cls, 3, {0: (1, [0])})
    assert repr(c) == "KVCells(size=3, used=1, has_shift=False)"
