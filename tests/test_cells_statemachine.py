"""Cross-check of the cell twins: one random operation sequence drives a Python and a Cython KVCells.

After every step the complete state of the two must be equal (arrays, used set, per-sequence index of
all 256 sequences, has_shift), and the Python twin's derived state must match what its arrays imply.
Every operation returns the same value (same type) on both, or raises the same error class on both and
leaves both unchanged.

Defaults are modest (KVREF_HYPOTHESIS_EXAMPLES=50 examples x KVREF_HYPOTHESIS_STEPS=50 steps); the
``slow`` campaign runs at least 10^4 steps (``pytest -m slow tests/test_cells_statemachine.py -s``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from conftest import CELLS_C, NOT_BUILT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvref.errors import KVRefError
from kvref.memory import _cells_py

if CELLS_C is None:  # only in a KVREF_BACKEND=python run without a build (see conftest.pytest_configure)
    pytest.skip(NOT_BUILT, allow_module_level=True)

PyCells = _cells_py.KVCells
CCells = CELLS_C.KVCells

POS_MAX = 2**31 - 1
# what the runs covered (printed by the campaign): steps, operations, operations that raised, sequences
STATS: dict[str, Any] = {"steps": 0, "ops": 0, "errors": 0, "seqs": set()}

# ------------------------------------------------------------------ strategies
seq_ids = st.one_of(
    st.integers(0, 5),  # a few sequences share cells often
    st.integers(0, 5),
    st.integers(0, 255),
    st.sampled_from([0, 63, 64, 127, 128, 191, 192, 255]),  # word boundaries of the bitset
    st.sampled_from([-2, -1, 256, 2**40, -(2**70)]),  # rejected
)
valid_seq_ids = st.one_of(st.integers(0, 5), st.integers(0, 255))
positions = st.one_of(
    st.integers(0, 40),
    st.integers(0, POS_MAX),
    st.sampled_from([0, POS_MAX - 1, POS_MAX]),
    st.sampled_from([-1, -5, POS_MAX + 1, 2**70]),  # rejected by pos_set
)
bounds = st.one_of(
    st.integers(-3, 45),
    st.sampled_from([-1, 0, POS_MAX, POS_MAX + 1, -(2**31), 2**70, -(2**70)]),
)
deltas = st.one_of(
    st.integers(-45, 45),
    st.integers(-(2**31), POS_MAX),
    st.sampled_from([0, -(2**31), POS_MAX, POS_MAX + 1, -(2**31) - 1, 2**70]),
)
divisors = st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 2**31, 2**70]))
ext_values = st.one_of(st.integers(-3, 100), st.sampled_from([-(2**31), POS_MAX, POS_MAX + 1, -(2**31) - 1]))
sizes = st.sampled_from([0, 1, 3, 17, 40, 40, 40, 40, 64])


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types (arrays: same dtype and shape)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


QUERIES = frozenset(
    {
        "is_empty",
        "seq_count",
        "seq_get_all",
        "seq_has",
        "seq_get",
        "pos_get",
        "ext_get",
        "get_shift",
        "pos_in",
        "seq_pos_min",
        "seq_pos_max",
        "seq_pos_get",
        "seq_pos_tok_le",
        "seq_pos_min_many",
        "seq_pos_max_many",
    }
)


_N_PADS = (1, 3, 256, 2**40, 2**70)  # n_kv's padding: none, odd, llama.cpp's, beyond the cells, beyond int64


def full_state(c: Any) -> dict[str, Any]:
    """Everything observable about a KVCells instance.

    seq_pos_get is listed for the sequences whose min is not -1; for the others min = max = -1 already
    says the index is empty (and assert_consistent checks that against the arrays).
    """
    pos_min = c.seq_pos_min_many(np.arange(256))
    return {
        "size": c.size(),
        "pos": c.pos.copy(),
        "shift": c.shift.copy(),
        "ext": c.ext.copy(),
        "seq": c.seq.copy(),
        "used_cells": c.used_cells(),
        "get_used": c.get_used(),
        "used_min": c.used_min(),
        "used_max_p1": c.used_max_p1(),
        "n_kv": [c.n_kv(p) for p in _N_PADS],
        "has_shift": c.get_has_shift(),
        "pos_min": pos_min,
        "pos_max": c.seq_pos_max_many(np.arange(256)),
        "seq_pos": {int(s): c.seq_pos_get(int(s)) for s in np.flatnonzero(pos_min != -1)},
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for key in a:
        assert _same(a[key], b[key]), f"{what}: {key} differs:\n{a[key]!r}\n{b[key]!r}"


def assert_consistent(st_: dict[str, Any]) -> None:
    """The derived state (used set, per-sequence index) is what the arrays say."""
    pos, seq = st_["pos"], st_["seq"]
    used = np.flatnonzero(pos != -1)
    assert st_["used_cells"].tolist() == used.tolist()
    assert st_["get_used"] == used.size
    assert st_["used_min"] == (int(used[0]) if used.size else 0)
    assert st_["used_max_p1"] == (int(used[-1]) + 1 if used.size else 0)
    hi, n = st_["used_max_p1"], pos.shape[0]
    assert st_["n_kv"] == [min(max(-(-hi // p) * p, p), n) for p in _N_PADS]
    empty = pos == -1
    assert not seq[empty].any(), "an empty cell holds sequences"
    assert not st_["shift"][empty].any(), "an empty cell has a shift"
    # bits[i, s]: cell i holds sequence s (the words are little-endian uint64, bit s & 63 of word s >> 6)
    bits = np.unpackbits(seq.astype("<u8").view(np.uint8).reshape(-1, 32), axis=1, bitorder="little").astype(bool)
    present = np.flatnonzero(bits.any(axis=0))
    assert sorted(st_["seq_pos"]) == present.tolist(), "the sequences with an index are not those in the cells"
    for s in present:
        cells = np.flatnonzero(bits[:, s])
        expected = sorted(zip(pos[cells].tolist(), cells.tolist(), strict=True))
        assert st_["seq_pos"][s] == expected, f"sequence {s}: index out of step with the arrays"
        assert st_["pos_min"][s] == expected[0][0] and st_["pos_max"][s] == expected[-1][0]
    absent = np.ones(256, dtype=bool)
    absent[present] = False
    assert (st_["pos_min"][absent] == -1).all() and (st_["pos_max"][absent] == -1).all()


class CellsTwins(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.py = PyCells(0)
        self.c = CCells(0)
        self.copies: list[tuple[Any, Any]] = []  # (py copy, c copy) of earlier cp() calls

    # ------------------------------------------------------------------ plumbing
    @property
    def n(self) -> int:
        return self.py.size()

    def both(self, name: str, *args: Any, py_args: tuple | None = None, c_args: tuple | None = None) -> Any:
        """Call ``name`` on both twins; same result or same error class, and nothing changed on error."""
        STATS["ops"] += 1
        before = None if name in QUERIES else full_state(self.py)
        out = []
        for cells, a in ((self.py, py_args or args), (self.c, c_args or args)):
            try:
                out.append(("ok", getattr(cells, name)(*a)))
            except (KVRefError, ValueError, TypeError, OverflowError) as exc:
                out.append(("err", type(exc)))
        (kp, vp), (kc, vc) = out
        assert kp == kc, f"{name}{args}: py {kp} {vp!r}, c {kc} {vc!r}"
        if kp == "err":
            STATS["errors"] += 1
            assert vp is vc, f"{name}{args}: py raised {vp.__name__}, c raised {vc.__name__}"
            if before is not None:
                assert_same_state(before, full_state(self.py), f"py changed by failed {name}")
            return None
        if name not in ("cp",):
            assert _same(vp, vc), f"{name}{args}: py returned {vp!r}, c returned {vc!r}"
        return vp, vc

    def index(self, data: st.DataObject, used: bool = False) -> int:
        """Mostly a valid index (a used cell when asked and there is one), sometimes an invalid one."""
        choices = self.py.used_cells().tolist() if used else []
        strategies = [st.sampled_from([-1, self.n, self.n + 1, 2**40, -(2**70)])]
        if self.n:
            strategies += [st.integers(0, self.n - 1)] * 4
        if choices:
            strategies += [st.sampled_from(choices)] * 8
        return data.draw(st.one_of(strategies), label="i")

    def empty_cells(self) -> list[int]:
        return np.flatnonzero(self.py.pos == -1).tolist()

    # ------------------------------------------------------------------ whole-array state
    @initialize(n=sizes)
    def start(self, n: int) -> None:
        self.both("resize", n)

    @rule(n=sizes, go=st.integers(0, 9))
    def resize(self, n: int, go: int) -> None:
        if go == 7:  # rare: it wipes everything
            self.both("resize", n)

    @rule(go=st.integers(0, 9))
    def reset(self, go: int) -> None:
        if go == 7:
            self.both("reset")

    @rule()
    def reset_shift(self) -> None:
        self.both("reset_shift")

    # ------------------------------------------------------------------ filling
    @rule(data=st.data(), k=st.integers(1, 12), seqs=st.lists(valid_seq_ids, min_size=1, max_size=12))
    def fill(self, data: st.DataObject, k: int, seqs: list[int]) -> None:
        """pos_set_many then seq_add_many on empty cells: the way a ubatch lands."""
        free = self.empty_cells()
        if not free:
            return
        idxs = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=min(k, len(free)), unique=True))
        base = data.draw(st.integers(0, 30))
        pos = [base + j // 2 for j in range(len(idxs))]  # repeated positions happen (vision models)
        self.both("pos_set_many", np.asarray(idxs), pos)
        s = [seqs[j % len(seqs)] for j in range(len(idxs))]
        scalar = data.draw(st.booleans())
        self.both("seq_add_many", idxs, s[0] if scalar else s)
        STATS["seqs"].update(s[:1] if scalar else s)

    @rule(data=st.data(), start=st.integers(0, 255), step=st.integers(0, 127), k=st.integers(1, 256))
    def many_seqs(self, data: st.DataObject, start: int, step: int, k: int) -> None:
        """One used cell joins up to 256 sequences at once (start, start + step, ... with an odd step)."""
        used = self.py.used_cells().tolist()
        if not used:
            return
        i = data.draw(st.sampled_from(used))
        seqs = sorted({(start + j * (2 * step + 1)) % 256 for j in range(k)} - set(self.py.seq_get_all(i)))
        self.both("seq_add_many", [i] * len(seqs), seqs)
        STATS["seqs"].update(seqs)

    @rule(data=st.data(), p=positions)
    def pos_set(self, data: st.DataObject, p: int) -> None:
        self.both("pos_set", self.index(data), p)

    @rule(data=st.data(), s=seq_ids)
    def seq_add(self, data: st.DataObject, s: int) -> None:
        if self.both("seq_add", self.index(data, used=True), s) is not None:
            STATS["seqs"].add(s)

    @rule(data=st.data())
    def pos_set_many_any(self, data: st.DataObject) -> None:
        """pos_set_many with arbitrary (often invalid) arguments: duplicates, used cells, bad positions."""
        k = data.draw(st.integers(0, 6))
        idxs = [self.index(data) for _ in range(k)]
        pos = data.draw(st.lists(positions, min_size=k, max_size=k + data.draw(st.sampled_from([0, 0, 0, 1]))))
        self.both("pos_set_many", idxs, pos)

    @rule(data=st.data())
    def seq_add_many_any(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(0, 6))
        idxs = [self.index(data, used=True) for _ in range(k)]
        seqs = data.draw(st.lists(seq_ids, min_size=k, max_size=k))
        self.both("seq_add_many", idxs, seqs)

    # ------------------------------------------------------------------ per-cell changes
    @rule(data=st.data())
    def rm(self, data: st.DataObject) -> None:
        self.both("rm", self.index(data, used=True))

    @rule(data=st.data(), s=seq_ids)
    def seq_rm(self, data: st.DataObject, s: int) -> None:
        i = self.index(data, used=True)
        if data.draw(st.booleans()) and 0 <= i < self.n and self.py.seq_get_all(i):
            s = data.draw(st.sampled_from(self.py.seq_get_all(i)))  # mostly a sequence the cell holds
        self.both("seq_rm", i, s)

    @rule(data=st.data(), s=seq_ids)
    def seq_keep(self, data: st.DataObject, s: int) -> None:
        self.both("seq_keep", self.index(data, used=True), s)

    @rule(data=st.data(), x=ext_values, y=ext_values, tok=ext_values)
    def ext_set(self, data: st.DataObject, x: int, y: int, tok: int) -> None:
        self.both("ext_set", self.index(data), x, y, tok)

    @rule(data=st.data())
    def ext_set_many(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(0, 4))
        idxs = [self.index(data) for _ in range(k)]
        vals = [data.draw(st.one_of(ext_values, st.lists(ext_values, min_size=k, max_size=k))) for _ in range(3)]
        self.both("ext_set_many", idxs, *vals)

    @rule(data=st.data(), check=st.booleans(), with_ext=st.booleans())
    def place(self, data: st.DataObject, check: bool, with_ext: bool) -> None:
        empty = self.empty_cells()
        k = data.draw(st.integers(0, min(6, len(empty)) if empty else 3))
        if empty and data.draw(st.integers(0, 3)):
            idxs = data.draw(st.lists(st.sampled_from(empty), unique=True, min_size=k, max_size=k))
        else:
            idxs = [self.index(data) for _ in range(k)]
        pos = data.draw(st.lists(positions, min_size=k, max_size=k))
        seqs = data.draw(st.lists(seq_ids, min_size=k, max_size=k))
        ext = None
        if with_ext:
            one = st.one_of(ext_values, st.lists(ext_values, min_size=k, max_size=k))
            ext = tuple(data.draw(one) for _ in range(3))
        before = full_state(self.py)
        res = self.both("place", idxs, pos, seqs, ext, check)
        if res is not None and (check or not res[0]):
            assert_same_state(before, full_state(self.py), "place changed the cells without placing")

    @rule(data=st.data(), d=deltas)
    def pos_add(self, data: st.DataObject, d: int) -> None:
        self.both("pos_add", self.index(data, used=True), d)

    @rule(data=st.data(), d=divisors)
    def pos_div(self, data: st.DataObject, d: int) -> None:
        self.both("pos_div", self.index(data, used=True), d)

    @rule(data=st.data(), d=deltas)
    def pos_add_many(self, data: st.DataObject, d: int) -> None:
        used = self.py.used_cells().tolist()
        if used and data.draw(st.booleans()):
            idxs = data.draw(st.lists(st.sampled_from(used), unique=True, max_size=len(used)))
        else:
            idxs = [self.index(data, used=True) for _ in range(data.draw(st.integers(0, 4)))]
        self.both("pos_add_many", idxs, d)

    # ------------------------------------------------------------------ queries
    @rule(data=st.data(), s=seq_ids, p0=bounds, p1=bounds)
    def queries(self, data: st.DataObject, s: int, p0: int, p1: int) -> None:
        i = self.index(data, used=True)
        for name, args in (
            ("is_empty", (i,)),
            ("seq_count", (i,)),
            ("seq_get_all", (i,)),
            ("seq_has", (i, s)),
            ("seq_get", (i,)),
            ("pos_get", (i,)),
            ("ext_get", (i,)),
            ("get_shift", (i,)),
            ("pos_in", (i, p0, p1)),
            ("seq_pos_min", (s,)),
            ("seq_pos_max", (s,)),
            ("seq_pos_get", (s,)),
            ("seq_pos_tok_le", (s, p0)),
            ("seq_pos_min_many", ([s, 0, 255],)),
            ("seq_pos_max_many", (np.array([255, s], dtype=object),)),
        ):
            self.both(name, *args)

    # ------------------------------------------------------------------ copies
    @rule(data=st.data())
    def cp(self, data: st.DataObject) -> None:
        if data.draw(st.booleans()):
            i = data.draw(st.integers(-1, self.n))
            k = data.draw(st.integers(-1, self.n + 1))
            args: tuple = (i, k)
        else:
            args = ([self.index(data, used=True) for _ in range(data.draw(st.integers(0, 6)))],)
        res = self.both("cp", *args)
        if res is not None:
            cp_py, cp_c = res
            assert type(cp_py) is PyCells and type(cp_c) is CCells
            assert_same_state(full_state(cp_py), full_state(cp_c), f"cp{args}")
            assert_consistent(full_state(cp_c))
            self.copies.append((cp_py, cp_c))

    @rule(data=st.data())
    @precondition(lambda self: self.copies)
    def set(self, data: st.DataObject) -> None:
        cp_py, cp_c = data.draw(st.sampled_from(self.copies))
        k = cp_py.size()
        if data.draw(st.booleans()):
            target: Any = data.draw(st.integers(-1, max(self.n - k + 1, 0)))
        else:
            target = [self.index(data) for _ in range(k + data.draw(st.sampled_from([0, 0, 0, 1])))]
        if data.draw(st.booleans()):  # each twin restores from the other twin's copy
            self.both("set", target, py_args=(target, cp_c), c_args=(target, cp_py))
        else:
            self.both("set", target, py_args=(target, cp_py), c_args=(target, cp_c))

    @rule(data=st.data())
    def round_trip(self, data: st.DataObject) -> None:
        """cp, change, set back: the cells are exactly as before (prepare()'s rollback)."""
        used = self.py.used_cells().tolist()
        if not used or self.py.get_has_shift():
            return
        idxs = data.draw(st.lists(st.sampled_from(used), min_size=1, max_size=8, unique=True))
        before = full_state(self.py)
        res = self.both("cp", idxs)
        if res is None:
            return
        cp_py, cp_c = res
        for i in idxs:
            self.both("seq_keep", i, data.draw(valid_seq_ids))
        self.both("set", idxs, py_args=(idxs, cp_c), c_args=(idxs, cp_py))
        assert_same_state(before, full_state(self.py), "round trip")

    # ------------------------------------------------------------------ range operations
    @rule(s=st.one_of(seq_ids, st.just(-1)), p0=bounds, p1=bounds)
    def seq_rm_range(self, s: int, p0: int, p1: int) -> None:
        self.both("seq_rm_range", s, p0, p1)

    @rule(src=seq_ids, dst=seq_ids, p0=bounds, p1=bounds)
    def seq_cp_range(self, src: int, dst: int, p0: int, p1: int) -> None:
        if self.both("seq_cp_range", src, dst, p0, p1) is not None:
            STATS["seqs"].add(dst)

    @rule(s=seq_ids, go=st.integers(0, 3))
    def seq_keep_all(self, s: int, go: int) -> None:
        if go == 3:  # it drops every other sequence: not too often
            self.both("seq_keep_all", s)

    @rule(s=seq_ids, p0=bounds, p1=bounds, d=deltas)
    def seq_add_range(self, s: int, p0: int, p1: int, d: int) -> None:
        self.both("seq_add_range", s, p0, p1, d)

    @rule(s=seq_ids, p0=bounds, p1=bounds, d=divisors)
    def seq_div_range(self, s: int, p0: int, p1: int, d: int) -> None:
        self.both("seq_div_range", s, p0, p1, d)

    # ------------------------------------------------------------------ after every step
    @invariant()
    def twins_agree(self) -> None:
        STATS["steps"] += 1
        a, b = full_state(self.py), full_state(self.c)
        assert_same_state(a, b, "py vs c")
        assert_consistent(a)


def _settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )


