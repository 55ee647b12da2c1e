"""The decode step's fast paths change no answer.

- ``BatchAllocr.init`` checks the common batch (one sequence id per token) in one pass (``_init_single``, over the
  slots twins' kernels) and falls back to its general path for anything else: with the fast path or forced onto
  the general path, the allocator ends in the same state (every public field), splits the same ubatches and
  raises the same errors, with the same messages.
- ``Batch`` copies plain-int sequence ids at C speed: the same lists, or the same error, as its general check.
- ``prepare`` only checks the last ubatch when its apply would fill empty cells (the restore would undo it):
  with or without that shortcut, decode and prepare leave the same cells and heads and raise the same errors.
- ``KVCache.decode`` does the common step of a one-stream cache in one kernel call (``place_single``): with it or
  forced onto ``decode_batch``, every step returns the same ubatches and slots (or raises the same error) and leaves
  the same cells, heads and K/V rows.
- ``apply_ubatch`` writes one-sequence tokens into empty cells with ``KVCells.place`` (all-or-nothing, else the
  writes one kind at a time): ``place`` is exactly ``pos_set_many`` + ``ext_set_many`` + ``seq_add_many``.

Each runs against both slots twins (the kernels) and both cell twins.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
from conftest import CELLS_C, NOT_BUILT
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvref
from kvref._backend import _load_compiled
from kvref.errors import KVRefError
from kvref.memory import _cells_py, _slots_py, slot_kernels, slots
from kvref.memory.batch import Batch, BatchAllocr, UBatch

SLOTS_C = _load_compiled("memory.slots")
EXAMPLES = int(os.environ.get("KVREF_HYPOTHESIS_EXAMPLES", "200"))


@pytest.fixture(params=["py", "c"])
def kernels(request: pytest.FixtureRequest) -> Any:
    """Plug one slots twin in as the kernels of kvref.memory.slots, batch and kv_cache for the test."""
    mod = _slots_py if request.param == "py" else SLOTS_C
    if mod is None:
        pytest.skip(NOT_BUILT)
    saved = slot_kernels.impl
    slot_kernels.impl = mod
    yield mod
    slot_kernels.impl = saved


def outcome(f: Any) -> tuple:
    try:
        return ("ok", f())
    except KVRefError as exc:
        return (type(exc).__name__, str(exc))


def seq_op(mem: Any, kind: str, a: int, b: int, p: int) -> object:
    """The outcome of one of the replays' sequence operations on ``mem``."""
    ops = {
        "seq_rm": lambda: mem.seq_rm(a, p, -1),
        "seq_cp": lambda: mem.seq_cp(a, b, -1, -1),
        "seq_keep": lambda: mem.seq_keep(a),
        "seq_add": lambda: mem.seq_add(a, p, -1, 1),
    }
    return outcome(ops[kind])


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return (str(v.dtype), v.shape, v.tolist())
    if isinstance(v, UBatch):  # its fields read one by one (a decode step's ubatch builds them when first read)
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in sorted(v.items())}
    if isinstance(v, set):
        return sorted(v)
    return v


def allocr_state(a: BatchAllocr) -> dict:
    """Every public field of the allocator after init, and what each splitter makes of the batch."""
    state = {
        name: _plain(getattr(a, name))
        for name in (
            "token", "embd", "pos", "n_seq_id", "seq_id", "output", "n_outputs", "seq_id_unq", "seq_idx", "has_cpl",
            "seq_set", "seq_set_map", "n_embd", "used", "n_used", "out_ids",
        )
    }  # fmt: skip
    state["seq_pos"] = [sorted(p) for p in a.seq_pos]
    state["seq_cpl"] = np.argwhere(a.seq_cpl).tolist()
    state["n_tokens"] = a.get_n_tokens()
    state["seq_pos_min_max"] = [(a.seq_pos_min(s), a.seq_pos_max(s)) for s in range(8)]
    for kind, kw in (("simple", {}), ("equal", {"sequential": False}), ("equal", {"sequential": True}), ("seq", {})):
        for n_ubatch in (1, 3, 512):
            res = outcome(lambda kind=kind, kw=kw, n_ubatch=n_ubatch: a.split_whole(kind, n_ubatch, **kw))
            state[f"{kind}{kw}{n_ubatch}"] = (_plain(res), list(a.out_ids), a.get_n_used())
    return state


