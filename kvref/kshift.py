"""The K-shift: rotating stored K rows by RoPE for each cell's pending position delta.

llama.cpp applies a pending ``seq_add`` / ``seq_div`` to the K cache by running ``ggml_rope_ext`` on a view
of every layer's K tensor, with the per-cell ``shift`` as the position (``llama_kv_cache::build_rope_shift``).
This module computes the same float32 arithmetic as ggml's CPU kernel (``ggml-cpu/ops.cpp``:
``ggml_rope_cache_init`` / ``rope_yarn`` / ``rotate_pairs``):

- the angle of pair ``i`` is built by repeated float32 multiplication, ``theta_0 = pos`` and
  ``theta_{i+1} = theta_i * theta_scale`` with ``theta_scale = powf(freq_base, -2/n_dims)`` — not by a
  fresh power per pair, which would round differently;
- ``rope_yarn``: ``theta = freq_scale * theta``; with ``ext_factor != 0`` the YaRN ramp mixes in the
  unscaled angle and ``mscale`` grows by ``1 + 0.1 ln(1/freq_scale)``; cos and sin are scaled by mscale;
- NORM rotates the pairs ``(2i, 2i+1)``, NEOX the pairs ``(i, i + n_dims/2)``; both compute
  ``x0 cos - x1 sin`` and ``x0 sin + x1 cos`` in float32 and round the result to the storage type.

Every cell is rotated, empty or not (llama.cpp runs the rope on the whole tensor); a zero shift is the
identity unless YaRN's mscale differs from 1, exactly as in llama.cpp.

Precision notes: cosf/sinf/powf/logf are evaluated in float64 and rounded to float32 (glibc's float
functions agree with that except in rare last-bit cases), and no fused multiply-add is used (a build of
ggml with FMA contraction may differ in the last bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import KVRefError
from .ggml import GGMLType, ggml_type, row_size
from .rows import from_f32, to_f32

ROPE_NORM = 0  # GGML_ROPE_TYPE_NORMAL
ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX

_F = np.float32


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


def _f32(x: float) -> np.float32:
    return _F(x)


def _yarn_corr_dims(p: RopeParams) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims: the first and last pair index the YaRN ramp spans."""

    def corr_dim(beta: float) -> np.float32:
        denom = _f32(beta) * _F(2) * _f32(math.pi)
        ratio = _f32(p.n_ctx_orig) / denom
        num = _f32(p.n_dims) * _flog(ratio)
        return num / (_F(2) * _flog(_f32(p.freq_base)))

    with np.errstate(divide="ignore", invalid="ignore"):
        start = np.floor(corr_dim(p.beta_fast))
        end = np.ceil(corr_dim(p.beta_slow))
    return max(_F(0), start), min(_f32(p.n_dims - 1), end)


def _flog(x: np.float32) -> np.float32:
    if x <= 0:
        return _F(-np.inf) if x == 0 else _F(np.nan)
    return _f32(math.log(float(x)))


def cos_sin(pos: np.ndarray, p: RopeParams) -> tuple[np.ndarray, np.ndarray]:
    """ggml_rope_cache_init for each position: float32 (cos, sin) of shape (len(pos), n_dims/2)."""
    if p.n_dims % 2:
        raise KVRefError(f"rope: n_dims {p.n_dims} is odd")
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    half = p.n_dims // 2
    theta_scale = _f32(float(_f32(p.freq_base)) ** float(_F(-2.0) / _f32(p.n_dims)))
    freq_scale = _f32(p.freq_scale)
    mscale = _f32(p.attn_factor)
    ext = _f32(p.ext_factor)
    if ext != 0:
        corr0, corr1 = _yarn_corr_dims(p)
        mscale = mscale * (_F(1) + _F(0.1) * _flog(_F(1) / freq_scale))

    theta = pos.astype(np.float32)
    cos = np.empty((pos.size, half), dtype=np.float32)
    sin = np.empty((pos.size, half), dtype=np.float32)
    for i in range(half):
        ff = _F(1) if p.freq_factors is None else _f32(p.freq_factors[i])
        theta_extrap = theta / ff
        theta_i = freq_scale * theta_extrap
        if ext != 0:
            # rope_yarn_ramp(low, high, i0) with i0 = 2i, so i0/2 = i
            y = (_f32(i) - corr0) / max(_F(0.001), corr1 - corr0)
            ramp_mix = (_F(1) - min(_F(1), max(_F(0), y))) * ext
            theta_i = theta_i * (_F(1) - ramp_mix) + theta_extrap * ramp_mix
        t64 = theta_i.astype(np.float64)
        cos[:, i] = np.cos(t64).astype(np.float32) * mscale
        sin[:, i] = np.sin(t64).astype(np.float32) * mscale
        theta = theta * theta_scale
    return cos, sin


def rope_f32(x: np.ndarray, pos: np.ndarray, p: RopeParams, offs: int = 0) -> np.ndarray:
    """Rotate float32 rows ``x[cell, head, :]`` by their cell's position; dims ``[offs, offs+n_dims)``.

    Returns a new float32 array; the other dims are copied unchanged.
    """
    x = np.array(x, dtype=np.float32, copy=True)
    cos, sin = cos_sin(pos, p)
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
    x[..., i0] = x0 * cos - x1 * sin
    x[..., i1] = x0 * sin + x1 * cos
    return x


def shift_k_rows(
    buf: np.ndarray,
    type_k: GGMLType | int | str,
    n_head_kv: int,
    n_embd_head_k: int,
    shift: np.ndarray,
    p: RopeParams,
    n_embd_nope: int = 0,
) -> None:
    """Apply the K-shift in place to one stream-merged K buffer: uint8 ``(n_cells, row bytes)``.

    ``shift[c]`` is the rotation position of cell c (0 for empty cells, as set_input_k_shift writes it).
    The rotated dims of each head are ``[n_embd_nope, n_embd_nope + n_dims)`` (non-zero only for MLA).
    """
    t = ggml_type(type_k)
    if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        # llama.cpp dequantizes to f32, un-rotates with the Hadamard matrix, ropes, rotates and
        # re-quantizes; kvref has no quantizer yet.
        raise KVRefError(f"K-shift of a {t.name.lower()} K cache is not implemented (f32, f16, bf16 only)")
    n_cells = buf.shape[0]
    if buf.shape[1] != row_size(t, n_head_kv * n_embd_head_k):
        raise KVRefError("shift_k_rows: buffer rows do not match n_head_kv * n_embd_head_k")
    if n_embd_nope + p.n_dims > n_embd_head_k:
        raise KVRefError(f"rope: n_dims {p.n_dims} + offset {n_embd_nope} > head size {n_embd_head_k}")
    x = to_f32(buf, t).reshape(n_cells, n_head_kv, n_embd_head_k)
    y = rope_f32(x, shift, p, offs=n_embd_nope)
    buf[...] = from_f32(y.reshape(n_cells, -1), t)


__all__ = ["ROPE_NEOX", "ROPE_NORM", "RopeParams", "cos_sin", "rope_f32", "shift_k_rows"]