_EXAMPLES = int(os.environ.get("KVREF_HYPOTHESIS_EXAMPLES", "50"))
_STEPS = int(os.environ.get("KVREF_HYPOTHESIS_STEPS", "50"))

TestCellsTwins = CellsTwins.TestCase
TestCellsTwins.settings = _settings(_EXAMPLES, _STEPS)


@pytest.mark.slow
def test_cells_twins_campaign() -> None:
    """At least 10^4 operations through both twins (more with KVREF_HYPOTHESIS_STEPS / _EXAMPLES)."""
    target = max(10_000, _STEPS * _EXAMPLES)
    STATS.update(steps=0, ops=0, errors=0, seqs=set())
    runs = 0
    while STATS["steps"] < target:
        runs += 1
        run_state_machine_as_test(CellsTwins, settings=_settings(max(_EXAMPLES, 200), max(_STEPS, 100)))
    print(
        f"\ncampaign: {runs} run(s), {STATS['steps']} steps, {STATS['ops']} operations on both twins "
        f"({STATS['errors']} raised the same error on both), {len(STATS['seqs'])} distinct sequences used"
    )
    assert len(STATS["seqs"]) >= 200


# ------------------------------------------------------------------ large shifts, cross-checked
# The state machine's cells are small; shifts over many cells of one sequence take another path in the
# Cython twin (one ordered walk of the sequence's index, in place or rebuilt when the order changes),
# so drive that with hundreds of cells: uniform shifts, shifts that cross unmoved cells, divisions that
# reorder ties, cells freed by going negative, cells in several sequences.
shift_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add_range"), st.integers(0, 3), bounds, bounds, st.integers(-70, 70)),
        st.tuples(st.just("div_range"), st.integers(0, 3), bounds, bounds, st.integers(1, 5)),
        st.tuples(st.just("add_many"), st.integers(0, 3), st.floats(0, 1), st.just(0), st.integers(-70, 70)),
        st.tuples(st.just("rm_range"), st.integers(-1, 3), bounds, bounds, st.just(0)),
        st.tuples(st.just("reset_shift"), st.just(0), st.just(0), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(16, 400),
    seed=st.integers(0, 2**32 - 1),
    ops=shift_ops,
)
def test_large_shifts_match(n: int, seed: int, ops: list[tuple]) -> None:
    rng = np.random.default_rng(seed)
    used = np.flatnonzero(rng.random(n) < rng.uniform(0.3, 1.0))
    pos = rng.integers(0, rng.integers(1, 80), used.size)
    cells = [PyCells(n), CCells(n)]
    for c in cells:
        c.pos_set_many(used, pos)
    for s in range(4):
        holders = used[rng.random(used.size) < rng.uniform(0.2, 1.0)]
        for c in cells:
            c.seq_add_many(holders, s)
    extra = used[rng.random(used.size) < 0.1]
    for c in cells:
        c.seq_add_many(extra, 200)
    for kind, s, a, b, d in ops:
        if kind == "add_many":
            members = np.flatnonzero(cells[0].seq[:, 0] & np.uint64(1 << s))
            idxs = members[rng.random(members.size) < max(a, 0.5)]
            rng.shuffle(idxs)
            results = [c.pos_add_many(idxs, d) for c in cells]
        elif kind == "add_range":
            results = [c.seq_add_range(s, a, b, d) for c in cells]
        elif kind == "div_range":
            results = [c.seq_div_range(s, a, b, d) for c in cells]
        elif kind == "rm_range":
            results = [c.seq_rm_range(s, a, b) for c in cells]
        else:
            results = [c.reset_shift() for c in cells]
        assert _same(results[0], results[1]), (kind, s, a, b, d)
        st_py = full_state(cells[0])
        assert_same_state(st_py, full_state(cells[1]), f"after {kind}")
        assert_consistent(st_py)