@st.composite
def batches(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 8))
    single = draw(st.booleans())
    seq_id = st.integers(0, 4) if draw(st.booleans()) else st.sampled_from([0, 1, 3, 5, 255, 256, -1])
    seq_ids = draw(
        st.one_of(
            st.none(),
            st.lists(st.lists(seq_id, min_size=1, max_size=1) if single else st.lists(seq_id, max_size=3),
                     min_size=n, max_size=n),
        )
    )  # fmt: skip
    token = st.one_of(st.integers(0, 20), st.sampled_from([-1, 99, 2**31 - 1]))
    tokens = draw(st.lists(token, min_size=n, max_size=n))
    pos = draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, 12), min_size=n, max_size=n),
            st.builds(lambda p0, gaps: list(np.cumsum([p0, *gaps])), st.integers(0, 9),
                      st.lists(st.sampled_from([0, 1, 1, 1, 2, -1]), min_size=n - 1, max_size=n - 1)),
            st.lists(st.sampled_from([0, 2**31 - 2, 2**31 - 1]), min_size=n, max_size=n),
        )
    )  # fmt: skip
    logits = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    return dict(tokens=np.asarray(tokens, dtype=draw(st.sampled_from(["int32", "int64"]))), pos=pos, seq_ids=seq_ids,
                logits=logits)  # fmt: skip


def _memory(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["none", "kv", "kv", "kv_streams"]))
    if kind == "none":
        return None
    hp = kvref.HParams(arch="llama", n_layer=1, n_embd=4, n_head=1, n_ctx_train=1 << 16)
    n_seq = 5
    mem = kvref.KVCache(hp, kv_size=64, n_seq_max=n_seq, kv_unified=kind == "kv", type_k="f32", type_v="f32")
    for s in range(n_seq):
        k = draw(st.integers(0, 4))
        if k:
            mem.decode(Batch(tokens=[1] * k, seq_ids=[[s]] * k))
    return mem


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(spec=batches(), data=st.data())
def test_allocr_fast_path_equals_the_general_path(kernels: Any, spec: dict, data: st.DataObject) -> None:
    made = outcome(lambda: Batch(**spec))
    assume(made[0] == "ok")
    batch = made[1]
    memory = _memory(data.draw)
    kw = dict(
        n_vocab=data.draw(st.sampled_from([None, None, 21, 100, 0])),
        n_seq_max=data.draw(st.sampled_from([1, 2, 5, 5, 256, 257])),
        output_all=data.draw(st.booleans()),
    )
    npe = data.draw(st.sampled_from([1, 1, 4]))
    results = []
    for general in (False, True):
        a = BatchAllocr(npe)
        if general:
            a._init_single = lambda *args: False  # type: ignore[method-assign]
        res = outcome(lambda a=a: a.init(batch, memory, **kw))
        results.append(res if res[0] != "ok" else ("ok", allocr_state(a)))
    assert results[0] == results[1]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seq_ids=st.lists(
        st.one_of(
            st.lists(st.integers(0, 300), max_size=3),
            st.tuples(st.integers(0, 3)),
            st.lists(st.sampled_from([True, 1.5, np.int64(3), np.int8(-1), "1", 2**70]), min_size=1, max_size=2),
        ),
        min_size=1,
        max_size=6,
    ),
    outer=st.sampled_from([list, tuple]),
)
def test_batch_seq_ids_copy_equals_the_check(kernels: Any, seq_ids: list, outer: type) -> None:
    from kvref.memory.batch import _seq_id

    n = len(seq_ids)
    got = outcome(lambda: Batch(tokens=[1] * n, seq_ids=outer(seq_ids)).seq_ids)
    want = outcome(lambda: [[_seq_id(s, i, j) for j, s in enumerate(ids)] for i, ids in enumerate(seq_ids)])
    assert got == want
    if got[0] == "ok":
        assert all(type(s) is int for ids in got[1] for s in ids)


class _GeneralBatch:
    """A slots twin whose Batch kernels decline every batch: Batch then takes its general checks."""

    def __init__(self, twin: Any) -> None:
        self._twin = twin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._twin, name)

    @staticmethod
    def token_batch(*_args: Any) -> None:
        return None

    @staticmethod
    def int32_values(*_args: Any) -> None:
        return None


_INTS = st.one_of(st.integers(-3, 9), st.sampled_from([2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**70]))


