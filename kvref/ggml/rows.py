"""Float rows in and out of ggml storage: f32, f16 and bf16 as ggml converts them.

The KV cache keeps its tensors as raw bytes (``uint8``); this module is the one place that turns those
bytes into float32 and back, with ggml's rounding:

- f16: ggml's ``GGML_FP32_TO_FP16`` rounds to nearest, ties to even — what NumPy's ``astype(float16)`` does;
- bf16: ``ggml_compute_fp32_to_bf16`` rounds to nearest even on the upper 16 bits and turns a NaN into a
  quiet NaN (``(u >> 16) | 64``) instead of letting the rounding carry into the exponent.

Quantized types raise ``KVRefError``: kvref does not quantize yet.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt

from ..errors import KVRefError
from .types import GGMLType, ggml_type, type_name

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

# the element view of a float row: float32, float16, or the bf16 bit patterns as uint16
ElementRows = npt.NDArray[np.float32] | npt.NDArray[np.float16] | npt.NDArray[np.uint16]
_ITEM: dict[GGMLType, type[np.float32] | type[np.float16] | type[np.uint16]] = {
    GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16,
}  # fmt: skip


def _check(t: GGMLType | int | str) -> GGMLType:
    t = ggml_type(t)
    if t not in FLOAT_TYPES:
        raise KVRefError(f"ggml type {type_name(t)} is not supported here yet (only f32, f16 and bf16)")
    return t


def typed(buf: npt.NDArray[np.uint8], t: GGMLType | int | str) -> ElementRows:
    """View raw bytes (last axis) as the element type: float32, float16, or uint16 holding bf16 bits."""
    return cast(ElementRows, buf.view(_ITEM[_check(t)]))  # the dtype is one of _ITEM's


def to_f32(buf: npt.NDArray[np.uint8], t: GGMLType | int | str) -> npt.NDArray[np.float32]:
    """Decode raw bytes (last axis a whole number of elements) to a new float32 array."""
    t = _check(t)
    v = buf.view(_ITEM[t])
    if t == GGMLType.BF16:
        return (v.astype(np.uint32) << 16).view(np.float32)
    return v.astype(np.float32)


def bf16_bits(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """ggml_compute_fp32_to_bf16 on every element: the bf16 bit pattern as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    quiet = (u >> 16) | 64
    return np.where(nan, quiet, rounded).astype(np.uint16)


def from_f32(x: npt.ArrayLike, t: GGMLType | int | str) -> npt.NDArray[np.uint8]:
    """Encode float values as the storage type; returns raw bytes, last axis ``n * element size``."""
    t = _check(t)
    x = np.asarray(x, dtype=np.float32)
    if t == GGMLType.F32:
        out = np.ascontiguousarray(x)
    elif t == GGMLType.F16:
        out = x.astype(np.float16)
    else:
        out = bf16_bits(x)
    out = np.ascontiguousarray(out)
    return out.view(np.uint8).reshape(*x.shape[:-1], -1) if x.ndim else out.view(np.uint8)


__all__ = ["FLOAT_TYPES", "ElementRows", "bf16_bits", "from_f32", "to_f32", "typed"]
