"""``kvref diff``: where two state files differ -- by header field, section, stream, cell, layer and byte.

`diff` compares the two parsed states: the container fields (kind, version, tokens, arch, v9 outputs, layout),
then per section the stream count and, per stream, the cell table (position, sequence ids, ext) and the rows of
each layer (K, V, R, S) cell by cell. Two streams holding the same cells (with the same rows) in another order
are reported as differing *only in cell order* (a whole restore puts cell i at index i, so the caches differ in
layout but not in content). The first differing byte of the two files is reported too. Exit codes of the command
follow cmp / git diff: 0 equal, 1 different, 2 error.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, cast

import numpy as np
import numpy.typing as npt

from ..state import KVSection, RecurrentSection, TransposedRows
from ..state.dsv4 import CompStateSection, DSV4Section, KCacheSection

if TYPE_CHECKING:
    from ..state import Cells, KVStream, LayerRows, RecurrentLayer, StateObject
    from ._types import ModelSource, StateSource

    Rows = LayerRows | TransposedRows | RecurrentLayer  # one layer's K, V, R or S
    Table = KVStream | RecurrentSection  # what holds a cell table and its rows

MAX_LISTED = 100  # differences listed one by one; the counts cover all of them


@dataclass
class Difference:
    """One difference: ``what`` differs (a header field, "cell_count", "pos", "seq_ids", "ext", "k", "v", "r",
    "s", ...), where (section / stream / layer / cell, None when not applicable) and the two values (shortened)."""

    what: str
    a: object = None
    b: object = None
    section: int | None = None
    stream: int | None = None
    layer: int | None = None
    cell: int | None = None

    def where(self) -> str:
        """``section 0 stream 1 layer 3 cell 17`` (the parts that apply)."""
        parts = [f"{k} {v}" for k, v in (("section", self.section), ("stream", self.stream), ("layer", self.layer),
                                          ("cell", self.cell)) if v is not None]  # fmt: skip
        return " ".join(parts) or "header"

    def __str__(self) -> str:
        return f"{self.where()}: {self.what} {self.a!r} vs {self.b!r}"


class DifferenceJSON(TypedDict):
    """One `Difference` in `DiffResult.to_json`."""

    what: str
    a: object  # a JSON value: the first 8 items of a long list, the str() of anything else
    b: object
    where: str
    section: int | None
    stream: int | None
    layer: int | None
    cell: int | None


class CellOrderJSON(TypedDict):
    """A stream that holds the same cells in another order."""

    section: int
    stream: int


@dataclass
class SeqChange:
    """How one sequence of one stream (or recurrent section) changed from a to b, by position: the positions it
    ``lost`` and ``gained`` (as ``(first, last)`` runs) and those it holds on both sides whose cell differs
    (``changed``: position, ext or any layer's row bytes, wherever the cell sits), with the first such difference."""

    section: int
    stream: int | None
    seq: int
    lost: list[tuple[int, int]]
    gained: list[tuple[int, int]]
    changed: list[tuple[int, int]]
    first_change: str | None = None

    def to_json(self) -> SeqChangeJSON:
        """A JSON-ready dict: the runs as ``[first, last]`` pairs."""
        return {
            "section": self.section,
            "stream": self.stream,
            "seq": self.seq,
            "lost": [list(r) for r in self.lost],
            "gained": [list(r) for r in self.gained],
            "changed": [list(r) for r in self.changed],
            "first_change": self.first_change,
        }

    def line(self) -> str:
        """``section 0 stream 0 seq 1: lost pos 5..9 (5 positions); gained ...; changed rows at ...``."""
        where = f"section {self.section}" + (f" stream {self.stream}" if self.stream is not None else "")
        parts = [f"{what} {_runs_text(runs)}" for what, runs in (("lost", self.lost), ("gained", self.gained),
                 ("changed rows at", self.changed)) if runs]  # fmt: skip
        first = f" (first: {self.first_change})" if self.first_change else ""
        return f"{where} seq {self.seq}: {'; '.join(parts)}{first}"


class SeqChangeJSON(TypedDict):
    """One `SeqChange` in `DiffResult.to_json`: runs as ``[first, last]`` pairs."""

    section: int
    stream: int | None
    seq: int
    lost: list[list[int]]
    gained: list[list[int]]
    changed: list[list[int]]
    first_change: str | None


class DiffJSON(TypedDict):
    """`DiffResult.to_json`: what ``kvref diff --json`` prints."""

    equal: bool
    sizes: list[int]
    first_byte: int | None
    total: int
    counts: dict[str, int]
    cell_order_only: list[CellOrderJSON]
    sequences: list[SeqChangeJSON]
    first: DifferenceJSON | None
    differences: list[DifferenceJSON]


@dataclass
class DiffResult:
    """What `diff` found: ``differences`` (the first MAX_LISTED), ``total`` and ``counts`` by kind (all of them),
    ``cell_order_only`` (``(section, stream)`` pairs that hold the same cells in another order), ``first_byte``
    (the first differing byte offset of the encodings, None when equal) and the two sizes."""

    differences: list[Difference] = field(default_factory=list)
    total: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    cell_order_only: list[tuple[int, int]] = field(default_factory=list)
    sequences: list[SeqChange] = field(default_factory=list)
    first_byte: int | None = None
    sizes: tuple[int, int] = (0, 0)

    @property
    def equal(self) -> bool:
        """The two states are byte for byte the same."""
        return self.total == 0 and not self.cell_order_only and self.first_byte is None

    def add(self, d: Difference) -> None:
        """Count ``d`` and keep it when fewer than MAX_LISTED are kept."""
        self.total += 1
        self.counts[d.what] += 1
        if len(self.differences) < MAX_LISTED:
            self.differences.append(d)

    def to_json(self) -> DiffJSON:
        """A JSON-ready dict (what ``kvref diff --json`` prints)."""
        return {
            "equal": self.equal,
            "sizes": list(self.sizes),
            "first_byte": self.first_byte,
            "total": self.total,
            "counts": dict(self.counts),
            "cell_order_only": [{"section": s, "stream": t} for s, t in self.cell_order_only],
            "sequences": [c.to_json() for c in self.sequences],
            "first": _jd(self.differences[0]) if self.differences else None,
            "differences": [_jd(d) for d in self.differences],
        }

    def lines(self) -> list[str]:
        """A human report: first difference, totals, cell-order-only streams."""
        if self.equal:
            return ["the states are identical"]
        out = []
        if self.differences:
            out.append(f"first difference: {self.differences[0]}")
        if self.first_byte is not None:
            out.append(f"first differing byte: {self.first_byte} (sizes {self.sizes[0]} and {self.sizes[1]} bytes)")
        for s, t in self.cell_order_only:
            out.append(f"section {s} stream {t}: the same cells, differing only in cell order inside the stream")
        out += [c.line() for c in self.sequences]
        if self.total:
            by = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
            out.append(f"{self.total} difference{'s' if self.total != 1 else ''} ({by})")
        return out


def _jd(d: Difference) -> DifferenceJSON:
    return {"what": d.what, "a": _short(d.a), "b": _short(d.b), "where": d.where(), "section": d.section,
            "stream": d.stream, "layer": d.layer, "cell": d.cell}  # fmt: skip


def _short(x: object) -> object:
    if isinstance(x, np.generic):
        item: object = x.item()
        return item
    if isinstance(x, list | tuple) and len(x) > 8:
        return [*list(x[:8]), "..."]
    return x if isinstance(x, int | str | float | bool | list | tuple | type(None)) else str(x)


def _per_cell(x: Rows, n: int) -> npt.NDArray[np.uint8]:
    """Rows of a tensor as (n_cells, bytes) for comparison (transposed V / S regrouped per cell)."""
    data = np.asarray(x.data)
    if isinstance(x, TransposedRows):
        return np.ascontiguousarray(data.reshape(x.n_embd, n, x.el_size).transpose(1, 0, 2)).reshape(n, -1)
    return data.reshape(n, -1)


def _tensors(sec: KVSection | RecurrentSection, st: Table) -> list[tuple[str, int, Rows]]:
    """``[(name, layer index, rows), ...]`` of a stream (KV) or recurrent section."""
    if isinstance(sec, RecurrentSection):
        out: list[tuple[str, int, Rows]] = [("r", il, x) for il, x in enumerate(sec.r)]
        return out + [("s", il, x) for il, x in enumerate(sec.s)]
    d = cast("KVStream", st).data  # a KV section's table is a stream
    if d is None:
        return []
    return [("k", il, x) for il, x in enumerate(d.k)] + [("v", il, x) for il, x in enumerate(d.v)]


def _cell_keys(cells: Cells, tensors: list[tuple[str, int, Rows]]) -> list[bytes]:
    n = cells.n
    h = [hashlib.sha256() for _ in range(n)]
    for i in range(n):
        h[i].update(np.int32(cells.pos[i]).tobytes())
        h[i].update(np.asarray(cells.seq_ids(i), np.int32).tobytes() + b"|")
        h[i].update(cells.ext[i].tobytes())
    for _, _, x in tensors:
        rows = _per_cell(x, n)
        for i in range(n):
            h[i].update(rows[i].tobytes())
    return [x.digest() for x in h]


def _compare_table(
    res: DiffResult, k: int, s: int | None, sec_a: KVSection | RecurrentSection, sec_b: KVSection | RecurrentSection,
    a: Table | None, b: Table | None,
) -> None:  # fmt: skip
    """Compare one stream (or recurrent section): cells, then rows per layer."""
    ca, cb = a.cells if a is not None else None, b.cells if b is not None else None
    na, nb = (ca.n if ca is not None else 0), (cb.n if cb is not None else 0)
    if na != nb:
        res.add(Difference("cell_count", na, nb, k, s))
        _compare_sequences(res, k, s, sec_a, sec_b, a, b)
        return
    if na == 0:
        return
    ta, tb = _tensors(sec_a, cast("Table", a)), _tensors(sec_b, cast("Table", b))  # they have cells
    layout_a = [(n, il, x.type, x.row_size) for n, il, x in ta]
    layout_b = [(n, il, x.type, x.row_size) for n, il, x in tb]
    if layout_a != layout_b:
        for (n1, il, t1, r1), (n2, _, t2, r2) in zip(layout_a, layout_b, strict=False):
            if (n1, t1, r1) != (n2, t2, r2):
                res.add(Difference(f"{n1} type/row size", (t1, r1), (t2, r2), k, s, il))
                return
        res.add(Difference("layers", len(layout_a), len(layout_b), k, s))
        return
    assert ca is not None and cb is not None
    found: list[Difference] = []
    pos_a, pos_b = ca.pos, cb.pos
    for i in np.flatnonzero(pos_a != pos_b).tolist():
        found.append(Difference("pos", int(pos_a[i]), int(pos_b[i]), k, s, cell=i))
    for i in range(na):
        if ca.seq_ids(i) != cb.seq_ids(i):
            found.append(Difference("seq_ids", list(ca.seq_ids(i)), list(cb.seq_ids(i)), k, s, cell=i))
    if ca.ext_size != cb.ext_size:
        found.append(Difference("ext_size", ca.ext_size, cb.ext_size, k, s))
    elif ca.ext_size:
        for i in np.flatnonzero((ca.ext != cb.ext).any(axis=1)).tolist():
            found.append(Difference("ext", ca.ext[i].tolist(), cb.ext[i].tolist(), k, s, cell=i))
    for (name, il, xa), (_, _, xb) in zip(ta, tb, strict=True):
        ra, rb = _per_cell(xa, na), _per_cell(xb, nb)
        for i in np.flatnonzero((ra != rb).any(axis=1)).tolist():
            j = int(np.argmax(ra[i] != rb[i]))
            found.append(Difference(name, f"byte {j}: {int(ra[i][j])}", f"{int(rb[i][j])}", k, s, il, i))
    if found and ca.ext_size == cb.ext_size and sorted(_cell_keys(ca, ta)) == sorted(_cell_keys(cb, tb)):
        # the same cells with the same rows, in another order: say so instead of listing each cell
        res.cell_order_only.append((k, 0 if s is None else s))
        return
    for d in found:
        res.add(d)
    if found:
        _compare_sequences(res, k, s, sec_a, sec_b, a, b)


def _runs(values: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """Sorted distinct ints as ``(first, last)`` runs of consecutive values."""
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(values) - 1]])
    return [(int(values[i]), int(values[j])) for i, j in zip(starts, ends, strict=True)]