@st.composite
def int_field(draw: st.DrawFn, n: int) -> Any:
    """A Batch field of about ``n`` integers, as a caller may pass it: a list, an array of some dtype, or oddities."""
    m = draw(st.sampled_from([n, n, n, n - 1, 2 * n]))
    values = draw(st.lists(_INTS, min_size=max(m, 0), max_size=max(m, 0)))
    kind = draw(st.sampled_from(["list", "int32", "int64", "uint64", "int8", "float", "strided", "2d", "bool"]))
    if kind == "list":
        return values
    if kind == "bool":
        return [True] * len(values)
    if kind == "float":
        return np.array(values, dtype=np.float64)
    dt = np.dtype(kind if kind not in ("2d", "strided") else "int64")
    arr = np.array([v for v in values if np.iinfo(dt).min <= v <= np.iinfo(dt).max], dtype=dt)
    if kind == "2d":
        return arr.reshape(1, -1)
    return np.repeat(arr, 2)[::2] if kind == "strided" else arr


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(0, 4), with_pos=st.booleans(), with_seq=st.booleans())
def test_batch_common_fields_equal_the_checks(kernels: Any, data: st.DataObject, n: int, with_pos: bool,
                                              with_seq: bool) -> None:  # fmt: skip
    """Batch's one-call check of tokens, pos and seq_ids gives the same fields, or the same error, as its general
    checks one by one; the batch holds copies."""
    tokens = data.draw(int_field(n))
    pos = data.draw(int_field(n)) if with_pos else None
    seq_ids = [[i % 2] for i in range(n)] if with_seq else None

    def fields() -> tuple:
        b = Batch(tokens=tokens, pos=pos, seq_ids=seq_ids)
        assert not isinstance(tokens, np.ndarray) or not np.shares_memory(b.tokens, tokens)
        return (b.tokens.dtype.str, b.tokens.tolist(), None if b.pos is None else (b.pos.dtype.str, b.pos.tolist()),
                b.seq_ids)  # fmt: skip

    got = outcome(fields)
    slot_kernels.impl = _GeneralBatch(kernels)
    try:
        assert got == outcome(fields)
    finally:
        slot_kernels.impl = kernels  # the next example starts on the twin again


# ------------------------------------------------------------------------------- prepare's shortcut
@st.composite
def decode_steps(draw: st.DrawFn) -> list:
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["decode", "decode", "decode", "seq_rm", "odd"]))
        steps.append((kind, draw(st.integers(0, 2)), draw(st.integers(1, 9)), draw(st.integers(0, 3))))
    return steps


