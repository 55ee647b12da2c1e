"""Fidelity at the edges (issue 22 section 1): where llama.cpp 0.3.36 returns a value kvref returns it and leaves the
memory as llama.cpp does; kvref raises (a kvref.errors class) only where llama.cpp dies, throws, refuses the context
or would leave its cells contradicting themselves, and then changes nothing. The golden cases ``edges-*``
(conformance/edges.py) pin the same table against the real llama.cpp; these tests name each rule. They run on the
backend the session selects (KVREF_BACKEND), the cell-level ones on both twins (``cells_cls``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvref
from kvref.errors import (
    ArgumentError,
    BatchError,
    CellError,
    CorruptionError,
    KShiftError,
    KVRefError,
    SequenceError,
)

MODELS = Path(__file__).resolve().parent.parent / "conformance" / "models"
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def memory(model: str, n_seq_max: int = 3, kv_unified: bool = True, **kw: Any) -> Any:
    hp = kvref.HParams.from_gguf(MODELS / f"{model}-tiny.gguf")
    return kvref.create_memory(hp, n_ctx=256, n_seq_max=n_seq_max, kv_unified=kv_unified, n_batch=32, n_ubatch=32, **kw)


def fill(mem: Any, lens: tuple[int, ...] = (8, 5)) -> Any:
    """seq s at positions 0 .. lens[s] - 1, one decode per sequence (a recurrent memory takes one per cell)."""
    for s, n in enumerate(lens):
        mem.decode(kvref.Batch(tokens=[5 + i for i in range(n)], seq_ids=[[s]] * n), 32)
    return mem


def snap(mem: Any) -> tuple[bytes, list[tuple[int, int]]]:
    def rng(s: int) -> tuple[int, int]:
        try:
            return mem.seq_pos_min(s), mem.seq_pos_max(s)
        except KVRefError:
            return (-2, -2)

    return bytes(mem.state_write()), [rng(s) for s in range(256)]


def refuses(mem: Any, exc: type[Exception], fn: Any, *args: Any) -> None:
    before = snap(mem)
    with pytest.raises(exc):
        fn(*args)
    assert snap(mem) == before


KV_KINDS = ["llama", "gemma3", "lfm2", "lfm2-swa"]  # KV, iSWA, hybrid, hybrid iSWA


# ---------------------------------------------------------------------------------------------- seq_rm
@pytest.mark.parametrize("model", ["lfm2", "lfm2-swa"])
@pytest.mark.parametrize("seq_id", [3, 255, 256, I32_MAX, -2, I32_MIN])
@pytest.mark.parametrize("unified", [True, False])
def test_hybrid_seq_rm_of_an_id_past_n_seq_max_returns_false(model: str, seq_id: int, unified: bool) -> None:
    """llama_memory_hybrid(_iswa)::seq_rm asks the recurrent part first, which refuses an id outside [0, n_seq_max)
    (compared as unsigned): false, and the attention part (which would assert) is never asked."""
    mem = fill(memory(model, kv_unified=unified))
    before = snap(mem)
    assert mem.seq_rm(seq_id, -1, -1) is False
    assert mem.seq_rm(seq_id, 2, 4) is False
    assert snap(mem) == before
    assert mem.recr.seq_rm(seq_id, -1, -1) is False  # the recurrent memory alone answers the same


def test_hybrid_seq_rm_of_an_id_the_attention_part_refuses_changes_nothing() -> None:
    mem = fill(memory("lfm2"))
    assert mem.seq_rm(-1, -1, -1) is False  # -1 is not below n_seq_max as unsigned: refused by the recurrent part
    assert mem.seq_rm(1, -1, -1) is True and mem.seq_pos_max(1) == -1


# ---------------------------------------------------------------------------------------------- seq_div
@pytest.mark.parametrize("model", [*KV_KINDS, "mamba"])
def test_seq_div_by_zero_without_a_cell_in_range_does_nothing(model: str) -> None:
    mem = fill(memory(model))
    before = snap(mem)
    mem.seq_div(0, 50, 60, 0)
    mem.seq_div(2, -1, -1, 0)  # an empty sequence
    mem.seq_div(0, 5, 5, 0)  # an empty range
    assert snap(mem) == before


@pytest.mark.parametrize("model", [*KV_KINDS, "mamba"])
def test_seq_div_by_zero_of_a_cell_in_range_is_refused(model: str) -> None:
    """llama.cpp dies of SIGFPE there."""
    mem = fill(memory(model))
    refuses(mem, KVRefError, mem.seq_div, 0, -1, -1, 0)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_seq_div_by_a_negative_divisor_moves_positions_below_zero(model: str) -> None:
    """pos / d toward zero, as C divides: 3..7 / -1 -> -3..-7; the cells stay, attended like any other."""
    mem = fill(memory(model))
    mem.seq_div(0, 3, 8, -1)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (-7, 2)
    ubs = mem.decode(kvref.Batch(tokens=[9], seq_ids=[[0]]), 32)
    assert mem.seq_pos_max(0) == 3
    mask = kvref.mask.fill_kq_mask(mem, ubs[-1][0], sinfo=ubs[-1][1])
    assert np.isfinite(mask).sum() == 9  # the token attends the 8 cells of seq 0 (3 of them below 0) and itself


@pytest.mark.parametrize("model", ["llama", "gemma3", "lfm2"])
@pytest.mark.parametrize(("p0", "p1", "d"), [(-1, -1, -1), (-1, -1, -2), (3, 8, -3), (1, 2, -1)])
def test_seq_div_that_leaves_a_cell_at_minus_one_is_refused(model: str, p0: int, p1: int, d: int) -> None:
    """-1 marks an empty cell: llama.cpp keeps such a cell used, in its sequence, while it reads as empty."""
    mem = fill(memory(model))
    refuses(mem, CorruptionError, mem.seq_div, 0, p0, p1, d)


def test_seq_div_int32_min_divides_to_zero() -> None:
    mem = fill(memory("llama"))
    mem.seq_div(0, -1, -1, I32_MIN)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, 0)


def test_recurrent_seq_div_by_a_negative_divisor() -> None:
    mem = fill(memory("mamba"))
    mem.seq_div(0, -1, -1, -2)  # the tail 7 -> -3 (a recurrent cell is not marked empty by its position)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (-3, -1)
    mem.seq_div(1, -1, -1, -4)  # 4 -> -1
    assert mem.seq_pos_min(1) == -1


# ---------------------------------------------------------------------------------------------- seq_add
@pytest.mark.parametrize("model", KV_KINDS[:2])
def test_seq_add_past_int32_max_wraps_and_drops_the_cells_that_turn_negative(model: str) -> None:
    mem = fill(memory(model))
    mem.seq_add(0, -1, -1, I32_MAX - 5)  # 0..5 -> INT32_MAX - 5 .. INT32_MAX; 6, 7 wrap negative: dropped
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (I32_MAX - 5, I32_MAX)
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (0, 4)


def test_hybrid_positions_are_those_both_parts_hold() -> None:
    """llama_memory_hybrid: seq_pos_min is the larger of the parts' minima, seq_pos_max the smaller of their maxima;
    the recurrent part's running maximum starts at -1, so a tail moved below 0 reads as -1."""
    mem = fill(memory("lfm2"))
    mem.seq_div(0, 3, 8, -1)  # attention: 0, 1, 2, -3 .. -7; recurrent tail 7 -> -7
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (-7, -1)
    mem = fill(memory("lfm2"))
    mem.seq_add(0, -1, -1, I32_MAX - 5)  # attention: 0..5 moved up, 6, 7 dropped; recurrent tail 7 wraps negative
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (I32_MAX - 5, -1)


