"""Cell bookkeeping workloads over 32768 cells, for each twin (``python -m pytest benchmarks/bench_cells.py
--benchmark-only``). Each workload is one benchmark group, so ``py`` and ``c`` appear side by side; the
session ends with a Cython/Python ratio table (benchmarks/conftest.py).

The workloads (``python benchmarks/bench_vs_llama.py`` runs them against llama.cpp's llama_kv_cells, rows 14e-14i2):
  e  fill: pos_set(i, i // 16) + seq_add(i, i % 16) on every cell (16 sequences), bulk forms
  f  seq_rm of every cell of sequence 3 (the range op)
  g  pos_add(i, -100) on every used cell (the first 1600 cells are freed)
  h  10^5 seq_pos_max queries (bulk)
  i  cp(idxs) + set(idxs, copy) of all cells
  i2 as (i), but restoring a copy of different cells (every position + 1): set() really re-indexes
     every cell; (i) restores what is already there, which set() recognises and skips cell by cell
  j  n_kv(256) (get_n_kv's part of one stream) 10^4 times on unchanged cells; j2 after a one-cell change each time
  k  the slots twins' single_ubatch (a 1-token decode step's ubatch fields) 10^4 times
  l  the slots twins' recurrent_owned_step (a Mamba decode step of one token, whole) 10^4 times
Benchmarks never assert times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

N_CELLS = 32768
N_SEQ = 16
N_QUERIES = 100_000
POS_MAX = 2**31 - 1

IDXS = np.arange(N_CELLS, dtype=np.int64)
POSITIONS = IDXS // N_SEQ
SEQS = IDXS % N_SEQ
QUERIES = np.random.default_rng(0).integers(0, N_SEQ, N_QUERIES)

_TEMPLATES: dict[type, Any] = {}


def rounds(cls: type) -> dict[str, int]:
    """Few rounds for the Python twin (seconds per round), many for the Cython one."""
    return {"rounds": 3, "warmup_rounds": 0} if cls.__module__.endswith("_py") else {"rounds": 30, "warmup_rounds": 2}


def filled(cls: type) -> Any:
    """A fresh copy of the cells after workload (e)."""
    if cls not in _TEMPLATES:
        c = cls(N_CELLS)
        c.pos_set_many(IDXS, POSITIONS)
        c.seq_add_many(IDXS, SEQS)
        _TEMPLATES[cls] = c
    return _TEMPLATES[cls].cp(0, N_CELLS)


def _fresh_filled(twin: type, out: list[Any]) -> Callable[[], tuple[tuple, dict]]:
    """A pedantic ``setup``: a fresh filled() table every round, kept in ``out[0]`` for the checks after the run."""

    def setup() -> tuple[tuple, dict]:
        out[:] = [filled(twin)]
        return (out[0],), {}

    return setup


def test_e_fill(benchmark: Any, twin: type) -> None:
    benchmark.group = "cells-e-fill"

    def setup() -> tuple[tuple, dict]:
        return (twin(N_CELLS),), {}

    def fill(c: Any) -> None:
        c.pos_set_many(IDXS, POSITIONS)
        c.seq_add_many(IDXS, SEQS)

    benchmark.pedantic(fill, setup=setup, iterations=1, **rounds(twin))
    c = filled(twin)
    assert c.get_used() == N_CELLS and c.seq_pos_max(15) == N_CELLS // N_SEQ - 1


def test_f_seq_rm_range(benchmark: Any, twin: type) -> None:
    benchmark.group = "cells-f-seq_rm_range"
    out: list[Any] = []
    setup = _fresh_filled(twin, out)

    benchmark.pedantic(lambda c: c.seq_rm_range(3, 0, POS_MAX), setup=setup, iterations=1, **rounds(twin))
    assert out[0].seq_pos_max(3) == -1 and out[0].get_used() == N_CELLS - N_CELLS // N_SEQ


def test_g_pos_add_all(benchmark: Any, twin: type) -> None:
    benchmark.group = "cells-g-pos_add_all"
    out: list[Any] = []

    def setup() -> tuple[tuple, dict]:
        c = filled(twin)
        out[:] = [c]
        return (c, c.used_cells()), {}

    benchmark.pedantic(lambda c, used: c.pos_add_many(used, -100), setup=setup, iterations=1, **rounds(twin))
    assert out[0].get_used() == N_CELLS - 100 * N_SEQ and out[0].seq_pos_min(0) == 0


def test_h_seq_pos_max_queries(benchmark: Any, twin: type) -> None:
    benchmark.group = "cells-h-seq_pos_max_1e5"
    c = filled(twin)
    res = benchmark.pedantic(c.seq_pos_max_many, args=(QUERIES,), iterations=1, **rounds(twin))
    assert res.shape == (N_QUERIES,) and (res == N_CELLS // N_SEQ - 1).all()


def test_i_cp_set_all(benchmark: Any, twin: type) -> None:
    benchmark.group = "cells-i-cp_set_all"
    out: list[Any] = []
    setup = _fresh_filled(twin, out)

    def cp_set(c: Any) -> None:
        c.set(IDXS, c.cp(IDXS))

    benchmark.pedantic(cp_set, setup=setup, iterations=1, **rounds(twin))
    assert out[0].get_used() == N_CELLS and out[0].seq_pos_get(7)[:2] == [(0, 7), (1, 23)]


def test_i2_cp_set_changed(benchmark: Any, twin: type) -> None:
    benchmark.group = "cells-i2-cp_set_changed"
    other = twin(N_CELLS)
    other.pos_set_many(IDXS, POSITIONS + 1)
    other.seq_add_many(IDXS, SEQS)
    saved = other.cp(IDXS)
    out: list[Any] = []
    setup = _fresh_filled(twin, out)

    def cp_set(c: Any) -> None:
        c.cp(IDXS)
        c.set(IDXS, saved)

    benchmark.pedantic(cp_set, setup=setup, iterations=1, **rounds(twin))
    assert out[0].seq_pos_get(7)[:2] == [(1, 7), (2, 23)]


def test_j_n_kv(benchmark: Any, twin: type) -> None:
    """get_n_kv's part of one stream (``n_kv(256)``) 10^4 times on unchanged cells (the Python twin keeps its answer
    until a call changes the cells)."""
    benchmark.group = "cells-j-n_kv_1e4"
    c = filled(twin)

    def many() -> int:
        n = 0
        for _ in range(10_000):
            n = c.n_kv(256)
        return n

    assert benchmark.pedantic(many, iterations=1, **rounds(twin)) == N_CELLS


def test_j2_n_kv_after_a_change(benchmark: Any, twin: type) -> None:
    """``n_kv(256)`` after a one-cell change each time (a decode step between two asks), 10^3 times."""
    benchmark.group = "cells-j2-n_kv_changed_1e3"
    c = filled(twin)
    last = N_CELLS - 1

    def many() -> int:
        n = 0
        for k in range(1000):
            c.pos_add(last, 1 - 2 * (k & 1))
            n = c.n_kv(256)
        return n

    assert benchmark.pedantic(many, iterations=1, **rounds(twin)) == N_CELLS


def test_k_single_ubatch(benchmark: Any, twin: type) -> None:
    """The slots twin's ``single_ubatch`` (a decode step's ubatch fields, 1 token) 10^4 times; the twin of the
    slots kernels that goes with the cells twin."""
    from kvref._backend import _load_compiled
    from kvref.memory import _slots_py

    slots = _slots_py if twin.__module__.endswith("_py") else _load_compiled("memory.slots")
    benchmark.group = "cells-k-slots_single_ubatch_1e4"  # the cells- table lists it
    one = np.zeros(1, np.int32)

    def many() -> None:
        for _ in range(10_000):
            slots.single_ubatch(one, one, one, None)

    benchmark.pedantic(many, iterations=1, **rounds(twin))


def test_l_recurrent_owned_step(benchmark: Any, twin: type) -> None:
    """The slots twin's ``recurrent_owned_step`` (a recurrent memory's whole 1-token step of a sequence owning its
    state) 10^4 times, on a Mamba memory of one sequence."""
    import kvref
    from kvref._backend import _load_compiled
    from kvref.memory import _slots_py

    slots = _slots_py if twin.__module__.endswith("_py") else _load_compiled("memory.slots")
    benchmark.group = "cells-l-slots_recurrent_owned_step_1e4"
    hp = kvref.HParams(arch="mamba", n_layer=1, n_embd=8, n_head=0, n_head_kv=0, recurrent_layers=True,
                       rope_type=kvref.RopeType.NONE, ssm_d_conv=2, ssm_d_inner=4, ssm_d_state=2)  # fmt: skip
    mem = kvref.RecurrentMemory(hp, rs_size=1, n_seq_max=1)
    mem.decode(kvref.Batch(tokens=[1, 2]))
    tok = np.zeros(1, np.int64)
    seq_ids = [[0]]

    def many() -> None:
        for _ in range(10_000):
            if slots.recurrent_owned_step(mem, tok, None, seq_ids, None, 1) is None:
                raise AssertionError("the step was declined")

    benchmark.pedantic(many, iterations=1, **rounds(twin))
