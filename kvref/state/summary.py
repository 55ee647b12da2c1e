"""A JSON-ready description of a loaded state: what `kvref inspect` prints and the conformance runner compares.

Only metadata is touched (cell tables, layer headers); tensor rows are reported by size, never read.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from ..errors import FormatError
from ..ggml.types import type_name
from .cells import Cells
from .constants import Magic
from .dsv4 import DSV4Section
from .sections import KVSection, LayerRows, MemorySections, RecurrentSection, TransposedRows

Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"
Summary: TypeAlias = "dict[str, Json]"


class Container(Protocol):
    """What `summarize` reads of every container (a `kvref.state.files.StateObject`): its kind, its memory and the
    note `kvref.state.load` may leave; by kind, the fields of a `FileHeader` ("session", "seq"), a `ContextHeader`
    ("session", "state") or a `SeqBlobHeader` ("seq_state")."""

    @property
    def kind(self) -> str: ...
    @property
    def memory(self) -> MemorySections: ...
    @property
    def note(self) -> str | None: ...


class FileHeader(Protocol):
    """The header of a session or sequence file (`kvref.state.files.SessionFile`, ``SeqFile``)."""

    @property
    def magic(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def tokens(self) -> npt.NDArray[np.int32]: ...


class OutputBlock(Protocol):
    """The v9 output block, by its sizes (a `kvref.state.files.Outputs`)."""

    @property
    def output_pos(self) -> Sized: ...
    @property
    def logits(self) -> Sized: ...
    @property
    def embeddings(self) -> Sized: ...


class ContextHeader(Protocol):
    """What precedes the memory in a context state (`kvref.state.files.SessionFile`, ``StateBlob``)."""

    @property
    def arch(self) -> str: ...
    @property
    def outputs(self) -> OutputBlock | None: ...
    @property
    def rng(self) -> str | None: ...


class SeqBlobHeader(Protocol):
    """The prefix of a sequence blob (`kvref.state.files.SeqStateBlob`): the id it was saved from, or None."""

    @property
    def seq_id(self) -> int | None: ...


_N_FIRST_TOKENS = 16


def _cells(cells: Cells | None) -> Summary:
    if cells is None:
        return {"cell_count": 0, "sequences": {}}
    seqs = cells.sequences()
    return {
        "cell_count": cells.n,
        "ext_size": cells.ext_size,
        "pos_min": int(cells.pos.min()) if cells.n else None,
        "pos_max": int(cells.pos.max()) if cells.n else None,
        "sequences": {
            str(s): {"pos_min": r.pos_min, "pos_max": r.pos_max, "n_cells": r.n_cells} for s, r in seqs.items()
        },
    }


def _rows(x: LayerRows | TransposedRows) -> Summary:
    d: Summary = {"type": x.type_name, "row_size": x.row_size, "bytes": x.nbytes}
    if isinstance(x, TransposedRows):
        d.update(transposed=True, el_size=x.el_size, n_embd=x.n_embd)
    return d


def _kv_layer(il: int, k: LayerRows, v: LayerRows | TransposedRows | None) -> Summary:
    out: Summary = {"layer": il, "k": _rows(k)}
    if v is not None:
        out["v"] = _rows(v)
    return out


def _kv(sec: KVSection) -> Summary:
    streams: list[Json] = []
    for i, st in enumerate(sec.streams):
        d: Summary = {"stream": i, **_cells(st.cells)}
        if st.data is not None:
            d["v_trans"] = st.data.v_trans
            d["n_layer"] = st.data.n_layer
            d["layers"] = [_kv_layer(il, k, st.data.v[il] if st.data.v else None) for il, k in enumerate(st.data.k)]
        streams.append(d)
    return {"kind": "kv", "n_stream": sec.n_stream if sec.has_n_stream else None, "streams": streams}


def _recurrent(sec: RecurrentSection) -> Summary:
    layers: list[Json] = []
    for i, (r, s) in enumerate(zip(sec.r, sec.s, strict=False)):
        d: Summary = {
            "index": i,
            "r": {"type": r.type_name, "row_size": r.row_size, "bytes": int(r.data.nbytes)},
            "s": _rows(s),
        }
        if r.p_data is not None:
            d["p"] = {"row_size": r.p_row_size, "bytes": int(r.p_data.nbytes)}
        layers.append(d)
    return {
        "kind": "recurrent",
        **_cells(sec.cells),
        "s_trans": sec.s_trans,
        "n_layer": sec.n_layer,
        "n_state_layers": len(sec.r),
        "layers": layers,
    }


def _token_field(tokens: npt.NDArray[np.int32]) -> Summary:
    """Which form the token field has (a plain list, or llama-server's packed prompt with media) and its prompt."""
    from .server_tokens import read_prompt

    try:
        p = read_prompt(tokens)
    except FormatError as e:
        return {"form": "unreadable llama-server packed prompt", "error": str(e)}
    out: Summary = {"form": p.form}
    if p.form != "plain":
        out["n_prompt_tokens"] = len(p.tokens)
        out["first_prompt_tokens"] = [int(t) for t in p.tokens[:_N_FIRST_TOKENS]]
        out["media"] = [{"start": s, "bytes": n} for s, n in p.media]
    return out


def summarize(obj: Container) -> Summary:
    """The JSON-ready description of a session file, sequence file or blob (see the module docstring)."""
    # narrowed by the container's ``kind`` (the containers of kvref.state.files are built on this module)
    out: Summary = {"format": obj.kind}
    if obj.kind in ("session", "seq"):
        f = cast("FileHeader", obj)
        out["magic"] = Magic(f.magic).to_bytes(4, "big").decode("latin-1")
        out["version"] = f.version
        out["n_tokens"] = len(f.tokens)
        out["first_tokens"] = [int(t) for t in f.tokens[:_N_FIRST_TOKENS]]
        out["token_field"] = _token_field(f.tokens)
    if obj.kind == "seq_state":
        out["seq_id"] = cast("SeqBlobHeader", obj).seq_id
    if obj.kind in ("session", "state"):
        c = cast("ContextHeader", obj)
        out["arch"] = c.arch
        o = c.outputs
        if o is not None:
            out["outputs"] = {"n_outputs": len(o.output_pos), "logits": len(o.logits), "embeddings": len(o.embeddings)}
        if c.rng is not None:  # session version 8 (2024): the sampler's std::mt19937, as text (state/legacy.py)
            out["rng"] = {"bytes": len(c.rng)}
    out["layout"] = obj.memory.layout
    if obj.note:
        out["note"] = obj.note
    sections: list[Json] = []
    for sec in obj.memory.sections:
        if isinstance(sec, DSV4Section):
            sections.extend(_dsv4(sec))
        else:
            sections.append(_kv(sec) if isinstance(sec, KVSection) else _recurrent(sec))
    out["sections"] = sections
    return out


def _dsv4(sec: DSV4Section) -> list[Summary]:
    """A DSV4 section as the sections it holds: the raw iSWA's KV sections, each compressed K cache (kind
    ``dsv4_k``), each compressor state (kind ``dsv4_state``), labelled."""
    out: list[Summary] = []
    names = ["raw SWA attention KV"] if sec.partial else ["raw base attention KV (no layer)", "raw SWA attention KV"]
    for name, r in zip(names, sec.raw, strict=True):
        out.append({**_kv(r), "label": f"DSV4 {name}"})
    what = {"csa": "CSA (ratio 4)", "hca": "HCA (ratio 128)", "lid": "lightning-indexer (ratio 4)"}
    for k in sec.k_caches:
        layers: list[Json] = [{"il": il, "type": type_name(t.type), "row_size": t.row_size} for il, t in k.layers]
        out.append({"kind": "dsv4_k", "label": f"DSV4 {what[k.name]} compressed K", "n_rows": k.n_rows,
                    "n_stream": k.n_stream, "layers": layers})  # fmt: skip
    for c in sec.states:
        out.append({"kind": "dsv4_state", "label": f"DSV4 {what[c.name]} compressor state", "ratio": c.ratio,
                    "state_size": c.state_size, "n_embd_state": c.n_embd_state, "n_stream": c.n_stream,
                    "layers": [il for il, _, _ in c.layers]})  # fmt: skip
    return out


__all__ = [
    "Container",
    "ContextHeader",
    "FileHeader",
    "Json",
    "OutputBlock",
    "SeqBlobHeader",
    "Summary",
    "summarize",
]
