"""Both mask twins against the per-cell oracle on random cells, ubatches, modes and dtypes.

``KVREF_HYPOTHESIS_EXAMPLES`` sets the number of random cases (default 150; the long run uses 10**4).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mask_helpers import MASK_C, oracle, same_bits, seq_bits

from kvref.memory import _mask_py

EXAMPLES = int(os.environ.get("KVREF_HYPOTHESIS_EXAMPLES", "150"))
TWINS = [m for m in (_mask_py, MASK_C) if m is not None]
N_SEQ = 6


@st.composite
def mask_case(draw):
    n_cstream = draw(st.integers(1, 3))
    size = draw(st.integers(0, 40))
    max_pos = draw(st.integers(0, 30))
    scale = draw(st.sampled_from([1, 1, 1, 97, 3001]))  # large distances: f16 ALiBi rounding, wide windows
    pos, seq, ext = [], [], []
    for _ in range(n_cstream):
        layout = draw(st.sampled_from(["random", "sorted", "runs", "blocks"]))
        if layout == "blocks":  # prompts: each sequence in consecutive cells, positions going up
            cuts = sorted(draw(st.lists(st.integers(0, size), max_size=3)))
            bounds = [0, *cuts, size]
            p = np.zeros(size, dtype=np.int32)
            sets = []
            for b in range(len(bounds) - 1):
                n_b = bounds[b + 1] - bounds[b]
                start = draw(st.integers(0, max_pos))
                p[bounds[b] : bounds[b + 1]] = np.arange(start, start + n_b) * draw(st.sampled_from([1, 1, 2]))
                sets += [{b % N_SEQ}] * n_b
            pos.append(p * scale)
            seq.append(seq_bits(sets))
            e = np.array(draw(st.lists(st.integers(0, 3), min_size=3 * size, max_size=3 * size)), dtype=np.int32)
            ext.append(e.reshape(size, 3))
            continue
        if layout == "runs":  # sequences laid out one after the other with consecutive positions
            p = np.arange(size, dtype=np.int32) % max(1, max_pos + 1)
        else:
            p = np.array(draw(st.lists(st.integers(0, max_pos), min_size=size, max_size=size)), dtype=np.int32)
            if layout == "sorted":
                p.sort()
        empty = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        p[np.array(empty, dtype=bool)] = -1
        sets = [
            set() if p[j] == -1 else set(draw(st.lists(st.integers(0, N_SEQ - 1), max_size=3))) for j in range(size)
        ]
        e = np.array(draw(st.lists(st.integers(0, 3), min_size=3 * size, max_size=3 * size)), dtype=np.int32)
        pos.append(np.where(p == -1, -1, p * scale).astype(np.int32))
        seq.append(seq_bits(sets))
        ext.append(e.reshape(size, 3))
    s2s = np.array(draw(st.lists(st.integers(0, n_cstream - 1), min_size=N_SEQ, max_size=N_SEQ)), dtype=np.int32)
    n_groups = draw(st.integers(1, 4))
    toks = []
    for _ in range(n_groups):  # runs of consecutive positions of one sequence, like a prefill
        s = draw(st.integers(0, N_SEQ - 1))
        start = draw(st.integers(0, max_pos + 4))
        run = draw(st.integers(1, 6))
        step = draw(st.sampled_from([1, 1, 0, -1, 3]))
        toks += [(s, max(0, start + k * step) * scale) for k in range(run)]
    if draw(st.booleans()):
        toks = draw(st.permutations(toks))
    n = len(toks)
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    n_stream = draw(st.sampled_from(divisors))
    n_kv = draw(st.integers(0, size))
    kw = dict(
        n_swa=draw(st.integers(0, 12)) * draw(st.sampled_from([1, scale])),  # 0: empty windows
        swa_type=draw(st.integers(0, 3)),
        causal=draw(st.booleans()),
        non_causal_type=draw(st.integers(0, 2)),
        alibi=draw(st.booleans()),
    )
    if kw["swa_type"] == 2 and kw["n_swa"] == 0:
        kw["n_swa"] = 1  # a chunked window needs n_swa > 0 (an ArgumentError, tested elsewhere)
    if draw(st.booleans()):
        kw["tok_x"] = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        kw["tok_y"] = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    return (n_stream, n // n_stream, n_kv), dtype, pos, seq, ext, s2s, [p for _, p in toks], [s for s, _ in toks], kw


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(mask_case())
def test_twins_match_the_oracle(case):
    shape, dtype, pos, seq, ext, s2s, tok_pos, tok_seq, kw = case
    ref = oracle(shape, dtype, pos, seq, ext, s2s, tok_pos, tok_seq, **kw)
    for mod in TWINS:
        out = np.full(shape, 77.0, dtype=dtype)
        mod.fill_kq_mask_raw(out, pos, seq, ext, s2s, tok_pos, tok_seq, **kw)
        assert same_bits(out, ref), mod.__name__


@settings(max_examples=max(20, EXAMPLES // 5), deadline=None)
@given(
    x=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=50),
    y=st.integers(-(2**31), 2**31 - 1),
    n_buckets=st.integers(4, 2000),
    bidirectional=st.booleans(),
)
def test_bucket_twins_agree(x, y, n_buckets, bidirectional):
    if MASK_C is None:
        return
    a = _mask_py.relative_position_bucket(np.array(x, np.int32), y, n_buckets, bidirectional)
    b = MASK_C.relative_position_bucket(np.array(x, np.int32), y, n_buckets, bidirectional)
    assert np.array_equal(a, b)
