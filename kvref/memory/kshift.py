"""The K-shift: rotating stored K rows by RoPE for each cell's pending position delta.

llama.cpp applies a pending ``seq_add`` / ``seq_div`` to the K cache by running ``ggml_rope_ext`` in place on a
view of every layer's K tensor, with the per-cell ``shift`` as the position (``llama_kv_cache::build_rope_shift``).
This module reproduces ggml's CPU kernel (``ggml-cpu/ops.cpp``: ``ggml_rope_cache_init``, ``rope_yarn``,
``rotate_pairs``) bit for bit, as the compiled kernel evaluates it:

- the angle of pair ``i`` is built by repeated float32 multiplication, ``theta_0 = pos`` and
  ``theta_{i+1} = theta_i * theta_scale`` with ``theta_scale = powf(freq_base, -2/n_dims)`` — not by a
  fresh power per pair, which would round differently;
- ``rope_yarn``: ``theta = freq_scale * theta``; with ``ext_factor != 0`` the YaRN ramp mixes in the
  unscaled angle and ``mscale`` grows by ``1 + 0.1 ln(1/freq_scale)``; cos and sin are scaled by mscale;
- NORM rotates the pairs ``(2i, 2i+1)``, NEOX the pairs ``(i, i + n_dims/2)``; each element is
  ``x0 cos - x1 sin`` or ``x0 sin + x1 cos`` in float32, then stored: f16 goes in exactly and comes out
  rounded to nearest, ties to even (ggml's table and bit-trick conversions), as NumPy converts.

Two properties of the *build* decide the last bit, so they are a `RopeKernel`, not a model parameter.

**Fused multiply-add.** GCC contracts ``a*b - c*d`` into an ``fma`` when the target has FMA (its default is
``-ffp-contract=fast``). llama-cpp-python 0.3.36's x86-64 build has ``-mfma`` (AVX2 builds; also any
``-march=native`` build on an FMA machine), and its ``libggml-cpu.so`` computes ``x0 cos - x1 sin`` as
``fma(x0, cos, -round(x1 sin))`` and ``x0 sin + x1 cos`` as ``fma(x0, sin, round(x1 cos))``: the x0 product is
never rounded. The f32 NORM loop is vectorised (``vfmaddsub``, the same products fused) and hands a last single
pair (``n_dims/2`` odd, or ``n_dims`` 2) to an unfused ``vaddsubps``. YaRN's ``theta_interp*(1-mix) +
theta_extrap*mix`` and ``1 + 0.1 logf(.)`` are contracted the same way. kvref emulates an f32 fma exactly: the
product of two float32 is exact in float64; the float64 sum is made round-to-odd (its TwoSum error tells which
neighbour is odd), and round-to-odd with at least two extra bits (53 >= 24 + 2) followed by rounding to float32
is the correctly rounded result — no double rounding. ``RopeKernel(fma=False)`` rounds every product (a build
with ``-ffp-contract=off`` or without ``-mfma``; other compilers may fuse other products).

**The C library.** ggml calls the process's ``sincosf`` / ``powf`` / ``logf``. glibc's are within about half an
ULP but not correctly rounded (``cosf(-1.0953674)`` is one float32 ULP below the nearest value), so by default
kvref calls the same functions through ctypes, once per distinct angle (not per element; tables are cached per
parameters and positions). ``RopeKernel(libm=False)``, or no loadable libm, evaluates in float64 and rounds.

Measured on Gemma 3 270M (f16 K, head size 256, iSWA bases 1e4 / 1e6) against the 0.3.36 wheel, all 18 layers x
1024 cells after a context shift and a ``seq_div``: 111 of 4,718,592 K elements differ by one f16 ULP without
FMA, 6 with float64 trig, none with both rules (``conformance/kshift/``, ``tests/test_live_gemma3.py``).

Every cell is rotated, empty or not (llama.cpp runs the rope on the whole tensor); a zero shift is the
identity unless YaRN's mscale differs from 1, exactly as in llama.cpp.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import cast

import numpy as np
import numpy.typing as npt

from ..errors import KVRefError
from ..ggml.rows import from_f32, to_f32
from ..ggml.types import GGMLType, ggml_type, row_size

ROPE_NORM = 0  # GGML_ROPE_TYPE_NORMAL
ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX

_F = np.float32
F32Rows = npt.NDArray[np.float32]
Positions = npt.NDArray[np.int32] | npt.NDArray[np.int64]  # a cell's rotation position (int32 in llama.cpp)
Rows = npt.NDArray[np.uint8]  # K rows as bytes, (n_cells, row bytes)


@dataclass(frozen=True)
class RopeParams:
    """The arguments build_rope_shift passes to ggml_rope_ext."""

    n_dims: int  # hparams.n_rot(il)
    mode: int  # ROPE_NORM or ROPE_NEOX (M-RoPE models are shifted as NEOX)
    freq_base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0  # cparams.yarn_ext_factor (0 unless YaRN scaling)
    attn_factor: float = 1.0  # cparams.yarn_attn_factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0  # cparams.n_ctx_orig_yarn
    freq_factors: tuple[float, ...] | None = None  # model.get_rope_factors(), n_dims/2 values


@dataclass(frozen=True)
class RopeKernel:
    """How the ggml CPU build that runs the shift evaluates the rope (see the module doc).

    The default is llama-cpp-python's wheels on x86-64 with AVX2/FMA (and aarch64): fused multiply-add and the
    C library's ``sincosf`` / ``powf`` / ``logf``. ``RopeKernel(fma=False)`` is a build without FMA contraction
    (``-ffp-contract=off``, or an x86-64 build without ``-mfma``); ``libm=False`` rounds float64 results instead
    of calling the C library (platform-independent, and what kvref does when no libm can be loaded).
    """

    fma: bool = True
    libm: bool = True


GGML_CPU = RopeKernel()  # the default: the 0.3.36 wheel on a machine with AVX2/FMA
NO_FMA = RopeKernel(fma=False)  # a build without FMA contraction (-ffp-contract=off, or x86-64 without -mfma)


# ---------------------------------------------------------------------------------------------- C library


@dataclass(frozen=True)
class _Libm:
    sincosf: Callable[[F32Rows], tuple[F32Rows, F32Rows]]
    powf: Callable[[float, float], float]
    logf: Callable[[float], float]


@cache
def _libm() -> _Libm | None:
    """The process's libm float functions (the ones ggml's CPU backend calls), or None."""
    name = "libm.so.6" if sys.platform.startswith("linux") else ctypes.util.find_library("m")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        powf, logf, sinf, cosf = lib.powf, lib.logf, lib.sinf, lib.cosf
    except (OSError, AttributeError):
        return None
    for f, n in ((powf, 2), (logf, 1), (sinf, 1), (cosf, 1)):
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float] * n
    sincos = getattr(lib, "sincosf", None)  # what GCC turns a cosf + sinf pair into (same results in glibc)
    if sincos is not None:
        fp = ctypes.POINTER(ctypes.c_float)
        sincos.restype, sincos.argtypes = None, [ctypes.c_float, fp, fp]

    def sincosf(theta: F32Rows) -> tuple[F32Rows, F32Rows]:
        # one call per distinct angle (by bit pattern, so -0.0 stays apart from 0.0)
        u, inv = np.unique(np.ascontiguousarray(theta, dtype=_F).view(np.uint32), return_inverse=True)
        c = np.empty(u.size, dtype=_F)
        s = np.empty(u.size, dtype=_F)
        s_out, c_out = ctypes.c_float(), ctypes.c_float()  # per call: memories may run in several threads
        s_ref, c_ref = ctypes.byref(s_out), ctypes.byref(c_out)
        for k, t in enumerate(u.view(_F).tolist()):
            if sincos is not None:
                sincos(t, s_ref, c_ref)
                s[k], c[k] = s_out.value, c_out.value
            else:
                s[k], c[k] = sinf(t), cosf(t)
        inv = inv.reshape(theta.shape)
        return c[inv], s[inv]

    return _Libm(sincosf, lambda x, y: float(powf(x, y)), lambda x: float(logf(x)))


def _powf(x: np.float32, y: np.float32, k: RopeKernel) -> np.float32:
    lib = _libm() if k.libm else None
    return _f32(lib.powf(float(x), float(y)) if lib else float(x) ** float(y))


def _logf(x: np.float32, k: RopeKernel) -> np.float32:
    if x <= 0:
        return _f32(-np.inf if x == 0 else np.nan)
    lib = _libm() if k.libm else None
    return _f32(lib.logf(float(x)) if lib else math.log(float(x)))


def _sincos(theta: F32Rows, k: RopeKernel) -> tuple[F32Rows, F32Rows]:
    lib = _libm() if k.libm else None
    if lib:
        return lib.sincosf(theta)
    t64 = theta.astype(np.float64)
    return np.cos(t64).astype(_F), np.sin(t64).astype(_F)


# ---------------------------------------------------------------------------------------------- arithmetic


def fma_f32(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> F32Rows:
    """``fmaf(a, b, c)`` element-wise on float32 arrays: ``a*b + c`` rounded once, exactly.

    ``a*b`` is exact in float64; ``s = a*b + c`` in float64 with its error ``e`` (TwoSum) is made round-to-odd
    (when inexact and even, step to the neighbour towards the exact value), and rounding that to float32 is the
    correctly rounded result (round-to-odd with 2 or more extra bits does not double-round).
    """
    p = np.asarray(a, dtype=_F).astype(np.float64) * np.asarray(b, dtype=_F)
    q = np.asarray(c, dtype=_F).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + q
        qq = s - p
        e = (p - (s - qq)) + (q - qq)  # TwoSum: p + q == s + e exactly (finite s)
        fix = (e != 0) & np.isfinite(s) & ((s.view(np.uint64) & 1) == 0)
    if fix.any():
        s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    with np.errstate(over="ignore"):
        return s.astype(_F)


def _yarn_corr_dims(p: RopeParams, k: RopeKernel) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims: the first and last pair index the YaRN ramp spans."""

    def corr_dim(beta: float) -> np.float32:
        denom = _f32(beta) * _F(2) * _f32(math.pi)
        ratio = _f32(p.n_ctx_orig) / denom
        num = _f32(p.n_dims) * _logf(ratio, k)
        return _f32(num / (_F(2) * _logf(_f32(p.freq_base), k)))

    with np.errstate(divide="ignore", invalid="ignore"):
        start = np.floor(corr_dim(p.beta_fast))
        end = np.ceil(corr_dim(p.beta_slow))
    return max(_F(0), start), min(_f32(p.n_dims - 1), end)