def run_steps(steps: list, shortcut: bool, cells_cls: type, swa_type: int, n_swa: int, size: int, unified: bool,
              n_ubatch: int) -> list:  # fmt: skip
    hp = kvref.HParams(arch="llama", n_layer=1, n_embd=4, n_head=1, n_ctx_train=1 << 16)
    cache = kvref.KVCache(
        hp, kv_size=size, n_seq_max=3, kv_unified=unified, n_swa=n_swa, swa_type=swa_type, type_k="f32",
        type_v="f32", cells_cls=cells_cls,
    )  # fmt: skip
    saved = slots._writes_cannot_fail
    if not shortcut:
        slots._writes_cannot_fail = lambda *args: False  # type: ignore[assignment]
    log: list = []
    try:
        for kind, seq, n, twist in steps:
            if kind == "seq_rm":
                p = cache.seq_pos_max(seq)
                log.append(outcome(lambda seq=seq, p=p, n=n: cache.seq_rm(seq, max(p - n, 0), -1)))
                continue
            p0 = cache.seq_pos_max(seq) + 1
            if kind == "decode":
                batch = kvref.Batch(tokens=[1] * n, pos=list(range(p0, p0 + n)), seq_ids=[[seq]] * n)
                placed = outcome(lambda batch=batch: cache.decode(batch, n_ubatch=n_ubatch))
                if placed[0] == "ok":
                    placed = ("ok", [(list(s.strm), [list(x) for x in s.idxs]) for _, s in placed[1]])
                log.append(placed)
                continue
            # prepare of hand-made ubatches: the last one is odd in some way (apply refuses it part-way, or it
            # carries several sequences per token), so the shortcut must step aside exactly when apply would differ
            a = BatchAllocr()
            a.init(kvref.Batch(tokens=[1] * n, pos=list(range(p0, p0 + n)), seq_ids=[[seq]] * n), None, n_seq_max=3)
            ubs = a.split_all("simple", max(1, n // 2))
            last = ubs[-1]
            if twist == 1:
                last.pos = last.pos.astype(np.int64) - 10**6  # negative positions: pos_set_many refuses
            elif twist == 2:
                last.seq_id = [[seq, (seq + 1) % 3] for _ in last.seq_id]  # two sequences per token
                last.n_seq_id = np.full(last.n_tokens, 2, np.int32)
            elif twist == 3:
                last.seq_id = [[7] for _ in last.seq_id]  # outside a non-unified cache's sequences
            prepared = outcome(lambda ubs=ubs: cache.prepare(ubs))
            if prepared[0] == "ok":
                prepared = ("ok", [(list(s.strm), [list(x) for x in s.idxs]) for s in prepared[1]])
            log.append(prepared)
        for s in range(cache.n_stream):
            c = cache.cells(s)
            log.append((np.asarray(c.pos).tolist(), np.asarray(c.seq).tolist(), np.asarray(c.ext).tolist(),
                        c.get_used(), [c.seq_pos_get(q) for q in range(3)]))  # fmt: skip
        log.append(list(cache.heads))
    finally:
        slots._writes_cannot_fail = saved
    return log


@settings(
    max_examples=max(30, EXAMPLES // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    steps=decode_steps(),
    swa_type=st.integers(0, 3),
    n_swa=st.integers(1, 6),
    size=st.sampled_from([8, 16, 24]),
    unified=st.booleans(),
    n_ubatch=st.integers(1, 8),
)
def test_prepare_shortcut_changes_nothing(
    kernels: Any, cells_cls: type, steps: list, swa_type: int, n_swa: int, size: int, unified: bool, n_ubatch: int
) -> None:
    args = (cells_cls, swa_type, n_swa, size, unified, n_ubatch)
    assert run_steps(steps, True, *args) == run_steps(steps, False, *args)


# ------------------------------------------------------------------------------- KVCells.place / ext_set_many
CELL_CLASSES = [_cells_py.KVCells] + ([CELLS_C.KVCells] if CELLS_C is not None else [])


def cells_state(c: Any) -> tuple:
    return (np.asarray(c.pos).tolist(), np.asarray(c.seq).tolist(), np.asarray(c.ext).tolist(), c.get_used(),
            c.used_min(), c.used_max_p1(), [c.seq_pos_get(s) for s in range(6)] + [c.seq_pos_get(255)])  # fmt: skip


def filled(cls: type, used: list[tuple[int, int]]) -> Any:
    c = cls(12)
    for i, s in used:
        if c.is_empty(i):
            c.pos_set(i, i + 3)
        if not c.seq_has(i, s):
            c.seq_add(i, s)
    return c


values = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**31), 2**31 - 1, 2**31, -(2**31) - 1]))


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    used=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 5)), max_size=6),
    idxs=st.lists(st.one_of(st.integers(0, 11), st.sampled_from([-1, 12, 2**40])), max_size=5),
    data=st.data(),
)
def test_place_is_the_three_bulk_writes(used, idxs, data) -> None:
    k = len(idxs)
    pos = data.draw(st.lists(st.one_of(st.integers(0, 50), st.sampled_from([-1, 2**31 - 1, 2**31])), min_size=k,
                             max_size=k))  # fmt: skip
    seqs = data.draw(st.lists(st.one_of(st.integers(0, 5), st.sampled_from([255, 256, -1])), min_size=k, max_size=k))
    ext = data.draw(st.one_of(st.none(), st.tuples(*[st.one_of(values, st.lists(values, min_size=k, max_size=k))] * 3)))
    check = data.draw(st.booleans())
    answers = []
    for cls in CELL_CLASSES:
        ref, c = filled(cls, used), filled(cls, used)
        before = cells_state(c)
        ok = c.place(idxs, pos, seqs, ext, check)
        steps = [lambda ref=ref: ref.pos_set_many(idxs, pos), lambda ref=ref: ref.seq_add_many(idxs, seqs)]
        if ext is not None:
            steps.insert(1, lambda ref=ref: ref.ext_set_many(idxs, *ext))
        try:
            for step in steps:
                step()
            ref_ok = True
        except (KVRefError, ValueError, TypeError, OverflowError):
            ref_ok = False
        assert ok is ref_ok, (cls, ok, ref_ok)
        if ok and not check:
            assert cells_state(c) == cells_state(ref)
        else:
            assert cells_state(c) == before
        answers.append((ok, cells_state(c)))
    assert all(a == answers[0] for a in answers)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    idxs=st.lists(st.one_of(st.integers(0, 11), st.sampled_from([-1, 12, 2**40])), max_size=5),
    data=st.data(),
)
def test_ext_set_many_is_ext_set_in_turn(idxs, data) -> None:
    k = len(idxs)
    xs, ys, toks = (data.draw(st.one_of(values, st.lists(values, min_size=k, max_size=k))) for _ in range(3))
    answers = []
    for cls in CELL_CLASSES:
        c, ref = cls(12), cls(12)
        got = outcome(lambda c=c: c.ext_set_many(idxs, xs, ys, toks))

        def in_turn(ref: Any = ref) -> None:
            for j, i in enumerate(idxs):
                ref.ext_set(i, *(v[j] if isinstance(v, list) else v for v in (xs, ys, toks)))

        want = outcome(in_turn)
        assert (got[0] == "ok") == (want[0] == "ok"), (got, want)
        if got[0] == "ok":
            assert np.asarray(c.ext).tolist() == np.asarray(ref.ext).tolist()
        else:
            assert np.asarray(c.ext).tolist() == np.asarray(cls(12).ext).tolist()  # nothing written
            if "outside [0," in want[1]:
                assert got == want  # the same index named
        answers.append((got, np.asarray(c.ext).tolist()))
    assert all(a == answers[0] for a in answers)