def test_kv_seq_add_past_int32_max_cell_by_cell() -> None:
    mem = fill(memory("llama"))
    mem.seq_add(0, 4, -1, I32_MAX)  # 4..7 all wrap: only 0..3 stay
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, 3)
    assert mem.get_cells(0).get_used() == 4 + 5


def test_recurrent_seq_add_past_int32_max_wraps() -> None:
    mem = fill(memory("mamba"))
    mem.seq_add(0, -1, -1, I32_MAX - 5)  # the tail 7 -> INT32_MIN + 1: the cell stays (seq_pos_max reads -1)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (I32_MIN + 1, -1)


def test_recurrent_seq_pos_min_of_a_tail_at_int32_max_is_minus_one() -> None:
    """llama.cpp's running minimum starts at INT32_MAX, which also stands for "no cell"."""
    mem = fill(memory("mamba"))
    mem.seq_add(0, -1, -1, I32_MAX - 7)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (-1, I32_MAX)


# ---------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("model", KV_KINDS)
def test_decode_at_minus_one_of_an_attention_memory_is_refused_as_corrupting(model: str) -> None:
    mem = fill(memory(model))
    refuses(mem, CorruptionError, mem.decode, kvref.Batch(tokens=[5, 6], pos=[-1, 0], seq_ids=[[2], [2]]), 32)
    with pytest.raises(BatchError):  # below -1: decreasing positions, llama_decode returns -1
        mem.decode(kvref.Batch(tokens=[5], pos=[-2], seq_ids=[[2]]), 32)
    with pytest.raises(BatchError):  # -1 after the sequence's cells: not consecutive, -1 too
        mem.decode(kvref.Batch(tokens=[5], pos=[-1], seq_ids=[[0]]), 32)


