"""HybridMemory: scenarios derived from llama_memory_hybrid (src/llama-memory-hybrid.cpp, October 2026)."""

from __future__ import annotations

import pytest
from test_memory_factory import jamba

from kvref.errors import BatchError, FormatError, NoSlotError
from kvref.memory.batch import Batch
from kvref.memory.factory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, create_memory
from kvref.memory.hybrid import HybridMemory


def hybrid(n_seq_max: int = 3, kv_unified: bool = True, n_ctx: int = 256, **kw) -> HybridMemory:
    return create_memory(jamba(), n_ctx, n_seq_max, kv_unified, **kw)


def test_parts_and_filters():
    mem = hybrid()
    assert [layer.il for layer in mem.attn.layers] == [1, 3]
    assert mem.recr.layers == [0, 2]
    assert mem.get_can_shift() is mem.attn.get_can_shift()
    assert mem.total_size() == mem.attn.total_size() + mem.recr.total_size()


def test_default_filters_follow_is_recurrent():
    hp = jamba()
    mem = HybridMemory(hp, kv_size=256, rs_size=2, n_seq_max=2)
    assert ([layer.il for layer in mem.attn.layers], mem.recr.layers) == ([1, 3], [0, 2])


def test_decode_places_in_both_parts():
    mem = hybrid()
    placed = mem.decode(Batch(tokens=list(range(8)), seq_ids=[[0]] * 8))
    ((ub, slot),) = placed
    assert ub.equal_seqs  # the recurrent pattern: equal splits, even for the attention part
    assert (slot.recr.head, slot.recr.n) == (0, 1)
    assert (mem.attn.seq_pos_max(0), mem.recr.seq_pos_max(0)) == (7, 7)


def test_unified_equal_split_is_not_sequential():
    # one stream: split_equal(sequential=false) may group sequences in any order of their ids
    mem = hybrid()
    placed = mem.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 0, 1], seq_ids=[[2], [2], [0], [0]]))
    assert [sorted(u.seq_id_unq) for u, _ in placed] == [[0, 2]]
    assert mem.recr.tail[:3] == [1, -1, 0]


def test_seq_rm_recurrent_first():
    mem = hybrid()
    mem.decode(Batch(tokens=list(range(8)), seq_ids=[[0]] * 8))
    mem.seq_cp(0, 1, -1, -1)
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (7, 7)  # max of minima, min of maxima
    assert mem.attn.seq_pos_min(1) == 0
    # the recurrent part refuses to cut into its tail: the attention part is not touched
    assert mem.seq_rm(0, 4, -1) is False
    assert mem.attn.seq_pos_max(0) == 7
    assert mem.seq_rm(0, -1, -1) is True
    assert (mem.attn.seq_pos_max(0), mem.recr.seq_pos_max(0)) == (-1, -1)
    # every negative id is refused by the recurrent part, so llama_memory_seq_rm(mem, -1, ...) clears nothing
    assert mem.seq_rm(-1, -1, -1) is False
    assert mem.seq_pos_max(1) == 7


def test_other_sequence_ops_go_to_both():
    mem = hybrid()
    mem.decode(Batch(tokens=list(range(4)), seq_ids=[[0]] * 4))
    mem.seq_cp(0, 2, -1, -1)
    mem.seq_keep(2)
    assert (mem.attn.seq_pos_max(0), mem.recr.seq_pos_max(0)) == (-1, -1)
    mem.seq_add(2, 0, -1, 4)
    mem.seq_div(2, 0, -1, 2)
    mem.update()
    assert (mem.attn.seq_pos_max(2), mem.recr.seq_pos_max(2)) == (3, 3)
    mem.clear()
    assert (mem.attn.seq_pos_max(2), mem.recr.seq_pos_max(2)) == (-1, -1)


def test_a_batch_the_recurrent_part_cannot_place_changes_nothing():
    # 2025: a unified context let seq ids up to LLAMA_MAX_SEQ through to the memory
    mem = hybrid(n_seq_max=2, compat="2025")
    mem.decode(Batch(tokens=list(range(4)), seq_ids=[[0]] * 4))
    with pytest.raises(NoSlotError):
        mem.decode(Batch(tokens=[1], pos=[0], seq_ids=[[5]]))  # seq 5 has no recurrent cell
    assert (mem.attn.seq_pos_max(5), mem.recr.used) == (-1, 1)