def _naive_first_unused(self: BatchAllocr) -> int | None:
    return next((i for i, u in enumerate(self.used) if not u), None)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=2), min_size=1, max_size=14),
    n_ubatch=st.integers(1, 6),
    n_keep_tail=st.integers(0, 3),
)
def test_splitters_resume_where_a_rescan_would(seqs: list, n_ubatch: int, n_keep_tail: int) -> None:
    """The splitters remember the first token that can still be unused (``_unused_from``, lowered when split_equal
    hands tokens back): every split is the one a scan of ``used`` from the start gives."""
    batch = Batch(tokens=[1] * len(seqs), pos=list(range(len(seqs))), seq_ids=seqs)
    runs = []
    for naive in (False, True):
        a = BatchAllocr()
        outcome(lambda a=a: a.init(batch, None, n_seq_max=4))
        if naive:
            a._first_unused = _naive_first_unused.__get__(a)  # type: ignore[method-assign]
        got = []
        for kind, kw in (
            ("simple", {}),
            ("seq", {}),
            ("equal", {"sequential": False, "n_keep_tail": n_keep_tail}),
            ("equal", {"sequential": True}),
        ):
            res = outcome(lambda a=a, kind=kind, kw=kw: a.split_whole(kind, n_ubatch, **kw))
            got.append((_plain(res), list(a.out_ids), a.get_n_used()))
        runs.append(got)
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------- KVCache.decode's one-call step
@st.composite
def cache_steps(draw: st.DrawFn) -> list:
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["decode", "decode", "decode", "decode", "seq_rm", "seq_add", "update"]))
        if kind == "decode":
            spec = draw(batches())
            if draw(st.booleans()):  # the next positions of its sequences: mostly a step that succeeds
                spec["pos"] = None
            extra = dict(
                n_ubatch=draw(st.sampled_from([512, 512, 1, 3, 8, np.int64(8), True])),
                rows=draw(st.booleans()),
                on_ubatch=draw(st.booleans()),
                embd_all=draw(st.sampled_from([False, False, True])),
            )
            steps.append((kind, (spec, extra)))
        else:
            steps.append((kind, (draw(st.integers(0, 5)), draw(st.integers(0, 6)), draw(st.integers(-2, 2)))))
    return steps


def _slot_plain(slot: Any) -> Any:
    """A SlotInfo, or an ISWASlot (one per cache), as plain values."""
    if isinstance(slot, tuple):
        return [_slot_plain(s) for s in slot]
    return (slot.s0, slot.s1, list(slot.strm), [list(map(int, x)) for x in slot.idxs])


def replay_steps(mem: Any, caches: list, steps: list) -> list:
    """Replay ``steps`` on ``mem``: every result (or error), what ``on_ubatch`` saw, and after each step the cells,
    heads and pending check of each of its ``caches``; at the end their K/V rows."""
    n_seq = caches[0].n_seq_max
    log: list = []
    for kind, args in steps:
        if kind == "decode":
            spec, extra = args
            made = outcome(lambda spec=spec: Batch(**spec))
            if made[0] != "ok":
                continue
            batch, n = made[1], made[1].n_tokens
            seen: list = []
            kw: dict = {}
            if extra["rows"]:
                rows = np.arange(n * 4, dtype=np.float32).reshape(n, 4) + len(log)
                kw = dict(k={0: rows, 1: rows + 0.5}, v={0: -rows, 1: rows * 2})
            if extra["on_ubatch"]:
                kw["on_ubatch"] = lambda ub, slot, seen=seen: seen.append((_plain(ub), _slot_plain(slot)))
            res = outcome(lambda batch=batch, kw=kw, extra=extra: mem.decode(
                batch, extra["n_ubatch"], embd_all=extra["embd_all"], **kw))  # fmt: skip
            if res[0] == "ok":
                res = ("ok", [(_plain(ub), _slot_plain(slot)) for ub, slot in res[1]])
            log.append((res, seen))
        elif kind == "seq_rm":
            seq, p0, _ = args
            log.append(outcome(lambda seq=seq, p0=p0: mem.seq_rm(seq % n_seq, p0, -1)))
        elif kind == "seq_add":
            seq, p0, d = args
            log.append(outcome(lambda seq=seq, p0=p0, d=d: mem.seq_add(seq % n_seq, p0, -1, d)))
        else:
            log.append(outcome(mem.update))
        for cache in caches:
            c = cache.cells(0)
            log.append((np.asarray(c.pos).tolist(), np.asarray(c.seq).tolist(), np.asarray(c.ext).tolist(),
                        np.asarray(c.shift).tolist(), c.get_used(), c.get_has_shift(), list(cache.heads),
                        [c.seq_pos_get(q) for q in range(5)], cache._checked))  # fmt: skip
    for cache in caches:
        log.append([(layer.k.tobytes(), None if layer.v is None else layer.v.tobytes()) for layer in cache.layers])
    return log


def run_cache(steps: list, fast: bool, cells_cls: type, size: int, unified: bool, n_swa: int, swa_type: int) -> list:
    hp = kvref.HParams(arch="llama", n_layer=2, n_embd=4, n_head=1, n_ctx_train=1 << 16)
    cache = kvref.KVCache(
        hp, kv_size=size, n_seq_max=5 if unified else 1, kv_unified=unified, n_swa=n_swa, swa_type=swa_type,
        type_k="f32", type_v="f16", cells_cls=cells_cls,
    )  # fmt: skip
    if not fast:
        cache._decode_single = lambda *args: None  # type: ignore[method-assign]
    return replay_steps(cache, [cache], steps)


