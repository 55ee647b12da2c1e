"""The memory sections, declared once: attention KV (llama_kv_cache) and recurrent (llama_memory_recurrent).

Wire layout (see docs/state-format.md for the history of each field):

    kv section     = [u32 n_stream]            -- absent before llama.cpp PR #14363 (July 2025)
                     stream * n_stream (or one stream when n_stream is absent)
    stream         = u32 cell_count; if cell_count > 0: cells, kv data
    cells          = per cell: i32 pos, u32 n_seq_id, [ext: 2 or 3 x i32], i32 seq_id[n_seq_id]
    kv data        = u32 v_trans, u32 n_layer,
                     per layer: i32 k_type, u64 k_row_size, k rows (cell_count x k_row_size)
                     per layer with V (none for MLA caches):
                       v_trans == 0: i32 v_type, u64 v_row_size, v rows (cell_count x v_row_size)
                       v_trans == 1: i32 v_type, u32 v_el_size, u32 n_embd_v_gqa,
                                     n_embd_v_gqa rows of (cell_count x v_el_size)
    recurrent      = u32 cell_count, cells (no ext; seq-only saves write n_seq_id = 0),
                     u32 s_trans, u32 n_layer,
                     per layer with state: i32 r_type, u64 r_row_size, r rows, [u64 p_row_size, p rows]
                     per layer with state: S like V above (s_type, s_row_size | s_el_size, n_embd_s)

The recurrent section is written even when it has no cells (its layer headers then carry no rows); a KV
stream with no cells is just its zero ``cell_count``. The 2025 recurrent cache (``llama_kv_cache_recurrent``,
llama-cpp-python 0.3.12 .. 0.3.16) wrote the same bytes under the names K/V and ``v_trans`` with every layer
present; it reads as a recurrent section with ``n_state_layers = n_layer``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..constants import LLAMA_MAX_LAYERS, LLAMA_MAX_SEQ
from ..errors import FormatError
from ..ggml.types import TYPE_TRAITS, GGMLType, type_name
from . import mismatch
from .cells import Cells, CellTable
from .codec import Reader, Writer
from .constants import LAYOUTS
from .dsl import I32, U32, U64, Env, Field, List, Param, Record, Rows, Struct, Switch, When, env_flag, env_int
from .dsv4 import DSV4Section
from .specs import KVLayerSpec, KVSpec

Check = Callable[[int, Env], str | None]

_KNOWN_TYPES = {int(t) for t in TYPE_TRAITS}


def _type_size(t: int) -> int:
    return TYPE_TRAITS[GGMLType(t)].type_size


# --- object model --------------------------------------------------------------------------------------------


class _TypedRows(Record):
    """What LayerRows and TransposedRows share: a ggml type and a uint8 ``data`` array."""

    type: int
    data: npt.NDArray[np.uint8]

    @property
    def type_name(self) -> str:
        """The name ggml_type_name() prints for the rows' type (``f16``, ``q8_0``, ...)."""
        return type_name(self.type)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows."""
        return int(self.data.nbytes)


@dataclass(eq=False)
class LayerRows(_TypedRows):
    """One tensor's rows for one layer, one row per cell (K, row-wise V, row-wise S)."""

    type: int
    row_size: int
    data: npt.NDArray[np.uint8]  # (n_cells, row_size), a view into the file when loaded


@dataclass(eq=False)
class TransposedRows(_TypedRows):
    """V (or S) stored transposed: ``n_embd`` rows, each holding every cell's element of that row."""

    type: int
    el_size: int
    n_embd: int
    data: npt.NDArray[np.uint8]  # (n_embd, n_cells * el_size)

    @property
    def row_size(self) -> int:
        """Bytes of one cell's V row once un-transposed."""
        return self.el_size * self.n_embd