@pytest.mark.parametrize("unified", [True, False])
def test_decode_bounds_seq_ids_by_n_seq_max(unified):
    # October 2026: llama_decode refuses (-1) seq ids >= the context's n_seq_max, unified or not
    mem = hybrid(n_seq_max=2, kv_unified=unified)
    mem.decode(Batch(tokens=list(range(4)), seq_ids=[[0]] * 4))
    with pytest.raises(BatchError, match="seq_id"):
        mem.decode(Batch(tokens=[1], pos=[0], seq_ids=[[2]]))
    assert (mem.attn.seq_pos_max(0), mem.recr.used) == (3, 1)


def test_partial_only_state_is_the_recurrent_section():
    mem = hybrid()
    mem.decode(Batch(tokens=list(range(8)), seq_ids=[[0]] * 8))
    blob = mem.state_write(0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert blob == mem.recr.state_write(0)
    assert len(blob) == 4 + 8 + 8 + 2 * (12 + 384 * 4) + 2 * (12 + 1024 * 4)
    mem.state_read(blob, 2, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert (mem.recr.seq_pos_max(2), mem.attn.seq_pos_max(2)) == (7, -1)
    with pytest.raises(FormatError):
        mem.state_read(blob + b"\0", 2, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)


def test_state_round_trip_and_atomic_restore():
    mem = hybrid()
    mem.decode(Batch(tokens=list(range(8)), seq_ids=[[0]] * 8))
    blob = mem.state_write()
    assert [s.kind for s in mem.state_sections()] == ["kv", "recurrent"]
    other = hybrid()
    assert other.state_read(blob) == len(blob)
    assert other.state_write() == blob
    seq = mem.state_write(0)
    # a recurrent section that cannot be restored (f16 R here): the attention part must not change either
    f16 = HybridMemory(jamba(), kv_size=256, type_r="f16", rs_size=3, n_seq_max=3)
    with pytest.raises(FormatError, match="r type"):
        f16.state_read(seq, 1)
    assert f16.attn.seq_pos_max(1) == -1


def test_stage_parts_is_all_or_nothing():
    # the composites restore through stage_parts: a bad second section leaves the first part untouched
    from recurrent_helpers import mamba_hparams, ubatch

    from kvref.memory.base import read_all, stage_parts
    from kvref.memory.recurrent import RecurrentMemory

    a, b = (RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2) for _ in range(2))
    a.apply_ubatch(ubatch((0, [0, 1])))
    b.apply_ubatch(ubatch((1, [0, 1, 2])))
    blob = a.state_write() + b.state_write()
    x, y = (RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2) for _ in range(2))
    assert read_all(lambda d, s, f, o: stage_parts([x, y], d, s, f, o), blob, -1, 0) == len(blob)
    assert (x.seq_pos_max(0), y.seq_pos_max(1)) == (1, 2)
    x.clear()
    y.clear()
    bad = bytearray(blob)
    bad[len(a.state_write()) + 8] = 7  # the second section's first cell claims seq 7
    with pytest.raises(FormatError):
        read_all(lambda d, s, f, o: stage_parts([x, y], d, s, f, o), bytes(bad), -1, 0)
    assert (x.seq_pos_max(0), y.seq_pos_max(1), x.used) == (-1, -1, 0)


@pytest.mark.parametrize(("compat", "attn_kept"), [("2026-10", False), ("2026-08", True), ("2025", True)])
def test_failed_recurrent_part_and_the_restored_attention_part(compat, attn_kept):
    # llama_memory_hybrid::state_read reads the attention part, then the recurrent one; when the recurrent part
    # fails (its state_clear removes the destination) October 2026 clears the attention part for the sequence
    # again, 0.3.35 and 0.3.16 keep what it restored (their sources have no try/catch there)
    src = hybrid(compat=compat)
    src.decode(Batch(tokens=list(range(4, 10)), seq_ids=[[0]] * 6))
    seq = src.state_write(0)
    dst = HybridMemory(jamba(), kv_size=256, type_r="f16", rs_size=3, n_seq_max=3, compat=compat)
    dst.decode(Batch(tokens=[4, 5, 6], seq_ids=[[1]] * 3))
    with pytest.raises(FormatError, match="r type"):
        dst.state_read(seq, 1)  # atomic, the default: neither part changes
    assert (dst.recr.seq_pos_max(1), dst.attn.seq_pos_max(1)) == (2, 2)
    with pytest.raises(FormatError, match="r type"):
        dst.state_read(seq, 1, atomic=False)
    assert dst.recr.seq_pos_max(1) == -1
    assert dst.attn.seq_pos_max(1) == (5 if attn_kept else -1)