def _f32(x: float | np.float32) -> np.float32:
    return cast(np.float32, _F(x))  # numpy's stubs type the scalar constructor's result as Any


def cos_sin(pos: Positions, p: RopeParams, kernel: RopeKernel = GGML_CPU) -> tuple[F32Rows, F32Rows]:
    """ggml_rope_cache_init for each position: float32 (cos, sin) of shape (len(pos), n_dims/2)."""
    if p.n_dims % 2:
        raise KVRefError(f"rope: n_dims {p.n_dims} is odd")
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    upos, inv = np.unique(pos, return_inverse=True)  # the angles depend on the position only
    cos, sin = _table(p, kernel, upos.tobytes())  # every layer with the same parameters shares it
    return cos[inv], sin[inv]


@lru_cache(maxsize=2)  # the layers of one cache share their parameters (iSWA: two caches)
def _table(p: RopeParams, kernel: RopeKernel, upos_bytes: bytes) -> tuple[F32Rows, F32Rows]:
    """cos_sin of the distinct positions ``upos`` (int64 bytes); the arrays are shared, never written."""
    upos = np.frombuffer(upos_bytes, dtype=np.int64)
    half = p.n_dims // 2
    theta_scale = _powf(_f32(p.freq_base), _F(-2.0) / _f32(p.n_dims), kernel)
    freq_scale = _f32(p.freq_scale)
    mscale = _f32(p.attn_factor)
    ext = _f32(p.ext_factor)
    if ext != 0:
        corr0, corr1 = _yarn_corr_dims(p, kernel)
        log = _logf(_F(1) / freq_scale, kernel)
        mscale = mscale * (_F(fma_f32(_F(0.1), log, _F(1))) if kernel.fma else _F(1) + _F(0.1) * log)

    theta = upos.astype(_F)
    angles = np.empty((upos.size, half), dtype=_F)
    for i in range(half):
        ff = _F(1) if p.freq_factors is None else _f32(p.freq_factors[i])
        theta_extrap = theta / ff
        theta_i = freq_scale * theta_extrap
        if ext != 0:
            # rope_yarn_ramp(low, high, i0) with i0 = 2i, so i0/2 = i
            y = (_f32(i) - corr0) / max(_F(0.001), corr1 - corr0)
            ramp_mix = (_F(1) - min(_F(1), max(_F(0), y))) * ext
            if kernel.fma:
                theta_i = fma_f32(theta_i, _F(1) - ramp_mix, theta_extrap * ramp_mix)
            else:
                theta_i = theta_i * (_F(1) - ramp_mix) + theta_extrap * ramp_mix
        angles[:, i] = theta_i
        theta = theta * theta_scale
    cos, sin = _sincos(angles, kernel)
    cos, sin = cos * mscale, sin * mscale
    cos.flags.writeable = sin.flags.writeable = False  # shared by the cache
    return cos, sin


