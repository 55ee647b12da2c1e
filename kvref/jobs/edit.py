"""Edits of a state's memory sections without a memory: cut out a sequence, merge sequences, remap sequence ids,
and move cells between one unified stream and per-sequence streams.

Every function takes and returns ``kvref.state.MemorySections``; rows are gathered with NumPy (copies of the
selected cells only), cell tables rebuilt. A whole (context) state lists each cell's sequence ids; a sequence
state (sequence file, sequence blob) lists the saved id once per KV cell and none per recurrent cell, as llama.cpp
writes them. In a per-sequence-stream state stream ``s`` holds the cells of sequence ``s`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ..errors import EditError
from ..state import (
    Cells,
    KVData,
    KVSection,
    KVStream,
    LayerRows,
    MemorySections,
    RecurrentLayer,
    RecurrentSection,
    TransposedRows,
)

Indices = npt.NDArray[np.intp]  # cells of a table, by index


# ------------------------------------------------------------------------------------------- rows
def _take_rows(x: LayerRows | TransposedRows, idx: Indices) -> LayerRows | TransposedRows:
    if isinstance(x, TransposedRows):
        n = x.data.shape[1] // x.el_size if x.el_size else 0
        cols = np.asarray(x.data).reshape(x.n_embd, n, x.el_size)[:, idx, :]
        return TransposedRows(x.type, x.el_size, x.n_embd, np.ascontiguousarray(cols).reshape(x.n_embd, -1))
    return LayerRows(x.type, x.row_size, np.asarray(x.data)[idx])


def _cat_rows(xs: Sequence[LayerRows | TransposedRows], where: str) -> LayerRows | TransposedRows:
    a = xs[0]
    for b in xs[1:]:
        if type(a) is not type(b) or a.type != b.type or a.row_size != b.row_size:
            raise EditError(f"{where}: the states have different row types or sizes ({a.type_name} / {b.type_name})")
    if isinstance(a, TransposedRows):
        data = np.concatenate([np.asarray(x.data) for x in xs], axis=1)
        return TransposedRows(a.type, a.el_size, a.n_embd, data)
    return LayerRows(a.type, a.row_size, np.concatenate([np.asarray(x.data) for x in xs], axis=0))


def _cells(cells: Cells, idx: Indices, ids: Sequence[Sequence[int]]) -> Cells:
    return Cells.from_lists(cells.pos[idx].tolist(), ids, cells.ext[idx] if cells.ext_size else None, cells.ext_size)


def take_stream(st: KVStream, idx: Indices, ids: Sequence[Sequence[int]] | None = None) -> KVStream:
    """The cells ``idx`` of a stream (with their rows); ``ids``: their new sequence id lists (default: kept)."""
    if st.cells is None or len(idx) == 0:
        return KVStream(None, None)
    assert st.data is not None
    idx = np.asarray(idx, dtype=np.intp)
    if ids is None:
        ids = [st.cells.seq_ids(int(i)) for i in idx]
    d = st.data
    data = KVData(d.v_trans, [_take_rows(k, idx) for k in d.k], [_take_rows(v, idx) for v in d.v])  # type: ignore[misc]
    return KVStream(_cells(st.cells, idx, ids), data)


def cat_streams(streams: Sequence[KVStream], where: str = "") -> KVStream:
    """The cells of ``streams`` one after the other, in one stream (their row layouts must agree)."""
    full = [st for st in streams if st.cells is not None]
    if not full:
        return KVStream(None, None)
    if len(full) == 1:
        return full[0]
    datas = [st.data for st in full]
    assert all(d is not None for d in datas)
    v_trans = {d.v_trans for d in datas if d is not None}
    if len(v_trans) > 1:
        raise EditError(f"{where}: the states differ in v_trans (one was written with flash attention)")
    n_layers = {d.n_layer for d in datas if d is not None}
    if len(n_layers) > 1:
        raise EditError(f"{where}: the states have {sorted(n_layers)} layers: they come from different models")
    exts = {st.cells.ext_size for st in full if st.cells is not None}
    if len(exts) > 1:
        raise EditError(f"{where}: the states' cells carry different ext sizes {sorted(exts)}: convert them first")
    d0 = datas[0]
    assert d0 is not None
    k = [_cat_rows([d.k[il] for d in datas if d is not None], f"{where} layer {il} K") for il in range(d0.n_layer)]
    v = [_cat_rows([d.v[il] for d in datas if d is not None], f"{where} layer {il} V") for il in range(len(d0.v))]
    cells = [st.cells for st in full if st.cells is not None]
    pos = np.concatenate([c.pos for c in cells])
    ids = [c.seq_ids(i) for c in cells for i in range(c.n)]
    ext = np.concatenate([c.ext for c in cells]) if cells[0].ext_size else None
    return KVStream(Cells.from_lists(pos.tolist(), ids, ext, cells[0].ext_size), KVData(d0.v_trans, k, v))  # type: ignore[arg-type]


def _take_recurrent(sec: RecurrentSection, idx: Indices, ids: Sequence[Sequence[int]]) -> RecurrentSection:
    idx = np.asarray(idx, dtype=np.intp)
    r = [
        RecurrentLayer(
            x.type,
            x.row_size,
            np.asarray(x.data)[idx],
            x.p_row_size,
            None if x.p_data is None else np.asarray(x.p_data)[idx],
        )
        for x in sec.r
    ]
    s = [_take_rows(x, idx) for x in sec.s]
    return RecurrentSection(_cells(sec.cells, idx, ids), sec.s_trans, sec.n_layer, r, s)


def _cat_recurrent(secs: Sequence[RecurrentSection], ids: Sequence[Sequence[int]], where: str) -> RecurrentSection:
    a = secs[0]
    if len({s.n_layer for s in secs}) > 1 or len({len(s.r) for s in secs}) > 1:
        raise EditError(f"{where}: the recurrent sections have different layer counts: different models")
    r = []
    for il in range(len(a.r)):
        xs = [s.r[il] for s in secs]
        if len({(x.type, x.row_size, x.p_row_size) for x in xs}) > 1:
            raise EditError(f"{where}: state layer {il}: the R rows differ in type or size")
        p = None if xs[0].p_data is None else np.concatenate([np.asarray(x.p_data) for x in xs])
        r.append(RecurrentLayer(xs[0].type, xs[0].row_size, np.concatenate([np.asarray(x.data) for x in xs]),
                                xs[0].p_row_size, p))  # fmt: skip
    s = [_cat_rows([sec.s[il] for sec in secs], f"{where} state layer {il} S") for il in range(len(a.s))]
    pos = np.concatenate([sec.cells.pos for sec in secs])
    return RecurrentSection(Cells.from_lists(pos.tolist(), ids), a.s_trans, a.n_layer, r, s)


def _holding(cells: Cells, seq: int) -> Indices:
    return np.flatnonzero(np.isin(np.arange(cells.n), cells.cell_seq()[cells.seq_id == seq]))


def sequences(mem: MemorySections) -> list[int]:
    """The sequence ids a state's cells hold, ascending."""
    out: set[int] = set()
    secs: list[KVSection | RecurrentSection] = [*mem.kv_sections, *mem.recurrent_sections]
    for sec in secs:  # a DSV4 section's raw sections among the KV ones
        tables = [st.cells for st in sec.streams] if isinstance(sec, KVSection) else [sec.cells]
        for c in tables:
            if c is not None:
                out.update(int(x) for x in np.unique(c.seq_id))
    return sorted(out)


