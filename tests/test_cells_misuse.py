"""Misuse of a KVCells never kills the process and never half-changes it (issue 22, section 2), in both twins.

- an argument whose ``__index__`` (or a ``pos`` property of set()'s ``other``) calls back into the same cells:
  the nested call is refused with CellError and nothing changes; once wrote out of bounds in the Cython twin
  (pos_set, pos_add, ext_set) or corrupted its index (pos_div, pos_set_shifted);
- a resize() that fails half-way (MemoryError) leaves the cells as they were; once left the Cython twin's
  pointers on freed buffers;
- odd argument types (floats, None, strings, NaN, ragged lists, objects that are not cells): the same kvref error
  from both twins, nothing changed; once stored pos_set(5, 1.5) as 1 in the Python twin, raised plain
  ValueError / TypeError / OverflowError from the bulk methods, and changed the cell before raising in
  pos_set_shifted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import CELLS_C

from kvref.errors import ArgumentError, ArgumentTypeError, CellError, KVRefError
from kvref.memory import _cells_py

TWINS = [_cells_py.KVCells] + ([CELLS_C.KVCells] if CELLS_C is not None else [])
NESTED = "already inside a call in this thread"


def filled(cls: type) -> Any:
    """16 cells: 0..5 used at positions 0..5 by sequence 0 (cell 1 by sequence 1 too), ext (i, i, 100 + i)."""
    c = cls(16)
    for i in range(6):
        c.pos_set(i, i)
        c.seq_add(i, 0)
        c.ext_set(i, i, i, 100 + i)
    c.seq_add(1, 1)
    return c


def snapshot(c: Any) -> tuple:
    seqs = range(4)
    return (
        c.size(),
        c.get_used(),
        c.get_has_shift(),
        c.used_cells().tolist(),
        c.pos.tolist(),
        c.shift.tolist(),
        c.ext.tolist(),
        c.seq.tolist(),
        [c.seq_pos_get(s) for s in seqs],
    )


def outcome(f: Callable[[], Any]) -> tuple[str, Any]:
    try:
        res = f()
    except KVRefError as e:
        return (type(e).__name__, str(e))
    if isinstance(res, np.ndarray):
        return ("ok", (res.dtype.str, res.tolist()))
    if hasattr(res, "pos"):  # cp(): the copy's state
        return ("ok", snapshot(res))
    return ("ok", res)


# ------------------------------------------------------------------------------------------------ re-entry
class Reenter:
    """An integer whose ``__index__`` first calls back into the cells (``action``); with ``swallow`` it catches the
    refusal and goes on, else the refusal propagates out of the outer call."""

    def __init__(self, value: int, swallow: bool = False) -> None:
        self.value, self.swallow = value, swallow
        self.cells: Any = None
        self.action: Callable[[Any], Any] = lambda c: None
        self.refusals: list[str] = []

    def __index__(self) -> int:
        try:
            self.action(self.cells)
        except CellError as e:
            self.refusals.append(str(e))
            if not self.swallow:
                raise
        return self.value


class OtherCells:
    """set()'s ``other``, whose ``pos`` calls back into the target cells first."""

    def __init__(self, src: Any, arg: Reenter) -> None:
        self.src, self.arg = src, arg

    @property
    def pos(self) -> Any:
        self.arg.__index__()
        return self.src.pos

    @property
    def ext(self) -> Any:
        return self.src.ext

    @property
    def seq(self) -> Any:
        return self.src.seq


