"""The K-shift (update() after seq_add / seq_div) against a direct scalar RoPE written from ggml's C code.

The reference below follows ggml-cpu/ops.cpp element by element (ggml_rope_cache_init, rope_yarn,
rotate_pairs) with float32 scalars, as the 0.3.36 wheel compiles it: the C library's cosf/sinf/powf, and
``x0 cos - x1 sin`` / ``x0 sin + x1 cos`` contracted to one fma with the x0 product fused (rounded once, computed
here with exact fractions), except the last pair of an f32 NORM rope with an odd pair count.
kvref.memory.kshift computes the same vectorised. Results must be bit-identical.
"""

from __future__ import annotations

import ctypes
import math
import sys
from fractions import Fraction

import numpy as np
import pytest
from kv_cache_helpers import HP, place, seq_run, snapshot

from kvref.errors import KShiftError, KVRefError
from kvref.hparams import RopeType
from kvref.memory.kshift import ROPE_NEOX, ROPE_NORM, RopeParams, cos_sin
from kvref.memory.kv_cache import KVCache

F = np.float32

if sys.platform.startswith("linux"):
    _LIBM = ctypes.CDLL("libm.so.6")
    for _n, _k in (("cosf", 1), ("sinf", 1), ("powf", 2)):
        getattr(_LIBM, _n).restype, getattr(_LIBM, _n).argtypes = ctypes.c_float, [ctypes.c_float] * _k
    cosf, sinf, powf = (lambda t: F(_LIBM.cosf(t))), (lambda t: F(_LIBM.sinf(t))), (lambda a, b: F(_LIBM.powf(a, b)))
else:  # kvref rounds float64 results where it cannot load the C library
    cosf, sinf, powf = (lambda t: F(math.cos(t))), (lambda t: F(math.sin(t))), (lambda a, b: F(math.pow(a, b)))


def ref_fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fmaf: a*b + c exactly (fractions), rounded once to the nearest float32, ties to even."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    r = F(float(exact))  # within one float32 step of the correct rounding
    best = min(
        (np.nextafter(r, F(-np.inf)), r, np.nextafter(r, F(np.inf))),
        key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array([v], F).view(np.uint32)[0]) & 1),
    )
    return F(best)


