"""One KVCells shared between threads: every call is atomic in both twins (no crash, no torn state).

The hammering runs in a child process, so a regression (a segfault, as once with the Cython twin's nogil loops
racing resize) fails this test instead of killing the run."""

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


@pytest.mark.parametrize("twin", ["py", "c"])
def test_one_kvcells_shared_by_threads(twin: str) -> None:
    if twin == "c" and CELLS_C is None:
        pytest.skip("the compiled twin is not built (KVREF_BACKEND=python run)")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", HAMMER, twin], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