@dataclass(eq=False)
class RecurrentLayer(Record):
    """R rows of one layer, plus the PLE conv-history rows (``p``) that travel with them when the model has them."""

    type: int
    row_size: int
    data: npt.NDArray[np.uint8]
    p_row_size: int | None = None
    p_data: npt.NDArray[np.uint8] | None = None

    @property
    def type_name(self) -> str:
        """The name ggml_type_name() prints for the R rows' type (``f32``, ...)."""
        return type_name(self.type)

    @property
    def nbytes(self) -> int:
        """Bytes of the R rows plus the PLE rows when there are any."""
        return int(self.data.nbytes) + (int(self.p_data.nbytes) if self.p_data is not None else 0)


@dataclass(eq=False)
class KVData(Record):
    """The K/V rows of one stream: ``v_trans`` as written, one ``k`` entry per layer, one ``v`` entry per layer
    with V (none for an MLA cache)."""

    v_trans: int
    k: list[LayerRows]
    v: list[LayerRows | TransposedRows]

    @property
    def n_layer(self) -> int:
        """The ``n_layer`` written: one per K entry."""
        return len(self.k)


@dataclass(eq=False)
class KVStream(Record):
    """One stream of an attention cache: its cells and, when it has any, their K/V rows."""

    cells: Cells | None
    data: KVData | None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cells is not None and self.cells.n == 0:
            self.cells = None  # llama.cpp writes only the zero cell_count for an empty stream
            self.data = None

    @property
    def cell_count(self) -> int:
        """The stream's ``cell_count`` (0 when it has no cells)."""
        return 0 if self.cells is None else self.cells.n


@dataclass(eq=False)
class KVSection(Record):
    """What llama_kv_cache::state_write writes. ``has_n_stream`` is False for files older than PR #14363."""

    streams: list[KVStream]
    has_n_stream: bool = True

    kind = "kv"

    @property
    def n_stream(self) -> int:
        """The number of streams (the ``n_stream`` written, when ``has_n_stream``)."""
        return len(self.streams)


@dataclass(eq=False)
class RecurrentSection(Record):
    """What llama_memory_recurrent::state_write writes. ``n_layer`` counts every model layer, ``r``/``s`` only
    the layers that carry state (hybrid models skip their attention layers)."""

    cells: Cells
    s_trans: int
    n_layer: int
    r: list[RecurrentLayer]
    s: list[LayerRows | TransposedRows]

    kind = "recurrent"

    @property
    def cell_count(self) -> int:
        """The section's ``cell_count``."""
        return self.cells.n


@dataclass(eq=False)
class MemorySections:
    """The memory part of a state: ``layout`` names the composition, ``sections`` are in write order."""

    layout: str
    sections: list[KVSection | RecurrentSection]

    @property
    def kv_sections(self) -> list[KVSection]:
        """The attention KV sections, in write order (a DSV4 section's raw iSWA sections included)."""
        out: list[KVSection] = []
        for s in self.sections:
            if isinstance(s, KVSection):
                out.append(s)
            elif isinstance(s, DSV4Section):
                out.extend(s.raw)
        return out

    @property
    def recurrent_sections(self) -> list[RecurrentSection]:
        """The recurrent sections, in write order."""
        return [s for s in self.sections if isinstance(s, RecurrentSection)]


# --- field checks --------------------------------------------------------------------------------------------


def _check_type(v: int, env: Env) -> str | None:
    return None if v in _KNOWN_TYPES else f"unknown ggml type id {v}"


def _check_row_size(prefix: str) -> Check:
    def check(v: int, env: Env) -> str | None:
        t = env_int(env, f"{prefix}_type")
        ts = _type_size(t)
        return f"row size {v} is not a whole number of {type_name(t)} blocks ({ts} bytes)" if v % ts else None

    return check


def _check_el_size(prefix: str) -> Check:
    def check(v: int, env: Env) -> str | None:
        t = env_int(env, f"{prefix}_type")
        ts = _type_size(t)
        return None if v == ts else f"element size {v} != {ts} (ggml_type_size of {type_name(t)})"

    return check


def _check_flag(v: int, env: Env) -> str | None:
    return None if v in (0, 1) else f"expected 0 or 1, found {v}"