def ref_rope_head(
    x: list[np.float32], pos: int, n_rot: int, mode: int, base: float, scale: float, mscale: float = 1.0,
    f32_op: bool = True,
) -> list[np.float32]:  # fmt: skip
    """Rotate one head (first n_rot dims) the way ggml's CPU rope kernel does, one pair at a time."""
    out = list(x)
    theta_scale = powf(float(F(base)), float(F(-2.0) / F(n_rot)))
    theta = F(pos)
    for i0 in range(0, n_rot, 2):
        t = F(scale) * theta
        c = cosf(float(t)) * F(mscale)
        s = sinf(float(t)) * F(mscale)
        a, b = (i0, i0 + 1) if mode == ROPE_NORM else (i0 // 2, i0 // 2 + n_rot // 2)
        x0, x1 = F(x[a]), F(x[b])
        if f32_op and mode == ROPE_NORM and (n_rot // 2) % 2 and i0 == n_rot - 2:  # vector loop's unfused tail
            out[a], out[b] = F(x0 * c) - F(x1 * s), F(x0 * s) + F(x1 * c)
        else:
            out[a], out[b] = ref_fma(x0, c, -F(x1 * s)), ref_fma(x0, s, F(x1 * c))
        theta = F(theta * theta_scale)
    return out


def expected_k(
    before: np.ndarray, shifts: list[int], hp: HP, type_k: str, base: float, scale: float, n_rot: int, mode: int
) -> np.ndarray:
    """before: typed K rows (cells, n_embd) as stored; returns the typed rows after the shift."""
    out = before.copy()
    for cell, sh in enumerate(shifts):
        for h in range(hp.n_head_kv_l(0)):
            lo = h * hp.n_embd_head_k
            vals = [F(v) for v in before[cell, lo : lo + hp.n_embd_head_k]]
            rot = ref_rope_head(vals, sh, n_rot, mode, base, scale, f32_op=type_k == "f32")
            for j, v in enumerate(rot):
                out[cell, lo + j] = v
    return out


def filled_cache(hp: HP, type_k: str, size: int = 8, n_tokens: int = 6, seed: int = 0) -> KVCache:
    c = KVCache(hp, type_k=type_k, type_v="f32", v_trans=False, kv_size=size)
    s = place(c, seq_run(0, 0, n_tokens))
    rng = np.random.default_rng(seed)
    for il in range(hp.n_layer):
        c.cpy_k(il, rng.standard_normal((n_tokens, hp.n_embd_k_gqa(il))).astype(np.float32) * 3, s)
    return c


def test_kshift_of_a_bf16_k_cache_is_refused_as_llama_cpp_aborts():
    # ggml-cpu's rope has f32 and f16 kernels only (conformance/crashes/llama-bf16-kshift.json: SIGABRT)
    hp = HP(n_layer=2, n_head_kv=2, n_embd_head=8, rope_type=RopeType.NORM, n_rot=8, rope_freq_base=10000.0)
    c = filled_cache(hp, "bf16")
    c.seq_add(0, 2, 5, 7)
    before = (np.asarray(c.cells(0).shift).copy(), [c.get_k(il, 8)[0].copy() for il in range(2)])
    with pytest.raises(KShiftError, match=r"bf16 K cache.*ggml_compute_forward_rope"):
        c.update()
    assert c.get_has_shift() and np.array_equal(c.cells(0).shift, before[0])
    for il in range(2):
        assert np.array_equal(c.get_k(il, 8)[0].view(np.uint8), before[1][il].view(np.uint8))


@pytest.mark.parametrize("type_k", ["f32", "f16"])
@pytest.mark.parametrize(
    "mode,n_rot", [(RopeType.NORM, 8), (RopeType.NORM, 6), (RopeType.NORM, 4), (RopeType.NEOX, 8), (RopeType.NEOX, 6)]
)
def test_kshift_matches_scalar_reference(type_k, mode, n_rot):
    hp = HP(
        n_layer=2, n_head_kv=2, n_embd_head=8, rope_type=mode, n_rot=n_rot, rope_freq_base=10000.0, rope_freq_scale=0.5
    )
    c = filled_cache(hp, type_k)
    before = [c.get_k(il, 8)[0].copy() for il in range(2)]
    c.seq_add(0, 2, 5, 7)  # cells 2, 3, 4 move by +7
    c.seq_div(0, 5, 6, 2)  # cell 5: pos 5 -> 2, shift 3
    shifts = np.asarray(c.cells(0).shift).tolist()
    assert shifts == [0, 0, 7, 7, 7, 3, 0, 0]
    assert c.update() is True
    assert not c.get_has_shift() and not np.asarray(c.cells(0).shift).any()
    for il in range(2):
        want = expected_k(before[il], shifts, hp, type_k, 10000.0, 0.5, n_rot, int(mode))
        got = c.get_k(il, 8)[0]
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"layer {il}"
    # unshifted cells are bit-identical (rope by 0 is the identity without YaRN)
    assert np.array_equal(c.get_k(0, 2)[0].view(np.uint8), before[0][:2].view(np.uint8))


def test_kshift_swa_layers_use_swa_base_and_scale():
    hp = HP(
        n_layer=2,
        n_head_kv=1,
        n_embd_head=4,
        n_rot=4,
        swa=[False, True],
        rope_freq_base=10000.0,
        rope_freq_base_swa=500.0,
        rope_freq_scale_swa=1.0,
        rope_freq_scale=0.25,
    )
    c = filled_cache(hp, "f32", n_tokens=3)
    before = [c.get_k(il, 8)[0].copy() for il in range(2)]
    c.seq_add(0, 0, -1, 11)
    shifts = np.asarray(c.cells(0).shift).tolist()
    c.update()
    assert np.array_equal(c.get_k(0, 8)[0], expected_k(before[0], shifts, hp, "f32", 10000.0, 0.25, 4, ROPE_NORM))
    assert np.array_equal(c.get_k(1, 8)[0], expected_k(before[1], shifts, hp, "f32", 500.0, 1.0, 4, ROPE_NORM))


def test_kshift_negative_shift_and_freed_cells():
    hp = HP(n_layer=1, n_head_kv=1, n_embd_head=4, n_rot=4)
    c = filled_cache(hp, "f32", n_tokens=4)
    before = c.get_k(0, 8)[0].copy()
    c.seq_add(0, 0, -1, -2)  # pos 0, 1 freed; 2, 3 -> 0, 1 with shift -2
    assert np.asarray(c.cells(0).pos).tolist()[:4] == [-1, -1, 0, 1]
    shifts = c.k_shift_input().tolist()
    assert shifts == [0, 0, -2, -2, 0, 0, 0, 0]
    c.update()
    assert np.array_equal(c.get_k(0, 8)[0], expected_k(before, shifts, hp, "f32", 10000.0, 1.0, 4, ROPE_NORM))


def test_yarn_mscale_applies_to_unshifted_cells_too():
    p = RopeParams(
        n_dims=4, mode=ROPE_NORM, freq_base=10000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.0, n_ctx_orig=4096
    )
    cos, sin = cos_sin(np.array([0]), p)
    mscale = F(1.0) * (F(1) + F(0.1) * F(math.log(float(F(1) / F(0.25)))))
    assert cos.tolist() == [[mscale, mscale]] and sin.tolist() == [[0.0, 0.0]]
    hp = HP(n_layer=1, n_head_kv=1, n_embd_head=4, n_rot=4, rope_freq_scale=0.25)
    c = filled_cache(hp, "f32", n_tokens=2)
    before = c.get_k(0, 8)[0].copy()
    c.seq_add(0, 1, -1, 1)
    c.update(ext_factor=1.0, n_ctx_orig=4096)
    assert np.array_equal(c.get_k(0, 1)[0], before[:1] * mscale)


def test_rope_none_resets_shift_without_touching_k():
    hp = HP(n_layer=1, rope_type=RopeType.NONE)
    c = filled_cache(hp, "f16", n_tokens=3)
    k = c.layers[0].k.copy()
    c.seq_add(0, 0, -1, 4)
    assert c.update() and not c.get_has_shift()
    assert np.array_equal(c.layers[0].k, k)


def test_quantized_k_shift_refused_cache_untouched():
    hp = HP(n_layer=1, n_head_kv=1, n_embd_head=32, n_rot=32)
    c = KVCache(hp, type_k="q8_0", type_v="f16", v_trans=False, kv_size=4)
    place(c, seq_run(0, 0, 2))
    c.seq_add(0, 0, -1, 1)
    before, k = snapshot(c), c.layers[0].k.copy()
    with pytest.raises(KVRefError):
        c.update()
    assert snapshot(c) == before and np.array_equal(c.layers[0].k, k)


def test_cross_stream_copy_is_applied_before_the_shift():
    hp = HP(n_layer=1, n_head_kv=1, n_embd_head=4, n_rot=4)
    c = KVCache(hp, type_k="f32", type_v="f32", kv_unified=False, n_seq_max=2, kv_size=4)
    s = place(c, seq_run(0, 0, 2))
    c.cpy_k(0, np.arange(8, dtype=np.float32).reshape(2, 4) + 1, s)
    before = c.get_k(0, 4)[0].copy()
    c.seq_add(0, 0, -1, 3)
    c.seq_cp(0, 1, -1, -1)
    shifts = np.asarray(c.cells(0).shift).tolist()
    c.update()
    want = expected_k(before, shifts, hp, "f32", 10000.0, 1.0, 4, ROPE_NORM)
    assert np.array_equal(c.get_k(0, 4)[0], want) and np.array_equal(c.get_k(0, 4)[1], want)


def test_neox_pairs_are_half_apart():
    p = RopeParams(n_dims=4, mode=ROPE_NEOX, freq_base=10000.0)
    from kvref.memory.kshift import rope_f32

    x = np.array([[[1.0, 0.0, 0.0, 0.0]]], np.float32)
    y = rope_f32(x, np.array([1]), p)
    # pair (0, 2) rotated by theta = 1: (cos 1, 0, sin 1, 0)
    assert y[0, 0].tolist() == [F(math.cos(1.0)), 0.0, F(math.sin(1.0)), 0.0]
