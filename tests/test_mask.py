"""KQ mask, position buckets and K-shift input: each rule against small masks derived by hand.

Every test runs against both twins (ids ``py`` and ``c``). The expected matrices are written from
llama_kv_cache::set_input_kq_mask's conditions: ``0`` = attended, ``X`` = ``-inf``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mask_helpers import MASK_C, cells, need, oracle, same_bits, twin_params

from kvref.memory import _mask_py

X = float("-inf")


@pytest.fixture(params=twin_params())
def mk(request: pytest.FixtureRequest):
    """The mask twin module under test."""
    return need(request.param)


def run(mk, streams, toks, *, n_kv=None, n_stream=1, dtype=np.float32, s2s=None, xy=None, **kw):
    """Mask for tokens ``[(seq, pos), ...]`` over ``streams`` = list of (pos, seq, ext) per cache stream."""
    n_kv = len(streams[0][0]) if n_kv is None else n_kv
    n = len(toks)
    out = np.full((n_stream, n // n_stream, n_kv), 123.0, dtype=dtype)
    tx = ty = None
    if xy is not None:
        tx = [x for x, _ in xy]
        ty = [y for _, y in xy]
    mk.fill_kq_mask_raw(
        out,
        [s[0] for s in streams],
        [s[1] for s in streams],
        [s[2] for s in streams],
        s2s,
        [p for _, p in toks],
        [s for s, _ in toks],
        tok_x=tx,
        tok_y=ty,
        **kw,
    )
    return out


def expect(rows, n_stream=1, dtype=np.float32):
    a = np.array(rows, dtype=np.float32)
    return a.reshape(n_stream, a.shape[0] // n_stream, a.shape[1]).astype(dtype)


def test_backend_selected_matches_build():
    """A run meant to be Cython must really use kvref.memory._mask_c (no silent pure-Python run)."""
    from kvref.memory import mask

    if os.environ.get("KVREF_BACKEND", "auto").strip().lower() == "cython":
        assert mask.BACKEND == "cython" and mask.fill_kq_mask_raw is need(MASK_C).fill_kq_mask_raw
    elif MASK_C is not None and os.environ.get("KVREF_BACKEND", "auto").strip().lower() == "auto":
        assert mask.BACKEND == "cython"
    else:
        assert mask.BACKEND == "python"


# ------------------------------------------------------------------------------ causal / sequences


def test_causal_single_sequence(mk):
    # cells hold positions 0..3 of seq 0; tokens at 2 and 3 see everything up to their own position
    out = run(mk, [cells([0, 1, 2, 3])], [(0, 2), (0, 3)])
    assert same_bits(out, expect([[0, 0, 0, X], [0, 0, 0, 0]]))


def test_empty_cells_and_other_sequences_are_masked(mk):
    # cell 1 is empty, cell 2 belongs to seq 1, cell 3 to seqs 0 and 1
    c = cells([0, -1, 1, 2], [{0}, set(), {1}, {0, 1}])
    out = run(mk, [c], [(0, 5), (1, 5)])
    assert same_bits(out, expect([[0, X, X, 0], [X, X, 0, 0]]))


def test_token_sequence_selects_the_cells(mk):
    # the raw API takes one sequence per token (llama.cpp's seq_id[i][0]); cell 1 is seq 1's only
    c = cells([0, 1], [{0}, {1}])
    out = np.full((1, 1, 2), 9.0, np.float32)
    mk.fill_kq_mask_raw(out, [c[0]], [c[1]], None, None, [4], [1])
    assert same_bits(out, expect([[X, 0]]))


def test_non_causal_attends_all_cells_of_the_sequence(mk):
    out = run(mk, [cells([0, 1, 2, 3, -1])], [(0, 1)], causal=False)
    assert same_bits(out, expect([[0, 0, 0, 0, X]]))


def test_unsorted_cells_and_tokens(mk):
    # positions out of cell order, tokens out of position order, a repeated position
    c = cells([5, 1, 3, 0, 4, 2])
    out = run(mk, [c], [(0, 3), (0, 1), (0, 4), (0, 3), (0, 0)])
    assert same_bits(
        out,
        expect(
            [
                [X, 0, 0, 0, X, 0],
                [X, 0, X, 0, X, X],
                [X, 0, 0, 0, 0, 0],
                [X, 0, 0, 0, X, 0],
                [X, X, X, 0, X, X],
            ]
        ),
    )


def test_n_kv_padding_cells_are_masked(mk):
    # 3 used cells, n_kv = 6: the padding columns are empty cells
    out = run(mk, [cells([0, 1, 2, -1, -1, -1])], [(0, 2)])
    assert same_bits(out, expect([[0, 0, 0, X, X, X]]))


def test_n_kv_smaller_than_the_stream(mk):
    out = run(mk, [cells([0, 1, 2, 3])], [(0, 3)], n_kv=2)
    assert same_bits(out, expect([[0, 0]]))


# ------------------------------------------------------------------------------ sliding windows


def test_swa_standard(mk):
    # n_swa = 2: a cell is outside when p1 - p0 >= 2
    out = run(mk, [cells([0, 1, 2, 3, 4])], [(0, 3), (0, 4)], n_swa=2, swa_type=1)
    assert same_bits(out, expect([[X, X, 0, 0, X], [X, X, X, 0, 0]]))


def test_swa_chunked(mk):
    # n_swa = 4: a token sees from the start of its chunk: p1 = 5 -> cells 4, 5; p1 = 3 -> 0..3
    out = run(mk, [cells([0, 1, 2, 3, 4, 5, 6])], [(0, 5), (0, 3)], n_swa=4, swa_type=2)
    assert same_bits(out, expect([[X, X, X, X, 0, 0, X], [0, 0, 0, 0, X, X, X]]))


def test_swa_symmetric_non_causal(mk):
    # n_swa = 4 -> half = 2 either side of p1 = 3
    out = run(mk, [cells([0, 1, 2, 3, 4, 5, 6])], [(0, 3)], n_swa=4, swa_type=3, causal=False)
    assert same_bits(out, expect([[X, 0, 0, 0, 0, 0, X]]))


def test_swa_symmetric_causal(mk):
    out = run(mk, [cells([0, 1, 2, 3, 4, 5, 6])], [(0, 3)], n_swa=5, swa_type=3)
    assert same_bits(out, expect([[X, 0, 0, 0, X, X, X]]))


def test_swa_standard_non_causal_all_keeps_the_window(mk):
    # non_causal_type ALL: bidirectional, the window still cuts the past (p1 - p0 >= 2)
    out = run(mk, [cells(list(range(8)))], [(0, 5), (0, 7)], n_swa=2, swa_type=1, causal=False, non_causal_type=0)
    assert same_bits(out, expect([[X, X, X, X, 0, 0, 0, 0], [X, X, X, X, X, X, 0, 0]]))


def test_swa_full_span(mk):
    # SWA_FULL: the window cannot hide positions >= the sequence's first position in the ubatch (5)
    out = run(mk, [cells(list(range(8)))], [(0, 5), (0, 7)], n_swa=2, swa_type=1, causal=False, non_causal_type=2)
    assert same_bits(out, expect([[X, X, X, X, 0, 0, 0, 0], [X, X, X, X, X, 0, 0, 0]]))


def test_swa_full_span_is_per_sequence(mk):
    # n_swa = 1 leaves only p0 >= p1; seq 1's ubatch starts at 2, seq 0's at 6
    c = cells([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7], [{1}] * 4 + [{0}] * 8)
    out = run(mk, [c], [(1, 3), (1, 2), (0, 7), (0, 6)], n_swa=1, swa_type=1, causal=False, non_causal_type=2)
    assert same_bits(
        out,
        expect(
            [
                [X, X, 0, 0] + [X] * 8,
                [X, X, 0, 0] + [X] * 8,
                [X] * 4 + [X, X, X, X, X, X, 0, 0],
                [X] * 4 + [X, X, X, X, X, X, 0, 0],
            ]
        ),
    )


def test_swa_full_does_not_apply_when_causal(mk):
    out = run(mk, [cells(list(range(8)))], [(0, 5), (0, 7)], n_swa=2, swa_type=1, causal=True, non_causal_type=2)
    assert same_bits(out, expect([[X, X, X, X, 0, 0, X, X], [X, X, X, X, X, X, 0, 0]]))


def test_swa_only_keeps_a_cache_without_window_causal(mk):
    out = run(mk, [cells([0, 1, 2])], [(0, 1)], causal=False, non_causal_type=1)
    assert same_bits(out, expect([[0, 0, X]]))


def test_swa_only_makes_a_windowed_cache_bidirectional(mk):
    # n_swa = 1 hides p0 <= p1 - 1, and nothing after p1
    out = run(mk, [cells([0, 1, 2, 3])], [(0, 1)], n_swa=1, swa_type=1, causal=False, non_causal_type=1)
    assert same_bits(out, expect([[X, 0, 0, 0]]))


# ------------------------------------------------------------------------------ ALiBi, M-RoPE, dtypes


def test_alibi_values(mk):
    out = run(mk, [cells([0, 1, 2, 3, -1])], [(0, 2), (0, 3)], alibi=True)
    assert same_bits(out, expect([[-2, -1, 0, X, X], [-3, -2, -1, 0, X]]))
    assert not np.signbit(out[0, 0, 2])  # -|0| is +0, not -0


def test_alibi_f16_rounding(mk):
    # 2049 and 2051 are not halves: round to nearest even (2048, 2052); 70000 overflows to -inf
    out = run(mk, [cells([0, 0, 0, 100000])], [(0, 2049), (0, 2051), (0, 70000)], alibi=True, dtype=np.float16, n_kv=3)
    assert out[0, 0, 0] == -2048 and out[0, 1, 0] == -2052 and np.isneginf(out[0, 2, 0])


def test_f16_bit_patterns(mk):
    out = run(mk, [cells([0, 1])], [(0, 0)], dtype=np.float16)
    assert out.view(np.uint16).tolist() == [[[0x0000, 0xFC00]]]
    out32 = run(mk, [cells([0, 1])], [(0, 0)], dtype=np.float32)
    assert out32.view(np.uint32).tolist() == [[[0x00000000, 0xFF800000]]]


def test_mrope_2d_rule(mk):
    # four cells at pos 5 with (x, y) = (0,0) (1,0) (0,1) (1,1) and one earlier cell at pos 4 with (9, 9)
    c = cells([5, 5, 5, 5, 4], ext=[(0, 0), (1, 0), (0, 1), (1, 1), (9, 9)])
    out = run(mk, [c], [(0, 5), (0, 5), (0, 5)], xy=[(1, 0), (0, 1), (0, 0)])
    assert same_bits(
        out,
        expect(
            [
                [0, 0, X, X, 0],  # token (1, 0): cells with y > 0 come later
                [0, 0, 0, X, 0],  # token (0, 1): same row y = 1 only x > 0 comes later
                [0, X, X, X, 0],  # token (0, 0): everything but (0, 0) comes later
            ]
        ),
    )


def test_mrope_2d_rule_is_causal_only(mk):
    c = cells([5, 5], ext=[(0, 0), (1, 1)])
    out = run(mk, [c], [(0, 5)], xy=[(0, 0)], causal=False)
    assert same_bits(out, expect([[0, 0]]))


# ------------------------------------------------------------------------------ streams


def test_multi_stream_layout(mk):
    # two cache streams, seq 0 -> stream 0 and seq 1 -> stream 1; the ubatch has 2 tokens per stream
    s0 = cells([0, 1, 2, -1])
    s1 = cells([0, 1, -1, -1], [{1}, {1}, set(), set()])
    s2s = np.array([0, 1] + [0] * 254, dtype=np.int32)
    out = run(mk, [s0, s1], [(0, 1), (0, 2), (1, 0), (1, 1)], n_stream=2, s2s=s2s)
    assert out.shape == (2, 2, 4)
    assert same_bits(out, expect([[0, 0, X, X], [0, 0, 0, X], [0, X, X, X], [0, 0, X, X]], n_stream=2))


def test_out_is_returned_and_fully_written(mk):
    out = np.full((1, 3, 5), np.nan, np.float32)
    p, s, _ = cells([0, 1, 2, 3, 4])
    res = mk.fill_kq_mask_raw(out, [p], [s], None, None, [1, 3, 0], [0, 0, 0])
    assert res is out and not np.isnan(out).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matches_oracle_on_a_mixed_case(mk, dtype):
    rng = np.random.default_rng(7)
    pos = rng.integers(0, 40, 64).astype(np.int32)
    pos[rng.random(64) < 0.2] = -1
    seqs = [set(rng.choice(4, rng.integers(1, 3), replace=False).tolist()) if q != -1 else set() for q in pos]
    c = cells(pos.tolist(), seqs)
    toks = [(int(rng.integers(0, 4)), int(rng.integers(0, 45))) for _ in range(24)]
    modes = (
        dict(),
        dict(causal=False),
        dict(n_swa=8, swa_type=1),
        dict(n_swa=8, swa_type=2),
        dict(n_swa=8, swa_type=3, causal=False),
        dict(n_swa=5, swa_type=1, causal=False, non_causal_type=2),
        dict(alibi=True),
    )
    for kw in modes:
        out = run(mk, [c], toks, dtype=dtype, **kw)
        ref = oracle(out.shape, dtype, [c[0]], [c[1]], [c[2]], None, [p for _, p in toks], [s for s, _ in toks], **kw)
        assert same_bits(out, ref), kw


@pytest.mark.parametrize(
    ("n_kv", "dtype"),
    [(40, np.float16), (16384, np.float32), (32768, np.float16)],
    ids=["small", "f32-rows-64KiB-apart", "f16-rows-64KiB-apart"],
)
def test_one_token_sequences_match_the_oracle(mk, n_kv, dtype):
    """A decode step: one token for each of 12 sequences, beside a sequence with several tokens, cells shared
    by several sequences, empty cells, 2-D positions. The Cython twin writes the one-token rows during its pass
    over the cells, or lists their cells first when the rows are a multiple of 64 KiB long (they would evict
    each other); every mode must give the oracle's mask either way."""
    rng = np.random.default_rng(11)
    n_used = min(160, n_kv)  # the rest of the n_kv cells are empty
    pos = np.full(n_kv, -1, np.int32)
    pos[:n_used] = rng.integers(0, 30, n_used)
    pos[rng.choice(n_used, n_used // 8, replace=False)] = -1
    seqs: list[set[int]] = [set() for _ in range(n_kv)]
    for j in range(n_used):
        if pos[j] != -1:
            seqs[j] = set(rng.choice(14, rng.integers(1, 4), replace=False).tolist())
    ext = [(int(x), int(y)) for x, y in rng.integers(0, 3, (n_kv, 2))]
    c = cells(pos.tolist(), seqs, ext)
    toks = [(s, int(rng.integers(0, 34))) for s in range(12)] + [(13, 5), (13, 20), (13, 29)]
    xy = [(int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in toks]
    modes = (
        dict(),
        dict(causal=False),
        dict(n_swa=8, swa_type=1),
        dict(n_swa=0, swa_type=1),  # a window of 0: every interval empty, every cell masked
        dict(n_swa=6, swa_type=3, causal=False, non_causal_type=2),
        dict(alibi=True),
        dict(xy=xy),
    )
    for some in (toks, toks[:12]):  # with a sequence of several tokens, and only one-token sequences
        for kw in modes:
            kw = dict(kw, xy=xy[: len(some)]) if "xy" in kw else kw
            out = run(mk, [c], some, dtype=dtype, **kw)
            extra = {}
            if "xy" in kw:
                extra = dict(tok_x=[x for x, _ in kw["xy"]], tok_y=[y for _, y in kw["xy"]])
            rest = {k: v for k, v in kw.items() if k != "xy"}
            tok_pos, tok_seq = [p for _, p in some], [s for s, _ in some]
            ref = oracle(out.shape, dtype, [c[0]], [c[1]], [c[2]], None, tok_pos, tok_seq, **extra, **rest)
            assert same_bits(out, ref), (len(some), kw)


@pytest.mark.parametrize(("n_kv", "dtype"), [(16384, np.float32), (32768, np.float16)], ids=["f32", "f16"])
def test_one_token_rows_64KiB_apart_with_long_lists(mk, n_kv, dtype):
    """The listed one-token rows (rows a multiple of 64 KiB long) over a full cache: one sequence holds every used
    cell, so its list outgrows the room reserved per sequence, and every sequence has cells all along the row,
    which the Cython twin writes in pieces. Checked against the Python twin (itself checked against the oracle
    above): the cell-by-cell oracle is too slow for rows this long."""
    rng = np.random.default_rng(5)
    n_seq = 10
    pos = rng.integers(0, 4000, n_kv).astype(np.int32)
    pos[rng.choice(n_kv, n_kv // 16, replace=False)] = -1
    words = np.zeros((n_kv, 4), np.uint64)
    words[:, 0] = rng.integers(0, 1 << n_seq, n_kv).astype(np.uint64) | np.uint64(1)  # sequence 0 everywhere
    words[pos == -1] = 0
    c = (pos, words, np.zeros((n_kv, 3), np.int32))
    toks = [(s, int(rng.integers(2000, 4100))) for s in range(n_seq)]
    for kw in (dict(), dict(alibi=True), dict(n_swa=1500, swa_type=1), dict(n_swa=700, swa_type=2)):
        out = run(mk, [c], toks, dtype=dtype, **kw)
        ref = run(_mask_py, [c], toks, dtype=dtype, **kw)
        assert same_bits(out, ref), kw
        assert (out == 0).any() and np.isinf(out).any(), kw


# ------------------------------------------------------------------------------ argument errors


BAD_CASES = {
    "out dtype": dict(out=np.zeros((1, 1, 2), np.float64)),
    "out shape": dict(out=np.zeros((1, 2, 2), np.float32)),
    "out 2-D": dict(out=np.zeros((1, 2), np.float32)),
    "n_kv too big": dict(out=np.zeros((1, 1, 3), np.float32)),
    "seq out of range": dict(tok_seq=[256]),
    "negative seq": dict(tok_seq=[-1]),
    "negative pos": dict(tok_pos=[-1]),
    "stream out of range": dict(seq_to_stream=[1]),
    "pos dtype": dict(cell_pos=[np.zeros(2, np.int64)]),
    "seq shape": dict(cell_seq=[np.zeros((2, 3), np.uint64)]),
    "x without y": dict(tok_x=[0]),
    "2-D without ext": dict(tok_x=[0], tok_y=[0], cell_ext=None),
    "swa type": dict(swa_type=7),
    "chunked n_swa 0": dict(swa_type=2, n_swa=0),
    "n_swa negative": dict(swa_type=1, n_swa=-1),
    "non-causal type": dict(non_causal_type=5),
}


@pytest.mark.parametrize("case", list(BAD_CASES), ids=list(BAD_CASES))
def test_bad_arguments_raise_the_same_error_in_both_twins(case):
    errors = []
    for mod in (_mask_py, MASK_C):
        if mod is None:
            pytest.skip("kvref.memory._mask_c is not built")
        p, s, e = cells([0, 1])
        args = dict(
            out=np.zeros((1, 1, 2), np.float32),
            cell_pos=[p],
            cell_seq=[s],
            cell_ext=[e],
            seq_to_stream=None,
            tok_pos=[1],
            tok_seq=[0],
        )
        kw = {}
        for k, v in BAD_CASES[case].items():
            if k in args:
                args[k] = v
            else:
                kw[k] = v
        with pytest.raises((TypeError, ValueError)) as info:
            mod.fill_kq_mask_raw(*args.values(), **kw)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


# ------------------------------------------------------------------------------ T5 buckets, K-shift


def test_relative_position_bucket_hand_values(mk):
    # one-directional, 32 buckets: distances 0..15 exact, then log-spaced up to 128, then capped at 31
    d = np.array([0, 1, 15, 16, 32, 64, 100, 127, 128, 5000])
    got = mk.relative_position_bucket(np.zeros_like(d), d, 32, False)
    # 16 + floor(ln(d/16) * 16 / ln 8): d=32 -> 21.33, d=64 -> 26.67, d=100 -> 30.1, d=127 -> 31.9
    assert got.tolist() == [0, 1, 15, 16, 21, 26, 30, 31, 31, 31]
    # keys after the query fall in bucket 0 one-directionally
    assert mk.relative_position_bucket([10], [3], 32, False).tolist() == [0]
    # bidirectional, 32 buckets: 16 per direction, 8 exact; keys after the query add 16
    assert mk.relative_position_bucket([5, 0, 20], [0, 5, 0], 32, True).tolist() == [21, 5, 26]


def test_relative_position_bucket_twins_agree_exhaustively():
    if MASK_C is None:
        pytest.skip("kvref.memory._mask_c is not built")
    x = np.arange(-70000, 70000, dtype=np.int32)
    for nb in (2, 4, 16, 32, 64, 100, 128, 320, 1024):
        for bi in (False, True):
            if bi and nb < 4:
                continue
            a = _mask_py.relative_position_bucket(x, 0, nb, bi)
            assert np.array_equal(a, MASK_C.relative_position_bucket(x, 0, nb, bi)), (nb, bi)


def test_fill_pos_bucket_raw(mk):
    key = np.array([0, 3, -1, 7], np.int32)  # -1: an empty cell, bucketed as position -1
    tok = np.array([3, 7], np.int32)
    out = np.zeros((2, 4), np.int32)
    mk.fill_pos_bucket_raw(out, key, tok, 32)
    assert out.tolist() == [[3, 0, 4, 0], [7, 4, 8, 0]]
    mk.fill_pos_bucket_raw(out, key, tok, 32, True)
    assert out.tolist() == [[3, 0, 4, 16 + 4], [7, 4, 8, 0]]


def test_fill_k_shift_raw(mk):
    pos = [np.array([0, -1, 5], np.int32), np.array([-1, 2, 3], np.int32)]
    shift = [np.array([4, 9, -2], np.int32), np.array([1, 0, 7], np.int32)]
    out = np.full((2, 3), 99, np.int32)
    mk.fill_k_shift_raw(out, pos, shift)
    assert out.tolist() == [[4, 0, -2], [0, 0, 7]]