def test_recurrent_decode_at_minus_one_is_decoded() -> None:
    mem = fill(memory("mamba"))
    mem.decode(kvref.Batch(tokens=[5], pos=[-1], seq_ids=[[2]]), 32)
    assert (mem.seq_pos_min(2), mem.seq_pos_max(2)) == (-1, -1)
    mem.decode(kvref.Batch(tokens=[5, 6], pos=[0, 1], seq_ids=[[2], [2]]), 32)
    assert (mem.seq_pos_min(2), mem.seq_pos_max(2)) == (1, 1)


@pytest.mark.parametrize("model", [*KV_KINDS, "mamba"])
def test_decode_over_n_batch_is_refused(model: str) -> None:
    """llama_decode asserts n_tokens_all <= n_batch (the fast paths of KVCache and KVCacheISWA leave such a batch to
    the check)."""
    mem = fill(memory(model))
    refuses(mem, ArgumentError, mem.decode, kvref.Batch(tokens=[5] * 33, seq_ids=[[0]] * 33), 64)
    mem.decode(kvref.Batch(tokens=[5] * 32, seq_ids=[[1]] * 32), 64)  # n_batch tokens are fine


def test_hybrid_iswa_decode_after_a_shift_is_refused() -> None:
    """lfm2-swa's iSWA base cache has no layer: llama.cpp's K-shift of it asserts (GGML_ASSERT(buffer))."""
    mem = fill(memory("lfm2-swa"))
    mem.seq_add(0, 2, -1, -1)
    refuses(mem, KShiftError, mem.decode, kvref.Batch(tokens=[5], seq_ids=[[1]]), 32)
    mem = fill(memory("lfm2-swa"))
    mem.seq_div(0, 50, 60, 2)  # nothing moved: no shift
    mem.decode(kvref.Batch(tokens=[5], seq_ids=[[1]]), 32)


def test_swa_window_test_at_seq_pos_max_plus_one_wraps() -> None:
    """find_slot may reuse a cell outside its own sequence's window for a query at seq_pos_max + 1, an int32 sum in
    llama.cpp: for a cell at INT32_MAX it wraps to INT32_MIN, and a chunked window does not mask the cell (golden
    fuzz-llama4-chunked-swa-reuse-int32-max)."""
    mem = memory("llama4", n_seq_max=2)
    mem.decode(kvref.Batch(tokens=list(range(5, 15)), seq_ids=[[0]] * 10), 32)
    mem.seq_add(0, I32_MIN, I32_MAX, I32_MAX)  # pos 0 -> INT32_MAX, the others wrap negative: dropped
    mem.seq_add(0, -1, 21, -4)  # no cell in range: the heads go back to 0, where the cell at INT32_MAX is
    mem.decode(kvref.Batch(tokens=[5, 6, 7, 8], seq_ids=[[1]] * 4), 32)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (I32_MAX, I32_MAX)
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (0, 3)


# ---------------------------------------------------------------------------------------------- seq_cp
@pytest.mark.parametrize(("p0", "p1"), [(I32_MAX, -1), (-1, I32_MAX), (I32_MAX, I32_MAX), (3, -1), (0, 100), (254, -1)])
def test_cross_stream_seq_cp_of_a_partial_range_or_an_end_at_int32_max_is_refused(p0: int, p1: int) -> None:
    """llama.cpp's full-range test computes p + 1 as an int32: INT32_MAX + 1 wraps below the size and it asserts."""
    mem = fill(memory("llama", kv_unified=False))
    refuses(mem, SequenceError, mem.seq_cp, 0, 2, p0, p1)


@pytest.mark.parametrize(("p0", "p1"), [(-1, -1), (0, 0), (255, 255), (255, -1), (I32_MIN, -1)])
def test_cross_stream_seq_cp_of_a_full_range(p0: int, p1: int) -> None:
    mem = fill(memory("llama", kv_unified=False))
    mem.seq_cp(0, 2, p0, p1)
    assert (mem.seq_pos_min(2), mem.seq_pos_max(2)) == (0, 7)


