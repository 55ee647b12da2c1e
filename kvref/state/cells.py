"""Cell metadata of one stream, columnar: the ``pos / n_seq_id / ext / seq_id[]`` records of state_write_meta.

Per cell llama.cpp writes ``i32 pos``, ``u32 n_seq_id``, the cell ext when the cache has one (2 x i32 x, y or
3 x i32 x, y, tok: ``Profile.cell_ext_size``), then ``i32 seq_id[n_seq_id]``. `Cells` keeps those as NumPy
columns (the seq ids in CSR form) because a multi-GiB state has hundreds of thousands of cells and the
accessors (position ranges per sequence) are vectorised. `CellTable` is the DSL field that reads and writes it.
The common case (every cell with the same ``n_seq_id``) is parsed as one structured-array view; a mixed table
falls back to a per-cell walk that checks each count before it reads.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..constants import LLAMA_MAX_SEQ
from ..errors import ArgumentError, FormatError
from .codec import Reader, Writer
from .dsl import Env, Field


@dataclass(frozen=True)
class SeqRange:
    """Where one sequence lives in a stream: its smallest and largest position and how many cells it holds."""

    pos_min: int
    pos_max: int
    n_cells: int


class Cells:
    """The cells of one stream as written: ``pos (n,)``, ``ext (n, k)``, ``seq_id`` flat with ``seq_start (n+1,)``."""

    __slots__ = ("ext", "pos", "seq_id", "seq_start")
    pos: npt.NDArray[np.int32]
    seq_id: npt.NDArray[np.int32]
    seq_start: npt.NDArray[np.int64]
    ext: npt.NDArray[np.int32]

    def __init__(
        self,
        pos: npt.ArrayLike,
        seq_id: npt.ArrayLike,
        seq_start: npt.ArrayLike,
        ext: npt.ArrayLike | None = None,
        ext_size: int = 0,
    ) -> None:
        self.pos = np.asarray(pos, dtype=np.int32)
        self.seq_id = np.asarray(seq_id, dtype=np.int32)
        self.seq_start = np.asarray(seq_start, dtype=np.int64)
        k = ext_size // 4
        self.ext = np.zeros((len(self.pos), k), np.int32) if ext is None else np.asarray(ext, dtype=np.int32)
        if self.ext.ndim != 2 or self.ext.shape[0] != len(self.pos):
            raise ArgumentError(f"ext must have shape (n_cells, k), got {self.ext.shape}")
        if len(self.seq_start) != len(self.pos) + 1 or self.seq_start[-1] != len(self.seq_id):
            raise ArgumentError("seq_start must have n_cells + 1 offsets ending at len(seq_id)")

    @classmethod
    def from_lists(
        cls,
        pos: Sequence[int],
        seq_ids: Iterable[Iterable[int]],
        ext: npt.ArrayLike | None = None,
        ext_size: int | None = None,
    ) -> Cells:
        """Build from per-cell seq id lists (the order is kept: it is the order written)."""
        lists = [list(s) for s in seq_ids]
        start = np.zeros(len(lists) + 1, np.int64)
        np.cumsum([len(s) for s in lists], out=start[1:])
        flat = np.fromiter((x for s in lists for x in s), np.int32, count=int(start[-1]))
        if ext is None:
            return cls(pos, flat, start, None, ext_size or 0)
        ext_rows = np.asarray(ext, np.int32).reshape(len(lists), -1)
        return cls(pos, flat, start, ext_rows, ext_rows.shape[1] * 4)

    @property
    def n(self) -> int:
        """The number of cells (the ``cell_count`` written)."""
        return len(self.pos)

    @property
    def ext_size(self) -> int:
        """Bytes of ext per cell: 0, 8 (x, y) or 12 (x, y, tok)."""
        return int(self.ext.shape[1]) * 4

    @property
    def n_seq_id(self) -> npt.NDArray[np.uint32]:
        """Every cell's ``n_seq_id``, uint32 (n,)."""
        return np.diff(self.seq_start).astype(np.uint32)

    def seq_ids(self, i: int) -> tuple[int, ...]:
        """Cell ``i``'s sequence ids, in the order written."""
        return tuple(int(x) for x in self.seq_id[self.seq_start[i] : self.seq_start[i + 1]])

    def seq_set(self, i: int) -> frozenset[int]:
        """Cell ``i``'s sequence ids, as a set."""
        return frozenset(self.seq_ids(i))

    def cell_seq(self) -> npt.NDArray[np.intp]:
        """For every entry of ``seq_id``, the index of its cell."""
        return np.repeat(np.arange(self.n), np.diff(self.seq_start))

    def sequences(self) -> dict[int, SeqRange]:
        """Per sequence id: position range and cell count (cells shared by several sequences count for each)."""
        if not len(self.seq_id):
            return {}
        p = self.pos[self.cell_seq()]
        out: dict[int, SeqRange] = {}
        for s in np.unique(self.seq_id):
            m = self.seq_id == s
            out[int(s)] = SeqRange(int(p[m].min()), int(p[m].max()), int(m.sum()))
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cells):
            return NotImplemented
        return (
            np.array_equal(self.pos, other.pos)
            and np.array_equal(self.seq_id, other.seq_id)
            and np.array_equal(self.seq_start, other.seq_start)
            and np.array_equal(self.ext, other.ext)
        )

    def __repr__(self) -> str:
        return f"Cells(n={self.n}, ext_size={self.ext_size}, sequences={sorted(self.sequences())})"