@settings(
    max_examples=max(30, EXAMPLES // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    steps=cache_steps(),
    size=st.sampled_from([4, 8, 16, 64]),
    unified=st.booleans(),
    n_swa=st.integers(0, 4),
    swa_type=st.integers(0, 3),
)
def test_decode_single_step_equals_decode_batch(
    kernels: Any, cells_cls: type, steps: list, size: int, unified: bool, n_swa: int, swa_type: int
) -> None:
    args = (cells_cls, size, unified, n_swa, swa_type)
    assert run_cache(steps, True, *args) == run_cache(steps, False, *args)


def test_decode_single_step_is_taken(kernels: Any, cells_cls: type) -> None:
    """The common step goes through the one-call path (and its ubatch reads as decode_batch's)."""
    hp = kvref.HParams(arch="llama", n_layer=1, n_embd=4, n_head=1, n_ctx_train=1 << 16)
    caches = [kvref.KVCache(hp, kv_size=32, n_seq_max=4, cells_cls=cells_cls) for _ in range(2)]
    caches[1]._decode_single = lambda *args: None  # type: ignore[method-assign]
    taken = []
    orig = caches[0]._decode_single
    caches[0]._decode_single = lambda *a: taken.append(orig(*a)) or taken[-1]  # type: ignore[method-assign]
    for step in range(3):
        spec = dict(tokens=np.arange(3) + step, seq_ids=[[0], [2], [0]])
        got = [caches[i].decode(Batch(**spec)) for i in range(2)]
        assert taken[-1] is not None
        ub_fast, ub_gen = got[0][0][0], got[1][0][0]
        # built at once (the caller reads it next), every field in the dataclass's order
        assert list(vars(ub_fast)) == [f.name for f in dataclasses.fields(UBatch)]
        assert _plain(ub_fast) == _plain(ub_gen)
        assert got[0][0][1] == got[1][0][1]
    assert caches[0].heads == caches[1].heads


@st.composite
def iswa_steps(draw: st.DrawFn) -> list:
    """Mostly decodes of the next positions (enough to wrap the small SWA cache, whose masked cells are then
    reused), with sequence removals and shifts between them."""
    steps = draw(cache_steps())
    for _ in range(draw(st.integers(0, 10))):
        spec = draw(batches())
        spec["pos"] = None
        steps.append(
            (
                "decode",
                (spec, dict(n_ubatch=512, rows=draw(st.booleans()), on_ubatch=draw(st.booleans()), embd_all=False)),
            )
        )
    return draw(st.permutations(steps))


def _iswa_hparams(n_swa: int, swa_type: int) -> kvref.HParams:
    return kvref.HParams(arch="gemma2", n_layer=2, n_embd=4, n_head=1, n_ctx_train=1 << 16, n_swa=n_swa,
                         swa_type=swa_type, swa_layers=[True, False])  # fmt: skip


def run_iswa(steps: list, fast: bool, size: int, unified: bool, n_swa: int, swa_type: int, compat: str) -> list:
    # under "2025" the SWA cache is the window of every sequence plus a ubatch (no padding): a few cells, soon reused
    mem = kvref.KVCacheISWA(_iswa_hparams(n_swa, swa_type), kv_size=size, n_seq_max=5 if unified else 1,
                            kv_unified=unified, n_ubatch=4, type_k="f32", type_v="f16", compat=compat)  # fmt: skip
    if not fast:
        mem._decode_single = lambda *args: None  # type: ignore[method-assign]
    return replay_steps(mem, [mem.base, mem.swa], steps)


@settings(
    max_examples=max(30, EXAMPLES // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    steps=iswa_steps(),
    size=st.sampled_from([8, 16, 64]),
    unified=st.booleans(),
    n_swa=st.integers(1, 4),
    swa_type=st.integers(1, 3),
    compat=st.sampled_from(["2025", "2025", "2026-10"]),
)
def test_iswa_decode_single_step_equals_decode_batch(
    kernels: Any, steps: list, size: int, unified: bool, n_swa: int, swa_type: int, compat: str
) -> None:
    """KVCacheISWA's common step (planned in both caches, then written; reused SWA cells through apply_ubatch's
    writes) returns and leaves what decode_batch (prepare and apply of both caches) does, or raises the same."""
    args = (size, unified, n_swa, swa_type, compat)
    assert run_iswa(steps, True, *args) == run_iswa(steps, False, *args)


def test_iswa_decode_single_step_is_taken(kernels: Any) -> None:
    """The common step of an iSWA memory goes through the planned path, also once the SWA cache reuses cells."""
    mem = kvref.KVCacheISWA(_iswa_hparams(2, kvref.SWAType.STANDARD), kv_size=64, n_seq_max=1, n_ubatch=4,
                            compat="2025")  # fmt: skip
    taken = []
    orig = mem._decode_single
    mem._decode_single = lambda *a: taken.append(orig(*a)) or taken[-1]  # type: ignore[method-assign]
    for step in range(20):
        mem.decode(Batch(tokens=np.arange(2) + step))
        assert taken[-1] is not None, step
    assert mem.swa.get_size() == 6 and mem.seq_pos_max(0) == 39 and mem.base.cells(0).get_used() == 40


@pytest.mark.parametrize("seed", range(12))
def test_iswa_steps_that_purge_equal_decode_batch(kernels: Any, seed: int) -> None:
    """Long traces of several sequences decoding the next positions together (with removals between): the SWA
    cells the step reuses are not always a sequence's oldest, so apply_ubatch's purge drops more of its cells."""
    rng = np.random.default_rng(seed)
    n_seq, n_swa = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    steps: list = []
    for _ in range(40):
        if rng.random() < 0.1:
            steps.append(("seq_rm", (int(rng.integers(0, n_seq)), int(rng.integers(0, 12)), 0)))
            continue
        n = int(rng.integers(1, 5))
        spec = dict(
            tokens=np.arange(n, dtype=np.int32), pos=None, seq_ids=[[int(rng.integers(0, n_seq))] for _ in range(n)]
        )
        steps.append(
            ("decode", (spec, dict(n_ubatch=512, rows=bool(rng.random() < 0.5), on_ubatch=False, embd_all=False)))
        )
    assert run_iswa(steps, True, 64, True, n_swa, 1, "2025") == run_iswa(steps, False, 64, True, n_swa, 1, "2025")


# ------------------------------------------------------------------------------------------ recurrent memories
def _mamba() -> kvref.HParams:
    return kvref.HParams(arch="mamba", n_layer=2, n_embd=8, n_head=0, n_head_kv=0, recurrent_layers=True,
                         rope_type=kvref.RopeType.NONE, ssm_d_conv=2, ssm_d_inner=4, ssm_d_state=2)  # fmt: skip


@st.composite
def recurrent_steps(draw: st.DrawFn) -> list:
    """Mostly decodes (often of the next tokens of one sequence: the one-call step), with the sequence operations
    that share, move and drop states between them."""
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["decode", "decode", "next", "next", "next", "seq_rm", "seq_cp", "seq_keep",
                                     "seq_add"]))  # fmt: skip
        if kind == "decode":
            spec = draw(batches())
            if draw(st.booleans()):
                spec["pos"] = None
            extra = dict(
                n_ubatch=draw(st.sampled_from([512, 512, 1, 3, np.int64(8), True])),
                on_ubatch=draw(st.booleans()),
                embd_all=draw(st.sampled_from([False, False, True])),
            )
            steps.append(("decode", (spec, extra)))
        elif kind == "next":
            n = draw(st.integers(1, 4))
            spec = dict(tokens=np.arange(n), pos=None, seq_ids=[[draw(st.integers(0, 2))]] * n,
                        logits=draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n))))  # fmt: skip
            steps.append(("decode", (spec, dict(n_ubatch=draw(st.sampled_from([512, 2])), on_ubatch=False,
                                                embd_all=False))))  # fmt: skip
        else:
            steps.append((kind, (draw(st.integers(0, 2)), draw(st.integers(0, 2)), draw(st.integers(-1, 6)))))
    return steps