# ---------------------------------------------------------------------------------------------- state
def test_kv_save_of_an_id_no_cell_can_hold() -> None:
    """llama.cpp asks every used cell whether it holds the id (std::bitset::test): past LLAMA_MAX_SEQ it throws and
    llama_state_seq_get_data writes 0 bytes; an id below it in another stream's range writes empty streams."""
    mem = fill(memory("llama", kv_unified=False))
    for s in (3, 255):
        assert mem.state_size(s) == 4 + 3 * 4  # n_stream, then three empty streams
    for s in (-2, 256, I32_MAX, I32_MIN):
        refuses(mem, SequenceError, mem.state_write, s)
    empty = memory("llama", kv_unified=False)
    assert len(empty.state_write(-2)) == 4 + 3 * 4  # no used cell: nothing is asked


def test_hybrid_iswa_failed_restore_keeps_the_attention_part() -> None:
    """llama_memory_hybrid_iswa::state_read undoes nothing (llama_memory_hybrid clears the attention part again)."""
    mem = fill(memory("lfm2-swa"))
    blob = mem.state_write(0)
    with pytest.raises(KVRefError):  # the recurrent part has no cell for sequence 3
        mem.state_read(blob, 3, atomic=False)
    assert mem.attn.seq_pos_max(3) == 7 and mem.recr.seq_pos_max(3) == -1


def test_state_with_positions_below_minus_one_round_trips() -> None:
    """A seq_div by a negative divisor leaves positions below -1; llama.cpp saves and restores them as they are."""
    mem = fill(memory("llama"))
    mem.seq_div(0, 3, 8, -1)
    for seq_id in (-1, 0):
        blob = mem.state_write(seq_id)
        other = memory("llama")
        other.state_read(blob, seq_id)
        assert other.state_write(seq_id) == blob
    other = fill(memory("llama"), (3, 3))
    other.state_read(mem.state_write(0), 2)
    assert (other.seq_pos_min(2), other.seq_pos_max(2)) == (-7, 2)


def test_swa_purge_keeps_positions_below_zero() -> None:
    """apply_ubatch purges a sequence through seq_rm, whose range starts at 0 at the lowest."""
    mem = fill(memory("gemma3"))
    mem.seq_div(0, 3, 8, -1)
    mem.decode(kvref.Batch(tokens=[9], seq_ids=[[0]]), 32)
    assert mem.seq_pos_min(0) == -7


# ---------------------------------------------------------------------------------------------- context, load
@pytest.mark.parametrize("flash_attn", [True, "auto"])
def test_a_q8_0_k_whose_block_does_not_divide_the_head_size_is_refused(flash_attn: bool | str) -> None:
    """llama_init_from_model: "K cache type q8_0 with block size 32 does not divide n_embd_head_k=16"."""
    hp = kvref.HParams.from_gguf(MODELS / "qwen3-tiny.gguf")
    with pytest.raises(KVRefError, match="does not divide n_embd_head_k=16"):
        kvref.create_memory(hp, n_ctx=256, flash_attn=flash_attn, type_k="q8_0", type_v="f16")
    with pytest.raises(KVRefError, match="does not divide n_embd_head_v=16"):
        kvref.create_memory(hp, n_ctx=256, flash_attn=flash_attn, type_k="f16", type_v="q8_0")
    llama = kvref.HParams.from_gguf(MODELS / "llama-tiny.gguf")  # head 32: a whole q8_0 block
    kvref.create_memory(llama, n_ctx=256, flash_attn=flash_attn, type_k="q8_0", type_v="q8_0")


def test_state_load_takes_a_llama_cpp_python_llama_state() -> None:
    """llama-cpp-python's LlamaState (Llama.save_state()) holds llama_state_get_data's bytes in llama_state."""
    llama_cpp = pytest.importorskip("llama_cpp.llama")
    mem = fill(memory("llama"))
    arch = b"llama"
    blob = len(arch).to_bytes(4, "little") + arch + mem.state_write()
    st = llama_cpp.LlamaState(np.zeros(3, np.intc), np.zeros((3, 1), np.single), 3, blob + b"\0" * 5, len(blob), 0)
    obj = kvref.state.load(st)
    assert obj.kind == "state" and obj.to_bytes() == blob
    bad = llama_cpp.LlamaState(np.zeros(0, np.intc), np.zeros((0, 1), np.single), 0, blob, len(blob) + 1, 0)
    with pytest.raises(kvref.errors.FormatError, match="llama_state_size"):
        kvref.state.load(bad)


