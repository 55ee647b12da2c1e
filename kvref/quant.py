"""Rows of any ggml KV-cache type to float32 and back: ``dequantize`` / ``quantize``.

The float types go through `kvref.rows` (ggml's own rounding); the quantized ones through ``gguf.quants``
(the reference quantizers of ggml-quants.c, ported to NumPy by the gguf package). The KV-cache types ggml
allows (``llama_context_params.type_k`` / ``type_v`` that ``--cache-type-k`` accepts) are ``KV_TYPES``.

What each gguf release provides (checked against gguf 0.16.0, kvref's declared floor, and 0.19.0):

========== ============ ==========
type       dequantize   quantize
========== ============ ==========
f32 f16 bf16  kvref.rows  kvref.rows
q8_0 q4_0 q4_1 q5_0 q5_1  gguf      gguf
iq4_nl     gguf         none: refused (`QuantError`); no gguf release ships an IQ4_NL quantizer
========== ============ ==========

Other ggml types (q2_K, ...) are refused too: llama.cpp does not accept them as cache types.
"""

from __future__ import annotations

import numpy as np

from .errors import QuantError
from .ggml import GGMLType, ggml_type, row_size, traits, type_name
from .rows import FLOAT_TYPES, from_f32, to_f32

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


def dequantize(raw: np.ndarray, t: GGMLType | int | str) -> np.ndarray:
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


def quantize(x: np.ndarray, t: GGMLType | int | str) -> np.ndarray:
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


def can_quantize(t: GGMLType | int | str) -> bool:
    """Can `quantize` write this type?"""
    t = ggml_type(t)
    return t in KV_TYPES and t not in NO_QUANTIZER


__all__ = ["KV_TYPES", "QuantError", "can_quantize", "dequantize", "quantize"]
