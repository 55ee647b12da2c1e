"""The twins agree at the edges too: one contract, one result (issue: hardening, item 10).

Every case runs on both twins of the module it concerns and compares result and error class and message."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CELLS_C
from mask_helpers import MASK_C, seq_bits

from kvref.errors import KVRefError
from kvref.memory import _cells_py, _mask_py

CELL_TWINS = [pytest.param(_cells_py.KVCells, id="py")] + (
    [pytest.param(CELLS_C.KVCells, id="c")] if CELLS_C is not None else []
)
MASK_TWINS = [pytest.param(_mask_py, id="py")] + ([pytest.param(MASK_C, id="c")] if MASK_C is not None else [])


def outcome(f):
    try:
        return ("ok", f())
    except KVRefError as e:
        return (type(e).__name__, str(e))


def cells(cls) -> object:
    c = cls(8)
    for i in range(4):
        c.pos_set(i, i)
        c.seq_add(i, 0)
    return c


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.seq_rm_range(0, 1.5, 3),
        lambda c: c.seq_cp_range(0, 1, 0, 2.5),
        lambda c: c.seq_add_range(0, 0.5, -1, 1),
        lambda c: c.seq_div_range(0, 0, -1, float("nan")),
        lambda c: c.seq_div_range(0, 5, 5, float("nan")),  # an empty range: the argument is still refused
        lambda c: c.pos_in(0, 0.5, 2),
        lambda c: c.seq_keep_all(None),
    ],
)
def test_non_integer_arguments_are_refused_by_both_cell_twins(call) -> None:
    results = [outcome(lambda cls=p.values[0]: call(cells(cls))) for p in CELL_TWINS]
    assert results[0][0] == "ArgumentTypeError" and len(set(results)) == 1, results


@pytest.mark.parametrize("n", [2**32, 2**40, -1])
def test_impossible_sizes_are_the_same_cell_error(n: int) -> None:
    results = [outcome(lambda cls=p.values[0]: cls(n)) for p in CELL_TWINS]
    assert results[0][0] == "CellError" and len(set(results)) == 1, results


def test_a_size_beyond_memory_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvref import args

    monkeypatch.setattr(args, "physical_memory", lambda: 1 << 20)
    results = [outcome(lambda cls=p.values[0]: cls(1 << 20)) for p in CELL_TWINS]
    assert results[0][0] == "ArgumentError" and len(set(results)) == 1, results


@pytest.mark.parametrize("twin", MASK_TWINS)
def test_only_position_minus_one_is_an_empty_cell(twin) -> None:
    """llama.cpp marks an empty cell with -1; a position below it is a cell a seq_div by a negative divisor moved
    there, attended like any other (both twins, through every pass: one token, several of one sequence, ALiBi)."""
    pos = np.array([0, -5, 2, -1, -(2**31)], np.int32)
    seq = seq_bits([{0}, {0}, {0}, {0}, {0}])
    out = np.empty((1, 1, 5), np.float32)
    twin.fill_kq_mask_raw(out, [pos], [seq], None, [0], np.array([3], np.int64), np.array([0], np.int64))
    assert out[0, 0].tolist() == [0.0, 0.0, 0.0, float("-inf"), 0.0]
    out = np.empty((1, 2, 5), np.float32)
    twin.fill_kq_mask_raw(out, [pos], [seq], None, [0], np.array([1, 3], np.int64), np.array([0, 0], np.int64))
    assert out[0].tolist() == [[0.0, 0.0, float("-inf"), float("-inf"), 0.0], [0.0, 0.0, 0.0, float("-inf"), 0.0]]
    twin.fill_kq_mask_raw(out, [pos], [seq], None, [0], np.array([1, 3], np.int64), np.array([0, 0], np.int64),
                          alibi=True)  # fmt: skip
    assert out[0, 1].tolist() == [-3.0, -8.0, -1.0, float("-inf"), float(np.float32(-(2**31) - 3))]
    out = np.empty((1, 1, 5), np.float32)  # a window of 4 (standard): p1 - p0 < 4
    twin.fill_kq_mask_raw(out, [pos], [seq], None, [0], np.array([3], np.int64), np.array([0], np.int64),
                          n_swa=4, swa_type=1)  # fmt: skip
    assert out[0, 0].tolist() == [0.0, float("-inf"), 0.0, float("-inf"), float("-inf")]


@pytest.mark.parametrize("twin", CELL_TWINS)
@pytest.mark.parametrize("many", [False, True])
def test_a_shift_by_zero_frees_a_cell_a_negative_divisor_left_below_zero(twin, many: bool) -> None:
    """llama.cpp's pos_add frees a cell whose position is negative after the add, a shift by 0 included: the cell
    leaves its sequences' position index too (the C twin once skipped the index when the position did not move,
    and seq_pos_min then answered the freed cell's -26; found by the cells state machine)."""
    c = twin(8)
    for i, (p, s) in enumerate([(4, 0), (6, 1), (26, 0)]):
        c.pos_set(i, p)
        c.seq_add(i, s)
    c.pos_div(2, -1)  # position -26, still used
    assert c.seq_pos_min_many([0, 1]).tolist() == [-26, 6]
    freed = c.pos_add_many([2], 0).tolist() if many else [c.pos_add(2, 0)]
    assert freed == [True] and c.is_empty(2)
    assert c.seq_pos_min_many([0, 1]).tolist() == [4, 6] and c.seq_pos_max_many([0]).tolist() == [4]
