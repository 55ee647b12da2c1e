"""KVCacheISWA: scenarios derived from llama_kv_cache_iswa (src/llama-kv-cache-iswa.cpp, October 2026)."""

from __future__ import annotations

import pytest
from test_memory_factory import gemma2

from kvref.errors import NoSlotError
from kvref.memory.batch import Batch
from kvref.memory.factory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, create_memory
from kvref.memory.kv_cache_iswa import KVCacheISWA


def iswa(
    n_ctx: int = 512, n_seq_max: int = 1, kv_unified: bool = True, n_swa: int = 4, n_ubatch: int = 32, **kw
) -> KVCacheISWA:
    return create_memory(
        gemma2(n_swa, n_layer=2), n_ctx, n_seq_max, kv_unified, False, "f16", "f16", n_ubatch=n_ubatch, **kw
    )


def positions(cache, stream: int = 0) -> list[int]:
    cells = cache.cells(stream)
    return [int(p) for p in cells.pos if p >= 0] if hasattr(cells, "pos") else []


def test_layers_are_split_between_the_caches():
    mem = iswa()
    assert [layer.il for layer in mem.base.layers] == [1]  # dense
    assert [layer.il for layer in mem.swa.layers] == [0]  # sliding
    assert (mem.base.get_size(), mem.swa.get_size()) == (512, 256)
    assert mem.total_size() == mem.base.total_size() + mem.swa.total_size()


def test_both_caches_place_every_ubatch():
    mem = iswa()
    placed = mem.decode(Batch(tokens=list(range(10)), seq_ids=[[0]] * 10), n_ubatch=4)
    assert [u.n_tokens for u, _ in placed] == [4, 4, 2]
    assert all(slot.base is not None and slot.swa is not None for _, slot in placed)
    assert (mem.base.seq_pos_max(0), mem.swa.seq_pos_max(0)) == (9, 9)
    assert mem.base.seq_pos_min(0) == 0


def test_seq_pos_comes_from_the_swa_cache():
    # the SWA cache forgets positions outside the window once they are overwritten: its range is the memory's
    mem = iswa(n_ctx=512, n_swa=4, n_ubatch=128)
    assert mem.swa.get_size() == 256  # pad(min(512, 4 + 128), 256)
    for start in range(0, 300, 20):
        mem.decode(Batch(tokens=[1] * 20, pos=list(range(start, start + 20)), seq_ids=[[0]] * 20), n_ubatch=128)
    assert mem.seq_pos_max(0) == mem.swa.seq_pos_max(0) == 299
    assert mem.base.seq_pos_min(0) == 0  # the base keeps everything
    assert mem.seq_pos_min(0) == mem.swa.seq_pos_min(0) > 0  # the SWA cache overwrote masked cells


def test_sequence_ops_go_to_both():
    mem = iswa(n_seq_max=2)
    mem.decode(Batch(tokens=list(range(6)), seq_ids=[[0]] * 6))
    mem.seq_cp(0, 1, -1, -1)
    assert (mem.base.seq_pos_max(1), mem.swa.seq_pos_max(1)) == (5, 5)
    assert mem.seq_rm(1, 3, -1) is True
    assert (mem.base.seq_pos_max(1), mem.swa.seq_pos_max(1)) == (2, 2)
    mem.seq_add(1, 0, -1, 10)
    mem.seq_div(1, 0, -1, 2)
    mem.update()
    assert (mem.base.seq_pos_max(1), mem.swa.seq_pos_max(1)) == (6, 6)
    mem.seq_keep(1)
    assert (mem.base.seq_pos_max(0), mem.swa.seq_pos_max(0)) == (-1, -1)
    mem.clear()
    assert (mem.base.seq_pos_max(1), mem.swa.seq_pos_max(1)) == (-1, -1)


def test_can_shift_needs_equal_sizes():
    assert iswa(n_ctx=512).get_can_shift() is False  # 512 vs 256
    assert iswa(n_ctx=512, swa_full=True).get_can_shift() is True


def test_not_unified_uses_equal_splits():
    mem = iswa(n_ctx=512, n_seq_max=2, kv_unified=False)
    placed = mem.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 0, 1], seq_ids=[[0], [0], [1], [1]]))
    assert all(u.equal_seqs for u, _ in placed)
    assert (mem.seq_pos_max(0), mem.seq_pos_max(1)) == (1, 1)


def test_unified_tries_a_simple_split_first():
    mem = iswa(n_ctx=512, n_seq_max=2)
    placed = mem.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 0, 1], seq_ids=[[0], [0], [1], [1]]))
    assert [u.equal_seqs for u, _ in placed] == [False]


def test_a_batch_that_does_not_fit_changes_nothing():
    mem = iswa(n_ctx=256, n_ubatch=256)
    mem.decode(Batch(tokens=[1] * 200, seq_ids=[[0]] * 200))
    before = (mem.base.seq_pos_max(0), mem.swa.seq_pos_max(0), mem.base.seq_pos_min(0))
    with pytest.raises(NoSlotError):
        mem.decode(Batch(tokens=[1] * 100, seq_ids=[[0]] * 100))  # the base cache has 56 free cells
    assert (mem.base.seq_pos_max(0), mem.swa.seq_pos_max(0), mem.base.seq_pos_min(0)) == before


def test_state_round_trip_and_partial_only():
    mem = iswa(n_seq_max=2)
    mem.decode(Batch(tokens=list(range(6)), seq_ids=[[0]] * 6))
    blob = mem.state_write()
    assert len(mem.state_sections()) == 2
    other = iswa(n_seq_max=2)
    assert other.state_read(blob) == len(blob)
    assert other.state_write() == blob
    swa_only = mem.state_write(0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert swa_only == mem.swa.state_write(0)
    fresh = iswa(n_seq_max=2)
    fresh.state_read(swa_only, 1, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert (fresh.swa.seq_pos_max(1), fresh.base.seq_pos_max(1)) == (5, -1)
