"""Shared fixtures: the twins of each Cython module, side by side in one run.

``cells_cls`` is parametrized over the cell twins (ids ``py`` and ``c``). The ``c`` case is skipped only
when the extension is not built *and* the run did not ask for Cython; under ``KVREF_BACKEND=cython`` a
missing extension fails every ``c`` case, so a broken build can never pass as a Cython run.

Tests marked ``slow`` (the long hypothesis campaigns) run only when selected with ``-m slow`` or when
``KVREF_SLOW=1``.
"""

from __future__ import annotations

import os

import pytest

from kvref import _cells_py
from kvref._backend import _load_compiled


def cython_requested() -> bool:
    return os.environ.get("KVREF_BACKEND", "auto").strip().lower() == "cython"


# ``kvref._cells_c`` when it is built, else None (an extension that fails to load still raises)
CELLS_C = _load_compiled("cells")
NOT_BUILT = "kvref._cells_c is not built (run `python setup.py build_ext --inplace`); KVREF_BACKEND is not cython"


def _c_param(cls: object) -> object:
    if cls is None and not cython_requested():
        return pytest.param(None, id="c", marks=pytest.mark.skip(reason=NOT_BUILT))
    return pytest.param(cls, id="c")


@pytest.fixture(params=[pytest.param(_cells_py.KVCells, id="py"), _c_param(CELLS_C and CELLS_C.KVCells)])
def cells_cls(request: pytest.FixtureRequest) -> type:
    """The KVCells class of one twin."""
    if request.param is None:
        pytest.fail("KVREF_BACKEND=cython but the extension kvref._cells_c is not built")
    return request.param


@pytest.fixture
def cells_twins() -> tuple[type, type]:
    """(Python KVCells, Cython KVCells), for tests that cross the twins."""
    if CELLS_C is None:
        if cython_requested():
            pytest.fail("KVREF_BACKEND=cython but the extension kvref._cells_c is not built")
        pytest.skip(NOT_BUILT)
    return _cells_py.KVCells, CELLS_C.KVCells


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("markexpr", "") or "") or os.environ.get("KVREF_SLOW", "") in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason="slow campaign: select with -m slow or KVREF_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
