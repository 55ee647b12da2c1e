"""``kvref export IN OUT``: a state file's K/V/R/S tensors and cell metadata as ``.npz`` or ``.safetensors``.

Tensors are float32, dequantized, and un-rotated unless ``unrotate=False`` (`kvref.jobs.tensors`). Names:

============================== ============================================================================
``kv.{sec}.s{stream}.l{layer}.k``  K, ``(n_cells, n_head_kv, head_dim)``
``kv.{sec}.s{stream}.l{layer}.v``  V, the same shape, un-transposed (absent for MLA)
``kv.{sec}.s{stream}.pos``         int32 ``(n_cells,)``: each cell's position
``kv.{sec}.s{stream}.seq_id``      int32: every cell's sequence ids, one after the other
``kv.{sec}.s{stream}.seq_start``   int64 ``(n_cells + 1,)``: cell ``i``'s ids, ``seq_id[seq_start[i]:seq_start[i+1]]``
``kv.{sec}.s{stream}.seq_mask``    uint8 ``(n_cells, max id + 1)``: 1 where the cell holds the sequence
``kv.{sec}.s{stream}.layer``       int32 ``(n_layers,)``: the model layer of each ``l{layer}`` (-1: unknown)
``rs.{sec}.l{layer}.r`` / ``.s``   R and S (model shape when known, see `kvref.jobs.tensors`, else flat rows)
``rs.{sec}.pos`` / ``.seq_id`` / ``.seq_start`` / ``.seq_mask`` / ``.layer``   as above, for the recurrent cells
``dsv4.{part}.{sec}.s{stream}.l{layer}.k``  a DSV4 compressed K cache (``part`` csa, hca or lid, the lightning
                                   indexer): ``(n_rows, n_head_kv, head_dim)``, row ``r`` the compression of
                                   tokens ``[r * ratio, (r + 1) * ratio)`` (lid: one head of indexer_head_size)
``dsv4.{part}.{sec}.s{stream}.row``  int32 ``(n_rows,)``: the compressed row index
``dsv4.{part}.{sec}.layer``        int32: the model layer of each ``l{layer}`` (the file records it)
``dsv4.{part}_state.{sec}.s{stream}.l{layer}.kv`` / ``.score``  a DSV4 compressor state's f32 planes,
                                   ``(state_size, n_embd_state)``
``dsv4.{part}_state.{sec}.layer``  int32: the model layer of each ``l{layer}``
============================== ============================================================================

``sec`` is the section's index in the state (iSWA: 0 base, 1 SWA; hybrid: 0 attention, 1 recurrent; DSV4: its
parts as ``kvref inspect`` lists them: the raw K-only ``kv`` sections 0 base and 1 SWA, then 2-4 the CSA, HCA and
lid compressed K caches, 5-7 their compressor states; a partial save has only the raw SWA ``kv.0`` and the states
1-3), ``stream``
the KV stream, ``layer`` the position of the layer in the section. A ``.safetensors`` file also carries the
metadata key ``kvref`` (JSON: layout, the types, and whether the rotation was undone per tensor); a ``.npz``
file carries the same JSON as the array ``__kvref__`` (a 0-d string).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, BinaryIO, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

from ..errors import KVRefError
from .progress import Progress

if TYPE_CHECKING:
    from typing_extensions import NotRequired

    from ..hparams import HParams
    from ._types import ModelSource, StateSource
    from .tensors import KVTensors, RecurrentTensors

Arrays: TypeAlias = "dict[str, npt.NDArray[np.generic[object]]]"  # by name (the module doc's table)


class TensorMeta(TypedDict):
    """One tensor in the metadata: its ggml type in the file (None: a layer without V) and, for K / V, whether
    llama.cpp's attention rotation was undone."""

    type: str | None
    unrotated: NotRequired[bool]


class ExportMeta(TypedDict):
    """The metadata an export carries (``kvref`` key / ``__kvref__`` array, as JSON)."""

    layout: str
    kind: str
    unrotate: bool
    tensors: dict[str, TensorMeta]


