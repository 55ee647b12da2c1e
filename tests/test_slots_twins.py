"""The slots twins agree: find_cells and used_targets of ``_slots_py`` and ``_slots_c`` give the same cells and the
same errors on random caches, and both equal an independent oracle of find_slot's search (the whole-stream
vectorised search kvref used before the twins, written from llama_kv_cache::find_slot).

End to end, random decode sequences through ``kvref.slots`` with either twin plugged in place identical slots
(idxs per stream), leave identical cells and raise identical errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import CELLS_C, NOT_BUILT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvref
from kvref import _cells_py, _slots_py, slots
from kvref._backend import _load_compiled
from kvref.errors import KVRefError
from kvref.hparams import is_masked_swa

SLOTS_C = _load_compiled("slots")
EXAMPLES = int(os.environ.get("KVREF_HYPOTHESIS_EXAMPLES", "200"))
CELL_CLASSES = [_cells_py.KVCells] + ([CELLS_C.KVCells] if CELLS_C is not None else [])


def twins() -> list:
    if SLOTS_C is None:
        pytest.skip(NOT_BUILT)
    return [_slots_py, SLOTS_C]


def outcome(f):
    try:
        return ("ok", f())
    except KVRefError as e:
        return (type(e).__name__, str(e))


# ------------------------------------------------------------------------------------------ the oracle
def oracle_usable(cells, n_swa: int, swa_type: int) -> np.ndarray:
    pos = np.asarray(cells.pos, dtype=np.int64)
    usable = pos == -1
    if swa_type == 0 or (swa_type == 2 and n_swa == 0):
        return usable
    for i in np.flatnonzero(~usable).tolist():
        seqs = cells.seq_get_all(i)
        if len(seqs) == 1:
            usable[i] = bool(is_masked_swa(n_swa, swa_type, int(pos[i]), cells.seq_pos_max(seqs[0]) + 1))
    return usable


def oracle_find(cells, head: int, n_tokens: int, cont: bool, n_swa: int, swa_type: int) -> list[int] | None:
    size = cells.size()
    if head > cells.get_used() + 2 * n_tokens:
        head = 0
    if n_tokens > size:
        return None
    usable = oracle_usable(cells, n_swa, swa_type)
    if not cont:
        order = np.concatenate([np.arange(head, size), np.arange(0, head)])
        found = order[usable[order]]
        return found[:n_tokens].tolist() if found.size >= n_tokens else None
    n_tested = 0
    while True:
        if head + n_tokens > size:
            n_tested += size - head
            head = 0
            continue
        bad = np.flatnonzero(~usable[head : head + n_tokens])
        if bad.size == 0:
            return list(range(head, head + n_tokens))
        head += int(bad[0]) + 1
        n_tested += int(bad[0]) + 1
        if n_tested >= size:
            return None


# ------------------------------------------------------------------------------------------ random caches
SEQ_IDS = [0, 1, 2, 3, 63, 64, 130, 255]


@st.composite
def cache_cells(draw):
    size = draw(st.integers(1, 40))
    cells = []
    for _ in range(size):
        if draw(st.integers(0, 2)) == 0:
            cells.append(None)
        else:
            seqs = draw(st.lists(st.sampled_from(SEQ_IDS), min_size=0, max_size=3, unique=True))
            cells.append((draw(st.integers(0, 30)), seqs))
    return cells


def build(cls, spec):
    c = cls(len(spec))
    for i, cell in enumerate(spec):
        if cell is not None:
            c.pos_set(i, cell[0])
            for s in cell[1]:
                c.seq_add(i, s)
    return c


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=cache_cells(),
    head=st.integers(0, 45),
    n_tokens=st.integers(0, 42),
    cont=st.booleans(),
    swa_type=st.integers(0, 3),
    n_swa=st.sampled_from([0, 1, 2, 3, 4, 7, 16, 2**33, -3]),
)
def test_find_cells_twins_match_the_oracle(spec, head, n_tokens, cont, swa_type, n_swa) -> None:
    mods = twins()
    for cls in CELL_CLASSES:
        cells = build(cls, spec)
        head_ = min(head, cells.size())
        want = None if n_tokens == 0 else oracle_find(cells, head_, n_tokens, cont, n_swa, swa_type)
        if n_tokens == 0:
            want = []  # kvref's rule for an empty ubatch
        for mod in mods:
            assert mod.find_cells(cells, head, n_tokens, cont, n_swa, swa_type) == want, (mod.__name__, cls)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=cache_cells(), data=st.data())
def test_used_targets_twins_agree(spec, data) -> None:
    mods = twins()
    n = len(spec)
    idxs = data.draw(st.lists(st.integers(-2, n + 1), min_size=0, max_size=n + 2))
    size = data.draw(st.sampled_from([len(idxs), len(set(idxs)), max(len(idxs) - 1, 0)]))
    if data.draw(st.booleans()):
        idxs = [np.int64(i) for i in idxs]
    for cls in CELL_CLASSES:
        cells = build(cls, spec)
        results = [outcome(lambda mod=mod, cells=cells: mod.used_targets(cells, list(idxs), size)) for mod in mods]
        assert results[0] == results[1], (cls, results)


# ------------------------------------------------------------------------------------------ end to end
@st.composite
def decode_script(draw):
    n_seq = draw(st.integers(1, 3))
    unified = draw(st.booleans())
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["decode", "decode", "decode", "seq_rm"]))
        seq = draw(st.integers(0, n_seq - 1))
        steps.append((kind, seq, draw(st.integers(1, 9))))
    return n_seq, unified, steps


def run_script(mod, n_seq, unified, steps, swa_type, n_swa, size, n_ubatch):
    hp = kvref.HParams(arch="llama", n_layer=1, n_embd=4, n_head=1, n_ctx_train=1 << 16)
    cache = kvref.KVCache(
        hp, kv_size=size, n_seq_max=n_seq, kv_unified=unified, n_swa=n_swa, swa_type=swa_type, type_k="f32",
        type_v="f32",
    )  # fmt: skip
    saved = slots._impl
    slots._impl = mod
    log = []
    try:
        for kind, seq, n in steps:
            if kind == "seq_rm":
                p = cache.seq_pos_max(seq)
                log.append(outcome(lambda seq=seq, p=p, n=n: cache.seq_rm(seq, max(p - n, 0), -1)))
                continue
            p0 = cache.seq_pos_max(seq) + 1
            batch = kvref.Batch(tokens=[1] * n, pos=list(range(p0, p0 + n)), seq_ids=[[seq]] * n)
            placed = outcome(lambda batch=batch: cache.decode(batch, n_ubatch=n_ubatch))
            if placed[0] == "ok":
                placed = ("ok", [(list(s.strm), [list(x) for x in s.idxs]) for _, s in placed[1]])
            log.append(placed)
        for s in range(cache.n_stream):
            c = cache.cells(s)
            log.append((np.asarray(c.pos).tolist(), np.asarray(c.seq).tolist(), np.asarray(c.ext).tolist()))
        log.append(list(cache.heads))
    finally:
        slots._impl = saved
    return log


@settings(max_examples=max(20, EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=decode_script(),
    swa_type=st.integers(0, 3),
    n_swa=st.integers(1, 6),
    size=st.sampled_from([8, 16, 24]),
    n_ubatch=st.integers(1, 8),
)
def test_decode_places_the_same_slots_with_either_twin(script, swa_type, n_swa, size, n_ubatch) -> None:
    mods = twins()
    n_seq, unified, steps = script
    logs = [run_script(mod, n_seq, unified, steps, swa_type, n_swa, size, n_ubatch) for mod in mods]
    assert logs[0] == logs[1]


def test_selected_twin_matches_the_backend() -> None:
    assert kvref.backend() == slots.BACKEND
    assert slots._impl.__name__ == ("kvref._slots_c" if kvref.backend() == "cython" else "kvref._slots_py")


def test_a_decode_step_tests_few_cells_in_a_large_cache() -> None:
    """The walk stops at the head's first free cells: a 1-token step never looks at the whole cache."""
    seen: list[int] = []

    class Spy(_slots_py.Usable):
        def can_use(self, lo: int, hi: int) -> np.ndarray:
            seen.append(hi - lo)
            return super().can_use(lo, hi)

    cells = _cells_py.KVCells(1 << 16)
    n = (1 << 16) - 100
    cells.pos_set_many(np.arange(n), np.arange(n))
    cells.seq_add_many(np.arange(n), 0)
    saved = _slots_py.Usable
    _slots_py.Usable = Spy  # type: ignore[misc]
    try:
        assert _slots_py.find_cells(cells, n, 1, False, 0, 0) == [n]
    finally:
        _slots_py.Usable = saved
    assert sum(seen) <= 256
