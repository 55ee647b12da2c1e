"""Pure-Python twin of the GGUF metadata walk's inner loop; ``_gguf_c.pyx`` is the same at C speed.

``HParams.from_gguf`` reads a model's key/value pairs without their values (`kvref.hparams`); the one part of that
walk whose cost grows with the model is stepping over an array of strings, a tokenizer's vocabulary (262,144
tokens for Gemma 3): each string is a u64 length, then that many bytes, so the walk reads every length.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

TRUNCATED_LENGTH = 1  # a string's 8-byte length runs past the end
TRUNCATED_STRING = 2  # a string's bytes run past the end


def skip_strings(buf: Buffer, at: int, count: int, end: int, big_endian: bool) -> tuple[int, int]:
    """Step over ``count`` length-prefixed strings from offset ``at`` of ``buf`` (``end``: its usable length).

    Returns ``(offset, 0)``, the offset after the last string; or, at the first string that does not fit,
    ``(offset, TRUNCATED_LENGTH)`` with the offset of its length field, or ``(offset, TRUNCATED_STRING)`` with the
    offset it would end at. Nothing is allocated for a length, however large it claims to be.
    """
    u64 = struct.Struct(">Q" if big_endian else "<Q").unpack_from
    end = min(end, memoryview(buf).nbytes)
    for _ in range(count):
        if at < 0 or at + 8 > end:
            return at, TRUNCATED_LENGTH
        after: int = at + 8 + u64(buf, at)[0]
        if after > end:
            return after, TRUNCATED_STRING
        at = after
    return at, 0


__all__ = ["TRUNCATED_LENGTH", "TRUNCATED_STRING", "skip_strings"]
