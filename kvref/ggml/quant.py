"""Rows of any ggml KV-cache type to float32 and back: ``dequantize`` / ``quantize``.

The float types go through `kvref.ggml.rows` (ggml's own rounding); the quantized ones through ``gguf.quants``
(the reference quantizers of ggml-quants.c, ported to NumPy by the gguf package). The KV-cache types ggml
allows (``llama_context_params.type_k`` / ``type_v`` that ``--cache-type-k`` accepts) are ``KV_TYPES``.

What each gguf release provides (checked against gguf 0.16.0, kvref's declared floor, and 0.19.0):

========== ============ ==========
type       dequantize   quantize
========== ============ ==========
f32 f16 bf16  kvref.ggml.rows  kvref.ggml.rows
q8_0 q4_0 q4_1 q5_0 q5_1  gguf      gguf
iq4_nl     gguf         none: refused (`QuantError`); no gguf release ships an IQ4_NL quantizer
========== ============ ==========

Other ggml types (q2_K, ...) are refused too: llama.cpp does not accept them as cache types.

``quantize`` follows the reference quantizers (``quantize_row_*_ref``). Where llama.cpp quantizes inside a graph
(``ggml_cpy`` / ``ggml_set_rows`` from f32 to a quantized type: the K/V rows a decode stores, the K-shift of a
quantized K cache) the CPU backend calls its own ``from_float`` instead (ggml-cpu/ggml-cpu.c type traits), which
differs for q8_0 on x86 with AVX/AVX2 (``quantize_cpu``):

- reference q8_0: ``d = amax / 127``, ``id = 1 / d``, ``q = roundf(x * id)`` (ties away from zero);
- ggml-cpu q8_0 (arch/x86/quants.c): ``d = amax / 127``, ``id = 127 / amax``, ``q = x * id`` rounded to nearest
  with ties to even (``_mm256_round_ps``), then packed with signed saturation.

Both store ``d`` as f16 rounded to nearest even. The other types' ggml-cpu ``from_float`` calls the reference.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..errors import QuantError
from .rows import FLOAT_TYPES, from_f32, to_f32
from .types import GGMLType, ggml_type, row_size, traits, type_name

KV_TYPES = (
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
    GGMLType.Q5_1, GGMLType.IQ4_NL,
)  # fmt: skip
NO_QUANTIZER = (GGMLType.IQ4_NL,)


def _check(t: GGMLType | int | str) -> GGMLType:
    t = ggml_type(t)
    if t not in KV_TYPES:
        names = ", ".join(type_name(x) for x in KV_TYPES)
        raise QuantError(f"{type_name(t)} is not a KV-cache type llama.cpp accepts ({names})")
    return t


def _gguf_type(t: GGMLType) -> object:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(int(t))


def dequantize(raw: npt.ArrayLike, t: GGMLType | int | str) -> npt.NDArray[np.float32]:
    """Raw rows (``uint8``, last axis a whole number of blocks) -> a new float32 array, last axis in elements."""
    t = _check(t)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    tr = traits(t)
    if raw.shape[-1] % tr.type_size:
        raise QuantError(f"rows of {raw.shape[-1]} bytes are not a whole number of {tr.name} blocks")
    if t in FLOAT_TYPES:
        return to_f32(raw, t)
    import gguf.quants

    n = raw.shape[-1] // tr.type_size * tr.block_size
    if raw.size == 0:
        return np.zeros((*raw.shape[:-1], n), np.float32)
    out = gguf.quants.dequantize(raw, _gguf_type(t))  # type: ignore[arg-type]
    return np.asarray(out, dtype=np.float32).reshape(*raw.shape[:-1], n)


def quantize(x: npt.ArrayLike, t: GGMLType | int | str) -> npt.NDArray[np.uint8]:
    """float values (last axis a whole number of blocks) -> raw rows of type ``t`` (``uint8``)."""
    t = _check(t)
    x = np.ascontiguousarray(x, dtype=np.float32)
    nbytes = row_size(t, x.shape[-1]) if x.ndim else 0
    if t in FLOAT_TYPES:
        return from_f32(x, t)
    if t in NO_QUANTIZER:
        raise QuantError(
            f"kvref cannot quantize to {type_name(t)}: the gguf package (0.16 .. 0.19) has no {type_name(t)} "
            "quantizer (dequantizing works); pick q4_0 / q5_0 / q8_0 or a float type"
        )
    import gguf.quants

    if x.size == 0:
        return np.zeros((*x.shape[:-1], nbytes), np.uint8)
    out = gguf.quants.quantize(x, _gguf_type(t))  # type: ignore[arg-type]
    return np.ascontiguousarray(out, dtype=np.uint8).reshape(*x.shape[:-1], nbytes)


def _q8_0_cpu(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """ggml-cpu's quantize_row_q8_0 on x86 with AVX/AVX2: rows of float32 -> q8_0 blocks (34 bytes each)."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, None])  # _MM_ROUND_NEAREST: ties to even
    q = np.clip(q, -128, 127).astype(np.int8)  # _mm256_packs_*: signed saturation
    out = np.empty((blocks.shape[0], 34), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def quantize_cpu(x: npt.ArrayLike, t: GGMLType | int | str) -> npt.NDArray[np.uint8]:
    """Like `quantize`, with the quantizer ggml's CPU backend runs in a graph (``from_float`` of ggml-cpu's type
    traits, x86 AVX2 build): what llama.cpp writes when a decode stores K/V rows or the K-shift requantizes them."""
    t = _check(t)
    if t != GGMLType.Q8_0:
        return quantize(x, t)  # ggml-cpu's from_float is the reference quantizer for the other KV types
    x = np.ascontiguousarray(x, dtype=np.float32)
    nbytes = row_size(t, x.shape[-1])  # a GGMLTypeError unless a whole number of blocks, as in `quantize`
    if x.size == 0:
        return np.zeros((*x.shape[:-1], nbytes), np.uint8)
    return _q8_0_cpu(x).reshape(*x.shape[:-1], nbytes)


def can_quantize(t: GGMLType | int | str) -> bool:
    """Can `quantize` write this type?"""
    t = ggml_type(t)
    return t in KV_TYPES and t not in NO_QUANTIZER


__all__ = ["KV_TYPES", "QuantError", "can_quantize", "dequantize", "quantize", "quantize_cpu"]
