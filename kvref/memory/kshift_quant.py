"""The K-shift of a quantized K cache, as llama.cpp 0.3.36 runs it (``llama_kv_cache::build_rope_shift``).

For a quantized K tensor llama.cpp cannot rope in place. Its shift graph, per layer with rope, on a view of the
whole K tensor (every stream and cell, ``n_rot`` values of each head):

1. ``ggml_cast`` to f32: ggml's ``dequantize_row_*`` (exact: an int times an f16 scale);
2. ``llama_mul_mat_hadamard`` with the cache's K rotation (``attn_inp_k_rot``): undoes the attention rotation
   (the Walsh-Hadamard matrix is its own inverse); on the CPU a fast Walsh-Hadamard transform
   (`kvref.ggml.rotation.fwht`);
3. ``ggml_rope_ext`` on the f32 rows with each cell's shift (`kvref.memory.kshift.rope_f32`, the same arithmetic as
   the float K-shift);
4. the rotation again;
5. ``ggml_cpy`` back into the quantized view: ggml-cpu's ``from_float`` (`kvref.ggml.quant.quantize_cpu`).

Every cell is requantized, empty and unshifted ones too, so a cell whose shift is 0 may still change in the last
bits of its scale or values (two float transforms and a requantization are not the identity).

Where llama.cpp 0.3.36 does not get through the graph, `check_quantized_shift` names why and kvref refuses
(`kvref.errors.KShiftError`) before anything changes:

- no K rotation (``attn_rot_k`` off: a head size that is not a multiple of 64, layers with different head sizes,
  ``LLAMA_ATTN_ROT_DISABLE``): ``build_rope_shift`` hands a null rotation tensor to ``llama_mul_mat_hadamard``,
  which reads its size: a segmentation fault (recorded in ``conformance/crashes/``);
- partial rotary (``n_rot`` below the head size) or MLA heads: the view is not contiguous, and ggml-cpu's copy of
  f32 into a non-contiguous quantized tensor aborts (``GGML_ABORT("not implemented")`` in
  ``ggml_compute_forward_dup_to_q``: recorded for partial rotary, read in the sources for MLA);
- a type kvref cannot quantize (iq4_nl);
- (not quantized, refused by `check_shift_type` too) a bf16 K cache: ggml-cpu's rope has no bf16 kernel and
  aborts (recorded in ``conformance/crashes/``);
- a llama.cpp before 0.3.36 (no rotation; not checked against a real build).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import KShiftError
from ..ggml.quant import can_quantize, dequantize, quantize_cpu
from ..ggml.rotation import fwht, k_rot_size
from ..ggml.types import GGMLType, ggml_type, traits, type_name
from .kshift import GGML_CPU, Positions, RopeKernel, RopeParams, Rows, check_k_rows, rope_f32

if TYPE_CHECKING:
    from ..hparams import HParams
    from ..profile import Profile


class ShiftLayer(Protocol):
    """A layer of a `ShiftCache`: the model layer it holds."""

    @property
    def il(self) -> int: ...


class ShiftCache(Protocol):
    """What the K-shift checks read of a KV cache (a `kvref.memory.kv_cache.KVCache`): its K type, whether
    llama.cpp rotates its K rows, its layers, the model and the llama.cpp profile."""

    @property
    def type_k(self) -> GGMLType: ...
    @property
    def attn_rot_k(self) -> bool: ...
    @property
    def layers(self) -> Sequence[ShiftLayer]: ...
    @property
    def hparams(self) -> HParams: ...
    @property
    def profile(self) -> Profile: ...


def shift_quantized_k_rows(
    buf: Rows,
    type_k: GGMLType | int | str,
    n_head_kv: int,
    n_embd_head_k: int,
    shift: Positions,
    p: RopeParams,
    rot: int,
    kernel: RopeKernel = GGML_CPU,
) -> None:
    """Apply the K-shift in place to one stream-merged quantized K buffer: uint8 ``(n_cells, row bytes)``.

    ``rot``: the size of the cache's K rotation (`kvref.ggml.rotation.k_rot_size`), 0 for none (what llama.cpp
    before the rotation did; kvref does not use it for 0.3.36, where that case crashes). ``kernel``: how the ggml
    build rounds the rope (`kvref.memory.kshift.RopeKernel`); the rope runs on an f32 tensor here."""
    t = ggml_type(type_k)
    n_cells = buf.shape[0]
    check_k_rows(buf, t, n_head_kv, n_embd_head_k, "shift_quantized_k_rows", KShiftError)
    if p.n_dims != n_embd_head_k:
        raise KShiftError(
            f"K-shift of a {type_name(t)} K cache with n_rot {p.n_dims} below the head size {n_embd_head_k}: "
            "llama.cpp aborts (ggml_compute_forward_dup_to_q: not implemented)"
        )
    x = dequantize(buf, t).reshape(n_cells, n_head_kv, n_embd_head_k)
    if rot:
        x = fwht(x, rot)
    y = rope_f32(x, shift, p, kernel=kernel, f32_op=True)
    if rot:
        y = fwht(y, rot)
    buf[...] = quantize_cpu(y.reshape(n_cells, -1), t)


def check_shift_type(cache: ShiftCache) -> int:
    """The K rotation size the K-shift of ``cache`` uses (0 for a float K cache), or `KShiftError` naming why
    llama.cpp does not shift a K cache of this type. Changes nothing."""
    if cache.type_k == GGMLType.BF16:
        # ggml-cpu's rope has f32 and f16 kernels only; a bf16 K view is roped in place (it is not quantized)
        raise KShiftError(
            "K-shift of a bf16 K cache: ggml-cpu's rope has no bf16 kernel and llama.cpp aborts (GGML_ABORT "
            "'fatal error' in ggml_compute_forward_rope); use an f16 or f32 K cache to shift, or do not shift "
            f"(type_k bf16, llama.cpp profile {cache.profile.name})"
        )
    return check_quantized_shift(cache) if traits(cache.type_k).is_quantized else 0


def check_quantized_shift(cache: ShiftCache) -> int:
    """The K rotation size ``cache``'s quantized K-shift uses, or `KShiftError` naming why llama.cpp does
    not shift this cache (see the module doc). Changes nothing."""
    hp = cache.hparams
    t = cache.type_k
    layers = [layer.il for layer in cache.layers if hp.has_rope(layer.il) or not cache.profile.kshift_skips_nope]
    config = (
        f"type_k {type_name(t)}, head size {sorted({hp.n_embd_head_k_l(il) for il in layers}) or '-'}, "
        f"n_rot {sorted({hp.n_rot_l(il) for il in layers}) or '-'}, llama.cpp profile {cache.profile.name}"
    )
    if not cache.profile.attn_rotation:
        raise KShiftError(
            f"K-shift of a quantized K cache is modelled for llama-cpp-python 0.3.36 and later only ({config})"
        )
    if not cache.attn_rot_k:
        raise KShiftError(
            "K-shift of a quantized K cache without the attention rotation (attn_rot_k off: the head size is not a "
            "multiple of 64, the layers' head sizes differ, or LLAMA_ATTN_ROT_DISABLE is set): llama.cpp 0.3.36 "
            "crashes (segmentation fault in llama_kv_cache::build_rope_shift, which multiplies by the missing "
            f"rotation matrix); {config}"
        )
    for il in layers:
        if hp.n_rot_l(il) != hp.n_embd_head_k_l(il) or hp.n_lora_kv > 0:
            raise KShiftError(
                f"K-shift of a quantized K cache where layer {il} ropes {hp.n_rot_l(il)} of "
                f"{hp.n_embd_head_k_l(il)} values per head: the shifted view is not contiguous and llama.cpp "
                f"0.3.36 aborts (GGML_ABORT 'not implemented' in ggml_compute_forward_dup_to_q); {config}"
            )
    if not can_quantize(t):
        raise KShiftError(f"K-shift of a {type_name(t)} K cache: kvref cannot quantize {type_name(t)}; {config}")
    return k_rot_size(hp.n_embd_head_k_l(cache.layers[0].il))  # attn_rot_k: every layer has this head size


__all__ = ["ShiftCache", "ShiftLayer", "check_quantized_shift", "check_shift_type", "shift_quantized_k_rows"]
