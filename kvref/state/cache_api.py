"""What the memory classes call: serialize a section from their cells and buffers, and parse-then-validate one.

A cache describes itself with a *spec* (`KVSpec`, `RecurrentSpec`): stream count, cells per stream, sequence
limit, V transposition, cell ext size and, per layer, the types and row sizes its buffers have. `read_kv_section`
/ `read_recurrent_section` parse the bytes *and* check them against the spec completely before returning, so a
cache that applies the result only after a successful return restores atomically. The checks are the ones
llama.cpp makes in llama_kv_cache::state_read_meta / state_read_data and llama_memory_recurrent's twins, in the
same order, each reported as a FormatError naming the field and the byte offset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ..errors import ArgumentError, ArgumentTypeError, FormatError
from . import mismatch
from .cells import Cells
from .codec import Reader, ScalarT, Sink, Writer, join_bytes
from .dsl import Env, Record, Struct
from .dsv4 import DSV4Section
from .sections import (
    KV_SECTION,
    RECURRENT_SECTION,
    KVSection,
    LayerRows,
    RecurrentSection,
    TransposedRows,
    write_dsv4,
)
from .specs import KVLayerSpec, KVSpec, RecurrentLayerSpec, RecurrentSpec

if TYPE_CHECKING:
    from typing_extensions import Buffer

Rec = TypeVar("Rec", bound=Record)


def _fail(msg: str, field: str, offset: int | None) -> FormatError:
    return FormatError(msg, field=field, offset=offset)


def _check_cells(
    cells: Cells, at: int, seq_id: int, n_seq_max: int, kv_size: int, seq_ids_expected: int | None
) -> None:
    if cells.n > kv_size:
        raise _fail(mismatch.cell_count(cells.n, kv_size), "cell_count", at - 4)
    counts = cells.n_seq_id
    if seq_id != -1 and seq_ids_expected is not None:
        bad = (counts != seq_ids_expected).nonzero()[0]
        if len(bad):
            i = int(bad[0])
            raise _fail(
                f"cell {i} has n_seq_id {int(counts[i])}, a sequence state needs {seq_ids_expected}", "n_seq_id", at
            )
    if seq_id == -1 and len(cells.seq_id):
        bad = ((cells.seq_id < 0) | (cells.seq_id >= n_seq_max)).nonzero()[0]
        if len(bad):
            s = int(cells.seq_id[bad[0]])
            raise _fail(f"seq_id {s} is out of range [0, {n_seq_max})", "seq_id", at)


def _check_rows(x: LayerRows | TransposedRows, prefix: str, want_type: int, want_row: int | None, il: int) -> None:
    o = x.offsets
    if x.type != want_type:
        raise _fail(mismatch.layer_type(il, prefix, x.type, want_type), f"{prefix}_type", o.get(f"{prefix}_type"))
    if isinstance(x, LayerRows) and want_row is not None and x.row_size != want_row:
        raise _fail(
            mismatch.row_size(il, prefix, x.row_size, want_row), f"{prefix}_row_size", o.get(f"{prefix}_row_size")
        )


def validate_kv_section(sec: KVSection, spec: KVSpec, seq_id: int = -1) -> None:
    """Check a parsed KV section against a cache; raises the first violation in file order."""
    if sec.n_stream != spec.n_stream:
        raise _fail(mismatch.n_stream(sec.n_stream, spec.n_stream), "n_stream", sec.offsets.get("n_stream"))
    for st in sec.streams:
        if st.cells is None:
            continue
        _check_cells(st.cells, st.offsets["cells"], seq_id, spec.n_seq_max, spec.kv_size, spec.seq_cell_ids)
        d = st.data
        assert d is not None
        if d.n_layer != len(spec.layers):
            raise _fail(f"n_layer {d.n_layer}, the cache has {len(spec.layers)}", "n_layer", d.offsets.get("n_layer"))
        # llama.cpp checks v_trans right after n_layer, before any row
        if bool(d.v_trans) != spec.v_trans:
            raise _fail(mismatch.v_trans(d.v_trans, spec.v_trans), "v_trans", d.offsets.get("v_trans"))
        for il, (k, ls) in enumerate(zip(d.k, spec.layers, strict=True)):
            _check_rows(k, "k", ls.k_type, ls.k_row_size, il)
        if len(d.v) != (len(spec.layers) if spec.has_v else 0):
            raise _fail(
                f"{len(d.v)} V layers, the cache has {len(spec.layers) if spec.has_v else 0}",
                "v_type",
                d.offsets.get("v"),
            )
        for il, (v, ls) in enumerate(zip(d.v, spec.layers, strict=False)):
            assert ls.v_type is not None
            _check_rows(v, "v", ls.v_type, ls.v_row_size, il)
            if isinstance(v, TransposedRows) and ls.n_embd_v_gqa is not None and v.n_embd != ls.n_embd_v_gqa:
                raise _fail(
                    f"layer {il}: n_embd_v_gqa {v.n_embd}, the cache has {ls.n_embd_v_gqa}",
                    "n_embd_v_gqa",
                    v.offsets.get("n_embd_v_gqa"),
                )


def validate_recurrent_section(sec: RecurrentSection, spec: RecurrentSpec, seq_id: int = -1) -> None:
    at = sec.offsets.get("cells", 4)
    # a sequence save writes n_seq_id = 0 for every cell; llama.cpp rejects anything else
    _check_cells(sec.cells, at, seq_id, spec.n_seq_max, spec.size, 0)
    if sec.n_layer != spec.n_layer:
        raise _fail(f"n_layer {sec.n_layer}, the model has {spec.n_layer}", "n_layer", sec.offsets.get("n_layer"))
    if bool(sec.s_trans) != spec.s_trans:
        raise _fail(f"s_trans {sec.s_trans}, the cache has {int(spec.s_trans)}", "s_trans", sec.offsets.get("s_trans"))
    if len(sec.r) != len(spec.layers):
        raise _fail(f"{len(sec.r)} layers with state, the cache has {len(spec.layers)}", "r_type", sec.offsets.get("r"))
    for il, (r, ls) in enumerate(zip(sec.r, spec.layers, strict=True)):
        if r.type != ls.r_type:
            raise _fail(
                f"state layer {il}: r type {r.type}, the cache has {ls.r_type}", "r_type", r.offsets.get("r_type")
            )
        if r.row_size != ls.r_row_size:
            raise _fail(
                f"state layer {il}: r row size {r.row_size}, the cache has {ls.r_row_size}",
                "r_row_size",
                r.offsets.get("r_row_size"),
            )
        if r.p_row_size != ls.p_row_size:
            raise _fail(
                f"state layer {il}: p row size {r.p_row_size}, the cache has {ls.p_row_size}",
                "p_row_size",
                r.offsets.get("p_row_size"),
            )
    for il, (s, ls) in enumerate(zip(sec.s, spec.layers, strict=True)):
        _check_rows(s, "s", ls.s_type, ls.s_row_size, il)
        if isinstance(s, TransposedRows) and s.n_embd != ls.n_embd_s:
            raise _fail(
                f"state layer {il}: n_embd_s {s.n_embd}, the cache has {ls.n_embd_s}",
                "n_embd_s",
                s.offsets.get("n_embd_s"),
            )


def _read(struct: Struct[Rec], buf: object, offset: int, options: dict[str, object]) -> tuple[Rec, int]:
    r = Reader(buf, offset)
    env = Env(options)
    env["_reader"] = r
    return struct.read(r, env), r.pos


def read_kv_section(
    buf: object, spec: KVSpec, *, seq_id: int = -1, offset: int = 0, _shared_empty: bool = False
) -> tuple[KVSection, int]:
    """Parse the KV section at ``offset`` with the cache's layout, validate it, return it and its end offset.

    ``_shared_empty`` (a cache's restore, which looks only at the streams with cells): every empty stream of the
    result is one shared `KVStream`, whose ``offsets`` are not its own."""
    sec, end = _read(
        KV_SECTION,
        buf,
        offset,
        {
            "n_stream_field": spec.has_n_stream,
            "ext_size": spec.ext_size,
            "has_v": spec.has_v,
            # lets the parse check n_layer / v_trans / types / row sizes against the cache as llama.cpp does
            "cache_spec": spec,
            "_cache_il": {"k": -1, "v": -1},
            "_shared_empty": _shared_empty,
        },
    )
    validate_kv_section(sec, spec, seq_id)
    return sec, end


def read_recurrent_section(
    buf: object, spec: RecurrentSpec, *, seq_id: int = -1, offset: int = 0
) -> tuple[RecurrentSection, int]:
    ple = bool(spec.layers) and spec.layers[0].p_row_size is not None
    sec, end = _read(RECURRENT_SECTION, buf, offset, {"ple": ple, "n_state_layers": len(spec.layers)})
    validate_recurrent_section(sec, spec, seq_id)
    return sec, end


def read_sections(
    buf: object, specs: list[KVSpec | RecurrentSpec], *, seq_id: int = -1, offset: int = 0, exact: bool = True
) -> tuple[list[KVSection | RecurrentSection], int]:
    """Parse and validate consecutive sections (iSWA: base then SWA; hybrid: attention then recurrent).

    With ``exact`` the input must end with the last section (llama.cpp's "did not read all of the data").
    Nothing is returned unless every section is valid, so a caller that applies afterwards is atomic.
    """
    out: list[KVSection | RecurrentSection] = []
    for spec in specs:
        sec: KVSection | RecurrentSection
        if isinstance(spec, KVSpec):
            sec, offset = read_kv_section(buf, spec, seq_id=seq_id, offset=offset)
        else:
            sec, offset = read_recurrent_section(buf, spec, seq_id=seq_id, offset=offset)
        out.append(sec)
    n = Reader(buf).end  # the input's length in bytes
    if exact and offset != n:
        raise FormatError(f"{n - offset} trailing bytes after the last section", field="trailing", offset=offset)
    return out, offset


def write_section(sec: KVSection | RecurrentSection, f: Sink) -> int:
    """Stream a section (what the memory's state_write produces) to ``f``; returns the byte count."""
    w = Writer(f)
    if isinstance(sec, DSV4Section):  # llama_kv_cache_dsv4's whole section (kvref.state.dsv4)
        write_dsv4(w, sec, Env(ext_size=0))
        return w.n
    struct = KV_SECTION if isinstance(sec, KVSection) else RECURRENT_SECTION
    struct.write(w, sec, Env(ext_size=0))
    return w.n


class _Parts:
    """A write-only binary file that keeps what it is given (views of the rows included, uncopied) and joins
    it into one bytes object at the end: the rows are copied once, into the result."""

    def __init__(self) -> None:
        self.parts: list[Buffer] = []

    def write(self, b: Buffer) -> int:
        self.parts.append(b)
        return memoryview(b).nbytes

    def getvalue(self) -> bytes:
        return join_bytes(self.parts)


def section_bytes(*sections: KVSection | RecurrentSection) -> bytes:
    """The bytes of the sections one after the other (what a memory's ``state_write`` returns)."""
    buf = _Parts()
    for s in sections:
        write_section(s, buf)
    return buf.getvalue()


class _Count:
    """A write-only binary file that only counts the bytes it is given."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: Buffer) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n


class _Into:
    """A write-only binary file over a caller's writable buffer: each write is copied straight into place, so
    the rows of a state go from the cache's buffers to the caller's in one copy each."""

    def __init__(self, dst: memoryview) -> None:
        self.dst = dst
        self.n = 0
        self.full = False  # ran out of room (write_sections_into then names the size needed)

    def _room(self, n: int) -> int:
        end = self.n + n
        if end > len(self.dst):
            self.full = True
            raise ArgumentError(f"dst: {len(self.dst)} bytes is too small")
        return end

    def write(self, b: Buffer) -> int:
        mv = memoryview(b)
        end = self._room(mv.nbytes)
        self.dst[self.n : end] = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
        self.n = end
        return mv.nbytes

    def write_rows(self, a: npt.NDArray[ScalarT]) -> None:
        """The rows of a 2-D array with contiguous rows, one after the other, in one strided copy."""
        end = self._room(a.nbytes)
        out = np.frombuffer(self.dst[self.n : end], np.uint8).reshape(a.shape[0], -1)
        np.copyto(out, a.view(np.uint8).reshape(a.shape[0], -1))
        self.n = end


def sections_size(*sections: KVSection | RecurrentSection) -> int:
    """The byte count of the sections one after the other (what ``section_bytes`` would return, without
    building it): the size of the buffer `write_sections_into` needs."""
    count = _Count()
    for s in sections:
        write_section(s, count)
    return count.n


def write_sections_into(dst: Buffer | Sink, *sections: KVSection | RecurrentSection) -> int:
    """Write the sections one after the other into ``dst``; returns the byte count (``sections_size``).

    ``dst`` is a writable C-contiguous buffer (``bytearray``, ``memoryview``, NumPy array, ``mmap``, a ctypes
    array) whose first bytes receive the sections, each row block copied straight from where it lives (as
    llama_state_get_data fills the buffer its caller sized with llama_state_get_size), or a binary file object
    the sections are streamed to. A buffer too small raises ArgumentError naming the size needed (its content
    is then unspecified); a read-only one, ArgumentTypeError.
    """
    if hasattr(dst, "write") and not isinstance(dst, memoryview):
        return sum(write_section(s, cast("Sink", dst)) for s in sections)
    try:
        mv = memoryview(cast("Buffer", dst))  # not a file: a buffer, or a TypeError
    except TypeError:
        raise ArgumentTypeError(f"dst: a writable buffer or a binary file, not {type(dst).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        raise ArgumentTypeError("dst: expected a writable C-contiguous buffer")
    into = _Into(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    try:
        for s in sections:
            write_section(s, into)
    except ArgumentError:
        if not into.full:
            raise
        need = sections_size(*sections)
        raise ArgumentError(f"dst: {into.dst.nbytes} bytes, the state needs {need}") from None
    return into.n


__all__ = [
    "KVLayerSpec",
    "KVSpec",
    "RecurrentLayerSpec",
    "RecurrentSpec",
    "read_kv_section",
    "read_recurrent_section",
    "read_sections",
    "section_bytes",
    "sections_size",
    "validate_kv_section",
    "validate_recurrent_section",
    "write_section",
    "write_sections_into",
]