def _check_n_stream(v: int, env: Env) -> str | None:
    return None if 1 <= v <= LLAMA_MAX_SEQ else f"n_stream {v} outside [1, {LLAMA_MAX_SEQ}]"


# --- checks against a cache (only when a cache reads: kvref.state.cache_api passes ``cache_spec``) --------------
# llama.cpp's state_read_data compares n_layer, v_trans and each layer's type / row size / V width with its cache
# as it reads them, before the rows; checking them here (instead of after the parse) blames the field llama.cpp
# blames even when the mismatch makes the rest of the section unparseable.


def _cache_spec(env: Env) -> KVSpec | None:
    spec = env.get("cache_spec")
    return spec if isinstance(spec, KVSpec) else None


def _cursor(env: Env) -> dict[str, int]:
    """The index of the layer whose K (``"k"``) / V (``"v"``) header is being read."""
    cursor = env["_cache_il"]
    assert isinstance(cursor, dict)
    return cursor


def _cache_layer(env: Env, prefix: str) -> KVLayerSpec | None:
    spec = _cache_spec(env)
    if spec is None or prefix not in ("k", "v"):
        return None
    il = _cursor(env)[prefix]
    return spec.layers[il] if 0 <= il < len(spec.layers) else None


def _check_n_layer(v: int, env: Env) -> str | None:
    # every llama.cpp model has at most LLAMA_MAX_LAYERS layers (its per-layer hparams are arrays of that size),
    # so no state it writes has more; checking first also bounds every walk over the layer records
    return None if v <= LLAMA_MAX_LAYERS else f"n_layer {v} exceeds LLAMA_MAX_LAYERS ({LLAMA_MAX_LAYERS})"


def _check_cache_n_layer(v: int, env: Env) -> str | None:
    msg = _check_n_layer(v, env)
    spec = _cache_spec(env)
    if msg or spec is None:
        return msg
    _cursor(env).update(k=-1, v=-1)  # a new stream's data: layer cursors start again
    return None if v == len(spec.layers) else f"n_layer {v}, the cache has {len(spec.layers)}"


def _check_cache_v_trans(v: int, env: Env) -> str | None:
    msg = _check_flag(v, env)
    spec = _cache_spec(env)
    if msg or spec is None:
        return msg
    return None if bool(v) == spec.v_trans else mismatch.v_trans(v, spec.v_trans)


def _check_layer_type(prefix: str) -> Check:
    def check(v: int, env: Env) -> str | None:
        msg = _check_type(v, env)
        if msg or _cache_spec(env) is None or prefix not in ("k", "v"):
            return msg
        _cursor(env)[prefix] += 1
        ls = _cache_layer(env, prefix)
        want = None if ls is None else ls.k_type if prefix == "k" else ls.v_type
        if want is not None and v != want:
            return mismatch.layer_type(_cursor(env)[prefix], prefix, v, want)
        return None

    return check


def _check_layer_row_size(prefix: str) -> Check:
    base = _check_row_size(prefix)

    def check(v: int, env: Env) -> str | None:
        msg = base(v, env)
        ls = _cache_layer(env, prefix)
        want = None if ls is None else ls.k_row_size if prefix == "k" else ls.v_row_size
        if msg or want is None or v == want:
            return msg
        return mismatch.row_size(_cursor(env)[prefix], prefix, v, want)

    return check


def _check_layer_n_embd(prefix: str) -> Check:
    def check(v: int, env: Env) -> str | None:
        ls = _cache_layer(env, prefix)
        want = None if ls is None else ls.n_embd_v_gqa
        if want is None or v == want:
            return None
        return f"layer {_cursor(env)[prefix]}: n_embd_v_gqa {v}, the cache has {want}"

    return check


def _one_sequence(env: Env) -> bool:
    """A sequence-scope state of one sequence, whose cells list that sequence alone (or, recurrent, no id). A sequence
    blob of id -1 (llama_state_seq_get_data of every sequence, its header says so) is the whole memory's: its cells
    list their ids as a context state does."""
    return env_flag(env, "seq_scope") and env.get("io_seq_id") != -1