def _runs_text(runs: list[tuple[int, int]], most: int = 6) -> str:
    n = sum(b - a + 1 for a, b in runs)
    text = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs[:most])
    more = f", ... ({len(runs) - most} more runs)" if len(runs) > most else ""
    return f"pos {text}{more} ({n} position{'s' if n != 1 else ''})"


def _seq_cells(cells: Cells | None) -> dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """Per sequence id: its positions (sorted) and the cell holding each, from the flat seq_id lists."""
    if cells is None or not cells.n:
        return {}
    counts = np.diff(cells.seq_start)
    cell_of = np.repeat(np.arange(cells.n, dtype=np.int64), counts)
    pos_of = cells.pos.astype(np.int64)[cell_of]
    ids = cells.seq_id.astype(np.int64)
    out = {}
    for sid in np.unique(ids).tolist():
        sel = ids == sid
        order = np.argsort(pos_of[sel], kind="stable")
        out[sid] = (pos_of[sel][order], cell_of[sel][order])
    return out


def _compare_sequences(
    res: DiffResult, k: int, s: int | None, sec_a: KVSection | RecurrentSection, sec_b: KVSection | RecurrentSection,
    a: Table | None, b: Table | None,
) -> None:  # fmt: skip
    """Which positions each sequence lost, gained, or holds with another cell (rows compared wherever each cell
    sits): what changed after more decoding, a context shift or a cut, however the cells moved."""
    ca, cb = (a.cells if a is not None else None), (b.cells if b is not None else None)
    sa, sb = _seq_cells(ca), _seq_cells(cb)
    ta = _tensors(sec_a, a) if a is not None and ca is not None and ca.n else []
    tb = _tensors(sec_b, b) if b is not None and cb is not None and cb.n else []
    same_layout = [(n, il, x.type, x.row_size) for n, il, x in ta] == [(n, il, x.type, x.row_size) for n, il, x in tb]
    rows_a = [(n, il, _per_cell(x, ca.n)) for n, il, x in ta] if same_layout and ca is not None else []
    rows_b = [_per_cell(x, cb.n) for _, _, x in tb] if same_layout and cb is not None else []
    for sid in sorted(set(sa) | set(sb)):
        pa, ia = sa.get(sid, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        pb, ib = sb.get(sid, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        both, ja, jb = np.intersect1d(pa, pb, assume_unique=True, return_indices=True)
        differs = np.zeros(len(both), bool)
        first = None
        if ca is not None and cb is not None and len(both):
            xa, xb = ca.ext[ia[ja]], cb.ext[ib[jb]]
            if xa.shape == xb.shape:
                differs |= (xa != xb).any(axis=1)
            for (name, il, ra), rb in zip(rows_a, rows_b, strict=True):
                bad = (ra[ia[ja]] != rb[ib[jb]]).any(axis=1)
                if bad.any() and first is None:
                    i = int(np.flatnonzero(bad)[0])
                    first = f"pos {int(both[i])} layer {il} {name}"
                differs |= bad
        change = SeqChange(k, s, sid, _runs(np.setdiff1d(pa, pb)), _runs(np.setdiff1d(pb, pa)),
                           _runs(both[differs]), first)  # fmt: skip
        if change.lost or change.gained or change.changed:
            res.sequences.append(change)


def _header(res: DiffResult, a: StateObject, b: StateObject) -> None:
    if a.kind != b.kind:
        res.add(Difference("kind", a.kind, b.kind))
    for name in ("version", "arch", "seq_id"):
        va, vb = getattr(a, name, None), getattr(b, name, None)
        if va != vb:
            res.add(Difference(name, va, vb))
    ta, tb = getattr(a, "tokens", None), getattr(b, "tokens", None)
    if ta is not None and tb is not None:
        if len(ta) != len(tb):
            res.add(Difference("n_tokens", len(ta), len(tb)))
        else:
            bad = np.flatnonzero(np.asarray(ta) != np.asarray(tb))
            if len(bad):
                i = int(bad[0])
                res.add(Difference(f"tokens[{i}]", int(ta[i]), int(tb[i])))
    oa, ob = getattr(a, "outputs", None), getattr(b, "outputs", None)
    if (oa is None) != (ob is None):
        res.add(Difference("v9 output block", oa is not None, ob is not None))
    elif oa is not None and ob is not None:
        for name in ("output_pos", "logits", "embeddings"):
            xa, xb = np.asarray(getattr(oa, name)), np.asarray(getattr(ob, name))
            if xa.shape != xb.shape or not np.array_equal(xa, xb):
                res.add(Difference(f"outputs.{name}", f"{xa.size} values", f"{xb.size} values"))


def _compare_kv(res: DiffResult, k: int, x: KVSection, y: KVSection) -> None:
    """Compare two KV sections stream by stream."""
    if x.has_n_stream != y.has_n_stream:
        res.add(Difference("n_stream field", x.has_n_stream, y.has_n_stream, k))
    if x.n_stream != y.n_stream:
        res.add(Difference("n_stream", x.n_stream, y.n_stream, k))
        return
    for s, (p, q) in enumerate(zip(x.streams, y.streams, strict=True)):
        if p.data is not None and q.data is not None and p.data.v_trans != q.data.v_trans:
            res.add(Difference("v_trans", p.data.v_trans, q.data.v_trans, k, s))
            continue
        _compare_table(res, k, s, x, y, p, q)


def _compare_dsv4(res: DiffResult, k: int, x: DSV4Section, y: DSV4Section) -> None:
    """Compare two DSV4 sections: the raw iSWA's KV sections cell by cell, the compressed K caches and the compressor
    states as wholes (their rows are per compressed position, not per cell)."""
    if x.partial != y.partial:
        res.add(Difference("partial", x.partial, y.partial, k))
        return
    for p, q in zip(x.raw, y.raw, strict=True):
        _compare_kv(res, k, p, q)
    parts: list[tuple[str, KCacheSection | CompStateSection, KCacheSection | CompStateSection]] = [
        *(("K rows", p, q) for p, q in zip(x.k_caches, y.k_caches, strict=True)),
        *(("compressor state", p, q) for p, q in zip(x.states, y.states, strict=True)),
    ]
    for what, p, q in parts:
        if p.to_bytes() != q.to_bytes():
            res.add(Difference(f"{p.name} {what}", section=k))


def diff(a: StateSource, b: StateSource, *, model: ModelSource | None = None) -> DiffResult:
    """Compare two states (paths, bytes or loaded state objects); see `DiffResult`. ``model`` (a GGUF path or
    HParams) is what a session of version 5 .. 7 needs to be read."""
    from .. import state

    sa = a if isinstance(a, state.StateObject) else state.load(a, model=model)
    sb = b if isinstance(b, state.StateObject) else state.load(b, model=model)
    res = DiffResult()
    _header(res, sa, sb)
    ma, mb = sa.memory, sb.memory
    if ma.layout != mb.layout:
        res.add(Difference("layout", ma.layout, mb.layout))
    for k, (x, y) in enumerate(zip(ma.sections, mb.sections, strict=False)):
        if x.kind != y.kind:
            res.add(Difference("section kind", x.kind, y.kind, k))
        elif isinstance(x, KVSection) and isinstance(y, KVSection):
            _compare_kv(res, k, x, y)
        elif isinstance(x, DSV4Section) and isinstance(y, DSV4Section):
            _compare_dsv4(res, k, x, y)
        else:  # two recurrent sections (of one kind, not both KV)
            _compare_table(res, k, None, x, y, cast("RecurrentSection", x), cast("RecurrentSection", y))
    if len(ma.sections) != len(mb.sections):
        res.add(Difference("sections", len(ma.sections), len(mb.sections)))
    ba, bb = sa.to_bytes(), sb.to_bytes()
    res.sizes = (len(ba), len(bb))
    if ba != bb:
        n = min(len(ba), len(bb))
        neq = np.frombuffer(ba[:n], np.uint8) != np.frombuffer(bb[:n], np.uint8)
        res.first_byte = int(np.argmax(neq)) if neq.any() else n
    return res


__all__ = [
    "MAX_LISTED",
    "CellOrderJSON",
    "DiffJSON",
    "DiffResult",
    "Difference",
    "DifferenceJSON",
    "SeqChange",
    "SeqChangeJSON",
    "diff",
]