# each call with one hostile argument ``a`` (a Reenter standing for a valid value); its plain form is the call with
# ``int(a.value)`` in its place
CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "pos_set": lambda c, a: c.pos_set(10, a),
    "pos_set.i": lambda c, a: c.pos_set(a, 3),
    "pos_add": lambda c, a: c.pos_add(2, a),
    "pos_add.i": lambda c, a: c.pos_add(a, -1),
    "ext_set": lambda c, a: c.ext_set(3, a, 6, 7),
    "ext_set.i": lambda c, a: c.ext_set(a, 1, 2, 3),
    "pos_div": lambda c, a: c.pos_div(4, a),
    "pos_set_shifted": lambda c, a: c.pos_set_shifted(11, 9, a),
    "pos_set_shifted.p": lambda c, a: c.pos_set_shifted(11, a, 4),
    "seq_add": lambda c, a: c.seq_add(2, a),
    "seq_rm": lambda c, a: c.seq_rm(1, a),
    "seq_keep": lambda c, a: c.seq_keep(1, a),
    "rm": lambda c, a: c.rm(a),
    "pos_get": lambda c, a: c.pos_get(a),
    "seq_pos_tok_le": lambda c, a: c.seq_pos_tok_le(0, a),
    "pos_in": lambda c, a: c.pos_in(a, 0, 5),
    "seq_rm_range": lambda c, a: c.seq_rm_range(0, a, 4),
    "seq_cp_range": lambda c, a: c.seq_cp_range(0, 2, 0, a),
    "seq_add_range": lambda c, a: c.seq_add_range(0, 0, a, 2),
    "seq_div_range": lambda c, a: c.seq_div_range(0, 0, 10, a),
    "cp": lambda c, a: c.cp(a, 4),
    "set": lambda c, a: c.set(8, OtherCells(filled(type(c)).cp(0, 4), a)),
    "pos_set_many": lambda c, a: c.pos_set_many([a], [3]),
    "seq_add_many": lambda c, a: c.seq_add_many([3], [a]),
    "ext_set_many": lambda c, a: c.ext_set_many([3, 4], a, 2, 3),
    "pos_add_many": lambda c, a: c.pos_add_many([2, 3], a),
    "seq_pos_max_many": lambda c, a: c.seq_pos_max_many([a]),
    "place": lambda c, a: c.place([13], [20], [a]),
}
VALUES = {"pos_set": 7, "pos_set.i": 10, "pos_add": 1, "pos_add.i": 2, "ext_set": 5, "ext_set.i": 3, "pos_div": 2}
VALUES |= {"pos_set_shifted": 3, "pos_set_shifted.p": 9, "seq_add": 1, "seq_rm": 1, "seq_keep": 0, "rm": 3}
VALUES |= {"pos_get": 2, "seq_pos_tok_le": 3, "pos_in": 2, "seq_rm_range": 2, "seq_cp_range": 3, "seq_add_range": 10}
VALUES |= {"seq_div_range": 2, "cp": 0, "set": 0, "pos_set_many": 12, "seq_add_many": 2, "ext_set_many": 1}
VALUES |= {"pos_add_many": 1, "seq_pos_max_many": 0, "place": 0}
# what the argument's __index__ calls: (the method named in the refusal, the call)
ACTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "resize": ("resize", lambda c: c.resize(1)),
    "resize_to_0": ("resize", lambda c: c.resize(0)),
    "reset": ("reset", lambda c: c.reset()),
    "rm": ("rm", lambda c: c.rm(0)),
    "seq_rm_range": ("seq_rm_range", lambda c: c.seq_rm_range(-1, 0, 100)),
    "read": ("seq_pos_max", lambda c: c.seq_pos_max(0)),
}


@pytest.mark.parametrize("action", list(ACTIONS))
@pytest.mark.parametrize("call", list(CALLS))
def test_a_nested_call_from_an_argument_is_refused_and_changes_nothing(cells_cls: type, call: str, action: str) -> None:
    c = filled(cells_cls)
    before = snapshot(c)
    arg = Reenter(VALUES[call])
    method, arg.action = ACTIONS[action]
    arg.cells = c
    if call == "place":  # place() answers False for what it cannot take, a refused argument included
        assert c.place([13], [20], [arg]) is False
    else:
        with pytest.raises(CellError, match=NESTED) as e:
            CALLS[call](c, arg)
        assert str(e.value).startswith(f"{method}: ")
    assert arg.refusals, "the nested call ran"
    assert snapshot(c) == before
    c.pos_set(15, 1)  # and the cells still work
    assert c.get_used() == 7 and c.seq_pos_max(0) == 5


@pytest.mark.parametrize("call", list(CALLS))
def test_a_refused_nested_call_caught_by_the_argument_leaves_the_outer_call_intact(cells_cls: type, call: str) -> None:
    c, plain = filled(cells_cls), filled(cells_cls)
    arg = Reenter(VALUES[call], swallow=True)
    arg.cells, arg.action = c, ACTIONS["resize"][1]
    got = outcome(lambda: CALLS[call](c, arg))
    want = outcome(lambda: CALLS[call](plain, VALUES[call]))
    assert arg.refusals and got == want
    assert snapshot(c) == snapshot(plain)


def test_the_twins_refuse_nested_calls_alike() -> None:
    if len(TWINS) < 2:
        pytest.skip("the compiled twin is not built")
    for call in CALLS:
        res = []
        for cls in TWINS:
            c = filled(cls)
            arg = Reenter(VALUES[call])
            arg.cells, arg.action = c, ACTIONS["resize"][1]
            res.append((outcome(lambda c=c, arg=arg, call=call: CALLS[call](c, arg)), snapshot(c)))
        assert res[0] == res[1], call


