"""The ggml tensor types: wire ids, block layout and names, declared once.

Mirrors ``enum ggml_type`` of ``ggml/include/ggml.h`` and the ``type_traits`` table of ``ggml/src/ggml.c``
(llama.cpp of October 2026). Every size kvref computes (cache buffers, state-file row sizes, validation)
comes from ``TYPE_TRAITS``. Retired ids stay listed in comments so their numbers are never reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ..errors import GGMLTypeError


class GGMLType(IntEnum):
    """enum ggml_type: the tensor types by their wire ids (retired ids stay listed in comments)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    # Q4_2 = 4, Q4_3 = 5: removed from ggml
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    # Q4_0_4_4 = 31, Q4_0_4_8 = 32, Q4_0_8_8 = 33: removed from gguf files
    TQ1_0 = 34
    TQ2_0 = 35
    # IQ4_NL_4_4 = 36, IQ4_NL_4_8 = 37, IQ4_NL_8_8 = 38: removed
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


@dataclass(frozen=True)
class TypeTraits:
    """What ggml's ``type_traits`` says of one type: printed name, elements per block, bytes per block."""

    name: str
    block_size: int
    type_size: int
    is_quantized: bool


_QK_K = 256

# (name as ggml_type_name() prints it, block size, block bytes, quantized)
TYPE_TRAITS: dict[GGMLType, TypeTraits] = {
    t: TypeTraits(*v)
    for t, v in {
        GGMLType.F32: ("f32", 1, 4, False),
        GGMLType.F16: ("f16", 1, 2, False),
        GGMLType.Q4_0: ("q4_0", 32, 18, True),
        GGMLType.Q4_1: ("q4_1", 32, 20, True),
        GGMLType.Q5_0: ("q5_0", 32, 22, True),
        GGMLType.Q5_1: ("q5_1", 32, 24, True),
        GGMLType.Q8_0: ("q8_0", 32, 34, True),
        GGMLType.Q8_1: ("q8_1", 32, 36, True),  # half d, half s, 32 x int8
        GGMLType.Q2_K: ("q2_K", _QK_K, 84, True),
        GGMLType.Q3_K: ("q3_K", _QK_K, 110, True),
        GGMLType.Q4_K: ("q4_K", _QK_K, 144, True),
        GGMLType.Q5_K: ("q5_K", _QK_K, 176, True),
        GGMLType.Q6_K: ("q6_K", _QK_K, 210, True),
        GGMLType.Q8_K: ("q8_K", _QK_K, 292, True),
        GGMLType.IQ2_XXS: ("iq2_xxs", _QK_K, 66, True),
        GGMLType.IQ2_XS: ("iq2_xs", _QK_K, 74, True),
        GGMLType.IQ3_XXS: ("iq3_xxs", _QK_K, 98, True),
        GGMLType.IQ1_S: ("iq1_s", _QK_K, 50, True),
        GGMLType.IQ4_NL: ("iq4_nl", 32, 18, True),
        GGMLType.IQ3_S: ("iq3_s", _QK_K, 110, True),
        GGMLType.IQ2_S: ("iq2_s", _QK_K, 82, True),
        GGMLType.IQ4_XS: ("iq4_xs", _QK_K, 136, True),
        GGMLType.I8: ("i8", 1, 1, False),
        GGMLType.I16: ("i16", 1, 2, False),
        GGMLType.I32: ("i32", 1, 4, False),
        GGMLType.I64: ("i64", 1, 8, False),
        GGMLType.F64: ("f64", 1, 8, False),
        GGMLType.IQ1_M: ("iq1_m", _QK_K, 56, True),
        GGMLType.BF16: ("bf16", 1, 2, False),
        GGMLType.TQ1_0: ("tq1_0", _QK_K, 54, True),
        GGMLType.TQ2_0: ("tq2_0", _QK_K, 66, True),
        GGMLType.MXFP4: ("mxfp4", 32, 17, True),
        GGMLType.NVFP4: ("nvfp4", 64, 36, True),
        GGMLType.Q1_0: ("q1_0", 128, 18, True),
        GGMLType.Q2_0: ("q2_0", 64, 18, True),
    }.items()
}

_BY_NAME = {tr.name.lower(): t for t, tr in TYPE_TRAITS.items()}

# a ggml type as callers give it: the enum, its wire id or its name (what `ggml_type` resolves)
TypeLike = GGMLType | int | str


def ggml_type(t: GGMLType | int | str) -> GGMLType:
    """Resolve a type given as enum, wire id or name (``"f16"``, ``"q8_0"``, ``"Q4_K"``)."""
    if isinstance(t, str):
        try:
            return _BY_NAME[t.lower()]
        except KeyError:
            raise GGMLTypeError(f"unknown ggml type name {t!r}") from None
    try:
        return GGMLType(int(t))
    except ValueError:
        raise GGMLTypeError(f"unknown ggml type id {int(t)}") from None


def traits(t: GGMLType | int | str) -> TypeTraits:
    return TYPE_TRAITS[ggml_type(t)]


def type_name(t: GGMLType | int | str) -> str:
    """The name ggml_type_name() prints for the type."""
    return traits(t).name


def row_size(t: GGMLType | int | str, n: int) -> int:
    """Bytes of a row of ``n`` elements (ggml_row_size); ``n`` must be a whole number of blocks."""
    tr = traits(t)
    if n % tr.block_size:
        raise GGMLTypeError(f"{n} elements are not a whole number of {tr.name} blocks of {tr.block_size}")
    return n // tr.block_size * tr.type_size


__all__ = [
    "TYPE_TRAITS",
    "GGMLType",
    "GGMLTypeError",
    "TypeLike",
    "TypeTraits",
    "ggml_type",
    "row_size",
    "traits",
    "type_name",
]