# ------------------------------------------------------------------------------------------- edits
def extract_sequence(mem: MemorySections, seq: int) -> MemorySections:
    """The sequence state of ``seq`` cut out of a whole state: what llama_state_seq_get_data would write for it
    (every cell holding ``seq``, listed with that id alone; recurrent cells with none; the stream count kept).

    Cells an iSWA cache's sequence save would leave out as SWA-masked are kept (restoring them is harmless).
    """
    found = False
    out: list[KVSection | RecurrentSection] = []
    for sec in mem.sections:
        if isinstance(sec, KVSection):
            streams = []
            for st in sec.streams:
                if st.cells is None:
                    streams.append(KVStream(None, None))
                    continue
                idx = _holding(st.cells, seq)
                found |= len(idx) > 0
                streams.append(take_stream(st, idx, [[seq]] * len(idx)))
            out.append(KVSection(streams, sec.has_n_stream))
        else:
            idx = _holding(sec.cells, seq)
            found |= len(idx) > 0
            out.append(_take_recurrent(sec, idx, [()] * len(idx)))
    if not found:
        raise EditError(f"no cell holds sequence {seq} (the state holds {sequences(mem) or 'none'})")
    return MemorySections(mem.layout, out)


def merge_sequences(parts: Sequence[MemorySections], ids: Sequence[int], *, per_seq_streams: bool = False,
                    n_stream: int | None = None) -> MemorySections:  # fmt: skip
    """One whole state from sequence states: ``parts[k]`` becomes sequence ``ids[k]``.

    One unified stream (cells in input order) unless ``per_seq_streams`` (stream ``ids[k]`` holds part k;
    ``n_stream`` streams, default ``max(ids) + 1``). The parts must come from the same model and context layout.
    """
    if not parts:
        raise EditError("nothing to merge")
    if len(ids) != len(parts) or len(set(ids)) != len(ids):
        raise EditError(f"each part needs its own sequence id, got {list(ids)}")
    layouts = {p.layout for p in parts}
    if len(layouts) > 1:
        raise EditError(f"the states have different layouts {sorted(layouts)}: they come from different models")
    out: list[KVSection | RecurrentSection] = []
    for i, sec0 in enumerate(parts[0].sections):
        where = f"section {i}"
        if isinstance(sec0, KVSection):
            kv = [p.sections[i] for p in parts]
            assert all(isinstance(s, KVSection) for s in kv)
            flat = []
            for s, sid in zip(kv, ids, strict=True):
                st = cat_streams(s.streams, where)  # type: ignore[union-attr]
                n = st.cell_count
                flat.append(take_stream(st, np.arange(n), [[sid]] * n) if n else st)
            if per_seq_streams:
                n_st = n_stream or max(ids) + 1
                if max(ids) >= n_st:
                    raise EditError(f"sequence id {max(ids)} needs stream {max(ids)}, the state has {n_st} streams")
                streams = [KVStream(None, None) for _ in range(n_st)]
                for st, sid in zip(flat, ids, strict=True):
                    streams[sid] = st
            else:
                streams = [cat_streams(flat, where)]
            out.append(KVSection(streams, sec0.has_n_stream))
        else:
            rs = [p.sections[i] for p in parts]
            assert all(isinstance(s, RecurrentSection) for s in rs)
            cell_ids = [[sid] for s, sid in zip(rs, ids, strict=True) for _ in range(s.cell_count)]  # type: ignore[union-attr]
            out.append(_cat_recurrent(rs, cell_ids, where))  # type: ignore[arg-type]
    return MemorySections(parts[0].layout, out)