_CELL_HEAD = struct.Struct("<iI")


def _record_dtype(ext_k: int, n_seq: int) -> np.dtype[np.void]:
    return np.dtype([("pos", "<i4"), ("n", "<u4"), ("ext", "<i4", (ext_k,)), ("seq", "<i4", (n_seq,))])


class CellTable(Field[object]):
    """The DSL field for a stream's cell metadata. ``count(env)`` and ``ext_size(env)`` come from the header."""

    def __init__(
        self,
        name: str,
        count: Callable[[Env], int],
        ext_size: Callable[[Env], int],
        n_seq_id: Callable[[Env], tuple[int, ...] | None] = lambda env: None,
    ) -> None:
        self.name = self.attr = name
        self.count = count
        self.ext_size = ext_size
        self.n_seq_id = n_seq_id  # the n_seq_id values a cell may have, when the container fixes them

    def read(self, r: Reader, env: Env) -> Cells:
        at = r.pos
        cells = self._read(r, env)
        want = self.n_seq_id(env)
        if want is not None and cells.n:
            bad = np.flatnonzero(~np.isin(np.diff(cells.seq_start), want))
            if len(bad):
                i = int(bad[0])
                off = at + i * (8 + cells.ext_size) + 4 * int(cells.seq_start[i]) + 4
                raise FormatError(
                    f"cell {i} has n_seq_id {int(cells.seq_start[i + 1] - cells.seq_start[i])}, "
                    f"a sequence state has {' or '.join(map(str, want))} per cell",
                    field="n_seq_id",
                    offset=off,
                )
        return cells

    def _read(self, r: Reader, env: Env) -> Cells:
        n = self.count(env)
        ext_size = self.ext_size(env)
        k = ext_size // 4
        at = r.pos
        if n * (8 + ext_size) > r.remaining():  # every cell is at least pos + n_seq_id + ext
            raise FormatError(
                f"cell_count {n} needs at least {n * (8 + ext_size)} bytes of cell metadata, {r.remaining()} remain",
                field="cell_count",
                offset=at,
            )
        if n == 0:
            return Cells(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int64), None, ext_size)
        r.need(8, "pos")
        n_seq0 = _CELL_HEAD.unpack_from(r.buf, at)[1]
        if n_seq0 <= LLAMA_MAX_SEQ:
            cells = self._read_uniform(r, n, k, n_seq0)
            if cells is not None:
                return cells
        return self._read_walk(r, n, k)

    def _read_uniform(self, r: Reader, n: int, k: int, n_seq: int) -> Cells | None:
        """Every cell with ``n_seq`` ids: one structured view. None when the table is not uniform."""
        dt = _record_dtype(k, n_seq)
        if n * dt.itemsize > r.remaining():
            return None
        at = r.pos
        rec = np.frombuffer(r.buf, dtype=dt, count=n, offset=at)
        if not (rec["n"] == n_seq).all():
            return None
        ids = rec["seq"].reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= LLAMA_MAX_SEQ):
            return None  # the walk names the offset of the first bad id
        r.pos += n * dt.itemsize
        start = np.arange(0, n * n_seq + 1, n_seq, dtype=np.int64) if n_seq else np.zeros(n + 1, np.int64)
        return Cells(rec["pos"].copy(), ids.copy(), start, rec["ext"].reshape(n, k).copy())

    def _read_walk(self, r: Reader, n: int, k: int) -> Cells:
        pos = np.empty(n, np.int32)
        ext = np.empty((n, k), np.int32)
        start = np.zeros(n + 1, np.int64)
        ids: list[int] = []
        buf = r.buf
        for i in range(n):
            r.need(4, "pos")
            r.need(8, "n_seq_id")
            p, m = _CELL_HEAD.unpack_from(buf, r.pos)
            if m > LLAMA_MAX_SEQ:
                raise FormatError(
                    f"n_seq_id {m} exceeds LLAMA_MAX_SEQ ({LLAMA_MAX_SEQ})", field="n_seq_id", offset=r.pos + 4
                )
            r.pos += 8
            pos[i] = p
            if k:
                ext[i] = r.array(np.dtype("<i4"), k, "ext")
            at = r.pos
            cell_ids = r.array(np.dtype("<i4"), m, "seq_id", "n_seq_id")
            for j, s in enumerate(cell_ids.tolist()):
                if not 0 <= s < LLAMA_MAX_SEQ:
                    raise FormatError(
                        f"seq_id {s} is out of range [0, {LLAMA_MAX_SEQ})", field="seq_id", offset=at + 4 * j
                    )
            ids.extend(cell_ids.tolist())
            start[i + 1] = len(ids)
        return Cells(pos, np.array(ids, np.int32), start, ext)

    def write(self, w: Writer, cells: object, env: Env) -> None:
        if not isinstance(cells, Cells):
            raise FormatError(f"expected Cells, got {type(cells).__name__}", field=self.name, offset=w.n)
        n, ext_size = self.count(env), self.ext_size(env)
        if cells.n != n:
            raise FormatError(f"{cells.n} cells, but cell_count says {n}", field="cell_count", offset=w.n)
        if cells.ext_size != ext_size:
            raise FormatError(f"cells carry {cells.ext_size}-byte ext, the layout {ext_size}", field="ext", offset=w.n)
        if len(cells.seq_id) and (cells.seq_id.min() < 0 or cells.seq_id.max() >= LLAMA_MAX_SEQ):
            raise FormatError("seq_id out of range [0, LLAMA_MAX_SEQ)", field="seq_id", offset=w.n)
        counts = np.diff(cells.seq_start)
        k = ext_size // 4
        if n and (counts == counts[0]).all():
            rec = np.empty(n, _record_dtype(k, int(counts[0])))
            rec["pos"], rec["n"], rec["ext"] = cells.pos, counts, cells.ext
            rec["seq"] = cells.seq_id.reshape(n, int(counts[0]))
            w.array(rec.view(np.uint8), self.name)  # its bytes as laid out, no copy
            return
        out = bytearray()
        for i in range(n):
            out += _CELL_HEAD.pack(int(cells.pos[i]), int(counts[i]))
            out += cells.ext[i].astype("<i4").tobytes()
            out += cells.seq_id[cells.seq_start[i] : cells.seq_start[i + 1]].astype("<i4").tobytes()
        w.raw(bytes(out))


__all__ = ["CellTable", "Cells", "SeqRange"]
