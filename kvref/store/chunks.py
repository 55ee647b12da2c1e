"""One sequence's state, cut by position into chunk records, and put back together from them.

A state is cut per section. An attention section gives the sequence's cells in position order (`SeqRows`): K rows
per layer, V rows per layer (row-wise, or transposed: ``n_embd`` rows of each cell's elements) and the cells'
ext. A recurrent section gives one state per sequence (`Checkpoint`): it stands for the whole prefix it consumed,
so it is stored as a checkpoint at that prefix's length, never cut.

Every record the store keeps is framed by `encode` / `decode`: magic, kind, CRC-32 of the payload and its length,
so a flipped byte or a cut value is caught (`kvref.errors.DamagedValue`) before anything is served. Payload layouts:

- chunk meta: parent key, the chunk's tokens, their cells' ext, and per section the first covered offset (an
  iSWA sequence save keeps only the last window in its SWA cache, so a chunk may hold part of a section, always a
  suffix of the chunk);
- section part: the covered cells' rows, layer by layer (K, then V), as `split_part` reads them back;
- checkpoint: parent key, the recurrent cell's position, R rows (and PLE rows), then S rows per state layer.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..errors import ArgumentError, DamagedValue, FormatError

if TYPE_CHECKING:
    from ..state import Cells, KVSection, RecurrentSection, StateObject
    from .namespace import KVGeometry, RecurrentGeometry

MAGIC = b"KVRS"
HEAD = struct.Struct("<4sBBHIQ")  # magic, format version, kind, reserved, crc32, payload length
VERSION = 1
META, PART, CHECKPOINT, RECORD = 1, 2, 3, 4
U8 = npt.NDArray[np.uint8]
Piece = bytes | memoryview | U8 | npt.NDArray[np.int32]


def encode(kind: int, payload: Sequence[Piece]) -> bytearray:
    """Frame ``payload`` (its pieces joined) as a record of ``kind``: each piece is copied once, into the record
    (a transposed slice of V rows too), then checksummed."""
    arrs = [np.frombuffer(p, np.uint8) if isinstance(p, (bytes, bytearray, memoryview)) else p for p in payload]
    n = sum(int(a.nbytes) for a in arrs)
    out = bytearray(HEAD.size + n)
    buf = np.frombuffer(out, np.uint8)
    at = HEAD.size
    for a in arrs:
        if a.nbytes:
            np.copyto(buf[at : at + a.nbytes].view(a.dtype).reshape(a.shape), a)
            at += int(a.nbytes)
    HEAD.pack_into(out, 0, MAGIC, VERSION, kind, 0, zlib.crc32(memoryview(out)[HEAD.size :]), n)
    return out


def decode(value: bytes | bytearray, kind: int) -> memoryview:
    """The payload of a record of ``kind``; `DamagedValue` when the frame or the checksum is wrong."""
    if len(value) < HEAD.size:
        raise DamagedValue(f"{len(value)} bytes: shorter than a record header")
    magic, version, k, _, crc, n = HEAD.unpack_from(value)
    if magic != MAGIC or version != VERSION or k != kind:
        raise DamagedValue(f"header {magic!r} v{version} kind {k}, expected {MAGIC!r} v{VERSION} kind {kind}")
    body = memoryview(value)[HEAD.size :]
    if len(body) != n:
        raise DamagedValue(f"payload of {len(body)} bytes, the header says {n}")
    if zlib.crc32(body) != crc:
        raise DamagedValue("checksum mismatch")
    return body


# --- one sequence's rows ------------------------------------------------------------------------------------


@dataclass
class SeqRows:
    """One attention section's cells of one sequence, in position order, with their rows."""

    pos: npt.NDArray[np.int32]  # (m,), ascending
    ext: npt.NDArray[np.int32]  # (m, k)
    k: list[U8]  # per layer (m, row_size)
    v: list[U8]  # per layer (m, row_size), or (n_embd, m, el_size) when transposed

    def take(self, lo: int, hi: int) -> SeqRows:
        """The cells at indices [lo, hi)."""
        return SeqRows(self.pos[lo:hi], self.ext[lo:hi], [k[lo:hi] for k in self.k],
                       [v[:, lo:hi] if v.ndim == 3 else v[lo:hi] for v in self.v])  # fmt: skip