def rope_f32(
    x: npt.ArrayLike, pos: Positions, p: RopeParams, offs: int = 0, kernel: RopeKernel = GGML_CPU, f32_op: bool = True
) -> F32Rows:
    """Rotate float32 rows ``x[cell, head, :]`` by their cell's position; dims ``[offs, offs+n_dims)``.

    ``f32_op``: the ggml rope runs on an f32 tensor (False: on f16); ggml's vectorised f32 NORM loop rounds a
    last single pair without FMA. Returns a new float32 array; the other dims are copied unchanged.
    """
    x = np.array(x, dtype=_F, copy=True)
    cos, sin = cos_sin(pos, p, kernel)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = p.n_dims // 2
    if p.mode == ROPE_NORM:
        i0 = offs + 2 * np.arange(half)
        i1 = i0 + 1
    elif p.mode == ROPE_NEOX:
        i0 = offs + np.arange(half)
        i1 = i0 + half
    else:
        raise KVRefError(f"rope mode {p.mode} is not supported by the K-shift (NORM and NEOX only)")
    x0, x1 = x[..., i0], x[..., i1]
    if not kernel.fma:
        x[..., i0] = x0 * cos - x1 * sin
        x[..., i1] = x0 * sin + x1 * cos
        return x
    y0 = fma_f32(x0, cos, -(x1 * sin))
    y1 = fma_f32(x0, sin, x1 * cos)
    if f32_op and p.mode == ROPE_NORM and half % 2:
        # the vectorised f32 NORM loop (vfmaddsub, same fused products) leaves a last single pair to an
        # unfused addsub (n_dims/2 odd, or n_dims 2)
        y0[..., -1] = x0[..., -1] * cos[..., -1] - x1[..., -1] * sin[..., -1]
        y1[..., -1] = x0[..., -1] * sin[..., -1] + x1[..., -1] * cos[..., -1]
    x[..., i0] = y0
    x[..., i1] = y1
    return x