@pytest.mark.parametrize("model", ["llama", "lfm2", "mamba"])
def test_a_sequence_blob_of_id_minus_one_holds_the_whole_memory(model: str) -> None:
    """llama_state_seq_get_data(ctx, -1) writes every sequence, each cell with its ids (as a context state does):
    the blob's header says -1, and the reader takes the cells as they are."""
    mem = fill(memory(model))
    mem.seq_cp(0, 2, -1, -1)  # a cell of two sequences
    blob = (0xAF143CD8).to_bytes(4, "little") + (-1).to_bytes(4, "little", signed=True) + mem.state_write(-1)
    st = kvref.state.load(blob, kind="seq_state", seq_header=True)
    assert st.seq_id == -1 and st.to_bytes() == blob


# ---------------------------------------------------------------------------------------------- the cell twins
def _cells(cls: type, cells: dict[int, tuple[int, list[int]]], n: int = 6) -> Any:
    c = cls(n)
    for i, (p, seqs) in cells.items():
        c.pos_set(i, p)
        for s in seqs:
            c.seq_add(i, s)
    return c


def test_cells_pos_add_wraps_past_int32_max(cells_cls: type) -> None:
    c = _cells(cells_cls, {0: (10, [0]), 1: (I32_MAX - 1, [0])})
    assert c.pos_add(1, 1) is False and c.pos_get(1) == I32_MAX
    assert c.pos_add(1, 1) is True and c.is_empty(1)  # INT32_MAX + 1 wraps negative: freed
    c = _cells(cells_cls, {0: (10, [0]), 1: (I32_MAX - 1, [0])})
    assert c.seq_add_range(0, 0, I32_MAX, 5) == 1 and c.pos_get(0) == 15
    assert c.pos_add_many([0], I32_MAX).tolist() == [True]


def test_cells_seq_div_range_rules(cells_cls: type) -> None:
    c = _cells(cells_cls, {0: (0, [0]), 1: (4, [0]), 2: (9, [0]), 3: (9, [1])})
    c.seq_div_range(0, 10, 20, 0)  # no cell in range: nothing, whatever d
    with pytest.raises(CellError, match="SIGFPE"):
        c.seq_div_range(0, 0, 10, 0)
    with pytest.raises(CorruptionError):
        c.seq_div_range(0, 0, 10, -3)  # 4 / -3 = -1
    c.seq_div_range(0, 0, 10, -2, check=True)  # checked only
    assert c.pos.tolist()[:4] == [0, 4, 9, 9]
    c.seq_div_range(0, 0, 10, -2)  # toward zero: 0, -2, -4
    assert c.pos.tolist()[:4] == [0, -2, -4, 9] and c.shift.tolist()[:4] == [0, 6, 13, 0]
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (-4, 0)


def test_cells_pos_div_rules(cells_cls: type) -> None:
    c = _cells(cells_cls, {0: (7, [0]), 1: (10, [1])})
    with pytest.raises(CellError, match="SIGFPE"):
        c.pos_div(0, 0)
    with pytest.raises(CorruptionError):
        c.pos_div(0, -7)  # 7 / -7 = -1
    c.pos_div(0, -2)  # toward zero: -3
    assert c.pos_get(0) == -3 and c.get_shift(0) == 10
    c.pos_div(1, 2**40)
    assert c.pos_get(1) == 0


def test_cells_hold_positions_below_minus_one(cells_cls: type) -> None:
    """pos_set / place / pos_set_many / set take any int32 but -1 (what a state restores after a seq_div by a
    negative divisor)."""
    c = _cells(cells_cls, {0: (-7, [0]), 1: (3, [0])})
    assert (c.seq_pos_min(0), c.seq_pos_max(0), c.get_used()) == (-7, 3, 2)
    assert c.place([2, 3], [-2, I32_MIN], [1, 1]) is True
    c.pos_set_many([4], [-5])
    assert c.pos.tolist() == [-7, 3, -2, I32_MIN, -5, -1]
    with pytest.raises(CorruptionError):
        c.pos_set(5, -1)
    assert c.place([5], [-1], [0]) is False
    with pytest.raises(CellError):
        c.pos_set_many([5], [-1])
    d = cells_cls(6)
    d.set(0, c)
    assert d.pos.tolist() == c.pos.tolist() and d.seq_pos_get(1) == c.seq_pos_get(1)
