"""find_slot / apply_ubatch / prepare / init_batch / decode, pinned to llama-kv-cache.cpp (October 2026).

Each expected layout is derived from the C++ loop it names; '.' is an empty cell, 'pos:seqs' a used one.
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_cache_helpers import HP, layout, place, seq_run, snapshot, ub

from kvref.errors import NoSlotError
from kvref.hparams import SWAType
from kvref.memory.batch import Batch, BatchAllocr
from kvref.memory.cells import TOKEN_NULL
from kvref.memory.kv_cache import KVCache, SlotInfo


def cache(size: int = 8, **kw) -> KVCache:
    return KVCache(HP(n_layer=1), type_k="f32", type_v="f32", kv_size=size, **kw)


# ---------------------------------------------------------------------------------------------- find_slot
def test_placement_from_head_and_head_moves_past_last_cell():
    c = cache()
    s = place(c, seq_run(0, 0, 3))
    assert s == SlotInfo(0, 0, [0], [[0, 1, 2]]) and c.heads == [3]
    place(c, [([0, 1], 3), (1, 0)])
    assert layout(c) == ["0:0", "1:0", "2:0", "3:0,1", "0:1", ".", ".", "."]
    assert c.heads == [5]


def test_find_slot_changes_nothing():
    c = cache()
    place(c, seq_run(0, 0, 3))
    before = snapshot(c)
    assert c.find_slot(ub(seq_run(0, 3, 4)), True).idxs == [[3, 4, 5, 6]]
    assert snapshot(c) == before


@pytest.mark.parametrize("head,expected", [(12, [4, 5]), (8, [8, 9])])
def test_head_reset_rule(head, expected):
    # head_cur > used + 2*n_tokens -> search from 0; here used = 4, n_tokens = 2: reset when head > 8
    c = cache(size=16)
    place(c, seq_run(0, 0, 4))
    c.heads[0] = head
    assert c.find_slot(ub(seq_run(1, 0, 2))).idxs == [expected]


def test_wrap_around_non_contiguous():
    c = cache()
    place(c, seq_run(0, 0, 6))
    c.seq_rm(0, 0, 2)  # cells 0 and 1 free; the head drops to 0
    c.heads[0] = 6
    s = place(c, seq_run(1, 0, 4))
    # scan 6, 7, then wrap to 0, 1: token order follows the scan order
    assert s.idxs == [[6, 7, 0, 1]]
    assert layout(c) == ["2:1", "3:1", "2:0", "3:0", "4:0", "5:0", "0:1", "1:1"]
    assert c.heads == [2]  # past the last placed cell, not the highest one


def test_contiguous_requirement():
    c = cache()
    place(c, seq_run(0, 0, 6))
    c.seq_rm(0, 1, 3)  # free: 1, 2, 6, 7
    assert c.heads == [1]
    u3 = ub(seq_run(1, 0, 3))
    # windows [1,2,3] -> restart at 4, [4,5,6] -> 5, [5,6,7] -> 6, tail too short -> wrap, [0,1,2]: 8 tested
    assert c.find_slot(u3, True) is None
    assert c.find_slot(u3, False).idxs == [[1, 2, 6]]
    assert c.find_slot(ub(seq_run(1, 0, 2)), True).idxs == [[1, 2]]
    c.heads[0] = 3
    assert c.find_slot(ub(seq_run(1, 0, 2)), True).idxs == [[6, 7]]


def test_too_many_tokens_and_full_cache():
    c = cache(size=4)
    assert c.find_slot(ub(seq_run(0, 0, 5))) is None
    place(c, seq_run(0, 0, 4))
    assert c.find_slot(ub(seq_run(1, 0, 1))) is None


# ---------------------------------------------------------------------------------------------- SWA
def test_swa_reuses_masked_cell_of_own_sequence():
    c = cache(size=6, n_swa=4, swa_type=SWAType.STANDARD)
    place(c, seq_run(0, 0, 6))
    # head 6 + 1 > size: wrap to 0; cell 0 (pos 0) is masked for a query at seq_pos_max + 1 = 6
    s = place(c, [(0, 6)])
    assert s.idxs == [[0]]
    assert layout(c) == ["6:0", "1:0", "2:0", "3:0", "4:0", "5:0"] and c.heads == [1]
    # the query position is the cache's seq_pos_max + 1 = 7 (not the ubatch's positions):
    # pos 1..3 are masked (7 - 3 >= 4), pos 4 and 5 are not
    assert c.find_slot(ub(seq_run(0, 7, 4))) is None
    assert c.find_slot(ub(seq_run(0, 7, 3))).idxs == [[1, 2, 3]]


def test_swa_cell_of_another_sequence_and_shared_cells():
    c = cache(size=4, n_swa=1, swa_type=SWAType.STANDARD)
    place(c, [(0, 0), ([0, 1], 1), (1, 5), (2, 0)])
    # cell 0: seq 0 pos 0, masked for seq 0's query at 2 -> usable even for a token of seq 2;
    # cell 1: two sequences -> never; cell 2: seq 1's last position -> not masked (6 - 5 < 1 is false!)
    # so with n_swa = 1 cell 2 is masked as well (6 - 5 >= 1); cell 3 likewise (1 - 0 >= 1)
    assert c.find_slot(ub([(2, 1), (2, 2), (2, 3)])).idxs == [[0, 2, 3]]
    c2 = cache(size=4, n_swa=2, swa_type=SWAType.STANDARD)
    place(c2, [(0, 0), ([0, 1], 1), (1, 5), (2, 0)])
    # n_swa = 2: cell 0 masked (2 - 0 >= 2), cell 2 not (6 - 5 < 2), cell 3 not (1 - 0 < 2)
    assert c2.find_slot(ub([(2, 1)])).idxs == [[0]]
    assert c2.find_slot(ub([(2, 1), (2, 2)])) is None


def test_swa_chunked_rule():
    c = cache(size=5, n_swa=4, swa_type=SWAType.CHUNKED)
    place(c, seq_run(0, 0, 5))
    # query at 5 lies in chunk [4, 8): positions 0..3 are masked
    assert c.find_slot(ub(seq_run(0, 5, 4))).idxs == [[0, 1, 2, 3]]
    assert c.find_slot(ub(seq_run(0, 5, 5))) is None


def test_apply_purges_lower_positions_of_overwritten_sequence():
    c = cache(size=6, n_swa=2, swa_type=SWAType.STANDARD)
    # cells hold seq 0 positions out of order: 3 4 5 0 1 2
    place(c, [(0, p) for p in (3, 4, 5, 0, 1, 2)])
    s = place(c, [(0, 6)])
    # cell 0 (pos 3) is reused; positions [min, 3] of seq 0 are purged so its range stays gap-free
    assert s.idxs == [[0]]
    assert layout(c) == ["6:0", "4:0", "5:0", ".", ".", "."]
    assert c.heads == [1]


def test_apply_ext_token_and_2d_positions():
    c = cache(size=4)
    u = ub([(0, 0), (0, 1)], pos2d=[(3, 4), (5, 6)])
    c.apply_ubatch(c.find_slot(u), u)
    assert [c.cells(0).ext_get(i) for i in range(2)] == [(3, 4, 100), (5, 6, 101)]
    # an embedding batch without 2-D positions leaves ext untouched (a freed cell keeps what it had)
    c.seq_add(0, 0, -1, -1)  # frees cell 0 (pos -1) without resetting its ext
    u2 = ub([(1, 0)], token_ids=False)
    s = c.find_slot(u2)
    assert s.idxs == [[0]]
    c.apply_ubatch(s, u2)
    assert c.cells(0).ext_get(0) == (3, 4, 100)
    u3 = ub([(1, 1)])
    c.apply_ubatch(c.find_slot(u3), u3)
    assert c.cells(0).ext_get(2) == (0, 0, 100)
    assert TOKEN_NULL == -1


# ---------------------------------------------------------------------------------------------- prepare
def test_prepare_restores_cells_and_heads():
    c = cache()
    place(c, seq_run(0, 0, 2))
    before = snapshot(c)
    sinfos = c.prepare([ub(seq_run(0, 2, 3)), ub(seq_run(0, 5, 3))])
    assert [s.idxs for s in sinfos] == [[[2, 3, 4]], [[5, 6, 7]]]
    assert snapshot(c) == before


def test_prepare_failure_returns_empty_and_restores():
    c = cache(size=6)
    place(c, seq_run(0, 0, 2))
    before = snapshot(c)
    assert c.prepare([ub(seq_run(0, 2, 3)), ub(seq_run(0, 5, 2))]) == []
    assert snapshot(c) == before


def test_prepare_keeps_swa_purge_outside_the_slot():
    # llama.cpp saves only the slot's cells: what apply_ubatch purged elsewhere stays purged
    c = cache(size=6, n_swa=2, swa_type=SWAType.STANDARD)
    place(c, [(0, p) for p in (3, 4, 5, 0, 1, 2)])
    assert c.prepare([ub([(0, 6)]), ub(seq_run(1, 0, 6))]) == []
    assert layout(c) == ["3:0", "4:0", "5:0", ".", ".", "."]
    assert c.heads == [6]


def test_prepare_restores_head_by_stream_index():
    # llama.cpp restores head[strm[s]] from the saved v_heads[s]: for a ubatch living in stream 1
    # only, stream 1 gets stream 0's old head
    c = cache(size=4, kv_unified=False, n_seq_max=2)
    place(c, seq_run(0, 0, 2))
    place(c, seq_run(1, 0, 3))
    assert c.heads == [2, 3]
    assert c.prepare([ub([(1, 3)]), ub([(1, 4)])]) == []
    assert c.heads == [2, 2]
    assert layout(c, 1) == ["0:1", "1:1", "2:1", "."]


# ---------------------------------------------------------------------------------------------- multi-stream
def test_multi_stream_slot_and_indices():
    hp = HP(n_layer=1, n_head_kv=1, n_embd_head=2)
    c = KVCache(hp, type_k="f32", type_v="f32", v_trans=True, kv_unified=False, kv_size=4, n_seq_max=3)
    place(c, [(2, 0)])
    u = ub([(0, 0), (0, 1), (2, 1), (2, 2)])
    s = c.find_slot(u)
    assert (s.s0, s.s1, s.strm, s.idxs) == (0, 2, [0, 2], [[0, 1], [1, 2]])
    assert c.k_idxs(u, s).tolist() == [0, 1, 9, 10]
    # transposed V: element (token i, component j) -> stream offset + j * size + cell
    assert c.v_idxs(u, s).tolist() == [0, 4, 1, 5, 17, 21, 18, 22]
    c.apply_ubatch(s, u)
    assert layout(c, 0) == ["0:0", "1:0", ".", "."] and layout(c, 2) == ["0:2", "1:2", "2:2", "."]
    assert c.heads == [2, 0, 3]


def test_get_n_kv_padding():
    c = KVCache(HP(n_layer=1), type_k="f32", type_v="f32", kv_size=1024, n_pad=1)
    s = place(c, seq_run(0, 0, 3))
    assert c.get_n_kv(s) == 256  # padded to max(n_pad, 256)
    s = place(c, seq_run(0, 3, 297))
    assert c.cells(0).used_max_p1() == 300 and c.get_n_kv(s) == 512
    small = cache(size=8)
    assert small.get_n_kv(place(small, [(0, 0)])) == 8  # at most the cache size
    big_pad = KVCache(HP(n_layer=1), type_k="f32", type_v="f32", kv_size=1024, n_pad=512)
    assert big_pad.get_n_kv(place(big_pad, [(0, 0)])) == 512


# ---------------------------------------------------------------------------------------------- init_batch / decode
def test_decode_positions_continue_and_split_simple():
    c = cache()
    placed = c.decode(Batch(tokens=[1, 2, 3]), n_ubatch=2)
    assert [s.idxs for _, s in placed] == [[[0, 1]], [[2]]]
    c.decode(Batch(tokens=[4, 5]))
    assert layout(c) == ["0:0", "1:0", "2:0", "3:0", "4:0", ".", ".", "."]
    assert [c.cells(0).ext_get(i)[2] for i in range(5)] == [1, 2, 3, 4, 5]


def test_decode_multi_stream_split_equal():
    c = cache(size=4, kv_unified=False, n_seq_max=2)
    placed = c.decode(Batch(tokens=[1, 2, 3, 4], seq_ids=[[0], [1], [0], [1]]), n_ubatch=4)
    ((u, s),) = placed
    assert s.strm == [0, 1] and s.idxs == [[0, 1], [0, 1]]
    assert u.batch_idxs.tolist() == [0, 2, 1, 3]
    assert layout(c, 0) == ["0:0", "1:0", ".", "."] and layout(c, 1) == ["0:1", "1:1", ".", "."]


def test_decode_stores_rows_in_batch_order():
    hp = HP(n_layer=2, n_head_kv=1, n_embd_head=2)
    c = KVCache(hp, type_k="f32", type_v="f32", v_trans=True, kv_unified=False, kv_size=4, n_seq_max=2)
    k = np.arange(8, dtype=np.float32).reshape(4, 2)
    c.decode(Batch(tokens=[1, 2, 3, 4], seq_ids=[[0], [1], [0], [1]]), k={1: k}, v={1: k + 100})
    got = c.get_k(1, 2)
    assert got[0].tolist() == [[0, 1], [4, 5]] and got[1].tolist() == [[2, 3], [6, 7]]
    v = c.get_v(1, 2)  # transposed: (stream, component, cell)
    assert v[0].tolist() == [[100, 104], [101, 105]]
    assert not c.get_k(0, 4).any()


def test_decode_full_cache_raises_and_leaves_cache_unchanged():
    c = cache(size=4)
    c.decode(Batch(tokens=[1, 2, 3]))
    before = snapshot(c)
    with pytest.raises(NoSlotError):
        c.decode(Batch(tokens=[4, 5]), n_ubatch=1)
    assert snapshot(c) == before


def test_decode_applies_pending_update_first():
    c = cache(size=4)
    c.decode(Batch(tokens=[1, 2]))
    c.seq_add(0, 0, -1, 3)
    assert c.get_has_shift()
    c.decode(Batch(tokens=[3]))
    assert not c.get_has_shift()
    assert layout(c) == ["3:0", "4:0", "5:0", "."]


def test_init_batch_with_allocator():
    c = cache(size=4)
    balloc = BatchAllocr()
    balloc.init(Batch(tokens=[1, 2, 3, 4, 5]), memory=c, n_seq_max=256)
    with pytest.raises(NoSlotError):
        c.init_batch(balloc, 2)
    balloc.init(Batch(tokens=[1, 2, 3]), memory=c, n_seq_max=256)
    pairs = c.init_batch(balloc, 2)
    assert [s.idxs for _, s in pairs] == [[[0, 1]], [[2]]]
    assert layout(c) == ["."] * 4  # prepared, not applied


# ---------------------------------------------------------------------------------------------- misuse
def test_apply_ubatch_rejects_shared_target_cell_unchanged():
    from kvref.errors import CellError

    c = cache(size=4)
    place(c, [([0, 1], 0)])
    before = snapshot(c)
    with pytest.raises(CellError):
        c.apply_ubatch(SlotInfo(0, 0, [0], [[1, 0]]), ub([(0, 1), (0, 2)]))
    assert snapshot(c) == before


def test_prepare_refuses_pending_shift_in_target_and_restores():
    from kvref.errors import KVRefError

    c = cache(size=4, n_swa=1, swa_type=SWAType.STANDARD)
    place(c, seq_run(0, 0, 4))
    c.seq_add(0, 0, -1, 1)  # pending shift; every cell is SWA-reusable for seq 0 (query at 5)
    before = snapshot(c)
    with pytest.raises(KVRefError):
        c.prepare([ub([(0, 5)])])
    assert snapshot(c) == before
    c.update()
    assert c.prepare([ub([(0, 5)])])[0].idxs == [[0]]


def test_multi_stream_ubatch_must_be_grouped():
    from kvref.errors import BatchError

    c = cache(size=4, kv_unified=False, n_seq_max=2)
    with pytest.raises(BatchError):
        c.find_slot(ub([(0, 0), (1, 0), (0, 1)]))
    with pytest.raises(BatchError):
        c.find_slot(ub([(0, 0), (1, 0), (0, 1), (1, 1)]))  # interleaved instead of grouped


def test_rows_in_and_out():
    hp = HP(n_layer=2, n_head_kv=1, n_embd_head=2, n_embd_head_v=2)
    c = KVCache(hp, type_k="bf16", type_v="f16", v_trans=True, kv_size=4)
    s = place(c, seq_run(0, 0, 2))
    c.cpy_k(0, np.array([[1.0, 2.0], [3.0, 1.0 / 3.0]], np.float32), s)
    # bf16 is returned as its bit pattern; 1/3 rounds to nearest even: 0x3EAB
    assert c.get_k(0, 2)[0].tolist() == [[0x3F80, 0x4000], [0x4040, 0x3EAB]]
    raw = np.frombuffer(np.array([7.0, 8.0], np.float16).tobytes() * 2, np.uint8).reshape(2, 4)
    c.cpy_v(1, raw, s)
    assert c.get_v(1, 2)[0].tolist() == [[7.0, 7.0], [8.0, 8.0]]
    assert c.v_idxs(ub(seq_run(0, 0, 2)), s).tolist() == [0, 4, 1, 5]
    from kvref.errors import KVRefError

    with pytest.raises(KVRefError):
        c.cpy_k(0, np.zeros((2, 3), np.float32), s)


def test_transposed_v_pads_narrow_layers_with_zeros():
    from kvref.hparams import HParams

    hp = HParams(
        n_layer=2,
        n_head=1,
        n_head_kv=1,
        n_embd_head_k=4,
        n_embd_head_v=4,
        n_embd_head_v_swa=2,
        swa_layers=[False, True],
        swa_type=SWAType.STANDARD,
        n_swa=4,
    )
    c = KVCache(hp, type_k="f32", type_v="f32", v_trans=True, kv_size=4)
    assert c.layers[1].v.shape == (1, 4, 16)  # every layer padded to n_embd_v_gqa_max = 4
    c.layers[1].v.fill(0xFF)
    s = place(c, [(0, 0)])
    c.cpy_v(1, np.array([[5.0, 6.0]], np.float32), s)
    assert c.get_v(1, 1)[0, :, 0].tolist() == [5.0, 6.0, 0.0, 0.0]