def _cells_rows(env: Env, name: str) -> tuple[int, int]:
    return env_int(env, "cell_count"), env_int(env, name)


def _row_struct(prefix: str) -> Struct[LayerRows]:
    """``i32 type, u64 row_size, rows``: K, row-wise V and row-wise S share it under their own field names."""
    return Struct(
        LayerRows,
        I32(f"{prefix}_type", attr="type", check=_check_layer_type(prefix)),
        U64(f"{prefix}_row_size", attr="row_size", check=_check_layer_row_size(prefix)),
        Rows(f"{prefix}_data", lambda env: _cells_rows(env, f"{prefix}_row_size"), attr="data"),
    )


def _transposed_struct(prefix: str, n_embd_name: str) -> Struct[TransposedRows]:
    return Struct(
        TransposedRows,
        I32(f"{prefix}_type", attr="type", check=_check_layer_type(prefix)),
        U32(f"{prefix}_el_size", attr="el_size", check=_check_el_size(prefix)),
        U32(n_embd_name, attr="n_embd", check=_check_layer_n_embd(prefix)),
        Rows(
            f"{prefix}_data",
            lambda env: (env_int(env, n_embd_name), env_int(env, "cell_count") * env_int(env, f"{prefix}_el_size")),
            attr="data",
        ),
    )


# --- attention KV ---------------------------------------------------------------------------------------------


def _n_v_layers(env: Env) -> int:
    return env_int(env, "n_layer") if env_flag(env, "has_v") else 0


def _has_cells(env: Env) -> bool:
    return env_int(env, "cell_count") > 0


KV_DATA = Struct(
    KVData,
    U32("v_trans", check=_check_cache_v_trans),
    U32("n_layer", derive=lambda o, env: len(o.k), check=_check_cache_n_layer),
    List("k", _row_struct("k"), lambda env: env_int(env, "n_layer"), blame="n_layer"),
    Param("has_v", derive=lambda o, env: bool(o.v)),
    Switch(
        "v",
        lambda env: env_flag(env, "v_trans"),
        {
            False: List("v", _row_struct("v"), _n_v_layers, blame="n_layer"),
            True: List("v", _transposed_struct("v", "n_embd_v_gqa"), _n_v_layers, blame="n_layer"),
        },
    ),
)

KV_STREAM = Struct(
    KVStream,
    U32("cell_count", derive=lambda o, env: o.cell_count),
    Param("ext_size", derive=lambda o, env: o.cells.ext_size if o.cells is not None else 0),
    When(
        _has_cells,
        # a sequence save writes one id per KV cell, or none when the saved id is not below the context's
        # n_seq_max (state_write_meta lists only ids < n_seq_max); a restore accepts only 1 (cache_api checks)
        CellTable(
            "cells",
            lambda env: env_int(env, "cell_count"),
            lambda env: env_int(env, "ext_size"),
            lambda env: (0, 1) if _one_sequence(env) else None,
        ),
    ),
    # before PR #14363 (no n_stream field: llama-cpp-python 0.3.12 .. 0.3.14) state_write_data ran even for zero
    # cells: an empty section still carries v_trans, n_layer and every layer's type / row size (no rows)
    When(lambda env: _has_cells(env) or not env_flag(env, "n_stream_field", True), KV_DATA.named("data")),
)


