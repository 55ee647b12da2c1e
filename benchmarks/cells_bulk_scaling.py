"""Wall-clock time of every bulk KVCells method at a few sizes (issue 14: no operation worse than O(n log n)).

    python benchmarks/cells_bulk_scaling.py [--twin py|c] [--sizes 32768,131072] [--repeat 1]

The fill is a realistic one: four sequences share a common prefix (the first quarter of the cells holds all
four), then each continues on its own, interleaved cell by cell (a parallel decode). Every method runs on a
fresh copy of that fill (the copy is not timed). Prints one row per method, milliseconds per size, and the
ratio of the largest to the smallest size (about 4 for linear work at 32k -> 131k, about 16 for quadratic).
This script times; the tests never do (tests/test_cells_complexity.py counts work instead).
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

POS_MAX = 2**31 - 1
N_SEQ = 4


def fill_arrays(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cells, positions, seq ids) for seq_add_many after pos_set_many: the shared prefix, then 4 interleaved tails."""
    n_pre = n // 4
    cells = np.arange(n, dtype=np.int64)
    pos = np.where(cells < n_pre, cells, n_pre + (cells - n_pre) // N_SEQ)
    pre = np.repeat(np.arange(n_pre, dtype=np.int64), N_SEQ)
    add_cells = np.concatenate([pre, cells[n_pre:]])
    add_seqs = np.concatenate([np.tile(np.arange(N_SEQ), n_pre), cells[n_pre:] % N_SEQ])
    return pos, add_cells, add_seqs


def workloads(n: int) -> dict[str, Callable[[Any], object]]:
    idxs = np.arange(n, dtype=np.int64)
    return {
        "seq_keep_all(0)": lambda c: c.seq_keep_all(0),
        "seq_add_range(1, +7)": lambda c: c.seq_add_range(1, 0, POS_MAX, 7),
        "seq_add_range(2, -n/8) frees": lambda c: c.seq_add_range(2, 0, POS_MAX, -(n // 8)),
        "seq_div_range(3, /2)": lambda c: c.seq_div_range(3, 0, POS_MAX, 2),
        "seq_rm_range(0, all)": lambda c: c.seq_rm_range(0, 0, POS_MAX),
        "seq_rm_range(-1, >= n/8)": lambda c: c.seq_rm_range(-1, n // 8, POS_MAX),
        "seq_cp_range(1 -> 9)": lambda c: c.seq_cp_range(1, 9, 0, POS_MAX),
        "pos_add_many(used, +5)": lambda c: c.pos_add_many(c.used_cells(), 5),
        "cp(0, n)": lambda c: c.cp(0, n),
        "set(idxs, other cells)": lambda c: c.set(idxs, c.other),
        "set(0, same cells)": lambda c: c.set(0, c.same),
        "reset()": lambda c: c.reset(),
        "resize(n)": lambda c: c.resize(n),
    }


def run(twin: str, sizes: list[int], repeat: int) -> None:
    mod = importlib.import_module("kvref.memory._cells_py" if twin == "py" else "kvref.memory._cells_c")
    KVCells = mod.KVCells
    results: dict[str, list[float]] = {}
    for n in sizes:
        pos, add_cells, add_seqs = fill_arrays(n)
        t0 = time.perf_counter()
        template = KVCells(n)
        template.pos_set_many(np.arange(n), pos)
        template.seq_add_many(add_cells, add_seqs)
        results.setdefault("fill (pos_set_many + seq_add_many)", []).append(time.perf_counter() - t0)
        other = KVCells(n)
        other.pos_set_many(np.arange(n), pos + 1)
        other.seq_add_many(add_cells, (add_seqs + 1) % N_SEQ)
        same = template.cp(0, n)
        for name, f in workloads(n).items():
            best = float("inf")
            for _ in range(repeat):
                c = _Wrapped(template.cp(0, n), other, same)
                t0 = time.perf_counter()
                f(c)
                best = min(best, time.perf_counter() - t0)
            results.setdefault(name, []).append(best)
    head = f"{'method (' + twin + ')':<38}" + "".join(f"{n:>12,}" for n in sizes)
    if len(sizes) > 1:
        head += f"{'ratio':>8}"
    print(head)
    for name, ts in results.items():
        row = f"{name:<38}" + "".join(f"{t * 1e3:>10.1f}ms" for t in ts)
        if len(ts) > 1:
            row += f"{ts[-1] / ts[0]:>8.1f}"
        print(row)


class _Wrapped:
    """The cells, plus the ``other`` / ``same`` cells the set() workloads restore (the Cython class has no __dict__)."""

    def __init__(self, c: Any, other: Any, same: Any) -> None:
        self._c, self.other, self.same = c, other, same

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--twin", choices=["py", "c"], default="py")
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    run(a.twin, [int(s) for s in a.sizes.split(",")], a.repeat)
