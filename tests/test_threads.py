"""One KVCells shared between threads: every call is atomic in both twins (no crash, no torn state).

The hammering runs in a child process, so a regression (a segfault, as once with the Cython twin's nogil loops
racing resize, and with its set() racing resize) fails this test instead of killing the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import CELLS_C

HAMMER = """
import random, sys, threading
import numpy as np
from kvref.memory import _cells_py
twin = sys.argv[1]
if twin == "c":
    from kvref.memory import _cells_c as mod
else:
    mod = _cells_py
cells = mod.KVCells(256)
errors = []
def work(seed):
    rng = random.Random(seed)
    try:
        for _ in range(3000):
            r = rng.random()
            try:
                if r < 0.05:
                    cells.resize(rng.choice([64, 256, 1024]))
                elif r < 0.5:
                    i = rng.randrange(64)
                    if cells.is_empty(i):
                        cells.pos_set(i, rng.randrange(1000))
                        cells.seq_add(i, rng.randrange(4))
                elif r < 0.7:
                    cells.seq_rm_range(rng.randrange(4), 0, 500)
                elif r < 0.85:
                    cells.seq_add_range(rng.randrange(4), 0, -1, rng.choice([-3, 2]))
                else:
                    cells.seq_keep_all(rng.randrange(4))
            except Exception as e:  # a refused call (an index past a resize, ...) is fine: kvref errors only
                if type(e).__module__ != "kvref.errors":
                    raise
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
pos = np.asarray(cells.pos)
assert cells.get_used() == int((pos != -1).sum()), "the used count tore"
print("ok")
"""


# Calls that run Python-level code (NumPy conversions, the other cells' arrays, the slot kernels' seq_pos_max) in the
# middle of their work, racing resize() with a switch interval of a microsecond: set() once wrote through the freed
# buffers of the Cython twin (heap corruption in most runs); every call now holds the cells' guard.
RACE = """
import random, sys, threading
import numpy as np
twin = sys.argv[1]
if twin == "c":
    from kvref.memory import _cells_c as mod, _slots_c as slots
else:
    from kvref.memory import _cells_py as mod, _slots_py as slots
sys.setswitchinterval(1e-6)
cells = mod.KVCells(64)
src = mod.KVCells(64)
for i in range(64):
    src.pos_set(i, i)
    src.seq_add(i, i % 3)
stop = []
errors = []
def guarded(f):
    def run():
        try:
            f()
        except BaseException as e:
            errors.append(repr(e))
    return run
def loop(op):
    def run():
        rng = random.Random(hash(op.__name__))
        while not stop:
            try:
                op(rng)
            except Exception as e:  # refused (an index past a resize, a full cache, ...): kvref errors only
                if type(e).__module__ != "kvref.errors":
                    raise
    return guarded(run)
def set_all(rng):
    cells.set(0, src)
def set_listed(rng):
    cells.set(list(range(64)), src)
def copy(rng):
    cells.cp(list(range(rng.randrange(1, 64))))
def bulk(rng):
    k = rng.randrange(1, 40)
    cells.pos_set_many(np.arange(k), np.arange(k))
    cells.seq_add_many(list(range(k)), 1)
    cells.ext_set_many(np.arange(k), 1, 2, 3)
    cells.pos_add_many(np.arange(k), 1)
    cells.seq_pos_max_many([0, 1, 2] * 50)
def place(rng):
    n = rng.randrange(1, 8)
    cells.place(list(range(n)), list(range(n)), [0] * n, (0, 0, list(range(n))))
def slot(rng):
    n = rng.randrange(1, 8)
    slots.find_cells(cells, rng.randrange(64), n, rng.random() < 0.5, 4, 1)
    slots.place_single(cells, 0, np.arange(n, dtype=np.int64), None, [[2]] * n, 4, 4, 1)
def ranges(rng):
    cells.seq_rm_range(rng.randrange(-1, 3), 0, 1 << 20)
    cells.seq_cp_range(0, 2, 0, 1 << 20)
    cells.seq_add_range(1, 0, 1 << 20, rng.choice([-2, 3]))
    cells.seq_div_range(2, 0, 1 << 20, 2)
def resize():
    rng = random.Random(7)
    for _ in range(3000):
        try:
            cells.resize(rng.choice([0, 1, 8, 64, 128]))
        except Exception as e:
            if type(e).__module__ != "kvref.errors":
                raise
ops = [set_all, set_listed, copy, bulk, place, slot, ranges]
workers = [threading.Thread(target=loop(op)) for op in ops]
resizer = threading.Thread(target=guarded(resize))
for t in workers:
    t.start()
resizer.start()
resizer.join()
stop.append(1)
for t in workers:
    t.join()
assert not errors, errors
pos = np.asarray(cells.pos)
assert cells.size() == pos.shape[0] and cells.get_used() == int((pos != -1).sum()), "the cells tore"
print("ok")
"""


def _run(script: str, twin: str) -> None:
    if twin == "c" and CELLS_C is None:
        pytest.skip("the compiled twin is not built (KVREF_BACKEND=python run)")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", script, twin], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("twin", ["py", "c"])
def test_one_kvcells_shared_by_threads(twin: str) -> None:
    _run(HAMMER, twin)


@pytest.mark.parametrize("twin", ["py", "c"])
def test_calls_racing_resize_never_touch_freed_buffers(twin: str) -> None:
    _run(RACE, twin)
