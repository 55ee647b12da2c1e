"""A tiny declarative layout language: each record is declared once and walked both ways.

A `Struct` maps an ordered list of fields onto a Python class. Reading walks the fields over a `Reader` and
builds the object; writing walks the same fields over the object and a `Writer`. Fields see an *environment*
(an `Env`): the read options at its root (``ext_size``, ``n_stream_field`` ...) and every value read or
written so far in the enclosing records, so that a later field can depend on an earlier one (``cell_count``
sizes the cell table and every layer's rows). Values that are implied by the object (counts, flags) are
declared with ``derive=`` and never stored twice, so a writer cannot emit a count that disagrees with the data.

Typing: a field is generic over the record it is read into (``Field[R]``, contravariant: it only reads
attributes of ``R`` through ``derive``), so a ``derive`` callback is checked against the record class its
`Struct` builds. Environment values are plain objects; `env_int` / `env_flag` narrow them where a callback
computes with them.

Each record remembers where its fields started (``obj.offsets``), which is what lets a diff name the byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import FormatError
from .codec import Reader, Writer


class Env(dict[str, object]):
    """The values a field sees: the read options and what the enclosing records read or wrote so far.

    ``new_child()`` is the scope of a nested record: a copy, whose writes its parent never sees. (A child is only
    made after its parent's last write before it and dropped before the parent's next one, so a copy answers as a
    chain of maps would, with a dict's lookups.)"""

    __slots__ = ()

    def new_child(self) -> Env:
        return Env(self)


Pred = Callable[[Env], object]  # its truth value decides
R = TypeVar("R", contravariant=True)  # the record a field belongs to
S = TypeVar("S", np.int32, np.float32)  # an Array's element type (the two llama.cpp writes)
ScalarKind = Literal["u32", "i32", "u64"]


def env_int(env: Mapping[str, object], key: str) -> int:
    """An integer the layout read or was given (a count, a size, a flag)."""
    v = env[key]
    if isinstance(v, int | np.integer):
        return int(v)
    raise FormatError(f"{key} is {type(v).__name__}, the layout needs an integer", field=key)


def env_flag(env: Mapping[str, object], key: str, default: bool = False) -> bool:
    """A read option or flag; ``default`` when the env does not hold it."""
    return bool(env.get(key, default))


class Field(Generic[R]):
    """One wire field. ``attr`` is the attribute on the record (default: the field name)."""

    name: str
    attr: str | None
    min_size: int = 0  # smallest encoding, used to reject counts the remaining bytes cannot hold

    def read(self, r: Reader, env: Env) -> object:
        raise NotImplementedError

    def write(self, w: Writer, value: object, env: Env) -> None:
        raise NotImplementedError

    def get(self, obj: R, env: Env) -> object:
        return getattr(obj, self.attr) if self.attr else None


class _Derivable(Field[R]):
    """A field whose value is ``derive(obj, env)`` when a ``derive`` is given, else the record's ``attr``."""

    derive: Callable[[R, Env], object] | None

    def get(self, obj: R, env: Env) -> object:
        if self.derive is not None:
            try:
                return self.derive(obj, env)
            except (AttributeError, TypeError) as e:  # an edited record whose attributes have the wrong type
                raise FormatError(f"cannot compute it from the record: {e}", field=self.name) from None
        assert self.attr is not None, f"{self.name}: a field without attr must derive its value"
        return getattr(obj, self.attr)


class Scalar(_Derivable[R]):
    """A fixed-size integer (`U32`, `I32`, `U64`). ``check(value, env)`` returns an error message or None."""

    kind: ClassVar[ScalarKind]

    def __init__(
        self,
        name: str,
        *,
        attr: str | None = "",
        derive: Callable[[R, Env], int] | None = None,
        check: Callable[[int, Env], str | None] | None = None,
    ) -> None:
        self.name = name
        self.attr = None if derive is not None and attr == "" else (attr or name)
        self.derive = derive
        self.check = check
        self.min_size = 8 if self.kind == "u64" else 4

    def read(self, r: Reader, env: Env) -> int:
        at = r.pos
        v = r.u64(self.name) if self.kind == "u64" else r.i32(self.name) if self.kind == "i32" else r.u32(self.name)
        if self.check is not None:
            msg = self.check(v, env)
            if msg:
                raise FormatError(msg, field=self.name, offset=at)
        return v

    def write(self, w: Writer, value: object, env: Env) -> None:
        if not isinstance(value, int | np.integer):
            raise FormatError(f"expected an integer, got {type(value).__name__}", field=self.name, offset=w.n)
        v = int(value)
        if self.check is not None:
            msg = self.check(v, env)
            if msg:
                raise FormatError(f"refusing to write: {msg}", field=self.name, offset=w.n)
        if self.kind == "u64":
            w.u64(v, self.name)
        elif self.kind == "i32":
            w.i32(v, self.name)
        else:
            w.u32(v, self.name)


class U32(Scalar[R]):
    kind = "u32"


class I32(Scalar[R]):
    kind = "i32"


class U64(Scalar[R]):
    kind = "u64"


Count = Scalar[object] | Callable[[Env], int]  # a prefix field that is read and written, or computed


def _prefix(count: Count) -> Scalar[object] | None:
    return count if isinstance(count, Scalar) else None


class Str(Field[object]):
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

    def write(self, w: Writer, value: object, env: Env) -> None:
        if not isinstance(value, str):
            raise FormatError(f"expected a str, got {type(value).__name__}", field=self.name, offset=w.n)
        b = value.encode("utf-8", "surrogateescape")
        w.u32(len(b), self.length)
        w.raw(b)


class Array(Field[object], Generic[S]):
    """A 1-D little-endian array of ``scalar``; ``count`` is a prefix field (its length is written) or
    ``count(env)``."""

    def __init__(self, name: str, scalar: type[S], count: Count, *, attr: str | None = None) -> None:
        self.name = name
        self.attr = attr or name
        self.dtype: np.dtype[S] = np.dtype(scalar).newbyteorder("<")
        self.count = count
        prefix = _prefix(count)
        self.min_size = prefix.min_size if prefix is not None else 0

    def read(self, r: Reader, env: Env) -> npt.NDArray[S]:
        prefix = _prefix(self.count)
        if prefix is not None:
            n = prefix.read(r, env)
            env[prefix.name] = n
            return r.array(self.dtype, n, self.name, prefix.name)
        assert not isinstance(self.count, Scalar)
        return r.array(self.dtype, self.count(env), self.name)

    def write(self, w: Writer, value: object, env: Env) -> None:
        try:
            a = np.asarray(value, dtype=self.dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise FormatError(f"not an array of {self.dtype.name}: {e}", field=self.name, offset=w.n) from None
        if a.ndim != 1:
            raise FormatError(f"expected a 1-D array, got shape {a.shape}", field=self.name, offset=w.n)
        prefix = _prefix(self.count)
        if prefix is not None:
            prefix.write(w, len(a), env)
            env[prefix.name] = len(a)
        else:
            assert not isinstance(self.count, Scalar)
            if len(a) != self.count(env):
                raise FormatError(f"expected {self.count(env)} elements, got {len(a)}", field=self.name, offset=w.n)
        w.array(a, self.name)


_MAX_DIM = np.iinfo(np.intp).max


class Rows(Field[object]):
    """Raw tensor rows: a ``(n_rows, row_bytes)`` uint8 view; ``shape(env)`` gives both from earlier fields."""

    def __init__(self, name: str, shape: Callable[[Env], tuple[int, int]], *, attr: str | None = None) -> None:
        self.name = name
        self.attr = attr or name
        self.shape = shape

    def read(self, r: Reader, env: Env) -> npt.NDArray[np.uint8]:
        rows, cols = self.shape(env)
        r.need(rows * cols, self.name)
        if max(rows, cols) > _MAX_DIM:
            # zero rows of a u64 row size no array can have (no llama.cpp cache has such rows)
            raise FormatError(f"{rows} rows of {cols} bytes: too large a block", field=self.name, offset=r.pos)
        return r.array(np.dtype(np.uint8), rows * cols, self.name).reshape(rows, cols)

    def write(self, w: Writer, value: object, env: Env) -> None:
        if not isinstance(value, np.ndarray) or value.dtype.hasobject:
            raise FormatError(
                f"expected a NumPy array of rows, got {type(value).__name__}", field=self.name, offset=w.n
            )
        a = value
        want = self.shape(env)
        if a.dtype != np.uint8:
            a = a.reshape(a.shape[0], -1).view(np.uint8) if a.ndim else a
        if a.shape != want:
            raise FormatError(f"rows have shape {a.shape}, the header says {want}", field=self.name, offset=w.n)
        w.array(a, self.name)


class Param(_Derivable[R]):
    """No bytes: moves a read option into the object (read) and the object's choice into the env (write)."""

    def __init__(self, key: str, *, attr: str | None = "", derive: Callable[[R, Env], object] | None = None) -> None:
        self.name = key
        self.attr = None if derive is not None else (attr or key)
        self.derive = derive

    def read(self, r: Reader, env: Env) -> object:
        return env[self.name]

    def write(self, w: Writer, value: object, env: Env) -> None:
        pass


class When(Field[R]):
    """``field`` is present iff ``pred(env)``; the attribute is None when absent (both directions agree)."""

    def __init__(self, pred: Pred, field: Field[R]) -> None:
        self.pred = pred
        self.field = field
        self.name = field.name
        self.attr = field.attr

    def read(self, r: Reader, env: Env) -> object:
        return self.field.read(r, env) if self.pred(env) else None

    def get(self, obj: R, env: Env) -> object:
        return self.field.get(obj, env)

    def write(self, w: Writer, value: object, env: Env) -> None:
        if self.pred(env):
            if value is None:
                raise FormatError("missing, but the header says it is present", field=self.name, offset=w.n)
            self.field.write(w, value, env)
        elif value is not None and self.field.attr is not None:
            raise FormatError("present, but the header says it is absent", field=self.name, offset=w.n)


class Switch(Field[object]):
    """Chooses the field by ``select(env)`` (for example the V layout by ``v_trans``)."""

    def __init__(self, name: str, select: Callable[[Env], bool], cases: Mapping[bool, Field[object]]) -> None:
        self.name = self.attr = name
        self.select = select
        self.cases = cases

    def read(self, r: Reader, env: Env) -> object:
        return self.cases[self.select(env)].read(r, env)

    def write(self, w: Writer, value: object, env: Env) -> None:
        self.cases[self.select(env)].write(w, value, env)


class Record:
    """Base of the object-model classes: keeps the byte offsets the reader saw (empty when built by hand)."""

    offsets: dict[str, int]

    def __post_init__(self) -> None:
        self.offsets = {}


RecordT = TypeVar("RecordT", bound=Record, covariant=True)  # the record a Struct builds
Rec = TypeVar("Rec", bound=Record)


class Struct(Field[object], Generic[RecordT]):
    """A record: ``fields`` in wire order mapped onto ``cls`` (keyword construction, attribute access)."""

    def __init__(self, cls: type[RecordT], *fields: Field[RecordT], name: str | None = None) -> None:
        self.cls = cls  # a dataclass: built by keyword
        self.fields = fields
        self.name = name or cls.__name__
        self.attr = name
        self.min_size = sum(f.min_size for f in fields if not isinstance(f, When | Switch))

    def named(self, name: str) -> Struct[RecordT]:
        """The same record as a field called ``name`` of an enclosing record."""
        return Struct(self.cls, *self.fields, name=name)

    def read(self, r: Reader, env: Env) -> RecordT:
        local = env.new_child()
        kwargs: dict[str, object] = {}
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

    def write(self, w: Writer, value: object, env: Env) -> None:
        if not isinstance(value, self.cls):
            raise FormatError(
                f"expected a {self.cls.__name__}, got {type(value).__name__}", field=self.name, offset=w.n
            )
        local = env.new_child()
        for f in self.fields:
            v = f.get(value, local)
            local[f.name] = v
            f.write(w, v, local)


class List(Field[object]):
    """``count`` records; ``count`` is a prefix field or ``count(env)``. Implausible counts fail before allocating."""

    def __init__(
        self,
        name: str,
        item: Field[object],
        count: Count,
        *,
        attr: str | None = None,
        blame: str | None = None,
    ) -> None:
        self.name = name
        self.attr = attr or name
        self.item = item
        self.count = count
        self.blame = blame or name  # the header field an implausible computed count is blamed on
        prefix = _prefix(count)
        self.min_size = prefix.min_size if prefix is not None else 0

    def read(self, r: Reader, env: Env) -> list[object]:
        at = r.pos
        prefix = _prefix(self.count)
        if prefix is not None:
            n = prefix.read(r, env)
            env[prefix.name] = n
            blame = prefix.name
        else:
            assert not isinstance(self.count, Scalar)
            n = self.count(env)
            blame = self.blame
        if n * self.item.min_size > r.remaining():
            raise FormatError(
                f"count {n} of {self.name} needs at least {n * self.item.min_size} bytes, {r.remaining()} remain",
                field=blame,
                offset=at,
            )
        return [self.item.read(r, env) for _ in range(n)]

    def write(self, w: Writer, value: object, env: Env) -> None:
        if not isinstance(value, list | tuple):
            raise FormatError(f"expected a list, got {type(value).__name__}", field=self.name, offset=w.n)
        prefix = _prefix(self.count)
        if prefix is not None:
            prefix.write(w, len(value), env)
            env[prefix.name] = len(value)
        else:
            assert not isinstance(self.count, Scalar)
            if len(value) != self.count(env):
                raise FormatError(f"expected {self.count(env)} entries, got {len(value)}", field=self.blame, offset=w.n)
        for item in value:
            self.item.write(w, item, env)


def read_root(
    struct: Struct[Rec],
    buf: object,
    options: Mapping[str, object],
    *,
    start: int = 0,
    end: int | None = None,
) -> Rec:
    """Read ``struct`` from ``buf`` and require that it ends exactly at ``end`` (no trailing bytes)."""
    r = Reader(buf, start, end)
    env = Env(options)
    env["_reader"] = r
    obj = struct.read(r, env)
    if r.pos != r.end:
        raise FormatError(f"{r.end - r.pos} trailing bytes after the last section", field="trailing", offset=r.pos)
    return obj


def write_root(struct: Struct[Rec], obj: Rec, w: Writer, options: Mapping[str, object] | None = None) -> None:
    struct.write(w, obj, Env(options or {}))


__all__ = [
    "I32",
    "U32",
    "U64",
    "Array",
    "Env",
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
    "env_flag",
    "env_int",
    "read_root",
    "write_root",
]
