"""Benchmark plumbing: run with ``pytest benchmarks/ --benchmark-only`` (or one bench_*.py file).

- ``--benchmark-only`` wins over a ``--benchmark-disable`` coming from addopts or the command line
  (pytest-benchmark would otherwise refuse the two options together).
- ``twin`` is parametrized over the cell twins (ids ``py`` and ``c``, as in tests/conftest.py).
- At the end of the session a table puts Cython and Python side by side per cells workload; the same workloads
  against llama.cpp's llama_kv_cells, compiled and run in the same process, are rows 14e-14i2 of
  ``python benchmarks/bench_vs_llama.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvref._backend import _load_compiled


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("benchmark_only", False):
        config.option.benchmark_enable = True


CELLS_C = _load_compiled("memory.cells")


def _twins() -> list[Any]:
    from kvref.memory import _cells_py

    params = [pytest.param(_cells_py.KVCells, id="py")]
    if CELLS_C is not None:
        params.append(pytest.param(CELLS_C.KVCells, id="c"))
    elif os.environ.get("KVREF_BACKEND", "").strip().lower() == "cython":
        params.append(pytest.param(None, id="c"))  # fails in the fixture
    else:
        params.append(pytest.param(None, id="c", marks=pytest.mark.skip(reason="kvref.memory._cells_c is not built")))
    return params


@pytest.fixture(params=_twins())
def twin(request: pytest.FixtureRequest) -> type:
    if request.param is None:
        pytest.fail("KVREF_BACKEND=cython but kvref.memory._cells_c is not built")
    return request.param


def _seconds(bench: Any, key: str) -> float | None:
    meta = getattr(bench, "stats", None)
    stats = getattr(meta, "stats", meta)
    value = getattr(stats, key, None)
    return float(value) if value is not None else None


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled or not session.benchmarks:
        return
    rows: dict[str, dict[str, Any]] = {}
    for bench in session.benchmarks:
        if not getattr(bench, "stats", None) or not (bench.group or "").startswith("cells-"):
            continue  # the mask and state benchmarks print their own same-run ratio tables
        twin_id = bench.name.rsplit("[", 1)[-1].rstrip("]").split("-")[0]
        rows.setdefault(bench.group or bench.name, {})[twin_id] = bench
    tr = terminalreporter
    tr.section("kvref cells: Cython vs Python (median ms; min in brackets)")
    tr.write_line(f"{'workload':<30} {'py ms':>16} {'c ms':>16} {'py/c':>8}")
    for group, by_twin in sorted(rows.items()):
        cells = {}
        for twin_id in ("py", "c"):
            b = by_twin.get(twin_id)
            med, lo = (_seconds(b, "median"), _seconds(b, "min")) if b else (None, None)
            cells[twin_id] = (med * 1e3, lo * 1e3) if med is not None and lo is not None else None
        py, c = cells["py"], cells["c"]
        fmt = lambda v: f"{v[0]:9.3f} [{v[1]:.3f}]" if v else "-"  # noqa: E731
        ratio = f"{py[0] / c[0]:7.0f}x" if py and c and c[0] > 0 else "-"
        tr.write_line(f"{group:<30} {fmt(py):>16} {fmt(c):>16} {ratio:>8}")
    tr.write_line("py/c: Python time / Cython time; against llama.cpp: python benchmarks/bench_vs_llama.py (14e-14i2)")