# ------------------------------------------------------------------------------------------------ failed resize
@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_a_resize_that_fails_half_way_leaves_the_cells_as_they_were(
    cells_cls: type, fail_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = filled(cells_cls)
    c.pos_add(3, 2)  # a pending shift too
    before = snapshot(c)
    real_empty = np.empty
    calls = []

    def empty(*a: Any, **kw: Any) -> Any:
        calls.append(a)
        if len(calls) == fail_at:
            raise MemoryError("no memory for the new cells")
        return real_empty(*a, **kw)

    monkeypatch.setattr(np, "empty", empty)
    with pytest.raises(MemoryError):
        c.resize(4096)
    monkeypatch.undo()
    assert snapshot(c) == before
    assert c.pos.shape == (c.size(),) and c.ext.shape == (c.size(), 3)
    # everything reads and writes the buffers it had
    c.pos_set(15, 40)
    c.seq_add(15, 2)
    assert c.seq_pos_max(2) == 40 and c.used_cells().tolist() == [0, 1, 2, 3, 4, 5, 15]
    assert c.seq_pos_get(0) == [(0, 0), (1, 1), (2, 2), (4, 4), (5, 3), (5, 5)]
    c.resize(32)
    assert c.size() == 32 and c.get_used() == 0


# ------------------------------------------------------------------------------------------------ odd arguments
ODD = {
    "float": 1.5,
    "integral float": 2.0,
    "nan": float("nan"),
    "inf": float("inf"),
    "None": None,
    "str": "1",
    "np.float64": np.float64(1.0),
    "object": object(),
}
PER_CELL: dict[str, Callable[[Any, Any], Any]] = {
    "pos_set.p": lambda c, v: c.pos_set(10, v),
    "pos_set.i": lambda c, v: c.pos_set(v, 3),
    "pos_set_shifted.shift": lambda c, v: c.pos_set_shifted(10, 3, v),
    "pos_set_shifted.p": lambda c, v: c.pos_set_shifted(10, v, 0),
    "pos_add": lambda c, v: c.pos_add(2, v),
    "pos_div": lambda c, v: c.pos_div(2, v),
    "ext_set": lambda c, v: c.ext_set(2, 1, v, 3),
    "seq_add": lambda c, v: c.seq_add(2, v),
    "seq_pos_tok_le": lambda c, v: c.seq_pos_tok_le(0, v),
    "pos_in": lambda c, v: c.pos_in(2, v, 5),
    "cp.i": lambda c, v: c.cp(v, 2),
    "seq_rm_range": lambda c, v: c.seq_rm_range(v, 0, 5),
    "seq_add_range": lambda c, v: c.seq_add_range(0, 0, 5, v),
}
BULK: dict[str, Callable[[Any, Any], Any]] = {
    "pos_set_many.positions": lambda c, v: c.pos_set_many([10, 11], [3, v]),
    "pos_set_many.idxs": lambda c, v: c.pos_set_many(v, [3]),
    "seq_add_many": lambda c, v: c.seq_add_many([2, 3], [1, v]),
    "seq_add_many.one": lambda c, v: c.seq_add_many([2, 3], v),
    "ext_set_many": lambda c, v: c.ext_set_many([2, 3], [1, v], 0, 0),
    "pos_add_many.idxs": lambda c, v: c.pos_add_many([2, v], 1),
    "seq_pos_min_many": lambda c, v: c.seq_pos_min_many([0, v]),
    "seq_pos_max_many": lambda c, v: c.seq_pos_max_many(v),
    "cp.list": lambda c, v: c.cp([0, v]),
    "set.list": lambda c, v: c.set([8, v], c.cp(0, 2)),
}
ODD_BULK = {k: v for k, v in ODD.items() if k != "integral float"} | {
    "ragged": [[1, 2], [3]],
    "float array": np.array([1.0, 2.0]),
    "str array": np.array(["1"]),
    "bytes": b"\x01",
}


@pytest.mark.parametrize("value", list(ODD))
@pytest.mark.parametrize("call", list(PER_CELL))
def test_a_non_integer_argument_is_the_same_type_error_in_both_twins(call: str, value: str) -> None:
    res = []
    for cls in TWINS:
        c = filled(cls)
        before = snapshot(c)
        res.append(outcome(lambda c=c: PER_CELL[call](c, ODD[value])))
        assert snapshot(c) == before, (cls, call, value)
    assert res[0][0] == "ArgumentTypeError" and len(set(res)) == 1, res


@pytest.mark.parametrize("value", list(ODD_BULK))
@pytest.mark.parametrize("call", list(BULK))
def test_a_bulk_argument_that_is_not_integers_is_the_same_kvref_error_in_both_twins(call: str, value: str) -> None:
    res = []
    for cls in TWINS:
        c = filled(cls)
        before = snapshot(c)
        res.append(outcome(lambda c=c: BULK[call](c, ODD_BULK[value])))
        assert snapshot(c) == before, (cls, call, value)
    assert res[0][0] in ("ArgumentTypeError", "ArgumentError") and len(set(res)) == 1, res


def test_pos_set_does_not_round_a_float(cells_cls: type) -> None:
    c = cells_cls(8)
    with pytest.raises(ArgumentTypeError, match=r"float 1\.5"):
        c.pos_set(5, 1.5)
    assert c.is_empty(5) and c.get_used() == 0


def test_pos_set_shifted_checks_every_argument_before_it_places(cells_cls: type) -> None:
    c = cells_cls(8)
    with pytest.raises(ArgumentTypeError):
        c.pos_set_shifted(0, 5, 1.5)
    assert c.is_empty(0) and c.get_used() == 0 and not c.get_has_shift()
    c.pos_set_shifted(0, 5, 2**32 + 3)  # a shift wraps as llama.cpp's int32 does
    assert c.get_shift(0) == 3


@pytest.mark.parametrize(
    "args",
    [
        ([0, 1], [1.5, 2]),
        ([0], [None]),
        ("ab", [1]),
        ([0, 1], [[1], [2, 3]]),
        ([0], [1], [0], (1, 2)),  # ext must be (x, y, tok)
        ([0], [1], [0], 5),  # ... a sequence at all
    ],
)
def test_place_answers_false_for_values_it_cannot_take(cells_cls: type, args: tuple) -> None:
    c = cells_cls(8)
    ext = args[3] if len(args) > 3 else None
    idxs, pos = args[0], args[1]
    seqs = args[2] if len(args) > 2 else [0] * 2
    assert c.place(idxs, pos, seqs, ext) is False
    assert c.get_used() == 0


@pytest.mark.parametrize("other", [None, 5, "cells", np.zeros(3)])
def test_set_from_something_that_is_not_cells_is_a_type_error(cells_cls: type, other: Any) -> None:
    c = filled(cells_cls)
    before = snapshot(c)
    with pytest.raises(ArgumentTypeError, match="set: expected cells"):
        c.set(0, other)
    assert snapshot(c) == before


def test_mismatched_bulk_lengths_are_an_argument_error(cells_cls: type) -> None:
    c = filled(cells_cls)
    before = snapshot(c)
    with pytest.raises(ArgumentError, match="seq_ids: 3 values for 2 cells"):
        c.seq_add_many([2, 3], [1, 2, 3])
    with pytest.raises(ArgumentError, match="ys: 3 values for 2 cells"):
        c.ext_set_many([2, 3], 0, [1, 2, 3], 0)
    assert snapshot(c) == before


def test_integers_past_int64_are_refused_as_out_of_range(cells_cls: type) -> None:
    c = filled(cells_cls)
    before = snapshot(c)
    with pytest.raises(CellError, match="cell index 9223372036854775807 is outside"):
        c.pos_set_many([2**70], [1])
    with pytest.raises(CellError, match="outside"):
        c.ext_set_many([2], [-(2**80)], 0, 0)
    assert snapshot(c) == before
    c.pos_set_many(np.array([10], np.uint64), [np.int8(3)])  # any integer type is an integer
    assert c.pos_get(10) == 3


def test_the_first_refused_element_of_pos_set_many_names_the_error_in_both_twins() -> None:
    """Found by the cells fuzzer: the Python twin once named a later cell that was not empty before an earlier
    position that was out of range."""
    res = []
    for cls in TWINS:
        c = filled(cls)
        before = snapshot(c)
        res.append(outcome(lambda c=c: c.pos_set_many([6, 2], [-1, 5])))
        res.append(outcome(lambda c=c: c.pos_set_many([2, 6], [-1, 5])))
        assert snapshot(c) == before
    assert res[0] == ("CellError", "pos_set_many: a position is -1 (an empty cell) or outside int32")
    assert res[1] == ("CellError", "pos_set_many: a target cell is not empty")
    assert res[len(res) // 2 :] == res[: len(res) // 2]