@dataclass
class Checkpoint:
    """A recurrent sequence state: it has consumed positions [0, pos]."""

    pos: int
    r: list[U8]  # per state layer (1, row_size)
    p: list[U8 | None]  # PLE rows per state layer
    s: list[U8]  # (1, row_size), or (n_embd, 1, el_size) when transposed


def _seq_cells(cells: Cells, seq_id: int) -> npt.NDArray[np.intp]:
    return np.unique(cells.cell_seq()[cells.seq_id == seq_id])


def _gather(rows: object, idx: npt.NDArray[np.intp] | slice[int, int, None]) -> U8:
    """The rows of cells ``idx`` (a slice when they are consecutive: views, no copy)."""
    from ..state import TransposedRows

    if isinstance(rows, TransposedRows):
        return rows.data.reshape(rows.n_embd, -1, rows.el_size)[:, idx]
    return cast("U8", rows.data)[idx]  # type: ignore[attr-defined]


def sequence_of(obj: StateObject, seq_id: int | None) -> int:
    """The sequence a put stores: ``seq_id``, or the only one the state holds."""
    seen: set[int] = set()
    for sec in obj.memory.sections:
        cell_tables = [st.cells for st in sec.streams] if sec.kind == "kv" else [sec.cells]  # type: ignore[union-attr]
        for cells in cell_tables:
            if cells is not None:
                seen.update(int(s) for s in np.unique(cells.seq_id))
    if obj.kind in ("seq", "seq_state"):
        return -1  # one sequence, whatever its cells say (recurrent sequence saves list no id)
    if seq_id is not None:
        if seq_id not in seen:
            raise ArgumentError(f"seq_id={seq_id}: the state holds no cell of it (it holds {sorted(seen) or 'none'})")
        return seq_id
    if len(seen) != 1:
        raise ArgumentError(f"the state holds sequences {sorted(seen)}: pass seq_id= to say which one to store")
    return seen.pop()


def kv_rows(sec: KVSection, seq_id: int) -> SeqRows:
    """The cells of ``seq_id`` (-1: every cell of a sequence save) in position order, with their rows."""
    for st in sec.streams:
        if st.cells is None or st.data is None:
            continue
        idx = np.arange(st.cells.n) if seq_id < 0 else _seq_cells(st.cells, seq_id)
        if idx.size == 0:
            continue
        order = np.argsort(st.cells.pos[idx], kind="stable")
        idx = idx[order]
        pos = np.ascontiguousarray(st.cells.pos[idx])
        if pos.size > 1 and not (np.diff(pos) > 0).all():
            raise FormatError("the sequence has two cells at one position: the store keeps one row per token")
        run: npt.NDArray[np.intp] | slice[int, int, None] = idx
        if idx[-1] - idx[0] == idx.size - 1 and (idx.size == 1 or (np.diff(idx) == 1).all()):
            run = slice(int(idx[0]), int(idx[-1]) + 1)  # the usual case: the rows are views
        return SeqRows(pos, np.ascontiguousarray(st.cells.ext[idx]), [_gather(k, run) for k in st.data.k],
                       [_gather(v, run) for v in st.data.v])  # fmt: skip
    return SeqRows(np.zeros(0, np.int32), np.zeros((0, 0), np.int32), [], [])


def checkpoint_of(sec: RecurrentSection, seq_id: int) -> Checkpoint | None:
    """The recurrent state of ``seq_id`` (-1: the one cell of a sequence save), or None when it has none."""
    cells = sec.cells
    idx = np.arange(cells.n) if seq_id < 0 else _seq_cells(cells, seq_id)
    if idx.size != 1:
        return None
    i = idx[:1]
    return Checkpoint(int(cells.pos[i[0]]), [np.ascontiguousarray(x.data[i]) for x in sec.r],
                      [None if x.p_data is None else np.ascontiguousarray(x.p_data[i]) for x in sec.r],
                      [_gather(s, i) for s in sec.s])  # fmt: skip


# --- records ------------------------------------------------------------------------------------------------