def _seq_mask(seq_id: npt.NDArray[np.int32], seq_start: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    n = len(seq_start) - 1
    width = int(seq_id.max()) + 1 if seq_id.size else 0
    mask = np.zeros((n, width), np.uint8)
    rows = np.repeat(np.arange(n), np.diff(seq_start))
    mask[rows, seq_id] = 1
    return mask


def export_arrays(
    source: StateSource, *, hparams: HParams | None = None, model: ModelSource | None = None,
    head_dim: int | None = None, unrotate: bool = True, progress: bool | None = None,
) -> tuple[Arrays, ExportMeta]:  # fmt: skip
    """The arrays `export` writes and its metadata, by name (see the module doc)."""
    from .. import state
    from .tensors import state_tensors

    # the model (or hparams): what a session of version 5 .. 7 needs to be read at all
    obj = source if isinstance(source, state.StateObject) else state.load(source, model=hparams or model)
    total = sum(
        int(r.data.nbytes) for sec in obj.memory.kv_sections for st in sec.streams if st.data is not None
        for r in (*st.data.k, *st.data.v)
    )  # fmt: skip
    with Progress(total, "export", enabled=progress) as bar:
        ts = state_tensors(obj, hparams=hparams, model=model, head_dim=head_dim, unrotate=unrotate, progress=bar)
    arrays: Arrays = {}
    meta: ExportMeta = {"layout": obj.memory.layout, "kind": obj.kind, "unrotate": unrotate, "tensors": {}}
    layers: dict[str, list[int]] = {}

    def cells(base: str, t: KVTensors | RecurrentTensors) -> None:
        # the cell metadata of a section (and stream) once, the model layer of every tensor of it
        if f"{base}.pos" not in arrays:
            arrays[f"{base}.pos"] = t.pos
            arrays[f"{base}.seq_id"] = t.seq_id
            arrays[f"{base}.seq_start"] = t.seq_start
            arrays[f"{base}.seq_mask"] = _seq_mask(t.seq_id, t.seq_start)
        layers.setdefault(f"{base}.layer", []).append(-1 if t.il is None else t.il)

    for t in ts.kv:
        base = f"kv.{t.section}.s{t.stream}"
        arrays[f"{base}.l{t.layer}.k"] = t.k
        meta["tensors"][f"{base}.l{t.layer}.k"] = {"type": t.type_k, "unrotated": t.unrotated_k}
        if t.v is not None:
            arrays[f"{base}.l{t.layer}.v"] = t.v
            meta["tensors"][f"{base}.l{t.layer}.v"] = {"type": t.type_v, "unrotated": t.unrotated_v}
        cells(base, t)
    for rt in ts.recurrent:
        base = f"rs.{rt.section}"
        arrays[f"{base}.l{rt.layer}.r"] = rt.r
        arrays[f"{base}.l{rt.layer}.s"] = rt.s
        meta["tensors"][f"{base}.l{rt.layer}.r"] = {"type": rt.type_r}
        meta["tensors"][f"{base}.l{rt.layer}.s"] = {"type": rt.type_s}
        cells(base, rt)
    for ct in ts.compressed:
        base = f"dsv4.{ct.part}.{ct.section}"
        arrays[f"{base}.s{ct.stream}.l{ct.layer}.k"] = ct.k
        meta["tensors"][f"{base}.s{ct.stream}.l{ct.layer}.k"] = {"type": ct.type_k, "unrotated": ct.unrotated_k}
        arrays[f"{base}.s{ct.stream}.row"] = ct.row
        if ct.stream == 0:
            layers.setdefault(f"{base}.layer", []).append(ct.il)
    for st in ts.comp_states:
        base = f"dsv4.{st.part}_state.{st.section}"
        for plane, x in (("kv", st.kv), ("score", st.score)):
            arrays[f"{base}.s{st.stream}.l{st.layer}.{plane}"] = x
            meta["tensors"][f"{base}.s{st.stream}.l{st.layer}.{plane}"] = {"type": "f32"}
        if st.stream == 0:
            layers.setdefault(f"{base}.layer", []).append(st.il)
    for name, ils in layers.items():
        arrays[name] = np.asarray(ils, np.int32)
    return {k: np.ascontiguousarray(v) for k, v in arrays.items()}, meta


def export(
    source: StateSource, out: str | os.PathLike[str], *, fmt: str | None = None, hparams: HParams | None = None,
    model: ModelSource | None = None, head_dim: int | None = None, unrotate: bool = True,
    progress: bool | None = None, stream: BinaryIO | None = None,
) -> Arrays:  # fmt: skip
    """Write the tensors of ``source`` (a path, bytes or loaded state) to ``out``: ``fmt`` "npz" or "safetensors"
    (default: from the suffix; another suffix is an error). ``stream``: write the npz there instead (``out`` only
    names it in messages). Returns the arrays written."""
    path = os.fspath(out)
    if fmt is None:
        fmt = {".npz": "npz", ".safetensors": "safetensors"}.get(os.path.splitext(path)[1].lower())
        if fmt is None:
            raise KVRefError(f"{path}: export writes OUT.npz or OUT.safetensors (by the suffix), or pass fmt= "
                             "(kvref export: - writes npz to standard output)")  # fmt: skip
    if fmt not in ("npz", "safetensors"):
        raise KVRefError(f"export writes npz or safetensors, not {fmt!r}")
    arrays, meta = export_arrays(source, hparams=hparams, model=model, head_dim=head_dim, unrotate=unrotate,
                                 progress=progress)  # fmt: skip
    if fmt == "safetensors":
        try:
            from safetensors.numpy import save_file
        except ImportError:
            raise KVRefError(
                "writing .safetensors needs the safetensors package: pip install 'kvref[export]' (or write .npz)"
            ) from None
        save_file(arrays, path, metadata={"kvref": json.dumps(meta)})
    else:
        named: Arrays = {"__kvref__": np.asarray(json.dumps(meta)), **arrays}
        # numpy's stub types **kwds against savez's own allow_pickle too; no array has that name
        if stream is not None:
            np.savez(stream, **named)  # type: ignore[arg-type]
        else:
            with open(path, "wb") as f:
                np.savez(f, **named)  # type: ignore[arg-type]
    return arrays


__all__ = ["ExportMeta", "TensorMeta", "export", "export_arrays"]
