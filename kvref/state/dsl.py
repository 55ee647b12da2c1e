"""A tiny declarative layout language: each record is declared once and walked both ways.

A `Struct` maps an ordered list of fields onto a Python class. Reading walks the fields over a `Reader` and
builds the object; writing walks the same fields over the object and a `Writer`. Fields see an *environment*
(a ChainMap): the read options at its root (``ext_size``, ``n_stream_field`` ...) and every value read or
written so far in the enclosing records, so that a later field can depend on an earlier one (``cell_count``
sizes the cell table and every layer's rows). Values that are implied by the object (counts, flags) are
declared with ``derive=`` and never stored twice, so a writer cannot emit a count that disagrees with the data.

Each record remembers where its fields started (``obj.offsets``), which is what lets a diff name the byte.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import FormatError
from .codec import Reader, Writer

Env = ChainMap
Pred = Callable[[Env], Any]


class Field:
    """One wire field. ``attr`` is the attribute on the record (default: the field name)."""

    name: str
    attr: str | None
    min_size: int = 0  # smallest encoding, used to reject counts the remaining bytes cannot hold

    def read(self, r: Reader, env: Env) -> Any:
        raise NotImplementedError

    def write(self, w: Writer, value: Any, env: Env) -> None:
        raise NotImplementedError

    def get(self, obj: Any, env: Env) -> Any:
        return getattr(obj, self.attr) if self.attr else None


class _Derivable(Field):
    """A field whose value is ``derive(obj, env)`` when a ``derive`` is given, else the record's ``attr``."""

    derive: Callable[[Any, Env], Any] | None

    def get(self, obj: Any, env: Env) -> Any:
        if self.derive is not None:
            return self.derive(obj, env)
        assert self.attr is not None, f"{self.name}: a field without attr must derive its value"
        return getattr(obj, self.attr)


