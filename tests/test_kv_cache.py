"""KVCache construction, sizes and sequence operations, pinned to llama-kv-cache.cpp (October 2026).

Expected layouts come from reading the C++ (llama_kv_cache::seq_* and llama_kv_cells); each test says
which rule it pins. Layout strings: '.' empty cell, 'pos:seqs' otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_cache_helpers import HP, layout, place, seq_run, snapshot

import kvref
from kvref.errors import CellError, CorruptionError, KVRefError, SequenceError
from kvref.ggml.types import row_size
from kvref.hparams import SWAType
from kvref.memory.batch import Batch
from kvref.memory.kv_cache import KVCache


def test_uses_selected_cells_backend():
    from kvref.memory.cells import KVCells

    assert type(KVCache(HP(), kv_size=4).cells(0)) is KVCells
    assert kvref.backend() in ("python", "cython")


# ---------------------------------------------------------------------------------------------- sizes
def pad32(n: int) -> int:
    return (n + 31) // 32 * 32


def test_sizes_f16_unified():
    hp = HP(n_layer=3, n_head_kv=1, n_embd_head=3)
    c = KVCache(hp, type_k="f16", type_v="f16", kv_size=5)
    # ggml_nbytes of a [n_embd, size, n_stream] tensor: 3 values * 2 bytes * 5 cells, per layer
    assert c.size_k_bytes() == 3 * (3 * 2 * 5)
    assert c.size_v_bytes() == 3 * (3 * 2 * 5)
    # the CPU buffer pads every tensor to 32 bytes
    assert c.total_size() == 6 * pad32(30) == 192
    assert c.get_size() == 5 and c.get_n_stream() == 1 and c.get_layer_ids() == [0, 1, 2]


def test_sizes_multi_stream_quantized_k_and_layer_selection():
    hp = HP(n_layer=4, n_head_kv=2, n_embd_head=32, kv_from_start=3)
    c = KVCache(
        hp,
        type_k="q8_0",
        type_v="f32",
        v_trans=False,
        kv_unified=False,
        kv_size=8,
        n_seq_max=3,
        layer_filter=lambda il: il != 1,
    )
    # layer 1 filtered out, layer 3 has no KV (n_layer_kv_from_start = 3): layers 0 and 2, 3 streams each
    assert c.get_layer_ids() == [0, 2]
    k_layer = row_size("q8_0", 64) * 8 * 3
    v_layer = 64 * 4 * 8 * 3
    assert row_size("q8_0", 64) == 68
    assert c.size_k_bytes() == 2 * k_layer and c.size_v_bytes() == 2 * v_layer
    assert c.total_size() == 2 * (pad32(k_layer) + pad32(v_layer))


def test_layer_reuse_shares_buffers():
    hp = HP(n_layer=4)
    c = KVCache(
        hp,
        type_k="f32",
        type_v="f32",
        kv_size=4,
        layer_filter=lambda il: il < 2,
        layer_reuse=lambda il: il - 2 if il >= 2 else -1,
    )
    # a reused layer that fails the filter is not mapped (llama.cpp checks the filter again)
    assert c.get_layer_ids() == [0, 1]
    assert c.map_layer_ids == {0: 0, 1: 1}
    c2 = KVCache(hp, type_k="f32", type_v="f32", kv_size=4, layer_reuse=lambda il: 0 if il == 3 else -1)
    assert c2.map_layer_ids[3] == 0 and c2.get_layer_ids() == [0, 1, 2, 3]
    with pytest.raises(KVRefError):
        KVCache(hp, kv_size=4, layer_filter=lambda il: il != 0, layer_reuse=lambda il: 0 if il == 1 else -1)


def test_v_trans_uses_max_v_width_and_rejects_quantized_v():
    hp = HP(n_layer=2, n_head_kv=2, n_embd_head=4, n_embd_head_v=6)
    c = KVCache(hp, type_k="f16", type_v="f16", v_trans=True, kv_size=4)
    assert c.layers[0].v.shape == (1, 12, 4 * 2)
    with pytest.raises(KVRefError):
        KVCache(hp, type_k="f16", type_v="q8_0", v_trans=True, kv_size=4)
    with pytest.raises(KVRefError):
        KVCache(hp, kv_size=6, n_pad=4)


# ---------------------------------------------------------------------------------------------- seq_rm
def test_seq_rm_ranges_and_head():
    c = KVCache(HP(), kv_size=8)
    place(c, seq_run(0, 0, 4) + seq_run(1, 0, 2))
    assert c.heads == [6]
    assert c.seq_rm(0, 1, 3) is True
    assert layout(c) == ["0:0", ".", ".", "3:0", "0:1", "1:1", ".", "."]
    assert c.heads == [1]  # the first freed cell, being below the head
    assert c.seq_rm(1, -1, -1)  # open ends
    assert layout(c) == ["0:0", ".", ".", "3:0", ".", ".", ".", "."]
    assert c.heads == [1]  # freed cells after the head do not move it
    c.seq_rm(-1, 3, -1)  # every sequence
    assert layout(c) == ["0:0"] + ["."] * 7


def test_seq_rm_shared_cell_keeps_other_sequence():
    c = KVCache(HP(), kv_size=4)
    place(c, [([0, 1], 0), ([0, 1], 1)])
    c.seq_rm(0, -1, -1)
    assert layout(c) == ["0:1", "1:1", ".", "."]
    assert c.heads == [2]  # no cell freed


@pytest.mark.parametrize("seq", [-2, 256, 1000])
def test_seq_rm_rejects_bad_ids_unchanged(seq):
    c = KVCache(HP(), kv_size=4)
    place(c, seq_run(0, 0, 2))
    before = snapshot(c)
    with pytest.raises(SequenceError):
        c.seq_rm(seq, -1, -1)
    assert snapshot(c) == before


def test_unified_accepts_any_seq_id_below_max_seq():
    # seq_to_stream has LLAMA_MAX_SEQ entries in a unified cache, so ids >= n_seq_max pass llama.cpp's check
    c = KVCache(HP(), kv_size=4, n_seq_max=1)
    c.seq_rm(200, -1, -1)
    assert c.seq_pos_max(200) == -1


def test_multi_stream_bounds_seq_ids_by_n_seq_max():
    c = KVCache(HP(), kv_size=4, n_seq_max=2, kv_unified=False)
    before = snapshot(c)
    for op in (
        lambda: c.seq_rm(2, -1, -1),
        lambda: c.seq_keep(2),
        lambda: c.seq_add(2, 0, -1, 1),
        lambda: c.seq_div(2, 0, -1, 2),
        lambda: c.seq_cp(0, 2, -1, -1),
        lambda: c.seq_pos_min(2),
    ):
        with pytest.raises(SequenceError):
            op()
    assert snapshot(c) == before


# ---------------------------------------------------------------------------------------------- seq_cp / keep
def test_seq_cp_same_stream_is_metadata_only():
    c = KVCache(HP(), kv_size=6)
    place(c, seq_run(0, 0, 4))
    c.seq_cp(0, 1, 1, 3)
    assert layout(c) == ["0:0", "1:0,1", "2:0,1", "3:0", ".", "."]
    c.seq_cp(0, 1, -1, -1)  # cells already holding 1 are left alone
    assert layout(c) == ["0:0,1", "1:0,1", "2:0,1", "3:0,1", ".", "."]
    c.seq_cp(0, 0, -1, -1)
    assert c.pending_stream_copies() == []


def test_seq_keep():
    c = KVCache(HP(), kv_size=6)
    place(c, [*seq_run(0, 0, 2), ([0, 2], 2), *seq_run(1, 0, 2)])
    c.heads[0] = 5
    c.seq_keep(0)
    assert layout(c) == ["0:0", "1:0", "2:0", ".", ".", "."]
    assert c.heads == [3]


# ---------------------------------------------------------------------------------------------- seq_add / div
def test_seq_add_shifts_and_frees_below_zero():
    c = KVCache(HP(), kv_size=6)
    place(c, seq_run(0, 0, 4) + seq_run(1, 0, 2))
    c.seq_add(0, 2, -1, -3)  # pos 2 -> -1 (freed), pos 3 -> 0
    assert layout(c) == ["0:0", "1:0", ".", "0:0", "0:1", "1:1"]
    assert c.heads == [2]  # the first freed cell
    assert c.cells(0).get_shift(3) == -3
    assert c.get_has_shift()
    c.seq_add(1, 0, -1, 5)
    assert layout(c)[4:] == ["5:1", "6:1"]
    assert c.heads == [0]  # nothing freed: the next search starts at 0


def test_seq_add_early_returns_keep_head():
    c = KVCache(HP(), kv_size=6)
    place(c, seq_run(0, 0, 3))
    before = snapshot(c)
    c.seq_add(0, 0, -1, 0)  # shift 0
    c.seq_add(0, 2, 2, 4)  # empty range
    c.seq_add(0, -5, 0, 4)  # p0 < 0 becomes 0, so [0, 0): empty range too
    assert snapshot(c) == before
    c.seq_add(0, 3, 1, 4)  # p0 > p1: no cell matches, but the head still resets to 0
    assert layout(c) == ["0:0", "1:0", "2:0", ".", ".", "."] and c.heads == [0]


def test_seq_add_large_negative_frees_everything():
    c = KVCache(HP(), kv_size=4)
    place(c, seq_run(0, 0, 4))
    c.seq_add(0, -1, -1, -(2**31 - 10))
    assert layout(c) == ["."] * 4 and c.heads == [0]
    assert c.cells(0).get_used() == 0


def test_seq_div():
    c = KVCache(HP(), kv_size=6)
    place(c, seq_run(0, 0, 6))
    c.seq_div(0, 2, 5, 2)
    assert layout(c) == ["0:0", "1:0", "1:0", "1:0", "2:0", "5:0"]
    assert np.asarray(c.cells(0).shift).tolist() == [0, 0, 1, 2, 2, 0]
    before = snapshot(c)
    c.seq_div(0, -1, -1, 1)
    c.seq_div(0, 10, 20, 0)  # no cell in range: nothing, whatever d (as llama.cpp)
    with pytest.raises(CellError, match="SIGFPE"):  # a cell in range: llama.cpp dies of SIGFPE
        c.seq_div(0, -1, -1, 0)
    with pytest.raises(CorruptionError):  # 2 / -2 = -1: an empty cell's mark
        c.seq_div(0, -1, -1, -2)
    assert snapshot(c) == before
    c.seq_div(0, 2, 6, -1)  # toward zero, as C divides: 2, 5 -> -2, -5 (the cells stay)
    assert layout(c) == ["0:0", "1:0", "1:0", "1:0", "-2:0", "-5:0"]


def test_seq_add_div_refused_for_mrope():
    c = KVCache(HP(n_pos=4), kv_size=4)
    place(c, seq_run(0, 0, 2))
    before = snapshot(c)
    with pytest.raises(SequenceError):
        c.seq_add(0, 0, -1, 1)
    with pytest.raises(SequenceError):
        c.seq_div(0, 0, -1, 2)
    assert snapshot(c) == before
    assert not c.get_can_shift()


def test_seq_pos_min_max():
    c = KVCache(HP(), kv_size=6)
    assert c.seq_pos_min(0) == -1 and c.seq_pos_max(0) == -1
    place(c, [(0, 5), (0, 3), (1, 9)])
    assert (c.seq_pos_min(0), c.seq_pos_max(0), c.seq_pos_max(1)) == (3, 5, 9)


# ---------------------------------------------------------------------------------------------- streams
def multi(size: int = 4, n_seq: int = 3, **kw) -> KVCache:
    return KVCache(HP(n_layer=1), type_k="f32", type_v="f32", kv_unified=False, kv_size=size, n_seq_max=n_seq, **kw)


def test_streams_map_one_sequence_each():
    c = multi()
    assert c.seq_to_stream == [0, 1, 2]
    place(c, [(1, 0), (1, 1)])
    assert layout(c, 1) == ["0:1", "1:1", ".", "."] and layout(c, 0) == ["."] * 4
    assert c.heads == [0, 2, 0]


@pytest.mark.parametrize("p0,p1", [(1, -1), (-1, 2), (0, 1), (2, 3)])
def test_seq_cp_cross_stream_partial_range_rejected(p0, p1):
    c = multi(size=4)
    place(c, seq_run(0, 0, 3))
    before = snapshot(c)
    with pytest.raises(SequenceError):
        c.seq_cp(0, 1, p0, p1)
    assert snapshot(c) == before


@pytest.mark.parametrize("p0,p1", [(-1, -1), (0, 0), (3, -1), (0, 3), (0, 100)])
def test_seq_cp_cross_stream_full_range_forms(p0, p1):
    # llama.cpp's test: p0/p1 each either <= 0 or >= size - 1
    c = multi(size=4)
    place(c, seq_run(0, 0, 2))
    c.seq_cp(0, 1, p0, p1)
    assert c.pending_stream_copies() == [(0, 1)]


def test_seq_cp_cross_stream_after_seq_div_keeps_position_and_shift():
    # llama_kv_cache::seq_cp across streams places pos - shift, then pos_add(shift). After seq_div the shift is
    # old - new (llama_kv_cells::pos_div), so pos - shift can be negative: only an assert (compiled out) objects,
    # and the cell still ends at pos with the same shift. Found by conformance/fuzz.py (gemma2-ms, seed 10);
    # golden fuzz-gemma2-ms-seq-cp-after-div.
    c = multi(size=16)
    place(c, seq_run(0, 0, 9))
    c.seq_div(0, 7, 41, 3)  # 7 -> 2 (shift 5), 8 -> 2 (shift 6)
    c.seq_cp(0, 1, -1, -1)
    assert layout(c, 1)[:9] == ["0:1", "1:1", "2:1", "3:1", "4:1", "5:1", "6:1", "2:1", "2:1"]
    assert np.asarray(c.cells(1).shift).tolist()[:9] == [0] * 7 + [5, 6]
    assert c.cells(1).get_has_shift()
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 6)


def test_seq_cp_cross_stream_copies_cells_and_buffers_at_update():
    c = multi(size=4)
    sinfo = place(c, seq_run(0, 0, 3))
    k = np.arange(3 * 16, dtype=np.float32).reshape(3, 16)
    c.cpy_k(0, k, sinfo)
    c.cpy_v(0, -k, sinfo)
    place(c, [(1, 7)])  # stream 1 has its own content, which the copy wipes
    c.seq_add(0, 1, -1, 2)  # pending shift on the source cells (no rope: see update below)
    c.hparams.rope_type = kvref.RopeType.NONE
    assert c.heads == [0, 1, 0]  # seq_add freed nothing: head 0
    c.heads[0] = 2
    c.seq_cp(0, 1, -1, -1)
    assert layout(c, 1) == ["0:1", "3:1", "4:1", "."]
    assert np.asarray(c.cells(1).shift).tolist() == [0, 2, 2, 0]
    assert c.cells(1).get_has_shift() and c.heads == [2, 2, 0]
    # the data moves at the next update()
    assert not np.array_equal(c.layers[0].k[1], c.layers[0].k[0])
    assert c.update() is True
    assert np.array_equal(c.layers[0].k[1], c.layers[0].k[0])
    assert np.array_equal(c.layers[0].v[1], c.layers[0].v[0])
    assert c.pending_stream_copies() == [] and not c.get_has_shift()
    assert c.update() is False


def test_clear_keeps_queued_copies():
    c = multi(size=4)
    sinfo = place(c, seq_run(0, 0, 2))
    c.cpy_k(0, np.ones((2, 16), np.float32), sinfo)
    c.seq_cp(0, 2, -1, -1)
    c.clear(data=False)
    assert c.get_n_stream() == 3 and all(layout(c, s) == ["."] * 4 for s in range(3))
    assert c.pending_stream_copies() == [(0, 2)]
    assert c.layers[0].k.any()
    c.clear()
    assert not c.layers[0].k.any()


def test_swa_params_are_kept():
    c = KVCache(HP(), kv_size=4, n_swa=3, swa_type=SWAType.CHUNKED)
    assert c.n_swa == 3 and c.swa_type == SWAType.CHUNKED


def test_fork_has_its_own_bookkeeping():
    c = KVCache(HP(), kv_size=8, n_seq_max=2, kv_unified=False)
    c.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0]] * 3))
    f = c.fork()
    f.seq_rm(0, -1, -1)
    f.decode(Batch(tokens=[4, 5], seq_ids=[[1]] * 2))
    f.seq_cp(1, 0, -1, -1)  # a cross-stream copy: queued on the fork only
    assert c.seq_pos_max(0) == 2 and c.seq_pos_max(1) == -1 and c.heads == [3, 0]
    assert c.pending_stream_copies() == [] and f.pending_stream_copies() != []
    assert f.layers[0].k is c.layers[0].k  # rows are shared: a fork is for trying placements
