"""K, V, R and S as float32 NumPy arrays in their model shape, from a loaded state or from a memory.

::

    ts = kvref.jobs.tensors.state_tensors(kvref.state.load("slot0.bin"), hparams=hp)   # or head_dim=128
    for t in ts.kv:                        # one KVTensors per KV section, stream and layer
        t.k, t.v                           # (n_cells, n_head_kv, head_dim) float32, V un-transposed
        t.pos, t.seq_ids(i), t.il          # the cells' positions and sequence ids; the model layer
    for t in ts.recurrent:                 # one RecurrentTensors per recurrent layer with state
        t.r, t.s                           # model shape when known (see `recurrent_shapes`), else flat rows
    for t in ts.compressed:                # DSV4: one per compressed K cache (csa, hca, lid), layer and stream
        t.part, t.il, t.ratio, t.k, t.row  # (n_rows, n_head_kv, head_dim); row r: tokens [r * ratio, (r+1) * ratio)
    for t in ts.comp_states:               # DSV4: one per compressor state, layer and stream
        t.kv, t.score                      # f32 (state_size, n_embd_state)
    ts = kvref.jobs.tensors.memory_tensors(mem) # the same from a memory (its used cells; ``t.cells`` their indices)

Quantized rows are dequantized (`kvref.ggml.quant`). When llama.cpp rotated them (`kvref.ggml.rotation`: a
quantized type, a head size multiple of 64, from llama-cpp-python 0.3.36 on; a memory knows, a file does not and
the rule is applied to its era; a DSA indexer's K of deepseek32 / glm-dsa / dots3note whatever its type, known
with the model), the rotation is undone unless ``unrotate=False``. A state file does not record the head
size either: pass ``hparams=`` (or ``model=`` a GGUF path), or ``head_dim=``; without them K/V come as
``(n_cells, 1, n_embd_gqa)`` and a file whose rows may be rotated is refused unless ``unrotate=False``.

A DeepSeek-V4 state (kvref.state.dsv4) gives its raw iSWA sections as K-only ``kv`` entries (``v`` None; sections
numbered as ``kvref inspect`` lists the parts: raw base 0, raw SWA 1, the compressed caches 2-4, the states 5-7; a
partial save has raw SWA 0 and the states 1-3). A sequence save's compressed caches and states hold one stream, 0.
The lightning indexer's K (``lid``) is rotated by llama.cpp whatever its type (era permitting): undone unless
``unrotate=False``; its layout needs no head size (one head).

Layers are numbered by their position in the section (``layer``); ``il`` is the model layer when the model is
known (from the memory llama.cpp would build for it).

Recurrent shapes (read off llama.cpp's graph builders, ``models/mamba-base.cpp``, ``models/rwkv6-base.cpp``,
``llm_graph_context::build_rwkv_token_shift_load`` and ggml-cpu's ``rwkv_wkv6``), NumPy order:

============ ======================================= =====================================================
arch         R (n_embd_r per cell)                   S (n_embd_s per cell)
============ ======================================= =====================================================
mamba, jamba (d_inner, d_conv - 1)                   (d_inner, d_state)
mamba2       (d_inner + 2 n_group d_state, d_conv-1) (n_head, d_inner / n_head, d_state), n_head = dt_rank
rwkv6        (token_shift_count, n_embd)             (n_head, head_size [key], head_size [value])
============ ======================================= =====================================================

Other archs (the other hybrids included) keep the flat rows ``(n_cells, n_embd_r)`` / ``(n_cells, n_embd_s)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..errors import FormatError, KVRefError
from ..ggml import rotation as rot
from ..ggml.quant import dequantize, quantize
from ..ggml.types import GGMLType, traits, type_name
from ..profile import value_at

if TYPE_CHECKING:
    from ..hparams import HParams
    from ..memory.kv_cache import KVCache
    from ..memory.kv_cache_dsv4 import KVCacheDSV4
    from ..memory.recurrent import RecurrentMemory
    from ..state import KVSection, LayerRows, RecurrentSection, StateObject, TransposedRows
    from ..state.dsv4 import DSV4Section
    from ._types import AnyMemory, LeafMemory, ModelSource, StateSource
    from .progress import Progress

F32 = npt.NDArray[np.float32]


def era_rotates(name: str) -> bool:
    """Does the llama.cpp of era ``name`` (`kvref.state.eras`) rotate quantized K/V (``Profile.attn_rotation``)?"""
    from ..state.eras import era

    return bool(value_at("attn_rotation", era(name).first))


@dataclass
class KVTensors:
    """K and V of one layer of one stream of one KV section, float32, with the cells they belong to."""

    section: int
    stream: int
    layer: int
    il: int | None
    k: F32  # (n_cells, n_head_kv, head_dim_k)
    v: F32 | None  # (n_cells, n_head_kv, head_dim_v); None without V (MLA)
    pos: npt.NDArray[np.int32]  # (n_cells,)
    seq_id: npt.NDArray[np.int32]  # every cell's ids one after the other (CSR with seq_start)
    seq_start: npt.NDArray[np.int64]  # (n_cells + 1,)
    cells: npt.NDArray[np.int64]  # (n_cells,): cell indices in the cache (0..n-1 for a file)
    type_k: str
    type_v: str | None
    unrotated_k: bool = False  # was llama.cpp's rotation undone
    unrotated_v: bool = False

    def seq_ids(self, i: int) -> tuple[int, ...]:
        """The sequence ids of cell ``i`` (an index into these tensors)."""
        return tuple(int(x) for x in self.seq_id[self.seq_start[i] : self.seq_start[i + 1]])


@dataclass
class RecurrentTensors:
    """R and S of one recurrent layer with state, float32."""

    section: int
    layer: int
    il: int | None
    r: F32  # (n_cells, *r_shape)
    s: F32  # (n_cells, *s_shape)
    pos: npt.NDArray[np.int32]
    seq_id: npt.NDArray[np.int32]
    seq_start: npt.NDArray[np.int64]
    type_r: str
    type_s: str


@dataclass
class CompressedKTensors:
    """One layer of one stream of a DSV4 compressed K cache (``part`` "csa", "hca" or "lid", the lightning
    indexer), float32. Row ``r`` is the compression of the tokens ``[r * ratio, (r + 1) * ratio)``."""

    section: int
    part: str
    stream: int
    layer: int
    il: int  # the model layer (the file records it)
    ratio: int
    k: F32  # (n_rows, n_head_kv, head_dim): csa / hca the layer's K heads, lid one head of indexer_head_size
    row: npt.NDArray[np.int32]  # (n_rows,): the compressed row index
    type_k: str
    unrotated_k: bool = False


@dataclass
class CompStateTensors:
    """One layer of one stream of a DSV4 compressor state (``part`` "csa", "hca" or "lid"): its f32 ``kv`` and
    ``score`` planes, ``(state_size, n_embd_state)`` each."""

    section: int
    part: str
    stream: int
    layer: int
    il: int
    ratio: int
    kv: F32
    score: F32


@dataclass
class Tensors:
    """Every tensor of a state or memory: ``kv`` and ``recurrent`` entries in write order; a DSV4 state's raw
    K-only sections are ``kv`` entries (``v`` None), its compressed K caches ``compressed`` and its compressor
    states ``comp_states``."""

    kv: list[KVTensors] = field(default_factory=list)
    recurrent: list[RecurrentTensors] = field(default_factory=list)
    compressed: list[CompressedKTensors] = field(default_factory=list)
    comp_states: list[CompStateTensors] = field(default_factory=list)

    def __iter__(self) -> Iterator[KVTensors | RecurrentTensors | CompressedKTensors | CompStateTensors]:
        yield from self.kv
        yield from self.recurrent
        yield from self.compressed
        yield from self.comp_states


# ------------------------------------------------------------------------------------------- model facts
@dataclass
class _KVShape:
    """What kvref knows of one KV section's layers: model layer ids, head sizes, rotation."""

    il: list[int] | None = None
    head_k: list[int] | None = None
    head_v: list[int] | None = None
    rot_k: bool | None = None  # None: unknown
    rot_v: bool | None = None
    heads: tuple[int, int, int, int] | None = None  # n_embd_head_k_all, layer-0 K head, the same for V

    def rotates(self, which: str, t: int) -> bool | None:
        """Would llama.cpp rotate ``which`` ("k"/"v") rows of type ``t`` in this section? None: head size unknown."""
        if self.heads is None:
            return None
        h_all, h0 = self.heads[:2] if which == "k" else self.heads[2:]
        return rot.attn_rot(t, h_all, h0, disabled=False)


