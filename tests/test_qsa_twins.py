"""The QSA twins agree: ``rank_order`` of ``_qsa_py`` (libstdc++'s std::sort stated in Python) and ``_qsa_c`` (the
C++ library's std::sort itself) give the same order on keys full of ties, where the order of equal keys is the
algorithm's own; and `kvref.memory.qsa` uses the twin the backend picks.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NOT_BUILT

import kvref
from kvref._backend import _load_compiled
from kvref.memory import _qsa_py, qsa

QSA_C = _load_compiled("memory.qsa")


def c_twin():  # type: ignore[no-untyped-def]
    if QSA_C is None:
        pytest.skip(NOT_BUILT)
    return QSA_C


def test_the_backend_picks_the_twin() -> None:
    expected = "kvref.memory._qsa_c" if kvref.backend() == "cython" else "kvref.memory._qsa_py"
    assert qsa._twin.__name__ == expected


def test_twins_export_the_same_names() -> None:
    assert c_twin().__all__ == _qsa_py.__all__


def test_short_runs_keep_equal_keys_in_cell_order() -> None:
    # up to 16 elements std::sort is an insertion sort: stable, so equal keys keep the cells' ascending order
    cells = np.array([3, 5, 8, 9, 12], np.int64)
    pos = np.array([7, 7, 6, 7, 6], np.int64)
    y = np.array([1, 0, 0, 0, 0], np.int64)
    x = np.zeros(5, np.int64)
    for mod in (_qsa_py, *([QSA_C] if QSA_C is not None else [])):
        assert mod.rank_order(cells, pos, y, x).tolist() == [8, 12, 5, 9, 3]


@pytest.mark.parametrize("seed", range(8))
def test_twins_agree_on_ties(seed: int) -> None:
    c = c_twin()
    rng = np.random.default_rng(seed)
    for t in range(200):
        n = int(rng.integers(0, 400))
        k = int(rng.integers(1, 5))
        cells = np.sort(rng.choice(8192, n, replace=False)).astype(np.int64)
        pos, y, x = rng.integers(0, k, n), rng.integers(0, k, n), rng.integers(-1, 1, n)
        if t % 4 == 0:
            pos = np.concatenate([np.arange(n // 2), np.arange(n - n // 2)[::-1]]) % (k + 1)
        if t % 7 == 0:
            y = x = np.zeros(n, np.int64)
        want = _qsa_py.rank_order(cells, pos, y, x)
        assert np.array_equal(c.rank_order(cells, pos, y, x), want)
        keys = list(zip(pos.tolist(), y.tolist(), x.tolist(), strict=True))
        by_cell = dict(zip(cells.tolist(), keys, strict=True))
        assert [by_cell[i] for i in want.tolist()] == sorted(keys)  # and it is a sort
