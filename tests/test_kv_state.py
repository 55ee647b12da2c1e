"""KVCache.state_write / state_read: llama_kv_cache's memory section, written and restored (kvref.memory.kv_state)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from kv_cache_helpers import HP

import kvref.state as kst
from kvref.errors import FormatError, NoSlotError, SequenceError
from kvref.memory import _cells_py
from kvref.memory.batch import Batch
from kvref.memory.kv_cache import KVCache
from kvref.memory.kv_state import has_cell_ext, spec

try:
    from kvref.memory import _cells_c
except ImportError:  # pragma: no cover - pure-Python runs
    _cells_c = None

TWINS = [_cells_py.KVCells] + ([_cells_c.KVCells] if _cells_c is not None else [])
TWIN_IDS = ["py"] + (["c"] if _cells_c is not None else [])


def make(types=("f16", "f16"), v_trans=True, kv_unified=True, n_seq_max=4, size=32, cells_cls=None, hp=None, **kw):
    if hp is None:
        hp = HP(n_embd_head=32) if "q8_0" in types else HP()  # q8_0 rows need whole 32-element blocks
    return KVCache(
        hp,
        type_k=types[0],
        type_v=types[1],
        v_trans=v_trans,
        kv_unified=kv_unified,
        kv_size=size,
        n_seq_max=n_seq_max,
        cells_cls=cells_cls,
        **kw,
    )


def fill(cache: KVCache, seed: int = 0) -> None:
    """Random bytes in every K/V buffer, so row copies are visible (quantized rows are just bytes)."""
    rng = np.random.default_rng(seed)
    for layer in cache.layers:
        layer.k[...] = rng.integers(0, 256, layer.k.shape, dtype=np.uint8)
        if layer.v is not None:
            layer.v[...] = rng.integers(0, 256, layer.v.shape, dtype=np.uint8)


def populate(cache: KVCache) -> None:
    """Three sequences: a shared prefix (seqs 0 and 1), then separate continuations; seq 2 alone."""
    cache.decode(Batch(tokens=[5, 6, 7], seq_ids=[[0, 1]] * 3 if cache.n_stream == 1 else [[0]] * 3))
    cache.decode(Batch(tokens=[8, 9], seq_ids=[[0], [0]]))
    cache.decode(Batch(tokens=[10, 11, 12, 13], seq_ids=[[1]] * 4))
    cache.decode(Batch(tokens=[14, 15], seq_ids=[[2]] * 2))
    fill(cache)


def snapshot(cache: KVCache) -> tuple:
    cells = tuple(
        (np.asarray(c.pos).copy(), np.asarray(c.shift).copy(), np.asarray(c.ext).copy(), np.asarray(c.seq).copy(),
         c.get_used())
        for c in cache._cells
    )  # fmt: skip
    bufs = tuple((layer.k.copy(), None if layer.v is None else layer.v.copy()) for layer in cache.layers)
    return cells, list(cache.heads), bufs


def assert_same(a: tuple, b: tuple) -> None:
    (ca, ha, ba), (cb, hb, bb) = a, b
    assert ha == hb
    for x, y in zip(ca, cb, strict=True):
        for u, v in zip(x[:4], y[:4], strict=True):
            np.testing.assert_array_equal(u, v)
        assert x[4] == y[4]
    for (ka, va), (kb, vb) in zip(ba, bb, strict=True):
        np.testing.assert_array_equal(ka, kb)
        if va is not None:
            np.testing.assert_array_equal(va, vb)


def seq_cells(cache: KVCache, seq_id: int) -> list[tuple[int, tuple]]:
    c = cache.get_cells(seq_id)
    return [(int(c.pos[i]), tuple(c.seq_get_all(i))) for i in range(c.size()) if c.seq_has(i, seq_id)]


# ------------------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("v_trans", [True, False])
def test_whole_layout_matches_the_format(v_trans):
    cache = make(v_trans=v_trans)
    populate(cache)
    blob = cache.state_write()
    sec, end = kst.read_kv_section(blob, spec(cache))
    assert end == len(blob)
    assert struct.unpack_from("<I", blob)[0] == 1
    st = sec.streams[0]
    assert st.cell_count == 11
    assert [st.cells.seq_ids(i) for i in range(3)] == [(0, 1)] * 3
    assert st.data.v_trans == int(v_trans)
    c = cache.cells(0)
    idx = np.flatnonzero(np.asarray(c.pos) != -1)
    np.testing.assert_array_equal(st.data.k[1].data, cache.layers[1].k[0][idx])


def test_sequence_write_lists_only_its_id():
    cache = make()
    populate(cache)
    sec = cache.state_sections(1)[0]
    cells = sec.streams[0].cells
    assert cells.n == 7
    assert all(cells.seq_ids(i) == (1,) for i in range(cells.n))
    assert list(cells.pos) == [0, 1, 2, 3, 4, 5, 6]


def test_sequence_write_skips_swa_masked_cells():
    # n_swa 4 (standard): with seq_pos_max 9, cells at p <= 5 are masked (9 - p >= 4) and left out
    cache = make(hp=HP(swa=[True, True]), n_swa=4, swa_type=1, size=32)
    cache.decode(Batch(tokens=list(range(4, 14)), seq_ids=[[0]] * 10))
    sec = cache.state_sections(0)[0]
    assert list(sec.streams[0].cells.pos) == [6, 7, 8, 9]
    assert cache.state_sections(-1)[0].streams[0].cell_count == 10  # whole saves keep them


def test_cell_ext_only_for_mrope():
    assert not has_cell_ext(make())
    mc = make(hp=HP(n_pos=4))
    assert has_cell_ext(mc)
    mc.decode(Batch(tokens=[4, 5, 6], seq_ids=[[0]] * 3))
    cells = mc.state_sections()[0].streams[0].cells
    assert cells.ext_size == 12
    assert cells.ext.tolist() == [[0, 0, 4], [1, 1, 5], [2, 2, 6]]  # text tokens: x = y = pos, tok


# ------------------------------------------------------------------------------------------------- round trips
# a quantized V cache exists only without V transposition (llama.cpp refuses it otherwise)
@pytest.mark.parametrize(
    ("types", "v_trans"),
    [
        (t, vt)
        for t in [("f16", "f16"), ("f32", "f32"), ("q8_0", "q8_0"), ("q8_0", "f16")]
        for vt in (True, False)
        if not (vt and t[1] == "q8_0")
    ],
)
def test_whole_round_trip(types, v_trans):
    cache = make(types, v_trans)
    populate(cache)
    blob = cache.state_write()
    other = make(types, v_trans)
    fill(other, seed=7)
    assert other.state_read(blob) == len(blob)
    assert other.state_write() == blob
    for s in range(3):
        assert other.seq_pos_min(s) == cache.seq_pos_min(s)
        assert other.seq_pos_max(s) == cache.seq_pos_max(s)
    assert other.heads == [0]
    # the restored cells sit at 0..n-1 (the source had the same layout here)
    np.testing.assert_array_equal(np.asarray(other.cells(0).pos)[:11], np.asarray(cache.cells(0).pos)[:11])


@pytest.mark.parametrize(
    ("types", "v_trans"), [(("f16", "f16"), True), (("f16", "f16"), False), (("q8_0", "q8_0"), False)]
)
def test_sequence_round_trip_into_another_sequence(types, v_trans):
    cache = make(types, v_trans)
    populate(cache)
    blob = cache.state_write(1)
    cache.state_read(blob, 3)
    assert cache.seq_pos_min(3) == 0 and cache.seq_pos_max(3) == 6
    # the sequence's bytes are the same, with 3 in place of 1
    a, b = cache.state_sections(1)[0], cache.state_sections(3)[0]
    assert list(a.streams[0].cells.pos) == list(b.streams[0].cells.pos)
    for x, y in zip(a.streams[0].data.k, b.streams[0].data.k, strict=True):
        np.testing.assert_array_equal(x.data, y.data)
    for x, y in zip(a.streams[0].data.v, b.streams[0].data.v, strict=True):
        np.testing.assert_array_equal(x.data, y.data)


def test_sequence_restore_replaces_the_destination():
    cache = make()
    populate(cache)
    blob = cache.state_write(2)
    cache.state_read(blob, 0)  # seq 0 (which shared cells with 1) now holds seq 2's two cells
    assert (cache.seq_pos_min(0), cache.seq_pos_max(0)) == (0, 1)
    assert (cache.seq_pos_min(1), cache.seq_pos_max(1)) == (0, 6)  # seq 1 keeps the shared prefix


def test_sequence_restore_into_a_fresh_cache_uses_the_first_cells():
    cache = make(v_trans=False)
    populate(cache)
    blob = cache.state_write(1)
    other = make(v_trans=False)
    other.state_read(blob, 1)
    assert other.state_write(1) == blob
    assert seq_cells(other, 1) == [(p, (1,)) for p in range(7)]
    assert other.heads == [7]


@pytest.mark.parametrize("v_trans", [True, False])
def test_multistream_round_trips(v_trans):
    cache = make(kv_unified=False, n_seq_max=3, v_trans=v_trans)
    populate(cache)
    blob = cache.state_write()
    assert struct.unpack_from("<I", blob)[0] == 3
    other = make(kv_unified=False, n_seq_max=3, v_trans=v_trans)
    other.state_read(blob)
    assert other.state_write() == blob
    # a sequence artefact lists every stream; restore it into another stream
    seq = cache.state_write(0)
    sec = cache.state_sections(0)[0]
    assert [st.cell_count for st in sec.streams] == [5, 0, 0]
    other.state_read(seq, 2)
    assert (other.seq_pos_min(2), other.seq_pos_max(2)) == (0, 4)
    a, b = cache.state_sections(0)[0].streams[0], other.state_sections(2)[0].streams[2]
    for x, y in zip(a.data.k + a.data.v, b.data.k + b.data.v, strict=True):
        np.testing.assert_array_equal(x.data, y.data)


def test_mrope_sequence_restore_keeps_ext():
    mc = make(hp=HP(n_pos=4))
    mc.decode(Batch(tokens=[4, 5, 6], seq_ids=[[0]] * 3))
    mc.cells(0).ext_set(1, 7, 9, 5)  # as an image token would leave it
    blob = mc.state_write(0)
    mc.state_read(blob, 2)
    a, b = mc.state_sections(0)[0].streams[0].cells, mc.state_sections(2)[0].streams[0].cells
    assert a.ext.tolist() == b.ext.tolist()
    other = make(hp=HP(n_pos=4))
    other.state_read(mc.state_write())
    assert other.state_write() == mc.state_write()


@pytest.mark.parametrize(
    "writer,reader",
    [(w, r) for w in range(len(TWINS)) for r in range(len(TWINS))],
    ids=[f"{TWIN_IDS[w]}-to-{TWIN_IDS[r]}" for w in range(len(TWINS)) for r in range(len(TWINS))],
)
def test_cross_backend(writer, reader):
    a = make(cells_cls=TWINS[writer])
    assert isinstance(a.cells(0), TWINS[writer])
    populate(a)
    whole, seq = a.state_write(), a.state_write(1)
    b = make(cells_cls=TWINS[reader])
    b.state_read(whole)
    assert b.state_write() == whole
    b.state_read(seq, 3)
    assert isinstance(b.cells(0), TWINS[reader])
    assert a.state_sections(1)[0].streams[0].cells.pos.tolist() == b.state_sections(3)[0].streams[0].cells.pos.tolist()


def test_pending_shift_does_not_block_a_sequence_restore():
    cache = make()
    populate(cache)
    blob = cache.state_write(2)
    cache.seq_add(1, 0, -1, 3)  # pending K-shift on seq 1's cells
    before = [np.asarray(c.shift).copy() for c in cache._cells]
    cache.state_read(blob, 3)
    assert cache.seq_pos_max(3) == 1
    np.testing.assert_array_equal(np.asarray(cache.cells(0).shift)[:11], before[0][:11])


# ------------------------------------------------------------------------------------------------- atomic failures
def _u32(blob: bytes, off: int, v: int) -> bytes:
    return blob[:off] + struct.pack("<I", v) + blob[off + 4 :]


def _bad_sections(cache: KVCache) -> list[tuple[str, bytes, int, type, str | None]]:
    whole, seq = cache.state_write(), cache.state_write(1)
    n_cells = struct.unpack_from("<I", whole, 4)[0]
    meta_end = 8 + sum(8 + 4 * 2 if i < 3 else 12 for i in range(n_cells))  # 3 shared cells, then single
    out = [
        ("n_stream", _u32(whole, 0, 2), -1, FormatError, "n_stream"),
        ("cell_count too big", _u32(whole, 4, 1000), -1, FormatError, "cell_count"),
        ("truncated", whole[:-3], -1, FormatError, None),
        ("trailing", whole + b"\0", -1, FormatError, "trailing"),
        ("seq id out of range", _u32(whole, 16, 9), -1, FormatError, "seq_id"),
        # checked against the cache as it is read (as llama.cpp does), before the rows it changes the layout of
        ("v_trans", _u32(whole, meta_end, int(not cache.v_trans)), -1, FormatError, "v_trans"),
        ("n_layer", _u32(whole, meta_end + 4, 3), -1, FormatError, "n_layer"),
        (
            "k_row_size",
            whole[: meta_end + 12] + struct.pack("<Q", 64) + whole[meta_end + 20 :],
            -1,
            FormatError,
            "k_row_size",
        ),
        ("k_type", _u32(whole, meta_end + 8, 0), -1, FormatError, "k_type"),
        ("seq n_seq_id", _u32(seq, 12, 2), 0, FormatError, None),
        ("seq dest out of range", seq, 999, SequenceError, None),
        ("empty", b"", -1, FormatError, None),
    ]
    return out


# refused before llama_kv_cache::state_read changes anything: the n_stream count (an empty input fails
# reading it), the destination id (an assert there); kvref's trailing-bytes check is its own, also up front
UNTOUCHED = {"n_stream", "trailing", "seq dest out of range", "empty"}


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "as-llama.cpp"])
def test_every_bad_section_leaves_what_llama_cpp_leaves(v_trans, atomic):
    # atomic (kvref's default): nothing changes. As llama.cpp: past the n_stream check a whole restore has
    # cleared the cache (clear(true) up front, and again on failure), and a failed sequence restore ends in
    # state_clear: the destination sequence is removed
    cache = make(v_trans=v_trans)
    populate(cache)

    def target() -> KVCache:
        t = make(v_trans=v_trans)
        populate(t)
        t.seq_rm(2, 1, -1)
        return t

    for name, blob, seq_id, err, field in _bad_sections(cache):
        got, want = target(), target()
        if not atomic and name not in UNTOUCHED:
            if seq_id == -1:
                want.clear(True)
            else:
                want.seq_rm(seq_id, -1, -1)
        with pytest.raises(err) as info:
            got.state_read(blob, seq_id, atomic=atomic)
        if field is not None:
            assert info.value.field in ((field,) if isinstance(field, str) else field), name
        assert_same(snapshot(got), snapshot(want))


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "as-llama.cpp"])
def test_sequence_that_does_not_fit_removes_the_destination(atomic):
    # llama.cpp: state_read_meta removes the destination, find_slot fails, state_clear removes it (again);
    # golden fuzz-llama-restore-refused-no-room. Atomic (the default): the destination keeps its cells.
    cache = make(size=32)
    cache.decode(Batch(tokens=list(range(4, 24)), seq_ids=[[0]] * 20))
    blob = cache.state_write(0)
    target = make(size=32)
    target.decode(Batch(tokens=list(range(4, 20)), seq_ids=[[1]] * 16))
    target.decode(Batch(tokens=[4, 5], seq_ids=[[2]] * 2))
    fill(target, 3)
    with pytest.raises(NoSlotError):
        target.state_read(blob, 2, atomic=atomic)  # 14 free + 2 of seq 2 = 16 < 20
    assert (target.seq_pos_max(2), target.seq_pos_max(1)) == (1 if atomic else -1, 15)
    target.seq_rm(1, 12, -1)  # now 4 + 14 + 2 = 20 fit
    target.state_read(blob, 2)
    a, b = cache.state_sections(0)[0].streams[0], target.state_sections(2)[0].streams[0]
    assert a.cells.pos.tolist() == b.cells.pos.tolist()
    for x, y in zip(a.data.k + a.data.v, b.data.k + b.data.v, strict=True):
        np.testing.assert_array_equal(x.data, y.data)


@pytest.mark.parametrize("cells_cls", TWINS, ids=TWIN_IDS)
@pytest.mark.parametrize("shifted", [False, True], ids=["no-shift", "pending-shift"])
def test_refused_sequence_restore_leaves_every_cell_as_it_was(cells_cls, shifted):
    """A sequence restore tries its placement on the cache itself with the destination removed, then puts the
    destination's cells back (or, with a pending shift, tries it on a copy): after a refusal nothing observable
    differs, cells shared with other sequences, M-RoPE ext and heads included."""
    hp = HP() if shifted else HP(n_pos=4)  # seq_add (the pending shift) needs one position per token
    src = make(hp=hp, size=32, cells_cls=cells_cls)
    src.decode(Batch(tokens=list(range(4, 24)), seq_ids=[[0]] * 20))
    blob = src.state_write(0)
    target = make(hp=hp, size=32, cells_cls=cells_cls)
    target.decode(Batch(tokens=[5, 6, 7], seq_ids=[[1, 2]] * 3))  # shared by the destination and seq 1
    target.decode(Batch(tokens=list(range(4, 16)), seq_ids=[[1]] * 12))
    target.decode(Batch(tokens=[8, 9, 10, 11], seq_ids=[[2]] * 4))
    if not shifted:
        target.cells(0).ext_set(17, 7, 9, 5)  # a destination cell with an image token's ext
    if shifted:
        target.seq_add(2, 0, -1, 3)
    fill(target, 3)
    target.heads[0] = 5
    before = snapshot(target)
    ranges = [(target.seq_pos_min(q), target.seq_pos_max(q)) for q in range(4)]
    with pytest.raises(NoSlotError):
        target.state_read(blob, 2)  # 32 - 15 (seq 1) = 17 cells once seq 2 is removed, 20 needed
    assert_same(snapshot(target), before)
    assert [(target.seq_pos_min(q), target.seq_pos_max(q)) for q in range(4)] == ranges
    target.seq_rm(1, 5, -1)  # now 25 free: it fits, and the same blob restores
    target.state_read(blob, 2)
    a, b = src.state_sections(0)[0].streams[0], target.state_sections(2)[0].streams[0]
    assert a.cells.pos.tolist() == b.cells.pos.tolist() and a.cells.ext.tolist() == b.cells.ext.tolist()
    for x, y in zip(a.data.k + a.data.v, b.data.k + b.data.v, strict=True):
        np.testing.assert_array_equal(x.data, y.data)


@pytest.mark.parametrize("cells_cls", TWINS, ids=TWIN_IDS)
@pytest.mark.parametrize("case", ["plain", "mrope", "swa-used-targets"])
@pytest.mark.parametrize("v_trans", [True, False])
def test_a_sequence_restore_in_parts_leaves_what_one_apply_leaves(monkeypatch, cells_cls, case, v_trans):
    """A large sequence restore applies its ubatch a part at a time when every target cell is empty, undoes its
    trial placement and puts the ext back in parts: with tiny parts the cache ends as with one part, cells shared
    with other sequences, M-RoPE ext, heads and rows included; a restore over SWA-freed cells applies it whole."""
    import kvref.memory.kv_state as kv_state

    hp = HP(n_pos=4) if case == "mrope" else HP()
    kw = dict(n_swa=2, swa_type=1) if case == "swa-used-targets" else {}
    src = make(hp=hp, size=32, cells_cls=cells_cls, v_trans=v_trans)
    src.decode(Batch(tokens=list(range(4, 15)), seq_ids=[[0]] * 11))
    if case == "mrope":
        src.cells(0).ext_set(3, 7, 9, 5)  # as an image token would leave it
    fill(src, 1)
    blob = src.state_write(0)

    def restored(part: int) -> tuple[tuple, int]:
        for name in ("_APPLY_CHUNK", "_UNDO_CHUNK", "_SET_CHUNK"):
            monkeypatch.setattr(kv_state, name, part)
        calls = []  # the ubatches the restore reserves: one per part applied
        real = kv_state._reserve_ubatch
        monkeypatch.setattr(kv_state, "_reserve_ubatch", lambda *a: (calls.append(1), real(*a))[1])
        target = make(hp=hp, size=32, cells_cls=cells_cls, v_trans=v_trans, **kw)
        target.decode(Batch(tokens=[5, 6, 7], seq_ids=[[1, 2]] * 3))  # shared by the destination and seq 1
        target.decode(Batch(tokens=list(range(4, 10)), seq_ids=[[1], [2]] * 3))  # interleaved
        target.decode(Batch(tokens=list(range(4, 12)), seq_ids=[[3]] * 8))
        if case == "mrope":
            target.cells(0).ext_set(4, 7, 9, 5)  # a destination cell with an image token's ext
        target.seq_rm(1, 4, -1)  # holes between the destination's cells
        fill(target, 2)
        target.state_read(blob, 2)
        assert (target.seq_pos_min(2), target.seq_pos_max(2)) == (0, 10)
        return snapshot(target), len(calls)

    small, n_small = restored(3)
    whole, n_whole = restored(1 << 20)
    assert_same(small, whole)
    assert n_whole == 1 and n_small == (1 if case == "swa-used-targets" else 4)


def test_mismatching_cache_types_are_refused():
    cache = make(("f16", "f16"))
    populate(cache)
    other = make(("f32", "f16"))
    before = snapshot(other)
    with pytest.raises(FormatError) as info:
        other.state_read(cache.state_write())
    assert info.value.field == "k_type"
    assert_same(snapshot(other), before)


def test_sequence_restore_into_a_stream_with_seq_div_shifts():
    # seq_div leaves shift = old - new > pos (llama_kv_cells::pos_div); staging a restore copies the stream's
    # cells, which must not trip over pos - shift < 0. Found by conformance/fuzz.py (llama, seed 96).
    cache = make()
    cache.decode(Batch(tokens=list(range(4, 16)), seq_ids=[[0]] * 12), 512)
    cache.decode(Batch(tokens=[5, 6, 7], seq_ids=[[1]] * 3), 512)
    blob = cache.state_write(1)
    cache.seq_div(0, 4, -1, 4)  # 11 -> 2: shift 9
    cache.state_read(blob, 2)
    assert (cache.seq_pos_min(2), cache.seq_pos_max(2)) == (0, 2)
    assert (cache.seq_pos_min(0), cache.seq_pos_max(0)) == (0, 3)
    assert cache.cells(0).get_shift(11) == 9 and cache.cells(0).get_has_shift()


@pytest.mark.parametrize(
    ("writer", "reader", "hint"),
    [
        ({"v_trans": True}, {"v_trans": False}, "flash attention off; build the memory with flash_attn=False"),
        ({"v_trans": False}, {"v_trans": True}, "flash attention on; build the memory with flash_attn=True"),
        ({"types": ("f32", "f16")}, {}, "written with type_k='f32'"),
        ({"types": ("f16", "f32")}, {}, "written with type_v='f32'"),
        ({"kv_unified": False}, {}, "a context with kv_unified=False and n_seq_max=4"),
        ({}, {"kv_unified": False}, "a context with kv_unified=True"),
        ({"size": 32}, {"size": 8}, "build the memory with a larger n_ctx (at least 11 cells per stream)"),
    ],
)  # fmt: skip
def test_context_mismatch_names_the_setting_to_change(writer, reader, hint):
    src = make(**writer)
    populate(src)
    dst = make(**reader)
    before = snapshot(dst)
    with pytest.raises(FormatError) as e:
        dst.state_read(src.state_write())
    assert hint in str(e.value)
    assert_same(before, snapshot(dst))


def test_sequence_restore_without_room_says_how_to_make_room():
    src = make()
    src.decode(Batch(tokens=list(range(20)), seq_ids=[[0]] * 20))
    dst = make()
    dst.decode(Batch(tokens=list(range(20)), seq_ids=[[1]] * 20))
    with pytest.raises(NoSlotError, match=r"free cells \(seq_rm\) or build the memory with a larger n_ctx"):
        dst.state_read(src.state_write(0), 2)
