"""Issue 14: no KVCells operation of the Python twin may be worse than O(n log n) in the cells it touches.

Nothing here times anything. The work of one call is counted deterministically:

- every line of kvref/memory/_cells_py.py that runs (a ``sys.settrace`` line event; a comprehension counts once per
  element), which catches a Python loop nested in another;
- every entry that a one-entry change of a per-sequence list shifts (``_seq_pos_insert`` / ``_seq_pos_erase``
  on a list of L entries cost L: the list's memmove), which catches the per-cell bisect updates that made
  seq_keep_all, seq_add_range, ... quadratic.

The C-level pieces left (NumPy on the arrays, ``sorted`` / ``list.sort``, set and list building) are
O(n log n) at most. Quadrupling the cells must then multiply the count by less than 8: about 4 for linear work,
16 for quadratic work.

The index's two ways of updating a bulk change (entry by entry below ``_FEW`` entries of a sequence, one rebuild
above) are also cross-checked against the Cython twin with ``_FEW`` forced to each extreme, and set() of a
cells object into itself against a cell-by-cell reading of the rule.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import pytest
from conftest import CELLS_C
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.memory import _cells_py

PyCells = _cells_py.KVCells
POS_MAX = 2**31 - 1
N_SEQ = 4


def filled(cls: type, n: int) -> Any:
    """n cells: four sequences share a prefix (the first quarter of the cells), then go on interleaved."""
    n_pre = n // 4
    cells = np.arange(n, dtype=np.int64)
    c = cls(n)
    c.pos_set_many(cells, np.where(cells < n_pre, cells, n_pre + (cells - n_pre) // N_SEQ))
    c.seq_add_many(np.repeat(cells[:n_pre], N_SEQ), np.tile(np.arange(N_SEQ), n_pre))
    c.seq_add_many(cells[n_pre:], cells[n_pre:] % N_SEQ)
    return c


def other_fill(cls: type, n: int) -> Any:
    """Different cells of the same size: every position + 1, every sequence id + 1 (mod 4), empty tail."""
    c = cls(n)
    m = n - n // 8
    cells = np.arange(m, dtype=np.int64)
    c.pos_set_many(cells, cells // 2 + 1)
    c.seq_add_many(cells, (cells + 1) % N_SEQ)
    c.seq_add_many(cells[: m // 2], (cells[: m // 2] + 2) % N_SEQ)
    return c


def fill_from_scratch(c: Any) -> None:
    n = c.size()
    c.reset()
    cells = np.arange(n, dtype=np.int64)
    # positions in descending order: per-cell sorted inserts would each land at the front of the list
    c.pos_set_many(cells, n - cells)
    c.seq_add_many(cells, cells % N_SEQ)
    c.seq_add_many(cells[::2], (cells[::2] + 1) % N_SEQ)


# name -> the call, on a filled(n) copy
WORKLOADS: dict[str, Callable[[Any, int], object]] = {
    "fill (pos_set_many + seq_add_many)": lambda c, n: fill_from_scratch(c),
    "seq_keep_all": lambda c, n: c.seq_keep_all(0),
    "seq_add_range": lambda c, n: c.seq_add_range(1, 0, POS_MAX, 7),
    "seq_add_range freeing": lambda c, n: c.seq_add_range(2, 0, POS_MAX, -(n // 8)),
    "seq_div_range": lambda c, n: c.seq_div_range(3, 0, POS_MAX, 2),
    "seq_rm_range": lambda c, n: c.seq_rm_range(0, 0, POS_MAX),
    "seq_rm_range all sequences": lambda c, n: c.seq_rm_range(-1, n // 8, POS_MAX),
    "seq_cp_range": lambda c, n: c.seq_cp_range(1, 9, 0, POS_MAX),
    "pos_add_many": lambda c, n: c.pos_add_many(c.used_cells(), 5),
    "pos_add_many descending": lambda c, n: c.pos_add_many(c.used_cells()[::-1], -3),
    "cp": lambda c, n: c.cp(0, n),
    "cp listed": lambda c, n: c.cp(np.arange(n)[::-1]),
    "set other cells": lambda c, n: c.set(np.arange(n), other_fill(type(c), n)),
    "set other cells, listed twice": lambda c, n: c.set(np.arange(2 * n) % n, other_fill(type(c), 2 * n)),
    "set same cells": lambda c, n: c.set(0, c.cp(0, n)),
    "set into itself": lambda c, n: c.set(np.arange(n)[::-1], c),
    "seq_pos_get of every sequence": lambda c, n: [c.seq_pos_get(s) for s in range(N_SEQ)],
    "reset": lambda c, n: c.reset(),
    "resize": lambda c, n: c.resize(n),
}

SOURCE = _cells_py.__file__


class WorkCounter:
    """Counts the work of the calls made inside ``with counter.counting():`` (see the module docstring)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.work = 0
        self.on = False
        insert, erase = PyCells._seq_pos_insert, PyCells._seq_pos_erase

        def counted_insert(cells: Any, s: int, i: int) -> None:
            self.work += len(cells._seq_pos[s]) if self.on else 0
            insert(cells, s, i)

        def counted_erase(cells: Any, s: int, i: int) -> None:
            self.work += len(cells._seq_pos[s]) if self.on else 0
            erase(cells, s, i)

        monkeypatch.setattr(PyCells, "_seq_pos_insert", counted_insert)
        monkeypatch.setattr(PyCells, "_seq_pos_erase", counted_erase)

    def _trace(self, frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_filename != SOURCE:
            return None
        if event == "line":
            self.work += 1
        return self._trace

    def counting(self) -> _Counting:
        return _Counting(self)


class _Counting:
    def __init__(self, counter: WorkCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.counter.on = True
        self.previous = sys.gettrace()
        sys.settrace(self.counter._trace)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)
        self.counter.on = False


def work_of(counter: WorkCounter, name: str, n: int) -> int:
    c = filled(PyCells, n)
    counter.work = 0
    with counter.counting():
        WORKLOADS[name](c, n)
    return counter.work


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_bulk_work_grows_at_most_n_log_n(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    counter = WorkCounter(monkeypatch)
    n = 512
    small, large = work_of(counter, name, n), work_of(counter, name, 4 * n)
    assert small > 0
    assert large < 8 * small, f"{name}: work {small} at {n} cells, {large} at {4 * n} cells (x{large / small:.1f})"


def test_the_counter_sees_quadratic_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter is not blind: cell-by-cell inserts in front of a growing list count quadratically."""
    counter = WorkCounter(monkeypatch)

    def work(n: int) -> int:
        c = PyCells(n)
        c.pos_set_many(np.arange(n), n - np.arange(n))
        counter.work = 0
        with counter.counting():
            for i in range(n):
                c.seq_add(i, 0)
        return counter.work

    assert work(2048) > 8 * work(512)


# ------------------------------------------------------------------ both index paths, against the Cython twin
needs_c = pytest.mark.skipif(CELLS_C is None, reason="the compiled twins are not built")


@needs_c
@pytest.mark.parametrize("few", [0, 10**9], ids=["always-rebuild", "always-entry-by-entry"])
def test_state_machine_with_either_index_path(monkeypatch: pytest.MonkeyPatch, few: int) -> None:
    from test_cells_statemachine import CellsTwins

    monkeypatch.setattr(_cells_py, "_FEW", few)
    run_state_machine_as_test(
        CellsTwins,
        settings=settings(
            max_examples=25, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


@needs_c
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_match_the_cython_twin(name: str) -> None:
    """Every workload above, at a size where each touched sequence takes the rebuild path, on both twins."""
    assert CELLS_C is not None
    n = 256
    out = []
    for cls in (PyCells, CELLS_C.KVCells):
        c = filled(cls, n)
        res = WORKLOADS[name](c, n)
        out.append((_plain(res), *_state(c)))
    assert out[0] == out[1]


def _plain(res: object) -> object:
    if isinstance(res, np.ndarray):
        return res.tolist()
    if isinstance(res, (PyCells,)) or (CELLS_C is not None and isinstance(res, CELLS_C.KVCells)):
        return _state(res)
    return res


def _state(c: Any) -> tuple[object, ...]:
    return (
        c.pos.tolist(),
        c.shift.tolist(),
        c.ext.tolist(),
        c.seq.tolist(),
        c.get_used(),
        c.get_has_shift(),
        [c.seq_pos_get(s) for s in range(256)],
    )


def _sequential_set(idxs: list[int], pos: list[int], ext: list[list[int]], seq: list[list[int]]) -> list[list[Any]]:
    """set(idxs, c) into itself, read cell by cell: write j copies cell j as the earlier writes left it."""
    for j, t in enumerate(idxs):
        pos[t], ext[t], seq[t] = pos[j], list(ext[j]), list(seq[j])
    return [pos, ext, seq]


@pytest.mark.parametrize("seed", range(20))
def test_set_into_itself_is_cell_by_cell(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 80))
    twins = [PyCells] + ([CELLS_C.KVCells] if CELLS_C is not None else [])
    idxs = rng.integers(0, n, n).tolist() if seed % 2 else rng.permutation(n).tolist()
    used = np.flatnonzero(rng.random(n) < 0.7)
    states = []
    for cls in twins:
        c = cls(n)
        c.pos_set_many(used, used // 3)
        c.seq_add_many(used, used % 3)
        c.seq_add_many(used[::2], 3 + used[::2] % 5)
        for i in used.tolist():
            c.ext_set(i, i, -i, 100 + i)
        expected = _sequential_set(idxs, c.pos.tolist(), c.ext.tolist(), c.seq.tolist())
        c.set(idxs, c)
        assert [c.pos.tolist(), c.ext.tolist(), c.seq.tolist()] == expected
        assert c.get_used() == int((c.pos != -1).sum())
        for s in range(8):
            cells = np.flatnonzero((c.seq[:, 0] >> np.uint64(s)) & np.uint64(1))
            assert c.seq_pos_get(s) == sorted(zip(c.pos[cells].tolist(), cells.tolist(), strict=True))
        states.append(_state(c))
    assert all(s == states[0] for s in states)