@dataclass
class ChunkMeta:
    """A chunk's tokens, their cells' ext, its parent's key, and which suffix of it each section holds."""

    parent: str
    tokens: npt.NDArray[np.int32]
    ext: npt.NDArray[np.int32]  # (n, k)
    cover: list[int]  # per section: first covered offset (len(tokens): none; recurrent sections: len(tokens))

    def encode(self) -> bytearray:
        n, k = len(self.tokens), self.ext.shape[1] if self.ext.ndim == 2 else 0
        head = struct.pack("<16sIII", bytes.fromhex(self.parent), n, k, len(self.cover))
        return encode(META, [head, np.asarray(self.cover, "<i4"), self.tokens.astype("<i4"),
                             self.ext.astype("<i4")])  # fmt: skip

    @classmethod
    def decode(cls, value: bytes) -> ChunkMeta:
        body = decode(value, META)
        try:
            parent, n, k, n_sec = struct.unpack_from("<16sIII", body)
            at = 28
            cover = np.frombuffer(body, "<i4", n_sec, at).tolist()
            at += 4 * n_sec
            tokens = np.frombuffer(body, "<i4", n, at).astype(np.int32)
            ext = np.frombuffer(body, "<i4", n * k, at + 4 * n).astype(np.int32).reshape(n, k)
        except (struct.error, ValueError) as e:
            raise DamagedValue(f"chunk meta: {e}") from e
        return cls(parent.hex(), tokens, ext, cover)


def part_payload(rows: SeqRows) -> list[U8]:
    """A section part's payload: every layer's K rows, then V rows, of the covered cells."""
    return [*rows.k, *rows.v]


def split_part(body: memoryview, geo: KVGeometry, m: int) -> tuple[list[U8], list[U8]]:
    """The K and V rows of ``m`` cells from a part's payload (`DamagedValue` when the sizes disagree)."""
    buf = np.frombuffer(body, np.uint8)
    at = 0
    ks: list[U8] = []
    vs: list[U8] = []
    for r in geo.k:
        n = m * int(r[2])
        ks.append(buf[at : at + n].reshape(m, int(r[2])))
        at += n
    for r in geo.v:
        if r[0] == "trans":
            el, n_embd = int(r[2]), int(r[3])
            vs.append(buf[at : at + n_embd * m * el].reshape(n_embd, m, el))
            at += n_embd * m * el
        else:
            vs.append(buf[at : at + m * int(r[2])].reshape(m, int(r[2])))
            at += m * int(r[2])
    if at != len(buf):
        raise DamagedValue(f"section part of {len(buf)} bytes, its {m} cells' rows take {at}")
    return ks, vs


def encode_checkpoint(parent: str, cp: Checkpoint) -> bytearray:
    """A checkpoint record."""
    pieces: list[Piece] = [struct.pack("<16si", bytes.fromhex(parent), cp.pos)]
    for r, p in zip(cp.r, cp.p, strict=True):
        pieces.append(r)
        if p is not None:
            pieces.append(p)
    pieces.extend(cp.s)
    return encode(CHECKPOINT, pieces)


def decode_checkpoint(value: bytes, geo: RecurrentGeometry) -> tuple[str, Checkpoint]:
    """(parent key, checkpoint) of a checkpoint record."""
    body = decode(value, CHECKPOINT)
    if len(body) < 20:
        raise DamagedValue("checkpoint shorter than its header")
    parent, pos = struct.unpack_from("<16si", body)
    buf = np.frombuffer(body, np.uint8, offset=20)
    at = 0
    rs: list[U8] = []
    ps: list[U8 | None] = []
    ss: list[U8] = []

    def take(n: int) -> U8:
        nonlocal at
        if at + n > len(buf):
            raise DamagedValue("checkpoint shorter than its rows")
        out = buf[at : at + n]
        at += n
        return out

    for r in geo.r:
        rs.append(take(int(cast(int, r[1]))).reshape(1, -1))
        ps.append(None if r[2] is None else take(int(r[2])).reshape(1, -1))
    for s in geo.s:
        if s[0] == "trans":
            ss.append(take(int(s[2]) * int(s[3])).reshape(int(s[3]), 1, int(s[2])))
        else:
            ss.append(take(int(s[2])).reshape(1, -1))
    if at != len(buf):
        raise DamagedValue(f"checkpoint of {len(buf)} row bytes, its layers take {at}")
    return parent.hex(), Checkpoint(int(pos), rs, ps, ss)