class Scalar(_Derivable):
    """A fixed-size integer. ``check(value, env)`` returns an error message or None."""

    def __init__(
        self,
        name: str,
        kind: str,
        *,
        attr: str | None = "",
        derive: Callable[[Any, Env], int] | None = None,
        check: Callable[[int, Env], str | None] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.attr = None if derive is not None and attr == "" else (attr or name)
        self.derive = derive
        self.check = check
        self.min_size = 8 if kind == "u64" else 4

    def read(self, r: Reader, env: Env) -> int:
        at = r.pos
        v = getattr(r, self.kind)(self.name)
        if self.check is not None:
            msg = self.check(v, env)
            if msg:
                raise FormatError(msg, field=self.name, offset=at)
        return v

    def write(self, w: Writer, value: int, env: Env) -> None:
        if self.check is not None:
            msg = self.check(value, env)
            if msg:
                raise FormatError(f"refusing to write: {msg}", field=self.name, offset=w.n)
        getattr(w, self.kind)(value, self.name)


def U32(name: str, **kw: Any) -> Scalar:
    return Scalar(name, "u32", **kw)


def I32(name: str, **kw: Any) -> Scalar:
    return Scalar(name, "i32", **kw)


def U64(name: str, **kw: Any) -> Scalar:
    return Scalar(name, "u64", **kw)


class Str(Field):
    """``u32 length`` + bytes (llama_io_write_i::write_string); decoded losslessly (surrogateescape)."""

    min_size = 4

    def __init__(self, name: str, *, max_len: int = 1 << 20) -> None:
        self.name = self.attr = name
        self.length = f"{name}_length"  # errors about the prefix name it, errors about the bytes the string
        self.max_len = max_len

    def read(self, r: Reader, env: Env) -> str:
        at = r.pos
        n = r.u32(self.length)
        if n > self.max_len:
            raise FormatError(f"string length {n} exceeds {self.max_len}", field=self.length, offset=at)
        if n > r.remaining():
            raise FormatError(
                f"string length {n} exceeds the {r.remaining()} remaining bytes", field=self.length, offset=at
            )
        return bytes(r.take(n, self.name)).decode("utf-8", "surrogateescape")

    def write(self, w: Writer, value: str, env: Env) -> None:
        b = value.encode("utf-8", "surrogateescape")
        w.u32(len(b), self.length)
        w.raw(b)


class Array(Field):
    """A 1-D array of ``dtype``; ``count`` is a prefix field (its length is written) or ``count(env)``."""

    def __init__(self, name: str, dtype: str, count: Scalar | Callable[[Env], int], *, attr: str | None = None) -> None:
        self.name = name
        self.attr = attr or name
        self.dtype = np.dtype(dtype)
        self.count = count
        self.min_size = count.min_size if isinstance(count, Scalar) else 0

    def read(self, r: Reader, env: Env) -> np.ndarray:
        if isinstance(self.count, Scalar):
            n = self.count.read(r, env)
            env[self.count.name] = n
            return r.array(self.dtype, n, self.name, self.count.name)
        return r.array(self.dtype, self.count(env), self.name)

    def write(self, w: Writer, value: Any, env: Env) -> None:
        a = np.asarray(value, dtype=self.dtype)
        if a.ndim != 1:
            raise FormatError(f"expected a 1-D array, got shape {a.shape}", field=self.name, offset=w.n)
        if isinstance(self.count, Scalar):
            self.count.write(w, len(a), env)
            env[self.count.name] = len(a)
        elif len(a) != self.count(env):
            raise FormatError(f"expected {self.count(env)} elements, got {len(a)}", field=self.name, offset=w.n)
        w.array(a, self.name)


_MAX_DIM = np.iinfo(np.intp).max


class Rows(Field):
    """Raw tensor rows: a ``(n_rows, row_bytes)`` uint8 view; ``shape(env)`` gives both from earlier fields."""

    def __init__(self, name: str, shape: Callable[[Env], tuple[int, int]], *, attr: str | None = None) -> None:
        self.name = name
        self.attr = attr or name
        self.shape = shape

    def read(self, r: Reader, env: Env) -> np.ndarray:
        rows, cols = self.shape(env)
        r.need(rows * cols, self.name)
        if max(rows, cols) > _MAX_DIM:
            # zero rows of a u64 row size no array can have (no llama.cpp cache has such rows)
            raise FormatError(f"{rows} rows of {cols} bytes: too large a block", field=self.name, offset=r.pos)
        return r.array(np.dtype(np.uint8), rows * cols, self.name).reshape(rows, cols)

    def write(self, w: Writer, value: Any, env: Env) -> None:
        a = np.asarray(value)
        want = self.shape(env)
        if a.dtype != np.uint8:
            a = a.reshape(a.shape[0], -1).view(np.uint8) if a.ndim else a
        if a.shape != want:
            raise FormatError(f"rows have shape {a.shape}, the header says {want}", field=self.name, offset=w.n)
        w.array(a, self.name)


class Param(_Derivable):
    """No bytes: moves a read option into the object (read) and the object's choice into the env (write)."""

    def __init__(self, key: str, *, attr: str | None = "", derive: Callable[[Any, Env], Any] | None = None) -> None:
        self.name = key
        self.attr = None if derive is not None else (attr or key)
        self.derive = derive

    def read(self, r: Reader, env: Env) -> Any:
        return env[self.name]

    def write(self, w: Writer, value: Any, env: Env) -> None:
        pass


class When(Field):
    """``field`` is present iff ``pred(env)``; the attribute is None when absent (both directions agree)."""

    def __init__(self, pred: Pred, field: Field) -> None:
        self.pred = pred
        self.field = field
        self.name = field.name
        self.attr = field.attr

    def read(self, r: Reader, env: Env) -> Any:
        return self.field.read(r, env) if self.pred(env) else None

    def get(self, obj: Any, env: Env) -> Any:
        return self.field.get(obj, env)

    def write(self, w: Writer, value: Any, env: Env) -> None:
        if self.pred(env):
            if value is None:
                raise FormatError("missing, but the header says it is present", field=self.name, offset=w.n)
            self.field.write(w, value, env)
        elif value is not None and self.field.attr is not None:
            raise FormatError("present, but the header says it is absent", field=self.name, offset=w.n)


class Switch(Field):
    """Chooses the field by ``select(env)`` (for example the V layout by ``v_trans``)."""

    def __init__(self, name: str, select: Pred, cases: dict[Any, Field]) -> None:
        self.name = self.attr = name
        self.select = select
        self.cases = cases

    def read(self, r: Reader, env: Env) -> Any:
        return self.cases[self.select(env)].read(r, env)

    def write(self, w: Writer, value: Any, env: Env) -> None:
        self.cases[self.select(env)].write(w, value, env)


class Struct(Field):
    """A record: ``fields`` in wire order mapped onto ``cls`` (keyword construction, attribute access)."""

    def __init__(self, cls: type, *fields: Field, name: str | None = None) -> None:
        self.cls = cls
        self.fields = fields
        self.name = name or cls.__name__
        self.attr = name
        self.min_size = sum(f.min_size for f in fields if not isinstance(f, When | Switch))

    def named(self, name: str) -> Struct:
        """The same record as a field called ``name`` of an enclosing record."""
        s = Struct(self.cls, *self.fields, name=name)
        return s

    def read(self, r: Reader, env: Env) -> Any:
        local = env.new_child()
        kwargs: dict[str, Any] = {}
        offsets: dict[str, int] = {}
        for f in self.fields:
            offsets[f.name] = r.pos
            v = f.read(r, local)
            local[f.name] = v
            if f.attr:
                kwargs[f.attr] = v
        obj = self.cls(**kwargs)
        obj.offsets = offsets
        return obj

    def write(self, w: Writer, obj: Any, env: Env) -> None:
        local = env.new_child()
        for f in self.fields:
            v = f.get(obj, local)
            local[f.name] = v
            f.write(w, v, local)


class List(Field):
    """``count`` records; ``count`` is a prefix field or ``count(env)``. Implausible counts fail before allocating."""

    def __init__(
        self,
        name: str,
        item: Field,
        count: Scalar | Callable[[Env], int],
        *,
        attr: str | None = None,
        blame: str | None = None,
    ) -> None:
        self.name = name
        self.attr = attr or name
        self.item = item
        self.count = count
        self.blame = blame or name  # the header field an implausible computed count is blamed on
        self.min_size = count.min_size if isinstance(count, Scalar) else 0

    def read(self, r: Reader, env: Env) -> list[Any]:
        at = r.pos
        if isinstance(self.count, Scalar):
            n = self.count.read(r, env)
            env[self.count.name] = n
            blame = self.count.name
        else:
            n = self.count(env)
            blame = self.blame
        if n * self.item.min_size > r.remaining():
            raise FormatError(
                f"count {n} of {self.name} needs at least {n * self.item.min_size} bytes, {r.remaining()} remain",
                field=blame,
                offset=at,
            )
        return [self.item.read(r, env) for _ in range(n)]

    def write(self, w: Writer, value: list[Any], env: Env) -> None:
        if isinstance(self.count, Scalar):
            self.count.write(w, len(value), env)
            env[self.count.name] = len(value)
        elif len(value) != self.count(env):
            raise FormatError(f"expected {self.count(env)} entries, got {len(value)}", field=self.blame, offset=w.n)
        for item in value:
            self.item.write(w, item, env)


class Record:
    """Base of the object-model classes: keeps the byte offsets the reader saw (empty when built by hand)."""

    offsets: dict[str, int]

    def __post_init__(self) -> None:
        self.offsets = {}


def read_root(struct: Struct, buf: Any, options: dict[str, Any], *, start: int = 0, end: int | None = None) -> Any:
    """Read ``struct`` from ``buf`` and require that it ends exactly at ``end`` (no trailing bytes)."""
    r = Reader(buf, start, end)
    env: Env = ChainMap({"_reader": r, **options})
    obj = struct.read(r, env)
    if r.pos != r.end:
        raise FormatError(f"{r.end - r.pos} trailing bytes after the last section", field="trailing", offset=r.pos)
    return obj


def write_root(struct: Struct, obj: Any, w: Writer, options: dict[str, Any] | None = None) -> None:
    struct.write(w, obj, ChainMap(dict(options or {})))


__all__ = [
    "I32",
    "U32",
    "U64",
    "Array",
    "Field",
    "List",
    "Param",
    "Record",
    "Rows",
    "Scalar",
    "Str",
    "Struct",
    "Switch",
    "When",
    "read_root",
    "write_root",
]
