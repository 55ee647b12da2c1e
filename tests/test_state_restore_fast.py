"""The fast paths of the KV state code give what the general ones give: empty streams read at once, the ids of
cells of n_seq_max above 64, a whole restore zeroing only the rows it does not copy, a sequence restore keeping its
trial placement when it commits at once."""

from __future__ import annotations

import numpy as np
import pytest
from test_kv_state import TWIN_IDS, TWINS, assert_same, fill, make, snapshot

import kvref.state as kst
from kvref.errors import FormatError, NoSlotError
from kvref.memory import kv_state
from kvref.memory.batch import Batch
from kvref.state.dsl import List
from kvref.state.sections import KV_SECTION, KV_STREAM


def _many_streams(n_seq_max: int = 64) -> bytes:
    cache = make(kv_unified=False, n_seq_max=n_seq_max, size=8)
    cache.decode(Batch(tokens=[5, 6, 7], seq_ids=[[5]] * 3))
    cache.decode(Batch(tokens=[5, 6], seq_ids=[[40]] * 2))
    fill(cache)
    return cache.state_write()


def _field_by_field(blob: bytes, **opts: object):
    """KV_SECTION read with a plain List of streams (every stream walked field by field)."""
    fields = [
        List("streams", KV_STREAM, f.count, blame=f.blame) if f.name == "streams" else f for f in KV_SECTION.fields
    ]
    struct = type(KV_SECTION)(KV_SECTION.cls, *fields)
    return kst.dsl.read_root(struct, blob, {"n_stream_field": True, "ext_size": 0, "has_v": True, **opts})


def test_empty_streams_read_at_once_as_field_by_field():
    blob = _many_streams()
    fast = kst.dsl.read_root(KV_SECTION, blob, {"n_stream_field": True, "ext_size": 0, "has_v": True})
    slow = _field_by_field(blob)
    assert len(fast.streams) == len(slow.streams) == 64
    for a, b in zip(fast.streams, slow.streams, strict=True):
        assert a.offsets == b.offsets and a.cell_count == b.cell_count
        assert (a.cells is None) == (b.cells is None) and (a.data is None) == (b.data is None)


@pytest.mark.parametrize("cut", [2, 4 + 4 * 3 + 2, 4 + 4 * 5, 4 + 4 * 63])
def test_a_truncated_run_of_empty_streams_fails_as_field_by_field(cut):
    blob = _many_streams()
    with pytest.raises(FormatError) as fast:
        kst.dsl.read_root(KV_SECTION, blob[:cut], {"n_stream_field": True, "ext_size": 0, "has_v": True})
    with pytest.raises(FormatError) as slow:
        _field_by_field(blob[:cut])
    assert (str(fast.value), fast.value.field, fast.value.offset) == (
        str(slow.value),
        slow.value.field,
        slow.value.offset,
    )


@pytest.mark.parametrize("cells_cls", TWINS, ids=TWIN_IDS)
@pytest.mark.parametrize("n_seq_max", [65, 100, 128, 256])
def test_cell_ids_above_64_sequences(cells_cls, n_seq_max):
    """One id a cell (ids in every word), then a cell with two ids, two words, and ids at or above n_seq_max."""
    cache = make(n_seq_max=n_seq_max, size=64, cells_cls=cells_cls)
    ids = [s % n_seq_max for s in (0, 63, 64, 127, n_seq_max - 1, 1, 65, n_seq_max // 2)]
    cache.decode(Batch(tokens=list(range(len(ids))), seq_ids=[[s] for s in ids]))
    rng = np.random.default_rng(1)

    def general(idx):
        rows, got = np.nonzero(kv_state._seq_bits(cache.cells(0), idx, n_seq_max))
        start = np.zeros(idx.size + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=idx.size), out=start[1:])
        return got.astype(np.int32), start

    idx = kv_state.written_cells(cache, 0)
    for got, want in zip(kv_state._cell_ids(cache.cells(0), idx, n_seq_max), general(idx), strict=True):
        np.testing.assert_array_equal(got, want)
    cells = cache.cells(0)
    cells.seq_add(3, 2)  # two ids in different words
    cells.seq_add(5, 7)  # two in one word
    if n_seq_max < 256:
        cells.seq_add(6, min(255, n_seq_max + int(rng.integers(0, 256 - n_seq_max))))  # never written
    idx = kv_state.written_cells(cache, 0)
    for got, want in zip(kv_state._cell_ids(cells, idx, n_seq_max), general(idx), strict=True):
        np.testing.assert_array_equal(got, want)
    assert kv_state._one_id_each(cells, idx, n_seq_max) is None


@pytest.mark.parametrize("cells_cls", TWINS, ids=TWIN_IDS)
@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("kv_unified", [True, False])
def test_a_whole_restore_leaves_the_rows_clear_true_leaves(cells_cls, v_trans, kv_unified):
    """Rows of cells past the restored ones (and of streams restored empty) are zero, as after clear(True)."""
    src = make(size=16, v_trans=v_trans, kv_unified=kv_unified, cells_cls=cells_cls)
    src.decode(Batch(tokens=[5, 6, 7, 8], seq_ids=[[0], [1], [0], [1]]))
    fill(src)
    blob = src.state_write()
    dst = make(size=16, v_trans=v_trans, kv_unified=kv_unified, cells_cls=cells_cls)
    dst.decode(Batch(tokens=list(range(10)), seq_ids=[[2]] * 10))
    fill(dst, seed=3)
    dst.state_read(blob)
    ref = make(size=16, v_trans=v_trans, kv_unified=kv_unified, cells_cls=cells_cls)
    ref.clear(True)
    for s, st in enumerate(kst.read_kv_section(blob, kv_state.spec(ref))[0].streams):
        if st.cells is not None:
            kv_state.copy_rows(ref, s, np.arange(st.cells.n), st.data)
    for a, b in zip(dst.layers, ref.layers, strict=True):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
    assert dst.state_write() == blob


@pytest.mark.parametrize("cells_cls", TWINS, ids=TWIN_IDS)
def test_a_sequence_restore_that_fails_after_its_trial_changes_nothing(cells_cls):
    """state_read keeps its trial placement only when it commits at once: trailing bytes or no room leave the
    cache exactly as it was."""
    src = make(size=32, cells_cls=cells_cls)
    src.decode(Batch(tokens=list(range(12)), seq_ids=[[0]] * 12))
    fill(src)
    blob = src.state_write(0)
    dst = make(size=32, cells_cls=cells_cls)
    dst.decode(Batch(tokens=list(range(8)), seq_ids=[[1]] * 8))
    dst.decode(Batch(tokens=list(range(6)), seq_ids=[[0]] * 6))
    dst.decode(Batch(tokens=list(range(10)), seq_ids=[[2]] * 10))
    fill(dst, seed=5)
    before = snapshot(dst)
    with pytest.raises(FormatError, match="trailing"):
        dst.state_read(blob + b"\0", 0)
    assert_same(snapshot(dst), before)
    big = make(size=32, cells_cls=cells_cls)
    big.decode(Batch(tokens=list(range(20)), seq_ids=[[0]] * 20))
    with pytest.raises(NoSlotError):
        dst.state_read(big.state_write(0), 0)
    assert_same(snapshot(dst), before)
    dst.state_read(blob, 0)
    assert dst.state_write(0) == blob
