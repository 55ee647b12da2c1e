"""llama.cpp's limits and sentinels that kvref's modules share, each defined once.

The Cython twins read the same values at C level from ``kvref/constants.pxd`` (compile-time enums, since C
arrays are sized by them); ``tests/test_constants.py`` checks that the two agree.
"""

from __future__ import annotations

from enum import IntEnum

LLAMA_MAX_SEQ = 256  # sequence ids are 0 .. 255: llama_kv_cells keeps them in a std::bitset<LLAMA_MAX_SEQ>
N_SEQ_WORDS = LLAMA_MAX_SEQ // 64  # that bitset as uint64 words per cell
LLAMA_MAX_LAYERS = 512  # per-layer hparam arrays are std::array<uint32_t, LLAMA_MAX_LAYERS>
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: the ext token of a cell made from an embedding
POS_MAX = 2**31 - 1  # what llama.cpp substitutes for an open upper bound (p1 < 0)
INT32_MIN = -(2**31)
UINT32_MAX = 2**32 - 1  # llama_context_params' sizes and counts are uint32_t
# what kvref's KVCells keep per cell: pos, shift, ext (3 x i32), the sequence bitset
CELL_BYTES = 4 + 4 + 12 + 8 * N_SEQ_WORDS


class SWAType(IntEnum):
    """llama_swa_type, with llama.cpp's numeric values."""

    NONE = 0
    STANDARD = 1
    CHUNKED = 2
    SYMMETRIC = 3


class RopeType(IntEnum):
    """llama_rope_type, with llama.cpp's numeric values (LLAMA_ROPE_TYPE_* in llama.h)."""

    NONE = -1
    NORM = 0
    NEOX = 2
    MROPE = 8
    IMROPE = 40
    VISION = 24


__all__ = [
    "CELL_BYTES",
    "INT32_MIN",
    "LLAMA_MAX_LAYERS",
    "LLAMA_MAX_SEQ",
    "N_SEQ_WORDS",
    "POS_MAX",
    "TOKEN_NULL",
    "UINT32_MAX",
    "RopeType",
    "SWAType",
]