def check_k_rows(
    buf: Rows,
    t: GGMLType,
    n_head_kv: int,
    n_embd_head_k: int,
    who: str,
    error: type[KVRefError] = KVRefError,
) -> None:
    """Raise ``error`` unless ``buf`` holds whole K rows of ``n_head_kv`` heads of ``n_embd_head_k`` values."""
    want = row_size(t, n_head_kv * n_embd_head_k)
    if buf.shape[1] != want:
        raise error(
            f"{who}: rows of {buf.shape[1]} bytes, but n_head_kv {n_head_kv} x n_embd_head_k {n_embd_head_k} "
            f"{t.name.lower()} values take {want}: pass one layer's K rows, every stream, as (n_cells, row bytes)"
        )


def shift_k_rows(
    buf: Rows,
    type_k: GGMLType | int | str,
    n_head_kv: int,
    n_embd_head_k: int,
    shift: Positions,
    p: RopeParams,
    n_embd_nope: int = 0,
    kernel: RopeKernel = GGML_CPU,
) -> None:
    """Apply the K-shift in place to one stream-merged K buffer: uint8 ``(n_cells, row bytes)``.

    ``shift[c]`` is the rotation position of cell c (0 for empty cells, as set_input_k_shift writes it).
    The rotated dims of each head are ``[n_embd_nope, n_embd_nope + n_dims)`` (non-zero only for MLA).
    """
    t = ggml_type(type_k)
    if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        raise KVRefError(f"shift_k_rows: {t.name.lower()} K rows are quantized (kvref.memory.kshift_quant shifts them)")
    n_cells = buf.shape[0]
    check_k_rows(buf, t, n_head_kv, n_embd_head_k, "shift_k_rows")
    if n_embd_nope + p.n_dims > n_embd_head_k:
        raise KVRefError(f"rope: n_dims {p.n_dims} + offset {n_embd_nope} > head size {n_embd_head_k}")
    x = to_f32(buf, t).reshape(n_cells, n_head_kv, n_embd_head_k)
    y = rope_f32(x, shift, p, offs=n_embd_nope, kernel=kernel, f32_op=t == GGMLType.F32)
    buf[...] = from_f32(y.reshape(n_cells, -1), t)


__all__ = [
    "GGML_CPU",
    "NO_FMA",
    "ROPE_NEOX",
    "ROPE_NORM",
    "RopeKernel",
    "RopeParams",
    "cos_sin",
    "fma_f32",
    "rope_f32",
    "shift_k_rows",
]