def recurrent_shapes(hp: HParams) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The per-cell shape of R and S for ``hp``'s arch (table in the module doc), or None when kvref does not
    know it (the rows then stay flat)."""
    arch = hp.arch
    d_conv, d_inner, d_state = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state
    if arch in ("mamba", "jamba"):  # jamba's recurrent layers are Mamba-1 blocks
        return (d_inner, d_conv - 1), (d_inner, d_state)
    if arch == "mamba2" and hp.ssm_dt_rank > 0:
        n_head = hp.ssm_dt_rank
        return (d_inner + 2 * hp.ssm_n_group * d_state, d_conv - 1), (n_head, d_inner // n_head, d_state)
    if arch in ("rwkv6", "rwkv6qwen2") and hp.wkv_head_size > 0:
        hs = hp.wkv_head_size
        return (hp.token_shift_count, hp.n_embd), (hp.n_embd // hs, hs, hs)
    return None


def _model_leaves(hp: HParams, layout: str) -> list[LeafMemory] | None:
    """The single-section memories llama.cpp builds for ``hp`` whose sections make ``layout`` (None if unknown)."""
    from ..memory.factory import create_memory
    from .restore import PARTIAL_ONLY, leaf_caches, memory_layout

    full, partial = memory_layout(hp)
    if full in ("msa", "dsa") and layout == "iswa":
        layout = full  # the same two KV sections: a file without an arch string reads as iswa
    flags = PARTIAL_ONLY if layout == partial and layout != full else 0
    if layout not in (full, partial):
        return None
    try:
        mem = create_memory(hp, n_ctx=256, n_seq_max=1, flash_attn=True, type_k="f16", type_v="f16")
    except KVRefError:
        return None
    return None if mem is None else leaf_caches(cast("AnyMemory", mem), flags)  # create_memory builds one


def _hparams(hparams: HParams | None, model: ModelSource | None) -> HParams | None:
    if hparams is not None or model is None:
        return hparams
    from ..hparams import HParams

    return model if isinstance(model, HParams) else HParams.from_gguf(os.fspath(model))


def _era_rotates(obj: StateObject) -> bool:
    from ..state.eras import matching_eras

    eras = matching_eras(obj) if hasattr(obj, "kind") else []
    return any(era_rotates(e) for e in eras) or not eras


# ------------------------------------------------------------------------------------------- rows -> arrays
def _rows_f32(rows: LayerRows | TransposedRows) -> F32:
    """A LayerRows / TransposedRows -> (n_cells, n_embd) float32."""
    from ..state import TransposedRows

    if isinstance(rows, TransposedRows):
        n_cells = rows.data.shape[1] // max(rows.el_size, 1) if rows.data.ndim == 2 else 0
        flat = dequantize(np.asarray(rows.data).reshape(rows.n_embd, n_cells * rows.el_size), rows.type)
        return np.ascontiguousarray(flat.T)
    return dequantize(np.asarray(rows.data), rows.type)


def _heads(x: F32, head: int | None) -> F32:
    n = x.shape[1]
    if head is None or head <= 0 or n % head:
        return x.reshape(x.shape[0], 1, n)
    return x.reshape(x.shape[0], n // head, head)


def _maybe_unrotate(x: F32, t: int, head: int | None, rotated: bool | None, n_rot: int | None,
                    what: str, unrotate: bool) -> tuple[F32, bool]:  # fmt: skip
    if not unrotate or (not traits(t).is_quantized and not rotated):  # a DSA indexer's f16 K may be rotated
        return x, False
    if rotated is None:
        if x.shape[1] % 64:
            return x, False  # no head size that divides the row is a multiple of 64: never rotated
        raise KVRefError(
            f"{what} rows are {type_name(t)} and may hold llama.cpp's attention rotation (a head size multiple of "
            "64): pass model= / hparams= (--model M.gguf) or head_dim= (--head-dim N) so kvref can undo it, or "
            "unrotate=False (--no-unrotate)"
        )
    if not rotated:
        return x, False
    if n_rot is None or head is None:  # the model given has fewer layers than the state: not the state's model
        raise FormatError(
            f"{what} rows of a layer the model has no head size for: the state has more layers than the model given "
            "(its model is another one)",
            field="n_layer",
        )
    if x.shape[1] % n_rot:  # the model's head size is not the one the state's rows were written with
        raise FormatError(
            f"{what} rows of {x.shape[1]} values are not whole {n_rot}-element rotation blocks of heads of {head}: "
            "the model given is not the state's (another head size)",
            field="k_row_size" if what == "K" else "v_row_size",
        )
    return rot.rotate(x, n_rot), True


def _fitting_leaves(obj: StateObject, hp: HParams) -> list[LeafMemory]:
    """The memories ``hp``'s model builds for ``obj``'s sections, or a KVRefError unless the model could have
    written ``obj``: its arch (when the file names one), the memory layout and each section's layer count. Head
    sizes, layer ids and R/S shapes come from the model, so a wrong one would label every tensor wrongly."""
    from .restore import memory_layout

    why = None
    arch = getattr(obj, "arch", None)
    leaves = _model_leaves(hp, obj.memory.layout)
    if arch and arch != hp.arch:
        why = f"the file was written by a {arch!r} model, the model given is {hp.arch!r}"
    elif leaves is None or len(leaves) != len(obj.memory.sections):
        why = f"the file holds a {obj.memory.layout} memory, a {hp.arch!r} model builds a {memory_layout(hp)[0]} one"
    else:
        for i, (sec, leaf) in enumerate(zip(obj.memory.sections, leaves, strict=True)):
            if sec.kind == "kv":
                n = next((st.data.n_layer for st in cast("KVSection", sec).streams if st.data is not None), None)
            else:
                n = len(cast("RecurrentSection", sec).r)
            want = len(cast("KVCache | RecurrentMemory", leaf).layers)
            if n is not None and n != want:
                why = f"section {i} holds {n} layers, the model's {sec.kind} cache {want}"
                break
    if why is not None or leaves is None:
        raise KVRefError(f"the model does not fit this state: {why}. Give the model that wrote it (--model), or "
                         "none (layers are then numbered within their section and rows stay flat)")  # fmt: skip
    return leaves


def section_layer_ids(obj: StateObject, hp: HParams) -> list[list[int]]:
    """Per section of ``obj.memory``, the model layer (``il``) of each of its layers, as the memory llama.cpp builds
    for ``hp`` holds them (a KVRefError when the model could not have written the state)."""
    from ..memory.kv_cache import KVCache

    if obj.memory.layout == "dsv4":  # the parts as `kvref inspect` lists them (kvref.state.summary)
        dsec = cast("DSV4Section", obj.memory.sections[0])
        mem = _dsv4_model(hp)
        assert mem is not None
        raw = [mem.raw.swa] if dsec.partial else [mem.raw.base, mem.raw.swa]
        ks = [[layer.il for layer in c.layers] for c in mem.comp_caches[: len(dsec.k_caches)]]
        states = [list(st.layer_ids) for st in mem.comp_states]
        got = [[il for il, _ in k.layers] for k in dsec.k_caches] + [[il for il, _, _ in c.layers] for c in dsec.states]
        if got != ks + states:
            raise KVRefError(f"the model does not fit this state: its compressed layers are {ks + states}, the "
                             f"file's {got}. Give the model that wrote it (--model), or none")  # fmt: skip
        return [[layer.il for layer in c.layers] for c in raw] + ks + states
    leaves = _fitting_leaves(obj, hp)
    return [[layer.il for layer in leaf.layers] if isinstance(leaf, KVCache) else list(leaf.layers) for leaf in leaves]


def _section_shapes(
    obj: StateObject, hp: HParams | None, head_dim: int | None, rotated: bool | None,
    leaves: list[LeafMemory] | None = None,
) -> list[_KVShape | None]:  # fmt: skip
    """Per section of ``obj.memory``: its _KVShape (None for recurrent sections). ``leaves``: the model's memories
    for the sections, when the caller has them (else built here from ``hp``)."""
    mem = obj.memory
    era_rot = _era_rotates(obj) if rotated is None else rotated
    if leaves is None and hp is not None:
        leaves = _model_leaves(hp, mem.layout)
    if leaves is not None and [getattr(c, "kind", "") for c in leaves] != [s.kind for s in mem.sections]:
        leaves = None
    out: list[_KVShape | None] = []
    for i, sec in enumerate(mem.sections):
        if sec.kind != "kv":
            out.append(None)
            continue
        kv = cast("KVSection", sec)
        data = next((st.data for st in kv.streams if st.data is not None and st.data.k), None)
        shape = _KVShape()
        forced_k = False  # llama.cpp rotates a DeepSeek lightning indexer's K whatever its type
        if leaves is not None and hp is not None:
            leaf = cast("KVCache", leaves[i])  # the model's memory has a KV cache where the file has a KV section
            forced_k = leaf.attn_rot_k  # an f16 cache (_model_leaves): rotated only when forced
            lhp = leaf.hparams  # the cache's own (an MSA indexer cache has one head of the indexer key length)
            shape.il = [layer.il for layer in leaf.layers]
            shape.head_k = [lhp.n_embd_head_k_l(il) for il in shape.il]
            shape.head_v = [lhp.n_embd_head_v_l(il) for il in shape.il]
            hk0, hv0 = lhp.n_embd_head_k_l(0), lhp.n_embd_head_v_l(0)
            hk_all = rot.shared_head_size(shape.head_k)
            hv_all = 0 if lhp.is_mla() else rot.shared_head_size(shape.head_v)
        elif head_dim is not None:
            n = 0 if data is None else len(data.k)
            shape.head_k = shape.head_v = [int(head_dim)] * n
            hk0 = hv0 = hk_all = hv_all = int(head_dim)
        else:
            out.append(shape)
            continue
        shape.heads = (hk_all, hk0, hv_all, hv0)
        if data is not None:
            shape.rot_k = bool(era_rot) and (forced_k or rot.attn_rot(data.k[0].type, hk_all, hk0, disabled=False))
            if data.v:
                shape.rot_v = bool(era_rot) and rot.attn_rot(data.v[0].type, hv_all, hv0, disabled=False)
        out.append(shape)
    return out


def _kv_entries(sec: KVSection, si: int, shape: _KVShape, unrotate: bool, cells_idx: list[npt.NDArray[np.int64]] | None,
                progress: Progress | None = None) -> list[KVTensors]:  # fmt: skip
    out = []
    for s, st in enumerate(sec.streams):
        if st.cells is None or st.data is None:
            continue
        c = st.cells
        idx = cells_idx[s] if cells_idx is not None else np.arange(c.n, dtype=np.int64)
        d = st.data
        for li, krows in enumerate(d.k):
            hk = shape.head_k[li] if shape.head_k and li < len(shape.head_k) else None
            hv = shape.head_v[li] if shape.head_v and li < len(shape.head_v) else None
            k = _rows_f32(krows)
            nk = rot.k_rot_size(hk) if hk else None
            k, uk = _maybe_unrotate(k, krows.type, hk, shape.rot_k, nk, "K", unrotate)
            v = None
            uv = False
            vtype = None
            if li < len(d.v):
                vrows = d.v[li]
                vtype = type_name(vrows.type)
                vf = _rows_f32(vrows)
                if hv is not None and hk is not None and vf.shape[1] > 0 and shape.head_v is not None:
                    n_head = k.shape[1] // hk if hk else 1
                    vf = vf[:, : n_head * hv]  # a transposed V is padded to n_embd_v_gqa_max
                vf, uv = _maybe_unrotate(vf, vrows.type, hv, shape.rot_v, rot.V_ROT_SIZE, "V", unrotate)
                v = _heads(vf, hv)
            out.append(KVTensors(
                si, s, li, shape.il[li] if shape.il and li < len(shape.il) else None, _heads(k, hk), v,
                np.asarray(c.pos, np.int32), np.asarray(c.seq_id, np.int32), np.asarray(c.seq_start, np.int64),
                idx, type_name(krows.type), vtype, uk, uv,
            ))  # fmt: skip
            if progress is not None:
                progress.update(k.nbytes + (0 if v is None else v.nbytes))
    return out


def _recurrent_entries(
    sec: RecurrentSection, si: int, hp: HParams | None, il: list[int] | None
) -> list[RecurrentTensors]:
    shapes = recurrent_shapes(hp) if hp is not None else None
    out = []
    c = sec.cells
    for li, rl in enumerate(sec.r):
        r = dequantize(np.asarray(rl.data), rl.type)
        s = _rows_f32(sec.s[li])
        if shapes is not None and r.shape[1] == int(np.prod(shapes[0])) and s.shape[1] == int(np.prod(shapes[1])):
            r = r.reshape(r.shape[0], *shapes[0])
            s = s.reshape(s.shape[0], *shapes[1])
        out.append(RecurrentTensors(
            si, li, il[li] if il and li < len(il) else None, r, s, np.asarray(c.pos, np.int32),
            np.asarray(c.seq_id, np.int32), np.asarray(c.seq_start, np.int64), type_name(rl.type),
            type_name(sec.s[li].type),
        ))  # fmt: skip
    return out


def state_tensors(
    obj: StateSource, *, hparams: HParams | None = None, model: ModelSource | None = None,
    head_dim: int | None = None, unrotate: bool = True, rotated: bool | None = None, progress: Progress | None = None,
) -> Tensors:  # fmt: skip
    """The tensors of a loaded state (``kvref.state`` object, or a path / bytes to load). ``rotated``: force the
    answer to "did llama.cpp rotate these rows" (default: its rule, for the file's era)."""
    from .. import state

    if not isinstance(obj, state.StateObject):
        obj = state.load(obj)
    hp = _hparams(hparams, model)
    if obj.memory.layout == "dsv4":
        (dsec,) = obj.memory.sections
        era_rot = _era_rotates(obj) if rotated is None else rotated
        return _dsv4_tensors(cast("DSV4Section", dsec), _dsv4_model(hp), head_dim, era_rot, unrotate, None, progress)
    leaves = _fitting_leaves(obj, hp) if hp is not None else None
    shapes = _section_shapes(obj, hp, head_dim, rotated, leaves)
    out = Tensors()
    rec_il = None
    for leaf in leaves or []:
        if getattr(leaf, "kind", "") == "recurrent":
            rec_il = list(cast("RecurrentMemory", leaf).layers)
    for si, sec in enumerate(obj.memory.sections):
        shape = shapes[si]
        if shape is not None:  # a KV section (_section_shapes)
            out.kv.extend(_kv_entries(cast("KVSection", sec), si, shape, unrotate, None, progress))
        else:
            out.recurrent.extend(_recurrent_entries(cast("RecurrentSection", sec), si, hp, rec_il))
    return out


def memory_tensors(mem: AnyMemory, *, unrotate: bool = True) -> Tensors:
    """The tensors of a memory's used cells (KVCache, RecurrentMemory, iSWA, hybrid); rotation per the caches'
    `attn_rot_k` / `attn_rot_v`."""
    from ..memory.kv_cache import KVCache
    from ..memory.kv_state import written_cells
    from .restore import leaf_caches

    if getattr(mem, "kind", "") == "dsv4":
        dsv4 = cast("KVCacheDSV4", mem)
        (dsec,) = dsv4.state_sections(-1)
        raw = [dsv4.raw.swa] if dsec.partial else [dsv4.raw.base, dsv4.raw.swa]
        raw_idx = [[written_cells(c, s, -1).astype(np.int64) for s in range(c.n_stream)] for c in raw]
        return _dsv4_tensors(dsec, dsv4, None, dsv4.profile.attn_rotation, unrotate, raw_idx)
    out = Tensors()
    for si, leaf in enumerate(leaf_caches(mem)):
        (sec,) = leaf.state_sections(-1)
        hp = leaf.hparams
        if isinstance(leaf, KVCache):
            il = [layer.il for layer in leaf.layers]
            shape = _KVShape(il, [hp.n_embd_head_k_l(i) for i in il], [hp.n_embd_head_v_l(i) for i in il],
                             leaf.attn_rot_k, leaf.attn_rot_v)  # fmt: skip
            idx = [written_cells(leaf, s, -1).astype(np.int64) for s in range(leaf.n_stream)]
            out.kv.extend(_kv_entries(cast("KVSection", sec), si, shape, unrotate, idx))  # a KVCache's section
        else:
            out.recurrent.extend(_recurrent_entries(cast("RecurrentSection", sec), si, hp, list(leaf.layers)))
    return out


# ------------------------------------------------------------------------------------------- DSV4
def _dsv4_model(hp: HParams | None) -> KVCacheDSV4 | None:
    """The llama_kv_cache_dsv4 ``hp``'s model builds (its parts' layers and head sizes), None without a model."""
    if hp is None:
        return None
    from ..memory.factory import create_memory
    from ..memory.kv_cache_dsv4 import KVCacheDSV4

    if hp.arch != "deepseek4":
        raise KVRefError(f"the model does not fit this state: the file holds a dsv4 memory, a {hp.arch!r} model "
                         "builds another. Give the model that wrote it (--model), or none")  # fmt: skip
    mem = create_memory(hp, n_ctx=256, n_seq_max=1, flash_attn=True, type_k="f16", type_v="f16")
    if not isinstance(mem, KVCacheDSV4):  # pragma: no cover - create_memory builds one for deepseek4
        raise KVRefError("the model's memory is not a llama_kv_cache_dsv4")
    return mem


def _dsv4_tensors(
    sec: DSV4Section, mem: KVCacheDSV4 | None, head_dim: int | None, era_rot: bool, unrotate: bool,
    cells_idx: list[list[npt.NDArray[np.int64]]] | None, progress: Progress | None = None,
) -> Tensors:  # fmt: skip
    """The tensors of a DSV4 section (kvref.state.dsv4), numbered as `kvref inspect` lists its parts: the raw
    iSWA KV sections (base then SWA; SWA only when partial), the compressed K caches (none when partial), the
    compressor states. ``mem``: the model's memory (layer ids, head sizes), or None (``head_dim`` for the raw
    and CSA / HCA K heads, else flat rows)."""
    from ..state.dsv4 import COMP_PARTS

    out = Tensors()
    si = 0
    raw_caches = [] if mem is None else ([mem.raw.swa] if sec.partial else [mem.raw.base, mem.raw.swa])
    for ri, rsec in enumerate(sec.raw):
        shape = _KVShape()
        data = next((st.data for st in rsec.streams if st.data is not None and st.data.k), None)
        n = 0 if data is None else len(data.k)
        if raw_caches:
            cache = raw_caches[ri]
            if n and n != len(cache.layers):
                raise KVRefError(f"the model does not fit this state: raw section {ri} holds {n} layers, the model's "
                                 f"{len(cache.layers)}. Give the model that wrote it (--model), or none")  # fmt: skip
            lhp = cache.hparams
            shape.il = [layer.il for layer in cache.layers]
            shape.head_k = shape.head_v = [lhp.n_embd_head_k_l(il) for il in shape.il]
            h_all, h0 = rot.shared_head_size(shape.head_k), lhp.n_embd_head_k_l(0)
        elif head_dim is not None:
            shape.head_k = shape.head_v = [int(head_dim)] * n
            h_all = h0 = int(head_dim)
        else:
            h_all = h0 = 0
        if h_all and data is not None:
            shape.heads = (h_all, h0, 0, 0)
            shape.rot_k = era_rot and rot.attn_rot(data.k[0].type, h_all, h0, disabled=False)
        idx = None if cells_idx is None else cells_idx[ri]
        out.kv.extend(_kv_entries(rsec, si, shape, unrotate, idx, progress))
        si += 1
    ratios = dict(COMP_PARTS)
    comp = [] if mem is None else mem.comp_caches
    for ki, ks in enumerate(sec.k_caches):
        ccache = comp[ki] if comp else None
        for li, (il, t) in enumerate(ks.layers):
            x = dequantize(np.asarray(t.data).reshape(ks.n_stream * t.rows, t.row_size), t.type) if t.rows else (
                np.zeros((0, t.ne0), np.float32))  # fmt: skip
            x = x.reshape(ks.n_stream, t.rows, t.ne0)
            if ccache is not None:
                head: int | None = ccache.hparams.n_embd_head_k_l(il)
                h_all = rot.shared_head_size([ccache.hparams.n_embd_head_k_l(layer.il) for layer in ccache.layers])
            elif ks.name == "lid":
                head = h_all = int(t.ne0)  # one head of the indexer key length
            else:
                head = None if head_dim is None else int(head_dim)
                h_all = head or 0
            if ks.name == "lid":  # llama.cpp always rotates a DeepSeek indexer cache's K, whatever its type
                rotated: bool | None = era_rot
            elif head is None:
                rotated = None
            else:
                rotated = era_rot and rot.attn_rot(t.type, h_all, head, disabled=False)
            for s in range(ks.n_stream):
                k = x[s]
                nk = rot.k_rot_size(h_all) if h_all and h_all > 0 else None
                if ks.name == "lid" and unrotate and rotated and nk is not None and not traits(t.type).is_quantized:
                    k, uk = rot.rotate(k, nk), True
                else:
                    k, uk = _maybe_unrotate(k, t.type, head, rotated, nk, "K", unrotate)
                out.compressed.append(CompressedKTensors(
                    si, ks.name, s, li, int(il), ratios[ks.name], _heads(np.ascontiguousarray(k), head),
                    np.arange(t.rows, dtype=np.int32), type_name(t.type), uk,
                ))  # fmt: skip
                if progress is not None:
                    progress.update(k.nbytes)
        si += 1
    for cs in sec.states:
        for li, (il, kv, sc) in enumerate(cs.layers):
            planes = [
                np.asarray(p.data).view(np.float32).reshape(cs.n_stream, p.rows, p.ne0) if p.rows
                else np.zeros((cs.n_stream, 0, p.ne0), np.float32)
                for p in (kv, sc)
            ]  # fmt: skip
            for s in range(cs.n_stream):
                out.comp_states.append(CompStateTensors(
                    si, cs.name, s, li, int(il), cs.ratio, planes[0][s].copy(), planes[1][s].copy(),
                ))  # fmt: skip
        si += 1
    return out


# ------------------------------------------------------------------------------------------- arrays -> rows
def encode_rows(x: npt.ArrayLike, t: GGMLType | int | str, *, rotate_n: int | None = None) -> npt.NDArray[np.uint8]:
    """Float rows ``(n_cells, n_embd)`` (or ``(n_cells, n_head, head_dim)``) -> raw rows of type ``t``, rotated
    first with ``H_{rotate_n}`` when given (what llama.cpp stores for a rotating cache)."""
    x = np.asarray(x, np.float32)
    x = x.reshape(x.shape[0], -1)
    if rotate_n:
        x = rot.rotate(x, rotate_n)
    return quantize(x, t)


__all__ = [
    "CompStateTensors",
    "CompressedKTensors",
    "KVTensors",
    "RecurrentTensors",
    "Tensors",
    "encode_rows",
    "era_rotates",
    "memory_tensors",
    "recurrent_shapes",
    "section_layer_ids",
    "state_tensors",
]