def run_recurrent(steps: list, fast: bool, n_seq_max: int) -> list:
    mem = kvref.RecurrentMemory(_mamba(), rs_size=max(1, n_seq_max), n_seq_max=n_seq_max)
    if not fast:
        mem._decode_owned = lambda *args: None  # type: ignore[method-assign]
    taken: list = []
    orig = mem._decode_owned
    mem._decode_owned = lambda *a: taken.append(orig(*a)) or taken[-1]  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    for buf in mem.r_l + mem.s_l:  # distinct rows: a wrong gather or zeroing shows
        if buf is not None:
            buf[...] = rng.integers(1, 255, buf.shape, dtype=np.uint8)
    log: list = []
    for kind, args in steps:
        if kind == "decode":
            spec, extra = args
            made = outcome(lambda spec=spec: Batch(**spec))
            if made[0] != "ok":
                continue
            seen: list = []
            kw: dict = {}
            if extra["on_ubatch"]:
                kw["on_ubatch"] = lambda ub, slot, seen=seen: seen.append((_plain(ub), _plain(vars(slot))))
            res = outcome(lambda b=made[1], kw=kw, extra=extra: mem.decode(
                b, extra["n_ubatch"], embd_all=extra["embd_all"], **kw))  # fmt: skip
            if res[0] == "ok":
                res = ("ok", [(_plain(ub), _plain(vars(slot))) for ub, slot in res[1]])
            log.append((res, seen))
        else:
            log.append(seq_op(mem, kind, *args))
        log.append(_plain([mem.pos, mem.src, mem.src0, mem.tail, mem.seq, mem.used, mem.head, mem.n, mem.rs_z,
                           mem.rs_idx]))  # fmt: skip
    log.append([None if b is None else b.tobytes() for b in mem.r_l + mem.s_l])
    return [*log, ("taken", sum(x is not None for x in taken))] if fast else log


