"""The two byte primitives every layout goes through: `Reader` and `Writer`.

All integers are little-endian (llama.cpp writes host order; every platform it ships on is little-endian),
and this is the only module that says so. The reader works over a memoryview (of bytes or of an mmap) and
never copies: arrays come back as NumPy views. Every check happens *before* anything is allocated, so a lying
count in a small input costs nothing, and every error names the field and the absolute byte offset.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ..errors import FormatError

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

# the element types the layouts read: rows (uint8), tokens and cell fields (int32), v9 logits (float32)
ScalarT = TypeVar("ScalarT", np.uint8, np.int32, np.float32)

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_ROW_WRITE_MIN = 4096  # Writer.array writes rows at least this long one by one instead of copying them


class Reader:
    """A cursor over a byte buffer; ``pos`` is the absolute offset of the next byte."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: object, pos: int = 0, end: int | None = None) -> None:
        try:
            mv = buf if isinstance(buf, memoryview) else memoryview(cast("Buffer", buf))
        except TypeError:  # None, str, a list ...: a kvref error like every other unreadable input
            raise FormatError(f"a state is read from a bytes-like object, not {type(buf).__name__}") from None
        self.buf = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        self.pos = pos
        self.end = len(self.buf) if end is None else end

    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, field: str) -> None:
        """Raise unless ``n`` more bytes are available for ``field``."""
        if n > self.end - self.pos:
            raise FormatError(
                f"truncated: {field} needs {n} bytes, {self.end - self.pos} remain", field=field, offset=self.pos
            )

    def _scalar(self, s: struct.Struct, field: str) -> int:
        if s.size > self.end - self.pos:
            self.need(s.size, field)
        v: int
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def u32(self, field: str) -> int:
        return self._scalar(_U32, field)

    def i32(self, field: str) -> int:
        return self._scalar(_I32, field)

    def u64(self, field: str) -> int:
        return self._scalar(_U64, field)

    def peek_u32(self, at: int | None = None) -> int | None:
        at = self.pos if at is None else at
        if at + 4 > self.end:
            return None
        v: int = _U32.unpack_from(self.buf, at)[0]
        return v

    def take(self, n: int, field: str) -> memoryview:
        """The next ``n`` bytes as a zero-copy memoryview."""
        self.need(n, field)
        mv = self.buf[self.pos : self.pos + n]
        self.pos += n
        return mv

    def array(
        self, dtype: np.dtype[ScalarT], count: int, field: str, count_field: str | None = None
    ) -> npt.NDArray[ScalarT]:
        """``count`` elements as a NumPy view; a count larger than the input is blamed on ``count_field``."""
        nbytes = count * dtype.itemsize
        if nbytes > self.end - self.pos:
            blame = count_field or field
            raise FormatError(
                f"count {count} of {field} needs {nbytes} bytes, only {self.end - self.pos} remain",
                field=blame,
                offset=self.pos,
            )
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += nbytes
        return arr


class Sink(Protocol):
    """Where a `Writer` streams: a binary file, or any object with its ``write``."""

    def write(self, b: Buffer, /) -> object: ...


class Writer:
    """Streams encoded fields to a binary file object (a `Sink`); ``n`` counts the bytes written."""

    __slots__ = ("f", "n")

    def __init__(self, f: Sink) -> None:
        self.f = f
        self.n = 0

    def raw(self, b: Buffer) -> None:
        self.f.write(b)
        self.n += memoryview(b).nbytes

    def _scalar(self, s: struct.Struct, v: int, field: str) -> None:
        try:
            b = s.pack(int(v))
        except (struct.error, TypeError, ValueError, OverflowError) as e:
            raise FormatError(f"cannot encode {v!r} as {s.format}: {e}", field=field, offset=self.n) from None
        self.f.write(b)
        self.n += s.size

    def u32(self, v: int, field: str) -> None:
        self._scalar(_U32, v, field)

    def i32(self, v: int, field: str) -> None:
        self._scalar(_I32, v, field)

    def u64(self, v: int, field: str) -> None:
        self._scalar(_U64, v, field)

    def array(self, arr: npt.NDArray[ScalarT], field: str) -> None:
        """Write the array's bytes as they are laid out (views of an mmap stream straight from the page cache)."""
        a = np.asarray(arr)
        if a.dtype.byteorder == ">":
            raise FormatError("big-endian arrays cannot be written", field=field, offset=self.n)
        if not a.flags.c_contiguous:
            if a.ndim == 2 and a.strides[1] == a.itemsize and a.shape[1] * a.itemsize >= _ROW_WRITE_MIN:
                # long contiguous rows (a transposed V block of some cells of a cache): no copy, row by row, or
                # in one strided copy when the sink is a buffer (`write_sections_into`)
                put = getattr(self.f, "write_rows", None)
                if put is not None:
                    put(a)
                else:
                    for row in a:
                        self.f.write(memoryview(row).cast("B"))
                self.n += a.nbytes
                return
            a = np.ascontiguousarray(a)
        if a.nbytes:
            self.f.write(memoryview(cast("Buffer", a)).cast("B"))
            self.n += a.nbytes


@dataclass(frozen=True)
class _BytesApi:
    new: Callable[[None, int], bytes]  # PyBytes_FromStringAndSize(NULL, n)
    data: Callable[[bytes], int]  # PyBytes_AsString: the address of its bytes
    madvise: Callable[[int, int, int], int] | None


@cache
def _bytes_api() -> _BytesApi | None:
    """CPython's PyBytes_FromStringAndSize / PyBytes_AsString and libc's madvise, when ctypes reaches them."""
    try:
        api = ctypes.pythonapi
        new, data = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
        data.restype, data.argtypes = ctypes.c_void_p, (ctypes.py_object,)
        madvise = None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.restype, madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _BytesApi(new, data, madvise)
    except (AttributeError, OSError):  # not CPython, or no libc to ask
        return None


_HUGE = 2 << 20  # a transparent huge page
_JOIN_MAX = 32 << 20  # results up to this size are simply b"".join-ed


def join_bytes(parts: Sequence[Buffer]) -> bytes:
    """``b"".join(parts)`` (C-contiguous buffers), copying every byte once.

    A large result is made as CPython's own C code makes one (PyBytes_FromStringAndSize(NULL, n), filled before
    anyone else sees it) with its pages advised as transparent huge pages: fresh 4 KiB pages cost a fault each,
    which is most of the time of a multi-GiB state's write. Elsewhere (not CPython), it is the plain join.
    """
    total = sum(memoryview(p).nbytes for p in parts)
    api = _bytes_api() if total > _JOIN_MAX else None
    if api is None:
        return b"".join(parts)
    out = api.new(None, total)
    addr = api.data(out)
    if api.madvise is not None:
        lo, hi = -(-addr // _HUGE) * _HUGE, (addr + total) // _HUGE * _HUGE
        if hi > lo:
            api.madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    view = np.ctypeslib.as_array((ctypes.c_ubyte * total).from_address(addr))
    at = 0
    for p in parts:
        mv = memoryview(p)
        if mv.nbytes:
            view[at : at + mv.nbytes] = np.frombuffer(mv.cast("B") if mv.format != "B" else mv, np.uint8)
            at += mv.nbytes
    assert at == total
    return out


__all__ = ["Reader", "Sink", "Writer", "join_bytes"]
