"""Shared fixtures: the twins of each Cython module, side by side in one run.

``cells_cls`` is parametrized over the cell twins (ids ``py`` and ``c``). A run that cannot load the compiled
twins stops before collecting anything, unless it asked for the Python twins (``KVREF_BACKEND=python``): a
broken or shadowed build can never pass by skipping every Cython case. Under ``KVREF_BACKEND=python`` without a
build (``KVREF_PUREPYTHON=1``), the ``c`` cases are skipped with that reason.

Tests marked ``slow`` (the long hypothesis campaigns) run only when selected with ``-m slow`` or when
``KVREF_SLOW=1``.
"""

from __future__ import annotations

import os

import pytest

from kvref._backend import _load_compiled, requested, why_not_compiled
from kvref.memory import _cells_py


def cython_requested() -> bool:
    return requested() == "cython"


# ``kvref.memory._cells_c`` when it is built, else None (an extension that fails to load still raises)
CELLS_C = _load_compiled("memory.cells")
NOT_BUILT = "the compiled twins are not built and this run asked for the Python twins (KVREF_BACKEND=python)"


def pytest_configure(config: pytest.Config) -> None:
    if requested() == "python":
        return
    for stem in ("memory.cells", "memory.mask", "memory.slots", "gguf"):
        if _load_compiled(stem) is None:
            raise pytest.UsageError(
                f"kvref's compiled twins cannot be loaded: {why_not_compiled(stem)}. "
                "Run with KVREF_BACKEND=python to test the Python twins only."
            )


def _c_param(cls: object) -> object:
    if cls is None:
        return pytest.param(None, id="c", marks=pytest.mark.skip(reason=NOT_BUILT))
    return pytest.param(cls, id="c")


@pytest.fixture(params=[pytest.param(_cells_py.KVCells, id="py"), _c_param(CELLS_C and CELLS_C.KVCells)])
def cells_cls(request: pytest.FixtureRequest) -> type:
    """The KVCells class of one twin."""
    return request.param


@pytest.fixture
def cells_twins() -> tuple[type, type]:
    """(Python KVCells, Cython KVCells), for tests that cross the twins."""
    if CELLS_C is None:
        pytest.skip(NOT_BUILT)
    return _cells_py.KVCells, CELLS_C.KVCells


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("markexpr", "") or "") or os.environ.get("KVREF_SLOW", "") in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason="slow campaign: select with -m slow or KVREF_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