# --- back to sections ---------------------------------------------------------------------------------------


def _cells(pos: npt.NDArray[np.int32], seq_id: int | None, ext: npt.NDArray[np.int32] | None, ext_size: int) -> Cells:
    """Cells at ``pos`` each listing ``seq_id`` (None: no id, as a recurrent sequence save writes them)."""
    from ..state import Cells

    m = len(pos)
    if seq_id is None:
        return Cells(pos, np.zeros(0, np.int32), np.zeros(m + 1, np.int64), ext, ext_size)
    return Cells(pos, np.full(m, seq_id, np.int32), np.arange(m + 1, dtype=np.int64), ext, ext_size)


def kv_section(geo: KVGeometry, rows: SeqRows, seq_id: int, n_stream: int, stream: int, ext_size: int,
               has_n_stream: bool) -> KVSection:  # fmt: skip
    """An attention section holding ``rows`` (cells of ``seq_id``) in stream ``stream`` of ``n_stream`` (the
    others empty)."""
    from ..state import KVData, KVSection, KVStream, LayerRows, TransposedRows

    m = len(rows.pos)
    cells = _cells(rows.pos, seq_id, rows.ext if ext_size else None, ext_size)
    k = [LayerRows(int(g[1]), int(g[2]), r) for g, r in zip(geo.k, rows.k, strict=True)]
    v: list[LayerRows | TransposedRows] = []
    for g, r in zip(geo.v, rows.v, strict=True):
        if g[0] == "trans":
            v.append(TransposedRows(int(g[1]), int(g[2]), int(g[3]), r.reshape(int(g[3]), m * int(g[2]))))
        else:
            v.append(LayerRows(int(g[1]), int(g[2]), r))
    streams = [KVStream(None, None) for _ in range(n_stream)]
    streams[stream] = KVStream(cells, KVData(geo.v_trans, k, v))
    return KVSection(streams, has_n_stream=has_n_stream)


def recurrent_section(geo: RecurrentGeometry, cp: Checkpoint, seq_id: int | None) -> RecurrentSection:
    """A recurrent section holding one cell, the checkpoint's state, listing ``seq_id`` (None: no id)."""
    from ..state import LayerRows, RecurrentLayer, RecurrentSection, TransposedRows

    r = [RecurrentLayer(int(cast(int, g[0])), int(cast(int, g[1])), x, None if g[2] is None else int(g[2]), p)
         for g, x, p in zip(geo.r, cp.r, cp.p, strict=True)]  # fmt: skip
    s: list[LayerRows | TransposedRows] = []
    for g, x in zip(geo.s, cp.s, strict=True):
        if g[0] == "trans":
            s.append(TransposedRows(int(g[1]), int(g[2]), int(g[3]), x.reshape(int(g[3]), int(g[2]))))
        else:
            s.append(LayerRows(int(g[1]), int(g[2]), x))
    return RecurrentSection(_cells(np.array([cp.pos], np.int32), seq_id, None, 0), geo.s_trans, geo.n_layer, r, s)


def concat(parts: list[SeqRows]) -> SeqRows:
    """Rows of consecutive position ranges, joined."""
    if len(parts) == 1:
        return parts[0]
    n_k, n_v = len(parts[0].k), len(parts[0].v)
    return SeqRows(
        np.concatenate([p.pos for p in parts]),
        np.concatenate([p.ext for p in parts]),
        [np.concatenate([p.k[i] for p in parts]) for i in range(n_k)],
        [np.concatenate([p.v[i] for p in parts], axis=1 if parts[0].v[i].ndim == 3 else 0) for i in range(n_v)],
    )


__all__ = [
    "Checkpoint",
    "ChunkMeta",
    "SeqRows",
    "checkpoint_of",
    "concat",
    "decode",
    "decode_checkpoint",
    "encode",
    "encode_checkpoint",
    "kv_rows",
    "kv_section",
    "part_payload",
    "recurrent_section",
    "sequence_of",
    "split_part",
]
