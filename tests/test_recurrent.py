"""RecurrentMemory: scenarios derived from llama_memory_recurrent (llama.cpp, October 2026) and from its mid-2025
rules (llama-cpp-python 0.3.12 .. 0.3.16, ``MID_2025`` below).

Expected values were worked out by hand from the C++ (find_slot, seq_rm, seq_cp, ...); each test says which rule.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from recurrent_helpers import mamba_hparams, ubatch

from kvref.errors import BatchError, FormatError, NoSlotError, SequenceError
from kvref.memory.batch import Batch
from kvref.memory.recurrent import POS_MAX, RecurrentMemory
from kvref.profile import Profile

# the newest profile with the recurrent rules of 2025 (what ``rules="mid-2025"`` selected before profiles)
MID_2025 = dataclasses.replace(
    Profile.of("2026-10"),
    recurrent_seq_rm_rule="any_end_inside",
    recurrent_seq_rm_checks_n_seq_max=False,
    recurrent_rollback_single_use=False,
    recurrent_rows_from_src=False,
    recurrent_restore_seq_bound="mem_size",
)


def mem(n_seq_max: int = 4, **kw) -> RecurrentMemory:
    return RecurrentMemory(
        mamba_hparams(), type_r="f32", type_s="f32", rs_size=max(1, n_seq_max), n_seq_max=n_seq_max, **kw
    )


def cells(m: RecurrentMemory) -> list[tuple[int, list[int], int]]:
    """(pos, sequences, src) of every cell."""
    return [(m.pos[i], sorted(m.seq[i]), m.src[i]) for i in range(m.size)]


def fill_rows(m: RecurrentMemory, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for bufs in (m.r_l, m.s_l):
        for b in bufs:
            if b is not None:
                b[:] = rng.integers(0, 256, b.shape, dtype=np.uint8)


# --- sizes --------------------------------------------------------------------------------------------------


def test_sizes_follow_the_constructor():
    # mamba-tiny: n_embd_r = (4-1)*64 = 192, n_embd_s = 8*64 = 512, f32, 4 cells, 2 layers
    m = mem(4)
    assert m.size_r_bytes() == 2 * 4 * 192 * 4
    assert m.size_s_bytes() == 2 * 4 * 512 * 4
    assert m.total_size() == m.size_r_bytes() + m.size_s_bytes()  # rows are multiples of 32 bytes already
    assert [b.shape for b in m.r_l] == [(4, 768), (4, 768)]


def test_layer_filter_and_rollback_planes_widen_the_tensors():
    m = RecurrentMemory(mamba_hparams(3), rs_size=2, n_seq_max=2, layer_filter=lambda il: il != 1, n_rs_seq=3)
    assert m.layers == [0, 2]
    assert m.r_l[1] is None and m.s_l[1] is None
    assert m.r_l[0].shape == (2 * (1 + 3), 768)  # mem_size * (1 + n_rs_seq) rows
    assert m.size_s_bytes() == 2 * 8 * 2048


def test_total_size_pads_each_tensor_to_32_bytes():
    hp = mamba_hparams()
    hp.ssm_d_inner = 3  # n_embd_r = 9 floats = 36 bytes -> padded to 64 per 1-cell tensor
    m = RecurrentMemory(hp, rs_size=1, n_seq_max=1)
    assert m.size_r_bytes() == 2 * 36
    assert m.total_size() == 2 * 64 + 2 * 96  # S: 8*3 floats = 96 bytes, already aligned


# --- find_slot ----------------------------------------------------------------------------------------------


def test_find_slot_new_sequence_takes_the_first_empty_cell_and_reads_the_zeroed_row():
    m = mem()
    assert m.find_slot(ubatch((0, range(7))))
    assert cells(m)[0] == (6, [0], 0)  # pos = last position of the ubatch; src = its own cell afterwards
    assert (m.head, m.n, m.rs_z, m.used) == (0, 1, 0, 1)
    assert m.tail[0] == 0
    assert m.src0[0] == 0  # src was -1: the state starts from the zeroed row rs_z


def test_seq_cp_shares_the_tail_and_the_copy_moves_out_on_its_next_ubatch():
    m = mem()
    m.apply_ubatch(ubatch((0, range(7))))
    m.seq_cp(0, 1)
    assert cells(m)[0] == (6, [0, 1], 0) and m.tail[1] == 0
    assert m.seq_pos_max(1) == 6 and m.used == 1
    slot = m.apply_ubatch(ubatch((1, [7, 8, 9])))
    # seq 1 does not own cell 0 alone: it moves to the next empty cell (1) and reads cell 0's state
    assert cells(m)[:2] == [(6, [0], 0), (9, [1], 1)]
    assert m.tail[:2] == [0, 1]
    assert (slot.head, slot.n, slot.rs_z, list(slot.s_copy)) == (1, 1, 1, [0])
    slot = m.apply_ubatch(ubatch((2, [0, 1, 2, 3])))
    assert (slot.head, slot.n, slot.rs_z, list(slot.s_copy)) == (2, 1, 2, [2])  # a new sequence: zeroed row
    assert [m.seq_pos_max(s) for s in range(4)] == [6, 9, 3, -1]


def test_find_slot_reorders_a_multi_sequence_ubatch_into_consecutive_cells():
    m = mem()
    m.apply_ubatch(ubatch((3, [0])))  # cell 0
    m.apply_ubatch(ubatch((0, [0])))  # cell 1
    # s=0: seq 1 (new) gets cell 2; s=1: seq 0 keeps cell 1; then seq 1 is swapped into cell lo + 0 = 1
    slot = m.apply_ubatch(ubatch((1, [0, 1]), (0, [1, 2])))
    assert cells(m) == [(0, [3], 0), (1, [1], 1), (2, [0], 2), (-1, [], -1)]
    assert m.tail == [2, 1, -1, 0]
    # seq 1 reads the zeroed row 2 (first cell of the range nobody copies from); seq 0 reads its old row 1
    assert (slot.head, slot.n, slot.rs_z, list(slot.s_copy_main), list(slot.s_copy_extra)) == (1, 2, 2, [2, 1], [])


def test_find_slot_moves_every_sharer_out_of_a_shared_cell():
    # mamba-multi-seq-batch: seq 0 copied to 1 and 2, then all three advance in one ubatch
    m = mem(3)
    m.apply_ubatch(ubatch((0, [0, 1])))
    m.seq_cp(0, 1)
    m.seq_cp(0, 2)
    slot = m.apply_ubatch(ubatch((0, [2, 3, 4]), (1, [2, 3, 4]), (2, [2, 3, 4])))
    assert cells(m) == [(4, [0], 0), (4, [1], 1), (4, [2], 2)]
    assert m.tail == [0, 1, 2]
    # all three start from the shared state in row 0; rs_z is cell 1, the first one without references
    assert list(slot.s_copy) == [0, 0, 0] and slot.rs_z == 1


def test_gather_copies_state_rows_like_build_rs():
    m = mem()
    m.apply_ubatch(ubatch((0, [0, 1])))
    fill_rows(m)
    row0 = m.s_l[0][0].copy()
    m.seq_cp(0, 1)
    m.apply_ubatch(ubatch((1, [2])))
    np.testing.assert_array_equal(m.s_l[0][1], row0)  # the copy starts from seq 0's state
    m.apply_ubatch(ubatch((2, [0])))
    assert not m.s_l[0][2].any()  # a new sequence starts from zeros


def test_find_slot_refuses_seq_ids_beyond_the_cells_and_head_resets_when_far():
    m = mem(2)
    assert not m.find_slot(ubatch((2, [0])))
    m.head = 5  # head > used + 2*n_seqs -> the search restarts from 0
    m.find_slot(ubatch((1, [0])))
    assert m.tail[1] == 0


def test_prepare_restores_cells_head_and_used():
    m = mem()
    m.apply_ubatch(ubatch((0, [0])))
    before = (cells(m), list(m.tail), m.head, m.used)
    assert m.prepare([ubatch((1, [0])), ubatch((1, [1]))])
    assert (cells(m), list(m.tail), m.head, m.used) == before
    assert not m.prepare([ubatch((1, [0])), ubatch((5, [0]))])
    assert (cells(m), list(m.tail), m.head, m.used) == before


def test_non_consecutive_positions_only_warn(caplog):
    m = mem()
    m.apply_ubatch(ubatch((0, [0, 1])))
    m.apply_ubatch(ubatch((0, [5])))
    assert m.pos[0] == 5
    assert "non-consecutive token position 5 after 1" in caplog.text


# --- seq_rm -------------------------------------------------------------------------------------------------


def three_sequences(**kw) -> RecurrentMemory:
    m = mem(**kw)
    m.apply_ubatch(ubatch((0, range(7))))
    m.seq_cp(0, 1)
    m.apply_ubatch(ubatch((1, [7, 8, 9])))
    m.apply_ubatch(ubatch((2, [0, 1, 2, 3])))
    return m


def test_seq_rm_refuses_cutting_into_the_tail():
    m = three_sequences()
    before = cells(m)
    assert m.seq_rm(0, 3, -1) is False  # 0 < 3 <= 6 < inf: the state cannot forget tokens
    assert m.seq_rm(0, 6, 7) is False
    assert cells(m) == before


def test_seq_rm_ranges_that_miss_the_tail_succeed_without_change():
    # mamba-seq-cp-rm: seq_rm(1, 5, 8) and seq_rm(1, 10, -1) return true (current rules)
    m = three_sequences()
    before = cells(m)
    assert m.seq_rm(1, 5, 8) is True
    assert m.seq_rm(1, 10, -1) is True
    assert m.seq_rm(1, 0, 5) is True
    assert cells(m) == before


def test_seq_rm_whole_sequence_frees_the_cell_and_moves_head_back():
    m = three_sequences()
    assert m.head == 2
    assert m.seq_rm(1, -1, -1) is True
    assert cells(m)[1] == (-1, [], -1) and m.tail[1] == -1 and m.used == 2
    assert m.head == 1
    assert m.seq_rm(0, 0, 7) is True  # [0, 7) covers pos 6: the whole state goes
    assert m.seq_pos_max(0) == -1


def test_seq_rm_negative_or_too_large_ids_are_refused_under_current_rules():
    m = three_sequences()
    before = cells(m)
    assert m.seq_rm(-1, -1, -1) is False  # (uint32_t) -1 >= n_seq_max
    assert m.seq_rm(4, -1, -1) is False
    assert cells(m) == before


def test_seq_rm_mid_2025_rules():
    m = mem(compat=MID_2025)
    m.apply_ubatch(ubatch((0, range(7))))
    m.seq_cp(0, 1)
    m.apply_ubatch(ubatch((1, [7, 8, 9])))
    assert m.seq_rm(1, 5, 8) is False  # 0 < p1 = 8 <= 9: any partial intersection is refused
    assert m.seq_rm(1, 10, -1) is True
    assert m.seq_rm(-1, 3, -1) is False  # negative id: all or nothing
    assert m.seq_rm(-1, 5, 5) is True  # empty range: nothing
    assert m.seq_rm(-1, -1, -1) is True  # everything: cells emptied, tails left as they were
    assert m.used == 0 and all(p == -1 for p in m.pos)
    assert m.tail[:2] == [0, 1]


def test_seq_rm_rollback_within_n_rs_seq():
    m = mem(2, n_rs_seq=2)
    m.apply_ubatch(ubatch((0, range(5))))  # pos 4
    assert m.seq_rm(0, 4, -1) is True  # rollback 1 token
    assert m.pos[0] == 3 and m.rs_idx[0] == 1
    assert m.seq_rm(0, 3, -1) is False  # a rollback is already pending
    m.rs_idx[0] = 0
    assert m.seq_rm(0, 1, -1) is False  # 3 tokens back > n_rs_seq
    slot_mem = mem(2, n_rs_seq=2)
    slot_mem.apply_ubatch(ubatch((0, range(5))))
    slot_mem.seq_rm(0, 3, -1)  # rollback 2: s_copy reads plane 2 once
    assert slot_mem.rs_idx[0] == 2
    slot = slot_mem.apply_ubatch(ubatch((0, [3])))
    assert list(slot.s_copy) == [2 * 2 + 0] and slot_mem.rs_idx[0] == 0


def test_seq_rm_whole_range_resets_a_pending_rollback():
    m = mem(2, n_rs_seq=2)
    m.apply_ubatch(ubatch((0, range(5))))
    m.seq_rm(0, 4, -1)
    assert m.seq_rm(0, -1, -1) is True and m.rs_idx[0] == 0


# --- seq_cp / seq_keep / seq_add / seq_div ------------------------------------------------------------------


def test_seq_cp_drops_the_destination_state_first():
    m = three_sequences()
    m.seq_cp(2, 1)  # seq 1 leaves cell 1 (freed), joins cell 2
    assert cells(m)[1] == (-1, [], -1) and cells(m)[2] == (3, [1, 2], 2)
    assert m.tail[1] == 2 and m.used == 2
    m.seq_cp(3, 2)  # empty source: the destination only loses its state
    assert m.tail[2] == -1 and cells(m)[2] == (3, [1], 2)
    m.seq_cp(0, 9)  # out of range: nothing
    m.seq_cp(1, 1)
    assert m.tail[:4] == [0, 2, -1, -1]


def test_seq_keep_clears_other_tails_and_cells():
    m = three_sequences()
    m.seq_cp(1, 3)
    m.seq_keep(1)
    assert cells(m) == [(-1, [], -1), (9, [1], 1), (-1, [], -1), (-1, [], -1)]
    assert m.tail == [-1, 1, -1, -1] and m.used == 1 and m.head == 0


def test_seq_add_below_zero_keeps_the_cell_but_seq_pos_max_reads_minus_one():
    # llama_memory_recurrent::seq_add only moves the tail cell's pos (nothing is removed below zero);
    # seq_pos_min keeps the running minimum from INT_MAX (so -3 shows), seq_pos_max starts its running
    # maximum at -1 (so the -3 cell reads as -1). Found by conformance/fuzz.py (mamba, jamba seeds).
    m = three_sequences()  # seq 2 at pos 3
    m.seq_add(2, 0, -1, -6)
    assert (m.seq_pos_min(2), m.seq_pos_max(2)) == (-3, -1)
    assert m.seq_pos_max(3) == -1


def test_seq_add_and_seq_div_move_only_the_tail_pos():
    m = three_sequences()
    m.seq_add(1, 0, -1, 5)
    assert m.seq_pos_max(1) == 14
    m.seq_add(1, 0, 14, 5)  # 14 not in [0, 14)
    assert m.seq_pos_max(1) == 14
    m.seq_div(1, 0, -1, 4)
    assert m.seq_pos_max(1) == 3
    m.seq_add(0, 7, 7, 3)  # empty range
    assert m.seq_pos_max(0) == 6
    m.seq_add(0, 0, -1, -10)  # may go negative: llama.cpp does not free the cell
    # seq_pos_max's running maximum starts at -1 (golden fuzz-mamba-seq-add-below-zero), seq_pos_min shows -4
    assert m.pos[0] == -4 and (m.seq_pos_min(0), m.seq_pos_max(0)) == (-4, -1)
    with pytest.raises(SequenceError):
        m.seq_div(1, 0, -1, 0)


def test_seq_pos_min_max_and_clear():
    m = three_sequences()
    m.seq_cp(1, 3)
    assert (m.seq_pos_min(3), m.seq_pos_max(3)) == (9, 9)
    assert (m.seq_pos_min(7), m.seq_pos_max(7)) == (-1, -1)
    fill_rows(m)
    m.src0[0] = 3
    m.clear(True)
    assert m.used == 0 and m.head == 0 and all(t == -1 for t in m.tail)
    assert not m.r_l[0].any()
    assert m.src0[0] == 3  # clear does not reset src0


# --- decode -------------------------------------------------------------------------------------------------


def test_decode_raises_no_slot_and_leaves_the_memory_unchanged():
    # 2025: a unified context let seq ids up to LLAMA_MAX_SEQ through to the memory
    m = three_sequences(compat="2025")
    before = (cells(m), list(m.tail), m.head, m.used)

    with pytest.raises(NoSlotError):
        m.decode(Batch(tokens=[1, 2], pos=[0, 0], seq_ids=[[3], [7]]))  # seq 7 has no cell
    assert (cells(m), list(m.tail), m.head, m.used) == before


@pytest.mark.parametrize("kv_unified", [True, False])
def test_decode_bounds_seq_ids_by_n_seq_max(kv_unified):
    # October 2026: llama_decode bounds seq ids by the context's n_seq_max, unified or not (-1)
    m = three_sequences()
    m.kv_unified = kv_unified
    before = (cells(m), list(m.tail), m.head, m.used)
    with pytest.raises(BatchError, match="seq_id"):
        m.decode(Batch(tokens=[1, 2], pos=[0, 0], seq_ids=[[3], [7]]))
    assert (cells(m), list(m.tail), m.head, m.used) == before


def test_decode_places_every_ubatch():
    m = mem()
    placed = m.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 0, 1], seq_ids=[[0], [0], [1], [1]]))
    # one equal split of two sequences, 2 tokens each
    assert [(u.n_seqs, u.n_seq_tokens) for u, _ in placed] == [(2, 2)]
    assert [(s.head, s.n) for _, s in placed] == [(0, 2)]
    assert cells(m)[:2] == [(1, [0], 0), (1, [1], 1)]
    placed = m.decode(Batch(tokens=[5, 6], seq_ids=[[1], [1]]), n_ubatch=1)  # positions continue at 2
    assert [list(u.pos) for u, _ in placed] == [[2], [3]]
    assert m.seq_pos_max(1) == 3


def test_decode_refuses_coupled_sequences():
    # mamba-multi-seq-batch: a token in several sequences cannot be split sequentially -> llama_decode returns 1
    m = mem(3)
    with pytest.raises(NoSlotError):
        m.decode(Batch(tokens=[1, 2, 3], pos=[0, 1, 2], seq_ids=[[0, 1, 2], [0, 1, 2], [0]]))
    assert m.used == 0
    assert m.update() is False and m.get_can_shift() is True


# --- state --------------------------------------------------------------------------------------------------


def test_state_round_trip_whole_memory():
    m = three_sequences()
    fill_rows(m, 1)
    blob = m.state_write()
    # 3 cells: 4 + 3*(4+4+4) meta, s_trans + n_layer, 2 R records of 12 + 3*768, 2 S records of 12 + 3*2048
    assert len(blob) == 4 + 36 + 8 + 2 * (12 + 3 * 768) + 2 * (12 + 3 * 2048)
    other = mem()
    assert other.state_read(blob) == len(blob)
    assert cells(other) == [(6, [0], 0), (9, [1], 1), (3, [2], 2), (-1, [], -1)]
    assert other.tail == [0, 1, 2, -1] and other.used == 3 and other.head == 0
    assert other.state_write() == blob


def test_state_round_trip_one_sequence_into_another_id():
    m = three_sequences()
    fill_rows(m, 2)
    blob = m.state_write(1)
    assert len(blob) == 5700  # 4 + 8 + 8 + 2*780 + 2*2060: the mamba-tiny sequence blob minus its 8-byte prefix
    m.state_read(blob, 3)
    assert m.seq_pos_max(3) == 9 and m.tail[3] == 3
    np.testing.assert_array_equal(m.s_l[1][3], m.s_l[1][1])
    assert m.state_write(3) == blob


def test_state_write_uses_the_src_row():
    m = three_sequences()
    fill_rows(m, 3)
    m.src[1] = 0  # a cell whose state still lives elsewhere writes that row (current rules)
    sec = m.state_section(1)
    np.testing.assert_array_equal(sec.r[0].data[0], m.r_l[0][0])


def test_state_read_errors_leave_what_llama_cpp_leaves():
    # llama_memory_recurrent::state_read: on failure state_clear clears everything (seq_id -1) or removes the
    # destination sequence; kvref's own trailing-bytes check refuses before anything changes
    m = three_sequences()
    fill_rows(m, 4)
    blob = m.state_write()
    target = mem(2)  # too few cells
    before = (cells(target), [b.copy() for b in target.r_l])
    with pytest.raises(FormatError):
        target.state_read(blob)
    assert cells(target) == before[0]
    snap = cells(m)
    with pytest.raises(FormatError):
        m.state_read(blob + b"\0")
    assert cells(m) == snap
    with pytest.raises(FormatError):
        m.state_read(blob[:-1])  # atomic, the default
    assert cells(m) == snap
    with pytest.raises(FormatError):
        m.state_read(blob[:-1], atomic=False)
    assert all(p == -1 for p, _, _ in cells(m))  # cleared, as llama.cpp leaves it
    m = three_sequences()
    with pytest.raises(FormatError):
        m.state_read(m.state_write(1)[:-1], 0)
    assert (m.seq_pos_max(0), m.seq_pos_max(1), m.seq_pos_max(2)) == (6, 9, 3)  # as three_sequences built it
    with pytest.raises(FormatError):
        m.state_read(m.state_write(1)[:-1], 0, atomic=False)
    assert (m.seq_pos_max(0), m.seq_pos_max(1), m.seq_pos_max(2)) == (-1, 9, 3)
    # a bad seq id in a whole restore
    small = mem(3)
    with pytest.raises(FormatError, match="seq_id"):
        small.state_read(_with_seq(blob, 9))
    # a sequence state cannot be restored into an id beyond the cells; nothing changes
    seq_blob = m.state_write(1)
    snap = cells(m)
    with pytest.raises(FormatError):
        m.state_read(seq_blob, 7)
    assert cells(m) == snap


def _with_seq(blob: bytes, seq: int) -> bytes:
    b = bytearray(blob)
    b[12:16] = seq.to_bytes(4, "little")  # first cell: u32 count, i32 pos, u32 n_seq_id, i32 seq_id
    return bytes(b)


def test_state_read_refuses_a_layer_mismatch():
    m = three_sequences()
    blob = m.state_write()
    other = RecurrentMemory(mamba_hparams(3), rs_size=4, n_seq_max=4)
    with pytest.raises(FormatError, match="n_layer"):
        other.state_read(blob)


def test_state_of_an_empty_memory():
    m = mem()
    blob = m.state_write()
    assert len(blob) == 4 + 8 + 2 * 12 + 2 * 12  # layer headers without rows
    assert m.state_write(0) == blob
    m2 = three_sequences()
    m2.state_read(blob, 1)  # an empty sequence state: the sequence is removed
    assert m2.seq_pos_max(1) == -1 and m2.seq_pos_max(0) == 6


def test_pos_max_constant():
    assert POS_MAX == 2**31 - 1


def test_mid_2025_layout_is_the_same_bytes_for_a_model_with_state_in_every_layer():
    old = mem(compat=MID_2025)
    old.apply_ubatch(ubatch((0, range(3))))
    old.seq_cp(0, 2)
    fill_rows(old, 5)
    old.src[0] = 3  # the 2025 cache wrote each cell's own rows, not its src's
    sec = old.state_section()
    np.testing.assert_array_equal(sec.s[1].data[0], old.s_l[1][0])
    blob = old.state_write()
    new = mem()
    new.state_read(blob)
    assert cells(new)[0] == (2, [0, 2], 0)
    np.testing.assert_array_equal(new.s_l[1][0], old.s_l[1][0])


def test_mid_2025_rules_refuse_what_the_2025_cache_did_not_have():
    with pytest.raises(ValueError):
        RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, n_rs_seq=1, compat=MID_2025)
    # llama_memory_recurrent of 2025 (llama-cpp-python 0.3.16) had layer filters
    m = RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, layer_filter=lambda il: True, compat=MID_2025)
    assert m.profile is MID_2025 and m.profile.recurrent_seq_rm_rule == "any_end_inside"


def test_compat_picks_the_rule_set():
    rules = ("recurrent_seq_rm_rule", "recurrent_seq_rm_checks_n_seq_max", "recurrent_rollback_single_use",
             "recurrent_rows_from_src", "recurrent_restore_seq_bound")  # fmt: skip

    def rule_set(m: RecurrentMemory) -> tuple:
        return tuple(getattr(m.profile, f) for f in rules)

    assert rule_set(RecurrentMemory(mamba_hparams(), compat="2025")) == rule_set(mem(compat=MID_2025))
    assert rule_set(RecurrentMemory(mamba_hparams())) == ("cuts_tail", True, True, True, "n_seq_max")
    # a custom profile overrides the rules of a named generation (what ``rules=`` did)
    current = dataclasses.replace(Profile.of("2025"), **{f: getattr(Profile.of("2026-10"), f) for f in rules})
    assert rule_set(RecurrentMemory(mamba_hparams(), compat=current)) == rule_set(RecurrentMemory(mamba_hparams()))
    with pytest.raises(ValueError):
        RecurrentMemory(mamba_hparams(), compat="2024")


def test_whole_restore_bounds_seq_ids():
    m = mem(4)
    m.apply_ubatch(ubatch((3, [0])))
    blob = m.state_write()
    current = RecurrentMemory(mamba_hparams(), rs_size=4, n_seq_max=3)  # ids must be < n_seq_max
    with pytest.raises(FormatError, match="seq_id"):
        current.state_read(blob)
    old = RecurrentMemory(mamba_hparams(), rs_size=4, n_seq_max=3, compat=MID_2025)  # < cell count only
    old.state_read(blob)
    assert old.tail[3] == 0


def test_duplicate_tails_are_refused():
    m = mem(4)
    m.apply_ubatch(ubatch((0, [0]), (1, [0])))
    blob = bytearray(m.state_write())
    blob[24:28] = (0).to_bytes(4, "little")  # cell 1 (u32 count, 3 x i32 per cell) now also claims seq 0
    target = mem(4)
    with pytest.raises(FormatError, match="duplicate tail"):
        target.state_read(bytes(blob))
    assert target.used == 0