class _Streams(List):
    """The streams of a KV section: `List` of `KV_STREAM`, reading a run of empty streams (a zero ``cell_count``
    each, what a sequence save writes for every stream but the sequence's own) in one NumPy look at their counts.

    Each empty stream is built as `KV_STREAM` builds it (``cells`` and ``data`` None, the same ``offsets``), without
    walking its fields: with the ``n_stream`` field nothing else of an empty stream is read (before it, the data
    header follows the zero count, and every stream is read field by field)."""

    def read(self, r: Reader, env: Env) -> list[object]:
        if not env_flag(env, "n_stream_field"):
            return super().read(r, env)
        n = env_int(env, "n_stream")
        if n * self.item.min_size > r.remaining():
            raise FormatError(
                f"count {n} of {self.name} needs at least {n * self.item.min_size} bytes, {r.remaining()} remain",
                field=self.blame,
                offset=r.pos,
            )
        out: list[object] = []
        # a cache's own read (``_shared_empty``: kvref.state.cache_api) keeps only the streams with cells: the empty
        # ones are all one KVStream (its offsets those of the first), never handed to anyone
        shared = _empty_stream(r.pos) if env_flag(env, "_shared_empty") else None
        while len(out) < n:
            k = min(n - len(out), r.remaining() // 4)
            counts = np.frombuffer(r.buf, "<u4", k, r.pos)
            nz = np.flatnonzero(counts)
            n_empty = int(nz[0]) if nz.size else k
            if shared is not None:
                out += [shared] * n_empty
            else:
                for at in range(r.pos, r.pos + 4 * n_empty, 4):
                    out.append(_empty_stream(at))
            r.pos += 4 * n_empty
            if len(out) < n:
                out.append(self.item.read(r, env))  # a stream with cells (or a truncated count: its error)
        return out


def _empty_stream(at: int) -> KVStream:
    """The `KVStream` `KV_STREAM` reads from a zero ``cell_count`` at ``at`` (with the ``n_stream`` field)."""
    st = KVStream.__new__(KVStream)
    st.cells = st.data = None
    st.offsets = {"cell_count": at, "ext_size": at + 4, "cells": at + 4, "data": at + 4}
    return st


KV_SECTION = Struct(
    KVSection,
    Param("n_stream_field", attr="has_n_stream"),
    When(
        lambda env: env_flag(env, "n_stream_field"),
        U32("n_stream", derive=lambda o, env: len(o.streams), check=_check_n_stream),
    ),
    _Streams(
        "streams",
        KV_STREAM,
        lambda env: env_int(env, "n_stream") if env_flag(env, "n_stream_field") else 1,
        blame="n_stream",
    ),
)


# --- recurrent ------------------------------------------------------------------------------------------------


def _walk_records(r: Reader, pos: int, cell_count: int, with_p: bool, limit: int) -> tuple[int, int]:
    """Count consecutive ``i32 type, u64 row_size, rows [, u64 p_row_size, p rows]`` records that fit."""
    count = 0
    while count < limit and pos + 12 <= r.end:
        t = r.peek_u32(pos)
        t = t - (1 << 32) if t is not None and t >= 1 << 31 else t
        if t not in _KNOWN_TYPES:
            break
        row = int(np.frombuffer(r.buf, "<u8", 1, pos + 4)[0])
        nxt = pos + 12 + row * cell_count
        if row % _type_size(t) or nxt > r.end:
            break
        if with_p:
            if nxt + 8 > r.end:
                break
            prow = int(np.frombuffer(r.buf, "<u8", 1, nxt)[0])
            nxt += 8 + prow * cell_count
            if nxt > r.end:
                break
        pos, count = nxt, count + 1
    return count, pos


def _scan_state_layers(env: Env) -> int:
    """Count the layers with state by walking the R and S records (only for ``load(..., layout="auto")``).

    A hybrid model's recurrent section holds fewer R/S records than ``n_layer`` and nothing in the bytes says
    how many. The records are self-sizing, though: walk them as far as they fit. Without PLE rows R and S
    records look alike, so the walk must find an even number (2 x the count), ending at the end of the input
    when the section is the last one. Falls back to ``n_layer`` when the walk is inconclusive; the parse that
    follows checks the answer either way.
    """
    r = env["_reader"]
    assert isinstance(r, Reader)
    n_layer, cell_count = env_int(env, "n_layer"), env_int(env, "cell_count")
    section_last = env_flag(env, "section_last")
    if env_flag(env, "s_trans"):
        return n_layer
    if env_flag(env, "ple"):
        # R records (with their p rows) differ in shape from S records: try every R count, prefer the one
        # whose k S records end exactly at the end of the input
        fits = []
        for k in range(n_layer, -1, -1):
            k_r, pos = _walk_records(r, r.pos, cell_count, True, k)
            if k_r != k:
                continue
            k_s, end = _walk_records(r, pos, cell_count, False, k)
            if k_s == k:
                fits.append((end != r.end, k))
        exact = [k for at_end, k in fits if not at_end]
        if section_last:
            return exact[0] if exact else n_layer
        return max(k for _, k in fits) if fits else n_layer
    if not section_last:
        # a section follows (llama_memory_hybrid_idx's indexer cache), whose bytes may pass for more records: the
        # R records share one row head, the S records another (n_embd_r / n_embd_s are per model, not per layer)
        heads: list[tuple[object, ...]] = []
        pos = r.pos
        while len(heads) < 2 * n_layer:
            count, nxt = _walk_records(r, pos, cell_count, False, 1)
            if count == 0:
                break
            heads.append((r.peek_u32(pos), int(np.frombuffer(r.buf, "<u8", 1, pos + 4)[0])))
            pos = nxt
        k = uniform_halves(heads)
        return k if k else n_layer
    count, pos = _walk_records(r, r.pos, cell_count, False, 2 * n_layer)
    if count % 2 or (section_last and pos != r.end) or (not section_last and count == 0):
        return n_layer
    return count // 2


def uniform_halves(heads: Sequence[tuple[object, ...]]) -> int:
    """The largest k such that ``heads[:k]`` are alike and ``heads[k:2k]`` are alike (R then S records), 0 if none."""
    for k in range(len(heads) // 2, 0, -1):
        if len(set(heads[:k])) == 1 and len(set(heads[k : 2 * k])) == 1:
            return k
    return 0


def _n_state_layers(env: Env) -> int:
    """The ``n_state_layers`` read option: a count, None (every layer) or ``"scan"`` (`_scan_state_layers`)."""
    v = env["n_state_layers"]
    n_layer = env_int(env, "n_layer")
    if v is None:
        return n_layer
    if v == "scan":
        return _scan_state_layers(env)
    n = env_int(env, "n_state_layers")
    if n > n_layer:
        r = env["_reader"]
        raise FormatError(
            f"{n} layers with state, but n_layer is {n_layer}",
            field="n_layer",
            offset=r.pos if isinstance(r, Reader) else None,
        )
    return n


def _n_r_layers(env: Env) -> int:
    r = env["r"]
    assert isinstance(r, list)
    return len(r)


R_LAYER = Struct(
    RecurrentLayer,
    I32("r_type", attr="type", check=_check_type),
    U64("r_row_size", attr="row_size", check=_check_row_size("r")),
    Rows("r_data", lambda env: _cells_rows(env, "r_row_size"), attr="data"),
    When(lambda env: env_flag(env, "ple"), U64("p_row_size")),
    When(lambda env: env_flag(env, "ple"), Rows("p_data", lambda env: _cells_rows(env, "p_row_size"))),
)

RECURRENT_SECTION = Struct(
    RecurrentSection,
    U32("cell_count", derive=lambda o, env: o.cells.n),
    # a sequence save writes n_seq_id = 0 for every recurrent cell
    CellTable(
        "cells",
        lambda env: env_int(env, "cell_count"),
        lambda env: 0,
        lambda env: (0,) if _one_sequence(env) else None,
    ),
    U32("s_trans", check=_check_flag),
    U32("n_layer", check=_check_n_layer),
    Param("ple", derive=lambda o, env: any(layer.p_data is not None for layer in o.r)),
    Param("n_state_layers", derive=lambda o, env: len(o.r)),
    List("r", R_LAYER, _n_state_layers, blame="n_layer"),
    Switch(
        "s",
        lambda env: env_flag(env, "s_trans"),
        {
            False: List("s", _row_struct("s"), _n_r_layers, blame="n_layer"),
            True: List("s", _transposed_struct("s", "n_embd_s"), _n_r_layers, blame="n_layer"),
        },
    ),
)


# --- the memory as a whole ------------------------------------------------------------------------------------

_SECTION_STRUCTS: dict[str, Struct[KVSection | RecurrentSection]] = {"kv": KV_SECTION, "recurrent": RECURRENT_SECTION}


def idx_section_options(env: Env) -> dict[str, object]:
    """The read options of llama_memory_hybrid_idx's indexer section, from the memory's: no V (an MLA-shaped cache),
    and a cell ext only when the model has PLE (the indexer's hparams have no RoPE, so no M-RoPE position)."""
    return {"has_v": False, "ext_size": env_int(env, "ext_size") if env_flag(env, "ple") else 0}


class MemoryField(Field[object]):
    """The sections of ``env["layout"]`` one after the other (iSWA: base then SWA; hybrid: attention then recurrent)."""

    def __init__(self) -> None:
        self.name = self.attr = "memory"

    def read(self, r: Reader, env: Env) -> MemorySections:
        layout = env["layout"]
        assert isinstance(layout, str), "the layout read option names a composition"
        kinds = LAYOUTS[layout]
        sections: list[KVSection | RecurrentSection] = []
        for i, k in enumerate(kinds):
            env["section_last"] = i == len(kinds) - 1  # lets the recurrent layer scan know where it must end
            if layout == "hybrid_idx" and i == 2:
                # the indexer cache keeps no V and no RoPE: a cell ext only for PLE models (its token)
                saved = {n: env.get(n) for n in ("ext_size", "has_v")}
                env.update(idx_section_options(env))
                try:
                    sections.append(_SECTION_STRUCTS[k].read(r, env))
                finally:
                    env.update(saved)
                continue
            if k == "dsv4":
                sections.append(read_dsv4(r, env))  # type: ignore[arg-type]
                continue
            sections.append(_SECTION_STRUCTS[k].read(r, env))
        return MemorySections(layout, sections)

    def write(self, w: Writer, mem: object, env: Env) -> None:
        if not isinstance(mem, MemorySections):
            raise FormatError(f"expected MemorySections, got {type(mem).__name__}", field="memory", offset=w.n)
        kinds = tuple(s.kind for s in mem.sections)
        if LAYOUTS.get(mem.layout) != kinds:
            raise FormatError(f"layout {mem.layout!r} does not match sections {kinds}", field="layout", offset=w.n)
        for s in mem.sections:
            if isinstance(s, DSV4Section):
                write_dsv4(w, s, env)
                continue
            _SECTION_STRUCTS[s.kind].write(w, s, env)


def read_dsv4(r: Reader, env: Env) -> DSV4Section:
    """A DSV4 memory section (kvref.state.dsv4): its header, the raw iSWA's KV sections read like any other (K
    only), then the compressed caches and compressor states."""
    from .dsv4 import DSV4Header, read_tail, reader

    buf = r.buf[: r.end]
    rr = reader(buf, r.pos)
    head = DSV4Header.read(rr)
    r.pos = rr.pos
    raw = [KV_SECTION.read(r, env) for _ in range(1 if head.partial else 2)]
    ks, ss, r.pos = read_tail(buf, r.pos, head.partial)
    return DSV4Section(head, raw, ks, ss)


def write_dsv4(w: Writer, sec: DSV4Section, env: Env) -> None:
    """The bytes `read_dsv4` reads."""
    w.raw(sec.header.to_bytes())
    for s in sec.raw:
        KV_SECTION.write(w, s, env)
    w.raw(sec.tail_bytes())


MEMORY = MemoryField()

__all__ = [
    "KV_DATA",
    "KV_SECTION",
    "KV_STREAM",
    "MEMORY",
    "RECURRENT_SECTION",
    "KVData",
    "KVSection",
    "KVStream",
    "LayerRows",
    "MemorySections",
    "RecurrentLayer",
    "RecurrentSection",
    "TransposedRows",
]
