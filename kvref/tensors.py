"""K, V, R and S as float32 NumPy arrays in their model shape, from a loaded state or from a memory.

::

    ts = kvref.tensors.state_tensors(kvref.state.load("slot0.bin"), hparams=hp)   # or head_dim=128
    for t in ts.kv:                        # one KVTensors per KV section, stream and layer
        t.k, t.v                           # (n_cells, n_head_kv, head_dim) float32, V un-transposed
        t.pos, t.seq_ids(i), t.il          # the cells' positions and sequence ids; the model layer
    for t in ts.recurrent:                 # one RecurrentTensors per recurrent layer with state
        t.r, t.s                           # model shape when known (see `recurrent_shapes`), else flat rows
    ts = kvref.tensors.memory_tensors(mem) # the same from a memory (its used cells; ``t.cells`` their indices)

Quantized rows are dequantized (`kvref.quant`). When llama.cpp rotated them (`kvref.rotation`: a quantized type,
a head size multiple of 64, from llama-cpp-python 0.3.36 on; a memory knows, a file does not and the rule is
applied to its era), the rotation is undone unless ``unrotate=False``. A state file does not record the head
size either: pass ``hparams=`` (or ``model=`` a GGUF path), or ``head_dim=``; without them K/V come as
``(n_cells, 1, n_embd_gqa)`` and a file whose rows may be rotated is refused unless ``unrotate=False``.

Layers are numbered by their position in the section (``layer``); ``il`` is the model layer when the model is
known (from the memory llama.cpp would build for it).

Recurrent shapes (read off llama.cpp's graph builders, ``models/mamba-base.cpp``, ``models/rwkv6-base.cpp``,
``llm_graph_context::build_rwkv_token_shift_load`` and ggml-cpu's ``rwkv_wkv6``), NumPy order:

=========== ====================================== =============================================
arch        R (n_embd_r per cell)                  S (n_embd_s per cell)
=========== ====================================== =============================================
mamba       (d_inner, d_conv - 1)                  (d_inner, d_state)
mamba2      (d_inner + 2 n_group d_state, d_conv-1) (n_head, d_inner / n_head, d_state), n_head = dt_rank
rwkv6       (token_shift_count, n_embd)            (n_head, head_size [key], head_size [value])
=========== ====================================== =============================================

Other archs (hybrids included) keep the flat rows ``(n_cells, n_embd_r)`` / ``(n_cells, n_embd_s)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import rotation as rot
from .errors import FormatError, KVRefError
from .ggml import GGMLType, traits, type_name
from .profile import value_at
from .quant import dequantize, quantize


def era_rotates(name: str) -> bool:
    """Does the llama.cpp of era ``name`` (`kvref.eras`) rotate quantized K/V (``Profile.attn_rotation``)?"""
    from .eras import era

    return bool(value_at("attn_rotation", era(name).first))


@dataclass
class KVTensors:
    """K and V of one layer of one stream of one KV section, float32, with the cells they belong to."""

    section: int
    stream: int
    layer: int
    il: int | None
    k: np.ndarray  # (n_cells, n_head_kv, head_dim_k)
    v: np.ndarray | None  # (n_cells, n_head_kv, head_dim_v); None without V (MLA)
    pos: np.ndarray  # (n_cells,) int32
    seq_id: np.ndarray  # int32, every cell's ids one after the other (CSR with seq_start)
    seq_start: np.ndarray  # (n_cells + 1,) int64
    cells: np.ndarray  # (n_cells,) int64: cell indices in the cache (0..n-1 for a file)
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
    r: np.ndarray  # (n_cells, *r_shape)
    s: np.ndarray  # (n_cells, *s_shape)
    pos: np.ndarray
    seq_id: np.ndarray
    seq_start: np.ndarray
    type_r: str
    type_s: str


@dataclass
class Tensors:
    """Every tensor of a state or memory: ``kv`` and ``recurrent`` entries in write order."""

    kv: list[KVTensors] = field(default_factory=list)
    recurrent: list[RecurrentTensors] = field(default_factory=list)

    def __iter__(self) -> Iterator[KVTensors | RecurrentTensors]:
        yield from self.kv
        yield from self.recurrent


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


def recurrent_shapes(hp: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The per-cell shape of R and S for ``hp``'s arch (table in the module doc), or None when kvref does not
    know it (the rows then stay flat)."""
    arch = hp.arch
    d_conv, d_inner, d_state = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state
    if arch == "mamba":
        return (d_inner, d_conv - 1), (d_inner, d_state)
    if arch == "mamba2" and hp.ssm_dt_rank > 0:
        n_head = hp.ssm_dt_rank
        return (d_inner + 2 * hp.ssm_n_group * d_state, d_conv - 1), (n_head, d_inner // n_head, d_state)
    if arch in ("rwkv6", "rwkv6qwen2") and hp.wkv_head_size > 0:
        hs = hp.wkv_head_size
        return (hp.token_shift_count, hp.n_embd), (hp.n_embd // hs, hs, hs)
    return None


def _model_leaves(hp: Any, layout: str) -> list[Any] | None:
    """The single-section memories llama.cpp builds for ``hp`` whose sections make ``layout`` (None if unknown)."""
    from .from_file import PARTIAL_ONLY, leaf_caches, memory_layout
    from .memory import create_memory

    full, partial = memory_layout(hp)
    flags = PARTIAL_ONLY if layout == partial and layout != full else 0
    if layout not in (full, partial):
        return None
    try:
        mem = create_memory(hp, n_ctx=256, n_seq_max=1, flash_attn=True, type_k="f16", type_v="f16")
    except KVRefError:
        return None
    return None if mem is None else leaf_caches(mem, flags)


def _hparams(hparams: Any, model: Any) -> Any:
    if hparams is not None or model is None:
        return hparams
    from .hparams import HParams

    return model if isinstance(model, HParams) else HParams.from_gguf(os.fspath(model))


def _era_rotates(obj: Any) -> bool:
    from .eras import matching_eras

    eras = matching_eras(obj) if hasattr(obj, "kind") else []
    return any(era_rotates(e) for e in eras) or not eras


# ------------------------------------------------------------------------------------------- rows -> arrays
def _rows_f32(rows: Any) -> np.ndarray:
    """A LayerRows / TransposedRows -> (n_cells, n_embd) float32."""
    from .state import TransposedRows

    if isinstance(rows, TransposedRows):
        n_cells = rows.data.shape[1] // max(rows.el_size, 1) if rows.data.ndim == 2 else 0
        flat = dequantize(np.asarray(rows.data).reshape(rows.n_embd, n_cells * rows.el_size), rows.type)
        return np.ascontiguousarray(flat.T)
    return dequantize(np.asarray(rows.data), rows.type)


def _heads(x: np.ndarray, head: int | None) -> np.ndarray:
    n = x.shape[1]
    if head is None or head <= 0 or n % head:
        return x.reshape(x.shape[0], 1, n)
    return x.reshape(x.shape[0], n // head, head)


def _maybe_unrotate(x: np.ndarray, t: int, head: int | None, rotated: bool | None, n_rot: int | None,
                    what: str, unrotate: bool) -> tuple[np.ndarray, bool]:  # fmt: skip
    if not unrotate or not traits(t).is_quantized:
        return x, False
    if rotated is None:
        if x.shape[1] % 64:
            return x, False  # no head size that divides the row is a multiple of 64: never rotated
        raise KVRefError(
            f"{what} rows are {type_name(t)} and may hold llama.cpp's attention rotation (a head size multiple of "
            "64): pass hparams= / model= (or head_dim=) so kvref can undo it, or unrotate=False"
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


def _section_shapes(obj: Any, hp: Any, head_dim: int | None, rotated: bool | None) -> list[_KVShape | None]:
    """Per section of ``obj.memory``: its _KVShape (None for recurrent sections)."""
    mem = obj.memory
    era_rot = _era_rotates(obj) if rotated is None else rotated
    leaves = _model_leaves(hp, mem.layout) if hp is not None else None
    if leaves is not None and [getattr(c, "kind", "") for c in leaves] != [s.kind for s in mem.sections]:
        leaves = None
    out: list[_KVShape | None] = []
    for i, sec in enumerate(mem.sections):
        if sec.kind != "kv":
            out.append(None)
            continue
        data = next((st.data for st in sec.streams if st.data is not None and st.data.k), None)
        shape = _KVShape()
        if leaves is not None:
            leaf = leaves[i]
            shape.il = [layer.il for layer in leaf.layers]
            shape.head_k = [hp.n_embd_head_k_l(il) for il in shape.il]
            shape.head_v = [hp.n_embd_head_v_l(il) for il in shape.il]
            hk0, hv0 = hp.n_embd_head_k_l(0), hp.n_embd_head_v_l(0)
            hk_all = rot.shared_head_size(shape.head_k)
            hv_all = 0 if hp.is_mla() else rot.shared_head_size(shape.head_v)
        elif head_dim is not None:
            n = 0 if data is None else len(data.k)
            shape.head_k = shape.head_v = [int(head_dim)] * n
            hk0 = hv0 = hk_all = hv_all = int(head_dim)
        else:
            out.append(shape)
            continue
        shape.heads = (hk_all, hk0, hv_all, hv0)
        if data is not None:
            shape.rot_k = bool(era_rot) and rot.attn_rot(data.k[0].type, hk_all, hk0, disabled=False)
            if data.v:
                shape.rot_v = bool(era_rot) and rot.attn_rot(data.v[0].type, hv_all, hv0, disabled=False)
        out.append(shape)
    return out


def _kv_entries(sec: Any, si: int, shape: _KVShape, unrotate: bool, cells_idx: list[np.ndarray] | None,
                progress: Any = None) -> list[KVTensors]:  # fmt: skip
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


def _recurrent_entries(sec: Any, si: int, hp: Any, il: list[int] | None) -> list[RecurrentTensors]:
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
    obj: Any, *, hparams: Any = None, model: Any = None, head_dim: int | None = None, unrotate: bool = True,
    rotated: bool | None = None, progress: Any = None,
) -> Tensors:  # fmt: skip
    """The tensors of a loaded state (``kvref.state`` object, or a path / bytes to load). ``rotated``: force the
    answer to "did llama.cpp rotate these rows" (default: its rule, for the file's era)."""
    from . import state

    if not isinstance(obj, state.StateObject):
        obj = state.load(obj)
    hp = _hparams(hparams, model)
    shapes = _section_shapes(obj, hp, head_dim, rotated)
    out = Tensors()
    rec_il = None
    if hp is not None:
        leaves = _model_leaves(hp, obj.memory.layout)
        for leaf in leaves or []:
            if getattr(leaf, "kind", "") == "recurrent":
                rec_il = list(leaf.layers)
    for si, sec in enumerate(obj.memory.sections):
        shape = shapes[si]
        if shape is not None:
            out.kv.extend(_kv_entries(sec, si, shape, unrotate, None, progress))
        else:
            out.recurrent.extend(_recurrent_entries(sec, si, hp, rec_il))
    return out


def memory_tensors(mem: Any, *, unrotate: bool = True) -> Tensors:
    """The tensors of a memory's used cells (KVCache, RecurrentMemory, iSWA, hybrid); rotation per the caches'
    `attn_rot_k` / `attn_rot_v`."""
    from .from_file import leaf_caches
    from .kv_cache import KVCache
    from .kv_state import written_cells

    out = Tensors()
    for si, leaf in enumerate(leaf_caches(mem)):
        (sec,) = leaf.state_sections(-1)
        hp = leaf.hparams
        if isinstance(leaf, KVCache):
            il = [layer.il for layer in leaf.layers]
            shape = _KVShape(il, [hp.n_embd_head_k_l(i) for i in il], [hp.n_embd_head_v_l(i) for i in il],
                             leaf.attn_rot_k, leaf.attn_rot_v)  # fmt: skip
            idx = [written_cells(leaf, s, -1).astype(np.int64) for s in range(leaf.n_stream)]
            out.kv.extend(_kv_entries(sec, si, shape, unrotate, idx))
        else:
            out.recurrent.extend(_recurrent_entries(sec, si, hp, list(leaf.layers)))
    return out


# ------------------------------------------------------------------------------------------- arrays -> rows
def encode_rows(x: np.ndarray, t: GGMLType | int | str, *, rotate_n: int | None = None) -> np.ndarray:
    """Float rows ``(n_cells, n_embd)`` (or ``(n_cells, n_head, head_dim)``) -> raw rows of type ``t``, rotated
    first with ``H_{rotate_n}`` when given (what llama.cpp stores for a rotating cache)."""
    x = np.asarray(x, np.float32)
    x = x.reshape(x.shape[0], -1)
    if rotate_n:
        x = rot.rotate(x, rotate_n)
    return quantize(x, t)


__all__ = [
    "KVTensors",
    "RecurrentTensors",
    "Tensors",
    "encode_rows",
    "era_rotates",
    "memory_tensors",
    "recurrent_shapes",
    "state_tensors",
]
