"""Retype the K/V rows of a state (``kvref convert --type-k q8_0 --type-v q8_0``), so llama.cpp reads it.

Every KV layer is dequantized (`kvref.ggml.quant`), its attention rotation undone when the input was written with
one and applied when the output's llama.cpp will expect one (`kvref.ggml.rotation`: a quantized type and a head size
multiple of 64, from llama-cpp-python 0.3.36 on), then quantized to the new type. A layer whose type and rotation
do not change keeps its bytes. The head size comes from the model (``model=`` / ``hparams=``) or ``head_dim=``;
it is needed only when a rotation may apply (rows a multiple of 64 values with a quantized type on either side).

Quantized V needs V stored row-wise (``v_trans`` 0, flash attention on): a transposed-V file is refused for a
quantized ``type_v``. iq4_nl can be read but not written (`kvref.ggml.quant`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..errors import ConversionError
from ..ggml import rotation as rot
from ..ggml.quant import QuantError, can_quantize, dequantize, quantize
from ..ggml.types import GGMLType, ggml_type, row_size, traits, type_name
from .progress import Progress

if TYPE_CHECKING:
    from ..ggml.types import TypeLike
    from ..hparams import HParams
    from ..state import KVSection, StateObject
    from .tensors import _KVShape


def _check_target(t: TypeLike | None, what: str) -> GGMLType | None:
    if t is None:
        return None
    gt = ggml_type(t)
    if not can_quantize(gt):
        raise QuantError(f"cannot retype {what} to {type_name(gt)}: kvref writes f32, f16, bf16, q8_0, q4_0, q4_1, "
                         "q5_0 and q5_1")  # fmt: skip
    return gt


def _rows_bytes(obj: StateObject) -> int:
    return sum(
        int(r.data.nbytes)
        for sec in obj.memory.kv_sections
        for st in sec.streams
        if st.data is not None
        for r in (*st.data.k, *st.data.v)
    )


def _retype_rows(x_raw: npt.NDArray[np.uint8], src: int, dst: GGMLType, n_rot: int | None, src_rot: bool,
                 dst_rot: bool, what: str) -> npt.NDArray[np.uint8]:  # fmt: skip
    if src == dst and src_rot == dst_rot:
        return x_raw
    x = dequantize(x_raw, src)
    if src_rot or dst_rot:
        if n_rot is None:
            raise ConversionError(
                f"{what}: retyping {type_name(src)} -> {type_name(dst)} must undo or apply llama.cpp's attention "
                "rotation, which depends on the head size: pass model= (--model M.gguf)"
            )
        if src_rot != dst_rot:
            x = rot.rotate(x, n_rot)
    return quantize(x, dst)


def retype(
    obj: StateObject, *, type_k: TypeLike | None = None, type_v: TypeLike | None = None, src_rotates: bool,
    dst_rotates: bool, hparams: HParams | None = None, head_dim: int | None = None, progress: bool | None = None,
) -> StateObject:  # fmt: skip
    """A copy of the state ``obj`` with its KV rows in ``type_k`` / ``type_v`` (None: unchanged).

    ``src_rotates`` / ``dst_rotates``: does the llama.cpp that wrote / will read the file rotate quantized rows
    (its era, `kvref.jobs.tensors.era_rotates`)? ``progress``: a bar on a terminal (None: when stderr is one)."""
    from ..state import LayerRows, TransposedRows
    from .tensors import _section_shapes

    tk, tv = _check_target(type_k, "K"), _check_target(type_v, "V")
    out = copy.copy(obj)
    out.memory = copy.copy(obj.memory)
    shapes = _section_shapes(obj, hparams, head_dim, src_rotates)
    sections = []
    with Progress(_rows_bytes(obj), "retype", enabled=progress) as bar:
        for si, sec in enumerate(obj.memory.sections):
            shape = shapes[si]
            if shape is None:
                sections.append(sec)
                continue
            kv = cast("KVSection", sec)  # a section with a shape is a KV section
            new_sec = copy.copy(kv)
            new_sec.streams = []
            for s, st in enumerate(kv.streams):
                if st.data is None:
                    new_sec.streams.append(st)
                    continue
                d = copy.copy(st.data)
                d.k, d.v = [], []
                for li, kr in enumerate(st.data.k):
                    dst = tk if tk is not None else GGMLType(kr.type)
                    hk = shape.head_k[li] if shape.head_k else None
                    n_embd = kr.row_size // traits(kr.type).type_size * traits(kr.type).block_size
                    sr, dr = _rot_flags(kr.type, dst, n_embd, src_rotates, dst_rotates, shape, "k")
                    raw = _retype_rows(np.asarray(kr.data), kr.type, dst, rot.k_rot_size(hk) if hk else None, sr, dr,
                                       f"section {si} stream {s} layer {li} K")  # fmt: skip
                    d.k.append(LayerRows(int(dst), row_size(dst, n_embd), raw))
                    bar.update(kr.data.nbytes)
                for li, vr in enumerate(st.data.v):
                    dst = tv if tv is not None else GGMLType(vr.type)
                    where = f"section {si} stream {s} layer {li} V"
                    if isinstance(vr, TransposedRows):
                        if traits(dst).is_quantized:
                            raise ConversionError(
                                f"{where}: the file stores V transposed (flash attention off); llama.cpp keeps a "
                                f"quantized V ({type_name(dst)}) only with flash attention: keep a float type_v"
                            )
                        n_cells = vr.data.shape[1] // vr.el_size if vr.el_size else 0
                        x = np.asarray(vr.data).reshape(vr.n_embd, n_cells * vr.el_size)
                        raw = x if dst == vr.type else quantize(dequantize(x, vr.type), dst)
                        d.v.append(TransposedRows(int(dst), traits(dst).type_size, vr.n_embd, raw))
                    else:
                        n_embd = vr.row_size // traits(vr.type).type_size * traits(vr.type).block_size
                        sr, dr = _rot_flags(vr.type, dst, n_embd, src_rotates, dst_rotates, shape, "v")
                        raw = _retype_rows(np.asarray(vr.data), vr.type, dst, rot.V_ROT_SIZE, sr, dr, where)
                        d.v.append(LayerRows(int(dst), row_size(dst, n_embd), raw))
                    bar.update(vr.data.nbytes)
                new_st = copy.copy(st)
                new_st.data = d
                new_sec.streams.append(new_st)
            sections.append(new_sec)
    out.memory.sections = sections
    return out


def _rot_flags(src: int, dst: GGMLType, n_embd: int, src_era: bool, dst_era: bool, shape: _KVShape,
               which: str) -> tuple[bool, bool]:  # fmt: skip
    """Are the rows rotated now / must they be rotated in the output? Raises when that depends on an unknown head
    size."""

    def rule(t: int, era: bool) -> bool | None:
        if not era or not traits(t).is_quantized or n_embd % 64:
            return False
        return shape.rotates(which, t)

    a, b = rule(src, src_era), rule(int(dst), dst_era)
    if a is None or b is None:
        if src == dst and src_era == dst_era:
            return False, False  # unchanged rows: whatever their rotation, it stays
        raise ConversionError(
            f"retyping {which.upper()} {type_name(src)} -> {type_name(dst)}: whether llama.cpp's attention rotation "
            "applies depends on the head size: pass model= (--model M.gguf)"
        )
    return a, b


__all__ = ["retype"]
