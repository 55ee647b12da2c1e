"""Arguments of the memory API, normalised once: ids, positions and shifts are llama.cpp's int32 values.

Every memory's sequence operations start here, so an id or position is taken the same way everywhere: any
integral type (Python int, NumPy integers: ``operator.index``), never a bool, a float or a string, and never
outside int32 (llama_seq_id and llama_pos are int32_t; a wider value would wrap in llama.cpp).
"""

from __future__ import annotations

import operator
import os

import numpy as np
import numpy.typing as npt

from .constants import INT32_MIN, POS_MAX
from .errors import ArgumentError, ArgumentTypeError, SequenceError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def as_int(value: object, name: str) -> int:
    """``value`` as a Python int; ArgumentTypeError naming ``name`` for a bool, float, string, None, ..."""
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name}: expected an integer, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None


def as_int32(value: object, name: str) -> int:
    """``as_int``, refused (ArgumentError) outside int32."""
    v = as_int(value, name)
    if not INT32_MIN <= v <= POS_MAX:
        raise ArgumentError(f"{name} = {v} is outside int32 (llama.cpp takes it as int32_t)")
    return v


def as_seq_id(value: object, name: str = "seq_id") -> int:
    """A sequence id as llama.cpp takes it (int32); SequenceError outside int32, so no id can wrap to another."""
    v = as_int(value, name)
    if not INT32_MIN <= v <= POS_MAX:
        raise SequenceError(f"{name} = {v} is outside int32: no llama_seq_id has that value")
    return v


def int64_values(values: object, name: str, n: int | None = None) -> npt.NDArray[np.int64]:
    """The integers a bulk method of the cells is given, as a C-contiguous int64 array: flattened, or (``n`` given)
    broadcast to ``n`` values, one value repeated.

    Both cell twins read their bulk arguments through this one function, so they accept and refuse the same inputs:
    integers (a Python or NumPy integer, bool included, as ``operator.index`` takes them), sequences of them and
    integer arrays. An integer beyond int64 saturates (every range check of the cells reads it the same way). Anything
    else (a float, NaN, a string, None, a ragged list) is an ArgumentTypeError naming ``name``; a length that does not
    broadcast to ``n`` is an ArgumentError. Nothing is written anywhere: callers convert before they check or change.
    """
    if isinstance(values, np.ndarray):
        arr = values
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            arr = np.empty(0, dtype=np.float64)  # refused below, element by element
        if arr.dtype.kind not in "biu":  # Python objects (ints past int64 among them): element by element
            try:
                arr = np.asarray(values, dtype=object)
            except (TypeError, ValueError):
                raise ArgumentTypeError(f"{name}: expected integers, got {type(values).__name__}") from None
    kind = arr.dtype.kind
    out: npt.NDArray[np.int64]
    if kind == "O":
        flat = [min(max(as_index(v, name), INT64_MIN), INT64_MAX) for v in arr.reshape(-1).tolist()]
        out = np.array(flat, dtype=np.int64).reshape(arr.shape)
    elif kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > INT64_MAX:
        out = np.minimum(arr, np.uint64(INT64_MAX)).astype(np.int64)
    elif kind in "biu":
        out = arr.astype(np.int64, copy=False)
    else:
        raise ArgumentTypeError(f"{name}: expected integers, got {arr.dtype} values")
    if n is None:
        return np.ascontiguousarray(out.reshape(-1))
    if out.ndim == 1 and out.size == n:
        return np.ascontiguousarray(out)
    try:
        return np.ascontiguousarray(np.broadcast_to(out, (n,)))
    except ValueError:
        raise ArgumentError(f"{name}: {out.size} values for {n} cells") from None


def as_index(value: object, name: str) -> int:
    """``value`` as a Python int the way ``operator.index`` takes it (bool included: the cells' own rule); an
    ArgumentTypeError naming ``name`` for anything else."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None


def physical_memory() -> int | None:
    """Bytes of RAM on this machine (None where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def check_alloc(nbytes: int, what: str, fix: str) -> None:
    """Refuse, before anything is allocated, a buffer larger than this machine's memory (ArgumentError)."""
    limit = physical_memory()
    if limit is not None and nbytes > limit:
        raise ArgumentError(
            f"{what} would take {nbytes} bytes ({nbytes / 2**30:.1f} GiB), more than this machine's "
            f"{limit / 2**30:.1f} GiB of memory; {fix}"
        )


def as_state_args(seq_id: object, flags: object) -> tuple[int, int]:
    """``state_write`` / ``state_read`` arguments: an int32 sequence id (-1: all) and uint32 llama_state_seq_flags."""
    f = as_int(flags, "flags")
    if not 0 <= f <= 0xFFFFFFFF:
        raise ArgumentError(f"flags = {f} is outside uint32 (llama_state_seq_flags)")
    return as_seq_id(seq_id), f


def as_buffer(data: object, name: str = "data") -> memoryview:
    """State bytes as a flat byte view (bytes, bytearray, memoryview, mmap, NumPy arrays: anything with the
    buffer protocol); ArgumentTypeError for anything else."""
    try:
        return memoryview(data).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(f"{name}: expected bytes-like state data, got {type(data).__name__}") from None


def args_name(op: str) -> str:
    """The name of the fourth argument of ``seq_add`` / ``seq_div``, as llama.cpp's API calls it."""
    return "shift" if op == "seq_add" else "d"


def as_range(p0: object, p1: object) -> tuple[int, int]:
    """``p0``, ``p1`` as int32 positions (negative: open ends, as llama.cpp reads them)."""
    return as_int32(p0, "p0"), as_int32(p1, "p1")


__all__ = [
    "args_name",
    "as_buffer",
    "as_index",
    "as_int",
    "as_int32",
    "as_range",
    "as_seq_id",
    "check_alloc",
    "int64_values",
    "physical_memory",
]