@settings(
    max_examples=max(30, EXAMPLES // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=recurrent_steps(), n_seq_max=st.sampled_from([1, 2, 3]))
def test_recurrent_decode_owned_step_equals_decode_batch(kernels: Any, steps: list, n_seq_max: int) -> None:
    """The recurrent memory's one-call step (a sequence that owns its state) leaves the memory, the ubatch and the
    slot exactly as decode_batch does; any other step is left to decode_batch."""
    fast = run_recurrent(steps, True, n_seq_max)
    assert fast[:-1] == run_recurrent(steps, False, n_seq_max)


def test_recurrent_decode_owned_step_is_taken(kernels: Any) -> None:
    """The steady decode of sequences that own their states goes through the one-call step."""
    steps = [("decode", (dict(tokens=np.arange(3), pos=None, seq_ids=[[s]] * 3, logits=None),
                         dict(n_ubatch=512, on_ubatch=False, embd_all=False))) for s in (0, 1, 0, 1, 1)]  # fmt: skip
    fast = run_recurrent(steps, True, 2)
    assert fast[-1] == ("taken", 3)  # the first step of each sequence finds it no cell: the general path
    assert fast[:-1] == run_recurrent(steps, False, 2)


def _jamba() -> kvref.HParams:
    return kvref.HParams(arch="jamba", n_layer=2, n_embd=8, n_head=1, n_embd_head_k=4, n_embd_head_v=4,
                         n_head_kv=[0, 1], recurrent_layers=[True, False], ssm_d_conv=2, ssm_d_inner=4,
                         ssm_d_state=2, rope_type=kvref.RopeType.NONE, n_ctx_train=4096)  # fmt: skip


def run_hybrid(steps: list, fast: bool, n_seq_max: int, kv_size: int) -> list:
    mem = kvref.HybridMemory(_jamba(), kv_size=kv_size, rs_size=max(1, n_seq_max), n_seq_max=n_seq_max,
                             type_k="f32", type_v="f32")  # fmt: skip
    if not fast:
        mem._decode_owned = lambda *args: None  # type: ignore[method-assign]
    taken: list = []
    orig = mem._decode_owned
    mem._decode_owned = lambda *a: taken.append(orig(*a)) or taken[-1]  # type: ignore[method-assign]
    log: list = []
    for kind, args in steps:
        if kind == "decode":
            spec, extra = args
            made = outcome(lambda spec=spec: Batch(**spec))
            if made[0] != "ok":
                continue
            res = outcome(lambda b=made[1], extra=extra: mem.decode(b, extra["n_ubatch"], embd_all=extra["embd_all"]))
            if res[0] == "ok":
                res = ("ok", [(_plain(ub), _slot_plain(slot.attn), _plain(vars(slot.recr))) for ub, slot in res[1]])
            log.append(res)
        else:
            log.append(seq_op(mem, kind, *args))
        r, c = mem.recr, mem.attn.cells(0)
        log.append(_plain([r.pos, r.src, r.src0, r.tail, r.seq, r.used, r.head, r.n, r.rs_z, np.asarray(c.pos),
                           np.asarray(c.seq), np.asarray(c.ext), c.get_used(), list(mem.attn.heads)]))  # fmt: skip
    return [*log, ("taken", sum(x is not None for x in taken))] if fast else log


@settings(
    max_examples=max(30, EXAMPLES // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=recurrent_steps(), n_seq_max=st.sampled_from([1, 2, 3]), kv_size=st.sampled_from([4, 16, 256]))
def test_hybrid_decode_owned_step_equals_decode_batch(kernels: Any, steps: list, n_seq_max: int, kv_size: int) -> None:
    """The hybrid memory's one-call step leaves both parts, the ubatch and the slots exactly as decode_batch does."""
    fast = run_hybrid(steps, True, n_seq_max, kv_size)
    assert fast[:-1] == run_hybrid(steps, False, n_seq_max, kv_size)


def test_hybrid_decode_owned_step_is_taken(kernels: Any) -> None:
    steps = [("decode", (dict(tokens=np.arange(3), pos=None, seq_ids=[[s]] * 3, logits=None),
                         dict(n_ubatch=512, on_ubatch=False, embd_all=False))) for s in (0, 1, 0, 1, 1)]  # fmt: skip
    fast = run_hybrid(steps, True, 2, 256)
    assert fast[-1] == ("taken", 3)
    assert fast[:-1] == run_hybrid(steps, False, 2, 256)
