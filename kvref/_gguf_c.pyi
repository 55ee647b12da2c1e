"""Type stub of the Cython GGUF twin; the API and semantics are those of kvref/_gguf_py.py."""

from typing_extensions import Buffer

TRUNCATED_LENGTH: int
TRUNCATED_STRING: int

def skip_strings(buf: Buffer, at: int, count: int, end: int, big_endian: bool) -> tuple[int, int]: ...

__all__ = ["TRUNCATED_LENGTH", "TRUNCATED_STRING", "skip_strings"]