def remap_sequences(mem: MemorySections, mapping: Mapping[int, int]) -> MemorySections:
    """Sequence ids renamed by ``mapping`` (ids not in it keep theirs); in per-sequence streams the cells move to
    the stream of their new id. Two ids may not end up as one."""
    present = sequences(mem)
    final = [mapping.get(s, s) for s in present]
    if len(set(final)) != len(final):
        raise EditError(f"the mapping {dict(mapping)} sends two of the sequences {present} to the same id")
    for a, b in mapping.items():
        if b < 0 or a < 0:
            raise EditError(f"sequence ids are >= 0, got {a}:{b}")

    def relabel(c: Cells) -> list[list[int]]:
        return [sorted(mapping.get(s, s) for s in c.seq_ids(i)) for i in range(c.n)]

    out: list[KVSection | RecurrentSection] = []
    for sec in mem.sections:
        if isinstance(sec, RecurrentSection):
            idx = np.arange(sec.cell_count)
            out.append(_take_recurrent(sec, idx, relabel(sec.cells)) if sec.cell_count else sec)
            continue
        n_st = sec.n_stream
        streams = [KVStream(None, None) for _ in range(n_st)]
        for s, st in enumerate(sec.streams):
            if st.cells is None:
                continue
            dest = mapping.get(s, s) if n_st > 1 else 0
            if dest >= n_st:
                raise EditError(f"sequence {s} -> {dest}: the state has {n_st} streams (ids below {n_st})")
            streams[dest] = take_stream(st, np.arange(st.cell_count), relabel(st.cells))
        out.append(KVSection(streams, sec.has_n_stream))
    return MemorySections(mem.layout, out)


def restream(mem: MemorySections, mode: str, n_stream: int | None = None) -> MemorySections:
    """Move the attention cells to one unified stream (``mode="unified"``, streams concatenated in order) or to
    one stream per sequence (``mode="per-seq"``: ``n_stream`` streams, default the largest id + 1; a cell shared
    by several sequences is copied into each of their streams). Recurrent sections have no streams."""
    if mode not in ("unified", "per-seq"):
        raise EditError(f"streams must be 'unified' or 'per-seq', not {mode!r}")
    seqs = sequences(mem)
    out: list[KVSection | RecurrentSection] = []
    for i, sec in enumerate(mem.sections):
        if isinstance(sec, RecurrentSection):
            out.append(sec)
            continue
        if not sec.has_n_stream and mode == "per-seq":
            raise EditError("this layout (before llama.cpp PR #14363) has no streams: convert to a newer era first")
        if mode == "unified":
            out.append(KVSection([cat_streams(sec.streams, f"section {i}")], sec.has_n_stream))
            continue
        n_st = n_stream or (max(seqs) + 1 if seqs else sec.n_stream)
        if seqs and max(seqs) >= n_st:
            raise EditError(f"sequence {max(seqs)} needs stream {max(seqs)}: pass n_stream >= {max(seqs) + 1}")
        whole = cat_streams(sec.streams, f"section {i}")
        streams = [KVStream(None, None) for _ in range(n_st)]
        if whole.cells is not None:
            if (whole.cells.n_seq_id == 0).any():
                raise EditError(f"section {i}: cells without a sequence id cannot be given a stream")
            for s in range(n_st):
                idx = _holding(whole.cells, s)
                streams[s] = take_stream(whole, idx, [[s]] * len(idx))
        out.append(KVSection(streams, True))
    return MemorySections(mem.layout, out)


__all__ = [
    "EditError",
    "cat_streams",
    "extract_sequence",
    "merge_sequences",
    "remap_sequences",
    "restream",
    "sequences",
    "take_stream",
]
