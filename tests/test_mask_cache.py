"""The mask glue (``kvref.memory.mask``) on a real KVCache: scenarios placed by ``KVCache.decode``.

Each test runs the glue over both twins (``kvref.memory.mask_kernels.impl`` swapped per parameter); the masks of the
placed ubatches are checked by hand where small, and against the per-cell oracle otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
from mask_helpers import need, oracle, same_bits, twin_params

import kvref.memory.mask as mask
import kvref.memory.mask_kernels as mask_kernels
from kvref.errors import ArgumentError, ArgumentTypeError, KVRefError
from kvref.hparams import HParams, SWAType
from kvref.memory.batch import Batch
from kvref.memory.kv_cache import KVCache

X = float("-inf")


@pytest.fixture(params=twin_params())
def glue(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """``kvref.memory.mask`` driving the twin under test."""
    monkeypatch.setattr(mask_kernels, "impl", need(request.param))
    return mask


def hp(**kw) -> HParams:
    return HParams(n_layer=1, n_head_kv=1, n_embd_head_k=4, n_embd_head_v=4, **kw)


def check_against_oracle(cache: KVCache, ub, sinfo, out: np.ndarray, **kw) -> None:
    n = ub.n_tokens
    cells = [cache.cells(s) for s in range(cache.n_stream)]
    ref = oracle(
        out.shape,
        out.dtype,
        [np.asarray(c.pos) for c in cells],
        [np.asarray(c.seq) for c in cells],
        [np.asarray(c.ext) for c in cells],
        cache.seq_to_stream,
        np.asarray(ub.pos)[:n],
        [ids[0] for ids in ub.seq_id],
        n_swa=cache.n_swa,
        swa_type=int(cache.swa_type),
        causal=cache.hparams.causal_attn,
        **kw,
    )
    assert same_bits(out, ref)


def test_two_prompts_in_a_unified_cache(glue):
    cache = KVCache(hp(), kv_size=512, n_seq_max=2, kv_unified=True)
    cache.decode(Batch(tokens=[1, 2, 3, 4], seq_ids=[[0]] * 4))
    ((ub, sinfo),) = cache.decode(Batch(tokens=[5, 6, 7], seq_ids=[[1]] * 3))
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo)
    # n_kv: 7 used cells padded to 256
    assert m.shape == (1, 3, 256) and m.dtype == np.float32
    rows = [[X, X, X, X, 0, X, X, X], [X, X, X, X, 0, 0, X, X], [X, X, X, X, 0, 0, 0, X]]
    assert same_bits(m[:, :, :8], np.array([rows], np.float32))
    assert np.all(np.isneginf(m[:, :, 8:]))
    # without the slot the glue derives the streams from the ubatch: same n_kv
    assert same_bits(glue.fill_kq_mask(cache, ub), m)


def test_shared_prefix_and_reused_out_buffer(glue):
    cache = KVCache(hp(), kv_size=256, n_seq_max=2, kv_unified=True)
    cache.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0, 1]] * 3))  # a prompt both sequences see
    ((ub, sinfo),) = cache.decode(Batch(tokens=[4, 5], seq_ids=[[0], [1]], logits=[1, 1]))
    out = np.empty((1, 2, 256), np.float16)
    m = glue.fill_kq_mask(cache, ub, out, dtype=np.float16, sinfo=sinfo)
    assert m is out
    assert same_bits(m[:, :, :6], np.array([[[0, 0, 0, 0, X, X], [0, 0, 0, X, 0, X]]], np.float16))


def test_multi_stream_ubatch_layout(glue):
    cache = KVCache(hp(), kv_size=256, n_seq_max=2, kv_unified=False)
    placed = cache.decode(Batch(tokens=[1, 2, 3, 4, 5, 6], seq_ids=[[0], [0], [0], [1], [1], [1]]))
    ((ub, sinfo),) = placed
    assert ub.n_seqs_unq == 2 and sinfo.strm == [0, 1]
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo)
    # one block per stream, each over its own stream's cells 0..2
    assert m.shape == (2, 3, 256)
    tri = np.array([[0, X, X], [0, 0, X], [0, 0, 0]], np.float32)
    assert same_bits(m[0, :, :3], tri) and same_bits(m[1, :, :3], tri)
    check_against_oracle(cache, ub, sinfo, m)


def test_swa_cache_and_non_causal(glue):
    cache = KVCache(hp(), kv_size=256, n_seq_max=1, kv_unified=True, n_swa=2, swa_type=SWAType.STANDARD)
    ((ub, sinfo),) = cache.decode(Batch(tokens=[1, 2, 3, 4]))
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo)
    assert same_bits(m[0, :, :4], np.array([[0, X, X, X], [0, 0, X, X], [X, 0, 0, X], [X, X, 0, 0]], np.float32))
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo, causal=False, non_causal_type=mask.NonCausalType.SWA_FULL)
    assert same_bits(m[0, :, :4], np.zeros((4, 4), np.float32))  # the whole ubatch is the span
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo, causal=False)
    assert same_bits(m[0, :, :4], np.array([[0, 0, 0, 0], [0, 0, 0, 0], [X, 0, 0, 0], [X, X, 0, 0]], np.float32))


def test_random_decode_scenario_matches_oracle(glue):
    rng = np.random.default_rng(3)
    for unified in (True, False):
        cache = KVCache(hp(), kv_size=512, n_seq_max=4, kv_unified=unified)
        for step in range(12):
            seqs = rng.choice(4, rng.integers(1, 4), replace=False)
            n_per = int(rng.integers(1, 9))
            seq_ids = [[int(s)] for s in seqs for _ in range(n_per)]
            placed = cache.decode(Batch(tokens=list(range(len(seq_ids))), seq_ids=seq_ids), n_ubatch=8)
            # the mask of the last ubatch sees the cells as they are now
            ub, sinfo = placed[-1]
            for dtype in (np.float32, np.float16):
                m = glue.fill_kq_mask(cache, ub, dtype=dtype, sinfo=sinfo)
                check_against_oracle(cache, ub, sinfo, m)
            if step % 4 == 3:
                s = int(rng.integers(0, 4))
                cache.seq_rm(s, int(rng.integers(0, 4)), -1)


def test_k_shift_input_matches_the_cache(glue):
    cache = KVCache(hp(), kv_size=256, n_seq_max=2, kv_unified=True)
    cache.decode(Batch(tokens=[1, 2, 3, 4, 5], seq_ids=[[0]] * 5))
    cache.seq_add(0, 2, -1, 3)
    got = glue.k_shift_input(cache)
    assert got.shape == (1, 256)
    assert got[0, :6].tolist() == [0, 0, 3, 3, 3, 0]
    flat = cache.k_shift_input()  # llama.cpp's flat [n_stream * size] tensor, as the K-shift reads it
    assert flat.shape == (256,) and flat[:6].tolist() == [0, 0, 3, 3, 3, 0]


def test_pos_bucket_with_and_without_cache(glue):
    cache = KVCache(hp(), kv_size=256, n_seq_max=1, kv_unified=True)
    ((ub, _),) = cache.decode(Batch(tokens=[1, 2, 3]))
    b = glue.fill_pos_bucket(cache, ub, n_buckets=32)
    assert b.shape == (3, 256)
    assert b[:, :4].tolist() == [[0, 0, 0, 1], [1, 0, 0, 2], [2, 1, 0, 3]]  # empty cell 3 counts as pos -1
    t = glue.fill_pos_bucket(None, ub, n_buckets=32)
    assert t.tolist() == [[0, 16 + 1, 16 + 2], [1, 0, 17], [2, 1, 0]]


def test_k_v_idxs_are_the_caches(glue):
    cache = KVCache(hp(), kv_size=256, n_seq_max=2, kv_unified=False, v_trans=True)
    ((ub, sinfo),) = cache.decode(Batch(tokens=[1, 2, 3, 4], seq_ids=[[0], [0], [1], [1]]))
    assert glue.k_idxs(cache, ub, sinfo).tolist() == [0, 1, 256, 257]
    v = glue.v_idxs(cache, ub, sinfo)
    assert v.shape == (4 * 4,) and v[:4].tolist() == [0, 256, 512, 768]


def test_mrope_image_tokens_attend_in_raster_order(glue):
    from kvref.hparams import RopeType

    cache = KVCache(hp(rope_type=RopeType.MROPE, n_embd=4), kv_size=256)
    cache.decode(Batch(tokens=[1, 2, 3, 4, 5]))  # text at positions 0..4
    # a 2x2 image at t = 5: position blocks t, y, x, (unused); tokens in raster order
    pos = np.array([5, 5, 5, 5, 0, 0, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0], np.int32)
    ((ub, sinfo),) = cache.decode(Batch(embd=np.zeros((4, 4), np.float32), pos=pos))
    assert ub.is_pos_2d() and sinfo.idxs == [[5, 6, 7, 8]]
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo)
    img = np.array([[0, X, X, X], [0, 0, X, X], [0, 0, 0, X], [0, 0, 0, 0]], np.float32)
    assert same_bits(m[0, :, 5:9], img)
    assert same_bits(m[0, :, :5], np.zeros((4, 5), np.float32))
    check_against_oracle(cache, ub, sinfo, m, tok_x=pos[8:12], tok_y=pos[4:8])
    # non-causal: the image sees itself whole
    m = glue.fill_kq_mask(cache, ub, sinfo=sinfo, causal=False)
    assert same_bits(m[0, :, 5:9], np.zeros((4, 4), np.float32))


def test_server_decode_step_over_many_column_blocks(glue):
    """A server's decode step (one token for each of many interleaved sequences) over a cache wide enough that the
    Cython twin fills and patches the rows a block of columns at a time, some sequences windowed or emptied."""
    n_seq = 64
    cache = KVCache(hp(), kv_size=16384, n_seq_max=n_seq, kv_unified=True, n_swa=3000, swa_type=SWAType.STANDARD)
    for _ in range(200):
        cache.decode(Batch(tokens=[1] * n_seq, seq_ids=[[s] for s in range(n_seq)]), n_ubatch=n_seq)
    cache.seq_rm(5, -1, -1)  # a sequence without cells
    cache.seq_rm(9, 0, 150)  # and one with a gap
    ((ub, sinfo),) = cache.decode(Batch(tokens=[1] * n_seq, seq_ids=[[s] for s in range(n_seq)]), n_ubatch=n_seq)
    for dtype in (np.float32, np.float16):
        m = glue.fill_kq_mask(cache, ub, dtype=dtype, sinfo=sinfo)
        assert m.shape[2] > 4096  # several 256 KiB blocks of 64 rows
        check_against_oracle(cache, ub, sinfo, m)


def test_server_loop_fills_one_caller_buffer(glue):
    """``fill_kq_mask(..., out=buf)``, the caller's buffer refilled every step (as llama.cpp refills its mask tensor):
    the same bits as a new mask each step, returned as ``buf`` itself; a buffer's dtype wins over ``dtype``."""
    n_seq = 4
    cache = KVCache(hp(), kv_size=512, n_seq_max=n_seq, kv_unified=True)
    cache.decode(Batch(tokens=list(range(8)), seq_ids=[[s % n_seq] for s in range(8)], logits=[1] * 8))
    bufs: dict[tuple, np.ndarray] = {}
    for step in range(6):
        ((ub, sinfo),) = cache.decode(Batch(tokens=[step] * n_seq, seq_ids=[[s] for s in range(n_seq)]))
        n_kv = cache.get_n_kv(sinfo)
        for dt in (np.float32, np.float16):
            buf = bufs.setdefault((dt, n_kv), np.full((1, n_seq, n_kv), 7, dt))  # stale values from the last step
            m = glue.fill_kq_mask(cache, ub, buf, sinfo=sinfo, dtype=np.float32)
            assert m is buf and m.dtype == dt
            assert same_bits(m, glue.fill_kq_mask(cache, ub, sinfo=sinfo, dtype=dt))
            check_against_oracle(cache, ub, sinfo, m)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda s: np.zeros(s, np.float64), ArgumentTypeError, "out: dtype float64 is not one of float32, float16"),
        (lambda s: np.zeros(s, np.int32), ArgumentTypeError, "out: dtype int32 is not one of float32, float16"),
        (lambda s: np.zeros((s[0], s[1], s[2] + 1), np.float32), ArgumentError, "out: shape"),
        (lambda s: np.zeros((s[1], s[2]), np.float32), ArgumentError, "out: shape"),
        (lambda s: np.zeros((s[0], s[1], 2 * s[2]), np.float32)[:, :, ::2], ArgumentError, "C-contiguous"),
        (lambda s: np.lib.stride_tricks.as_strided(np.zeros(s, np.float32), writeable=False), ArgumentError,
         "writeable"),
        (lambda s: [[[0.0] * s[2]] * s[1]] * s[0], ArgumentTypeError, "out: expected a NumPy array"),
    ],
    ids=["float64", "int32", "n_kv", "2-D", "strided", "read-only", "list"],
)  # fmt: skip
def test_caller_buffer_of_the_wrong_kind_is_refused(glue, make, error, message):
    """A buffer of the wrong dtype, shape or layout raises kvref's error naming ``out`` (both twins alike), and the
    buffer and the cache are left as they were."""
    cache = KVCache(hp(), kv_size=256, n_seq_max=2, kv_unified=True)
    ((ub, sinfo),) = cache.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0], [1], [0]], logits=[1, 1, 1]))
    shape = (1, 3, cache.get_n_kv(sinfo))
    buf = make(shape)
    before = np.array(buf, copy=True)
    with pytest.raises(error, match=message.replace("(", r"\(")) as info:
        glue.fill_kq_mask(cache, ub, buf, sinfo=sinfo)
    assert isinstance(info.value, KVRefError)
    assert np.array_equal(np.asarray(buf), before)
    assert cache.cells(0).get_used() == 3
