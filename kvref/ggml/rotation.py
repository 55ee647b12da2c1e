"""llama.cpp's attention rotation (PR #21038): a Walsh-Hadamard rotation of K and V in quantized caches.

What llama.cpp 0.3.36 does (src/llama-kv-cache.cpp, llama-graph.cpp, llama-impl.h):

- ``attn_rot_k = !disabled && n_embd_head_k_all > 0 && ggml_is_quantized(type_k) && n_embd_head_k(0) % 64 == 0``
  and the same for V with the V head size; ``n_embd_head_k_all`` is the head size shared by every layer of the
  cache (-1 when they differ), ``disabled`` is ``atoi(getenv("LLAMA_ATTN_ROT_DISABLE")) != 0``. (DeepSeek
  lightning indexers always rotate K; kvref models none of them.) The flags are decided when the cache is built.
- The matrix is ``ggml_gen_hadamard``: Sylvester's construction scaled by ``1/sqrt(n)``, symmetric and orthonormal,
  so ``H @ H == I``. K uses ``n`` = the largest power of two from 64 up that divides the head size (64 for 192,
  128 for 128, 256 for 256); V always uses ``n`` = 64.
- ``llama_mul_mat_hadamard`` reshapes a tensor to rows of ``n`` consecutive elements of its innermost dimension
  (the head dimension) and multiplies each by ``H``. Q and K are rotated after RoPE (so ``q.k`` is unchanged), V
  before it is stored, and the attention output is rotated back with the V matrix. The cache therefore holds
  ``quantize(H k)`` and ``quantize(H v)``.

State files do not say whether their rows are rotated. Undoing it is applying ``H`` again (`rotate`).

The CPU backend never multiplies by the matrix: ``ggml_mul_mat`` carries the hint ``GGML_HINT_SRC0_IS_HADAMARD``
and ggml-cpu runs a fast Walsh-Hadamard transform instead (ggml-cpu/ops.cpp, ``ggml_compute_forward_fwht``): each
value times ``1.0f / sqrtf(n)`` first, then the butterflies ``(u, v) -> (u + v, u - v)`` on pairs ``len`` apart,
``len = 1, 2, 4, ... n/2``, all in float32 (the SIMD passes compute ``u - v`` as ``fma(v, -1, u)``, which is exact
the same). `fwht` reproduces it bit for bit; `rotate` (a float32 matrix product) agrees only up to rounding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from .types import GGMLType, traits

ENV_DISABLE = "LLAMA_ATTN_ROT_DISABLE"
V_ROT_SIZE = 64


def _atoi(text: str) -> int:
    """C's atoi: optional spaces and sign, then leading digits; anything else gives 0."""
    s = text.lstrip(" \t\n\r\f\v")
    sign = -1 if s[:1] == "-" else 1
    s = s[1:] if s[:1] in "+-" else s
    digits = ""
    for ch in s:
        if not ch.isdigit():
            break
        digits += ch
    return sign * int(digits) if digits else 0


def rotation_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``LLAMA_ATTN_ROT_DISABLE`` as llama.cpp reads it (``atoi(value) != 0``)."""
    value = (os.environ if environ is None else environ).get(ENV_DISABLE)
    return value is not None and _atoi(value) != 0


def hadamard(n: int) -> npt.NDArray[np.float32]:
    """ggml_gen_hadamard: the ``n x n`` orthonormal Walsh-Hadamard matrix (float32; ``n`` a power of two)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Hadamard size must be a power of two, not {n}")
    h = np.zeros((n, n), np.float32)
    h[0, 0] = np.float32(1.0 / float(np.sqrt(np.float32(n))))
    s = 1
    while s < n:
        blk = h[:s, :s].copy()
        h[s : 2 * s, :s] = blk
        h[:s, s : 2 * s] = blk
        h[s : 2 * s, s : 2 * s] = -blk
        s *= 2
    return h


def k_rot_size(head_size: int) -> int:
    """The K rotation's size (build_input_k_rot): the largest power of two >= 64 that divides ``head_size``."""
    n = 64
    while True:
        n *= 2
        if head_size % n:
            break
    return n // 2


def attn_rot(cache_type: GGMLType | int | str, head_all: int, head_0: int, *, disabled: bool | None = None) -> bool:
    """llama.cpp's ``attn_rot_k`` / ``attn_rot_v`` rule for one cache type: ``head_all`` the head size every layer
    of the cache shares (-1 when they differ, 0 for none), ``head_0`` the model's layer-0 head size;
    ``disabled`` defaults to the environment's LLAMA_ATTN_ROT_DISABLE."""
    if disabled is None:
        disabled = rotation_disabled()
    return not disabled and head_all > 0 and traits(cache_type).is_quantized and head_0 % 64 == 0


def shared_head_size(sizes: list[int]) -> int:
    """``n_embd_head_k_all`` of a cache: the head size of its layers when all agree, -1 when not, 0 without."""
    if not sizes:
        return 0
    return sizes[0] if all(s == sizes[0] for s in sizes) else -1


def rotate(x: npt.ArrayLike, n: int) -> npt.NDArray[np.float32]:
    """``llama_mul_mat_hadamard`` on float rows: every run of ``n`` consecutive values of the last axis times
    ``H_n`` (float32). Its own inverse: ``rotate(rotate(x, n), n) == x`` up to float rounding."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % n:
        raise ValueError(f"rows of {x.shape[-1]} values are not a whole number of {n}-element rotation blocks")
    h = hadamard(n)
    y = x.reshape(*x.shape[:-1], x.shape[-1] // n, n) @ h.T
    return np.ascontiguousarray(y.reshape(x.shape), dtype=np.float32)


def fwht(x: npt.ArrayLike, n: int) -> npt.NDArray[np.float32]:
    """ggml-cpu's ``ggml_compute_forward_fwht``: every run of ``n`` consecutive values of the last axis
    transformed as llama.cpp's CPU backend rotates K/V rows (bit-exact float32). Returns a new float32 array."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Hadamard size must be a power of two, not {n}")
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % n:
        raise ValueError(f"rows of {x.shape[-1]} values are not a whole number of {n}-element rotation blocks")
    scale = np.float32(1) / np.sqrt(np.float32(n))
    y = x.reshape(-1, n) * scale
    step = 1
    while step < n:
        blk = y.reshape(-1, n // (2 * step), 2, step)
        u, v = blk[:, :, 0, :].copy(), blk[:, :, 1, :]
        blk[:, :, 0, :] = u + v
        blk[:, :, 1, :] = u - v
        step *= 2
    return np.ascontiguousarray(y.reshape(x.shape), dtype=np.float32)


__all__ = [
    "ENV_DISABLE",
    "V_ROT_SIZE",
    "attn_rot",
    "fwht",
    "hadamard",
    "k_rot_size",
    "rotate",
    "rotation_disabled",
    "shared_head_size",
]
