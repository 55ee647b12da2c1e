"""The attention KV cache: llama.cpp's ``llama_kv_cache`` (src/llama-kv-cache.cpp, October 2026).

One ``KVCache`` holds, per stream (one stream when ``unified``, else one per sequence), the cell
bookkeeping (``kvref.memory.cells.KVCells``) and a head, and per layer the K and V tensors as raw NumPy bytes:
K is ``(n_stream, size, row_size(type_k, n_embd_k_gqa))``; V the same when ``v_trans`` is False, and
``(n_stream, n_embd_v_gqa_max, size * element size)`` when transposed (each embedding component is a row
of ``size`` cells, which is how the transposed ggml view addresses the same bytes).

Slot search and placement live in ``kvref.memory.slots``, the K-shift math in ``kvref.memory.kshift``, the float
conversions in ``kvref.ggml.rows``. Where llama.cpp only asserts, kvref raises a ``kvref.errors`` exception
before changing anything.

State files: ``state_write`` / ``state_read`` / ``stage_state`` / ``state_sections`` are thin methods over
``kvref.memory.kv_state`` (which documents the layout and where kvref's atomic restore differs from llama.cpp).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, TypedDict

import numpy as np
import numpy.typing as npt

from ..args import args_name, as_int32, as_range, as_seq_id, as_state_args, check_alloc
from ..errors import KShiftError, KVRefError, NoSlotError, SequenceError
from ..ggml import rotation as _rotation
from ..ggml.rows import from_f32, typed
from ..ggml.types import GGMLType, ggml_type, row_size, traits
from ..hparams import HParams, RopeType, SWAType
from ..profile import DEFAULT, Profile, first_release, resolve
from . import kv_state as _kv_state
from . import slot_kernels as _kernels
from . import slots as _slots
from .base import ContextParams, decode_batch, decode_seq_bound, one_call_batch, store_rows
from .batch import UBatch
from .cells import LLAMA_MAX_SEQ, POS_MAX, KVCells
from .kshift import GGML_CPU, ROPE_NEOX, RopeKernel, RopeParams, shift_k_rows
from .kshift_quant import check_shift_type, shift_quantized_k_rows
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer, Unpack

    from ..state import KVSection
    from .batch import Batch, BatchAllocr

# what get_k / get_v return: float32, float16, bf16 bits (uint16), or raw bytes for a quantized type
CellRows = npt.NDArray[np.float32] | npt.NDArray[np.float16] | npt.NDArray[np.uint16] | npt.NDArray[np.uint8]
# a planned common decode step (the slots twins' plan_single): cells (int64), positions, sequence ids, tokens (int32)
SinglePlan = tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]


class YarnParams(TypedDict, total=False):
    """The context's YaRN parameters ``update`` hands the K-shift (cparams.yarn_*, `kvref.memory.kshift.RopeParams`)."""

    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int


# archs whose caches rotate K whenever their head size is the indexer key length (llama_kv_cache's constructor)
_INDEXER_ROT_ARCHS = frozenset({"deepseek32", "deepseek4", "glm-dsa", "dots3note"})

TENSOR_ALIGNMENT = 32  # ggml-cpu buffer alignment: each tensor's allocation is padded to it


@dataclass
class CacheLayer:
    """The K and V tensors of one model layer (``llama_kv_cache::kv_layer``)."""

    il: int
    k: npt.NDArray[np.uint8]  # uint8 (n_stream, size, k row bytes)
    v: npt.NDArray[np.uint8] | None  # uint8, layout per v_trans; None for MLA (no V cache)


def _add32(a: int, b: int) -> int:
    """``a + b`` as an int32 sum in llama.cpp: wrapped past INT32_MAX."""
    return (a + b + 2**31) % 2**32 - 2**31


def _norm_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's open ends: p0 < 0 means 0, p1 < 0 means "no upper bound"."""
    return (0 if p0 < 0 else int(p0)), (POS_MAX if p1 < 0 else int(p1))


class KVCache:
    """llama_kv_cache: cells, heads and K/V storage for the attention layers of a model."""

    kind = "kv"  # kvref.memory.factory.Memory: the memory's kind, as case.json's memory.type names it

    def __init__(
        self,
        hparams: HParams,
        *,
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        kv_unified: bool = True,
        kv_size: int = 256,
        n_seq_max: int = 1,
        n_pad: int = 1,
        n_swa: int = 0,
        swa_type: SWAType | int = SWAType.NONE,
        layer_filter: Callable[[int], bool] | None = None,
        layer_reuse: Callable[[int], int] | None = None,
        cells_cls: type[KVCells] | None = None,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        size, n_seq_max, n_pad = int(kv_size), int(n_seq_max), int(n_pad)
        # what the llama.cpp to reproduce does where llama.cpp builds differ (kvref.profile)
        self.profile = resolve(compat)
        if n_pad <= 0 or size % n_pad:
            raise KVRefError(f"kv size {size} is not a multiple of n_pad {n_pad}")
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise KVRefError(f"n_seq_max {n_seq_max} is outside [1, {LLAMA_MAX_SEQ}]")
        self.hparams = hparams
        self._mrope = hparams.n_pos_per_embd() != 1  # decode's fast path declines M-RoPE batches
        self.type_k = ggml_type(type_k)
        self.type_v = ggml_type(type_v)
        self.v_trans = bool(v_trans)
        self.n_seq_max = n_seq_max
        self.kv_unified = bool(kv_unified)  # n_stream is 1 either way when n_seq_max is 1
        self.n_stream = 1 if kv_unified else n_seq_max
        self.cparams = cparams  # the context create_memory built this for (None when built directly)
        self.n_pad = n_pad
        self.n_swa = int(n_swa)
        self.swa_type = SWAType(int(swa_type))
        if self.v_trans and traits(self.type_v).is_quantized:
            # llama.cpp refuses a quantized V cache without flash attention (which is what v_trans means)
            raise KVRefError("a quantized V cache needs v_trans=False (flash attention)")

        self._seq_bound = decode_seq_bound(self.profile, self.kv_unified, self.n_seq_max)  # for decode's fast path
        self.heads: list[int] = [0] * self.n_stream
        # (slot, ubatch, checks) of a decode step's only ubatch between init_batch and _apply (see _apply)
        self._checked: tuple[SlotInfo, UBatch, _slots.ApplyChecks] | None = None
        # cells_cls: a KVCells twin chosen explicitly (cross-backend tests); default: the selector's
        self._cells = [(cells_cls or KVCells)(size) for _ in range(self.n_stream)]
        # unified: every sequence id maps to stream 0 (ids up to LLAMA_MAX_SEQ are accepted);
        # otherwise sequence s owns stream s and only ids below n_seq_max are valid
        self.seq_to_stream: list[int] = [0] * LLAMA_MAX_SEQ if self.n_stream == 1 else list(range(self.n_stream))
        # queued cross-stream buffer copies (llama_kv_cache::stream_copy_info), applied by update()
        self._sc_src: list[int] = []
        self._sc_dst: list[int] = []

        self.layers: list[CacheLayer] = []
        self.map_layer_ids: dict[int, int] = {}
        self._build_layers(size, layer_filter, layer_reuse)

    # ------------------------------------------------------------------ construction and sizes
    def _build_layers(
        self, size: int, layer_filter: Callable[[int], bool] | None, layer_reuse: Callable[[int], int] | None
    ) -> None:
        hp = self.hparams
        is_mla = hp.is_mla()  # MLA caches store no V
        owned = [il for il in range(hp.n_layer) if hp.has_kv(il) and (layer_filter is None or layer_filter(il))]
        per_cell = sum(
            row_size(self.type_k, hp.n_embd_k_gqa(il))
            + (0 if is_mla else row_size(self.type_v, hp.n_embd_v_gqa_max() if self.v_trans else hp.n_embd_v_gqa(il)))
            for il in owned
        )
        check_alloc(
            self.n_stream * size * per_cell,
            f"a KV cache of {self.n_stream} x {size} cells over {len(owned)} layers",
            "lower n_ctx (or the cache types' size)",
        )
        for il in owned:
            n_embd_k = hp.n_embd_k_gqa(il)
            n_embd_v = self.hparams.n_embd_v_gqa_max() if self.v_trans else hp.n_embd_v_gqa(il)
            k = np.zeros((self.n_stream, size, row_size(self.type_k, n_embd_k)), dtype=np.uint8)
            v = None
            if not is_mla:
                if self.v_trans:
                    el = row_size(self.type_v, 1)
                    v = np.zeros((self.n_stream, n_embd_v, size * el), dtype=np.uint8)
                else:
                    v = np.zeros((self.n_stream, size, row_size(self.type_v, n_embd_v)), dtype=np.uint8)
            self.map_layer_ids[il] = len(self.layers)
            self.layers.append(CacheLayer(il, k, v))
        if layer_reuse is not None:
            for il in range(hp.n_layer):
                il_reuse = layer_reuse(il)
                if il_reuse < 0 or (layer_filter is not None and not layer_filter(il)):
                    continue
                if il_reuse not in self.map_layer_ids:
                    raise KVRefError(f"layer {il} reuses layer {il_reuse}, which has no KV buffers")
                self.map_layer_ids[il] = self.map_layer_ids[il_reuse]

    def size_k_bytes(self) -> int:
        """Bytes of the K tensors of every layer and stream, unpadded (llama_kv_cache::size_k_bytes)."""
        return sum(layer.k.nbytes for layer in self.layers)

    def size_v_bytes(self) -> int:
        """Bytes of the V tensors, unpadded; 0 without V (MLA) (llama_kv_cache::size_v_bytes)."""
        return sum(layer.v.nbytes for layer in self.layers if layer.v is not None)

    def total_size(self) -> int:
        """Bytes of the backing buffer as a ggml CPU buffer allocates it (each tensor padded to 32 bytes)."""

        def pad(n: int) -> int:
            return (n + TENSOR_ALIGNMENT - 1) // TENSOR_ALIGNMENT * TENSOR_ALIGNMENT

        return sum(pad(layer.k.nbytes) + (pad(layer.v.nbytes) if layer.v is not None else 0) for layer in self.layers)

    def get_size(self) -> int:
        """Cells per stream (llama_kv_cache::get_size)."""
        return self._cells[self.seq_to_stream[0]].size()

    def get_n_stream(self) -> int:
        """The number of streams: 1 when unified, else n_seq_max (llama_kv_cache::get_n_stream)."""
        return self.n_stream

    def get_n_seq_max(self) -> int:
        """The n_seq_max the cache was built for."""
        return self.n_seq_max

    def get_layer_ids(self) -> list[int]:
        """The model layers that own K/V buffers here, ascending (layers that reuse another's are left out)."""
        return [layer.il for layer in self.layers]

    def cells(self, stream: int) -> KVCells:
        """The cells of one stream (llama.cpp's ``v_cells[stream]``)."""
        return self._cells[stream]

    def get_cells(self, seq_id: int) -> KVCells:
        """The cells of the stream that holds ``seq_id``."""
        return self._cells[self.seq_to_stream[self.check_seq(seq_id)]]

    def attention_cache(self, sinfo: SlotInfo | None = None, *, swa: bool = False) -> tuple[KVCache, SlotInfo | None]:
        """The cache a KQ mask is built over, with its slot info: this cache (it has no separate SWA cache)."""
        if swa:
            raise KVRefError("swa=True needs an iSWA memory: a KVCache has one mask")
        return self, sinfo

    def get_stream(self, seq_id: int) -> int:
        """The stream that holds ``seq_id`` (llama.cpp's ``seq_to_stream``)."""
        return self.seq_to_stream[self.check_seq(seq_id)]

    def fork(self, streams: Iterable[int] | None = None) -> KVCache:
        """A copy to try placements on (a sequence restore's trial): its cells of ``streams`` (default: all),
        its heads and its queued stream copies are its own. Its K/V buffers are this cache's own arrays, so
        placements may be tried on it but rows must not be written to it."""
        fork = copy.copy(self)
        fork._cells = list(self._cells)
        for s in range(self.n_stream) if streams is None else streams:
            fork._cells[s] = _kv_state.clone_cells(self._cells[s])
        fork.heads = list(self.heads)
        fork._checked = None
        fork._sc_src, fork._sc_dst = list(self._sc_src), list(self._sc_dst)
        return fork

    def check_seq(self, seq_id: object, name: str = "seq_id") -> int:
        """``seq_id`` as an int when this cache can hold it (below LLAMA_MAX_SEQ when unified, else below
        n_seq_max); SequenceError (naming the argument ``name``) otherwise."""
        seq_id = as_seq_id(seq_id, name)
        if not 0 <= seq_id < len(self.seq_to_stream):
            raise SequenceError(f"{name} {seq_id} is outside [0, {len(self.seq_to_stream)})")
        return seq_id

    # ------------------------------------------------------------------ sequence operations
    def clear(self, data: bool = True) -> None:
        """Empty every stream and reset the heads; zero the buffers when ``data``.

        As in llama.cpp, queued cross-stream copies stay queued.
        """
        for s in range(self.n_stream):
            self._cells[s].reset()
            self.heads[s] = 0
        if data:
            for layer in self.layers:
                layer.k.fill(0)
                if layer.v is not None:
                    layer.v.fill(0)

    def _lower_head(self, stream: int, new_head: int) -> None:
        # a freed cell before the head becomes the next search start
        if new_head != self._cells[stream].size() and new_head < self.heads[stream]:
            self.heads[stream] = new_head

    def check_op(self, op: str, *args: object) -> tuple[int, ...]:
        """The arguments of sequence operation ``op`` normalised (`kvref.args`), or the error ``op`` would raise
        for them (where llama.cpp asserts); changes nothing. Composite memories check every part first."""
        if op == "seq_rm":
            seq_id, (p0, p1) = as_seq_id(args[0]), as_range(*args[1:])
            if seq_id != -1:
                self.check_seq(seq_id)
            elif self.profile.kv_seq_rm_all_asserts:
                # GGML_ASSERT(seq_id >= 0 && ...) came first: an abort
                first = first_release("kv_seq_rm_all_asserts", True)
                raise SequenceError(
                    f"seq_rm(-1) asserts in llama-cpp-python {first} (GGML_ASSERT seq_id >= 0; profile {self.profile})"
                )
            return seq_id, p0, p1
        if op == "seq_cp":
            src, dst = self.check_seq(args[0], "seq_id_src"), self.check_seq(args[1], "seq_id_dst")
            p0, p1 = as_range(*args[2:])
            # llama.cpp's "full range" test for a copy across streams, on the raw arguments: an open end, 0, or
            # >= size - 1; p + 1 is an int32 sum, so an end at INT32_MAX wraps below the size (and asserts too)
            n = self.get_size()
            s0, s1 = self.seq_to_stream[src], self.seq_to_stream[dst]
            if s0 != s1 and ((p0 > 0 and _add32(p0, 1) < n) or (p1 > 0 and _add32(p1, 1) < n)):
                raise SequenceError(
                    f"seq_cp across streams ({s0} -> {s1}) only copies the full range, got [{p0}, {p1})"
                )
            return src, dst, p0, p1
        if op == "seq_keep":
            return (self.check_seq(args[0]),)
        if op in ("seq_add", "seq_div"):
            seq_id, (p0, p1), x = self.check_seq(args[0]), as_range(*args[1:3]), as_int32(args[3], args_name(op))
            self._check_pos_ops(op)
            a, b = _norm_range(p0, p1)
            if op == "seq_div" and x != 1 and a != b:
                # d = 0 with a cell in range (llama.cpp's SIGFPE), a quotient of -1 (an empty cell that stays used)
                self._cells[self.seq_to_stream[seq_id]].seq_div_range(seq_id, a, b, x, check=True)
            return seq_id, p0, p1, x
        raise KVRefError(f"unknown sequence operation {op!r}")

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove ``seq_id`` (every sequence when -1) from the cells with p0 <= pos < p1. Always True."""
        seq_id, p0, p1 = self.check_op("seq_rm", seq_id, p0, p1)
        p0, p1 = _norm_range(p0, p1)
        streams = range(self.n_stream) if seq_id == -1 else [self.seq_to_stream[seq_id]]
        for s in streams:
            self._lower_head(s, self._cells[s].seq_rm_range(seq_id, p0, p1))
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``seq_id_dst`` see the cells of ``seq_id_src`` with p0 <= pos < p1.

        Within a stream only the metadata changes. Across streams llama.cpp only copies whole sequences:
        the destination stream is emptied, given the source's cells of that sequence (with their pending
        shifts) and its head, and the K/V buffers of the stream are copied at the next ``update()``.
        """
        src, dst, p0, p1 = self.check_op("seq_cp", seq_id_src, seq_id_dst, p0, p1)
        s0, s1 = self.seq_to_stream[src], self.seq_to_stream[dst]
        if s0 == s1:
            if src != dst:
                self._cells[s0].seq_cp_range(src, dst, *_norm_range(p0, p1))
            return
        self._sc_src.append(s0)
        self._sc_dst.append(s1)
        c_src, c_dst = self._cells[s0], self._cells[s1]
        c_dst.reset()
        for i in np.flatnonzero(np.asarray(c_src.pos) != -1).tolist():
            if not c_src.seq_has(i, src):
                continue
            pos, shift = c_src.pos_get(i), c_src.get_shift(i)
            # llama.cpp places the pre-shift position then redoes the shift, so the pending K-shift carries
            # over; after a seq_div (shift = old - new) that pre-shift position can be negative, harmlessly:
            # the cell ends at pos with shift either way
            c_dst.pos_set_shifted(i, pos, shift)
            c_dst.seq_add(i, dst)
            c_dst.ext_set(i, *c_src.ext_get(i))
        self.heads[s1] = self.heads[s0]

    def seq_keep(self, seq_id: int) -> None:
        """Drop every other sequence from the stream of ``seq_id`` (cells of no sequence stay as they are)."""
        (seq_id,) = self.check_op("seq_keep", seq_id)
        s = self.seq_to_stream[seq_id]
        self._lower_head(s, self._cells[s].seq_keep_all(seq_id))

    def _check_pos_ops(self, what: str) -> None:
        if self.hparams.n_pos_per_embd() != 1:
            raise SequenceError(f"{what}() is only supported for n_pos_per_embd() == 1")

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to the positions of ``seq_id`` in [p0, p1); cells pushed below 0 are freed.

        The head moves to the first freed cell, or to 0 when none was freed.
        """
        seq_id, p0, p1, shift = self.check_op("seq_add", seq_id, p0, p1, shift)
        s = self.seq_to_stream[seq_id]
        if shift == 0:
            return
        p0, p1 = _norm_range(p0, p1)
        if p0 == p1:
            return
        cells = self._cells[s]
        first = cells.seq_add_range(seq_id, p0, p1, shift)
        self.heads[s] = first if first != cells.size() else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions of ``seq_id`` in [p0, p1) by ``d``, toward zero as C does: a negative ``d`` moves them
        below 0 (the cells stay). Refused (nothing changes) where llama.cpp dies, ``d`` = 0 with a cell in range
        (SIGFPE: CellError), or would leave a cell at -1, which reads as empty (CorruptionError); with no cell in
        range nothing happens, whatever ``d``."""
        seq_id, p0, p1, d = self.check_op("seq_div", seq_id, p0, p1, d)
        s = self.seq_to_stream[seq_id]
        if d == 1:
            return
        p0, p1 = _norm_range(p0, p1)
        if p0 == p1:
            return
        self._cells[s].seq_div_range(seq_id, p0, p1, int(d))

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_memory_seq_pos_min: the smallest position of ``seq_id``, or -1 when it holds no cell."""
        return self.get_cells(seq_id).seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_memory_seq_pos_max: the largest position of ``seq_id``, or -1 when it holds no cell."""
        return self.get_cells(seq_id).seq_pos_max(seq_id)

    def seq_pos_max_many(self, seq_ids: Sequence[int]) -> list[int]:
        """``seq_pos_max`` of every listed sequence, in one call (the batch allocator asks for a batch's sequences)."""
        try:
            one_stream = self.n_stream == 1 and (not seq_ids or (min(seq_ids) >= 0 and max(seq_ids) < LLAMA_MAX_SEQ))
        except TypeError:
            one_stream = False
        if one_stream:
            cells = self._cells[0]
            if len(seq_ids) <= 8:  # a few sequences: fewer conversions one by one
                return [cells.seq_pos_max(s) for s in seq_ids]
            res: list[int] = cells.seq_pos_max_many(seq_ids).tolist()
            return res
        return [self.seq_pos_max(s) for s in seq_ids]

    # ------------------------------------------------------------------ shifts and stream copies
    def get_can_shift(self) -> bool:
        """llama_kv_cache::get_can_shift: can the K-shift run (not under M-RoPE, nor for step35's
        per-layer rope dims; always without ``Profile.shift_refuses_mrope``).
        """
        if not self.profile.shift_refuses_mrope:
            return True  # every KV cache can shift, M-RoPE included
        if self.hparams.arch == "step35":  # per-layer rope dims: no single n_rot
            return False
        return self.hparams.n_pos_per_embd() <= 1

    def get_has_shift(self) -> bool:
        """True when some stream has a pending K-shift (llama_kv_cache::get_has_shift)."""
        return any(c.get_has_shift() for c in self._cells)

    def pending_stream_copies(self) -> list[tuple[int, int]]:
        """The queued cross-stream buffer copies, as (src, dst) stream pairs; ``update`` applies them."""
        return list(zip(self._sc_src, self._sc_dst, strict=True))

    def update(
        self,
        *,
        ext_factor: float = 0.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        n_ctx_orig: int = 0,
    ) -> bool:
        """Apply what is pending (llama_context::memory_update): stream copies, then the K-shift.

        Returns True when something was pending. The keyword arguments are the context's YaRN parameters
        (cparams.yarn_*); the defaults are those of a model without YaRN scaling.
        """
        do_shift = self.get_has_shift()
        if not do_shift and not self._sc_src:
            return False
        if do_shift and not self.get_can_shift():
            # llama.cpp aborts here; kvref raises before applying anything
            raise KVRefError("the KV cache / model configuration does not support K-shift")
        k_rot = 0  # a quantized K cache's rotation size (kvref.memory.kshift_quant); refused where llama.cpp crashes
        if do_shift and self.hparams.rope_type != RopeType.NONE:
            if not self.layers:
                # the shift graph of a cache without a layer (lfm2-swa's iSWA base) never uses its k_shift input, so
                # the input gets no buffer and setting it asserts (GGML_ASSERT(buffer) in ggml-backend.cpp)
                raise KShiftError("a K-shift of a KV cache without a layer: llama.cpp asserts (GGML_ASSERT(buffer))")
            k_rot = check_shift_type(self)
        copies = list(zip(self._sc_src, self._sc_dst, strict=True))
        self._sc_src, self._sc_dst = [], []
        for ssrc, sdst in copies:
            for layer in self.layers:
                layer.k[sdst] = layer.k[ssrc]
                if layer.v is not None:
                    layer.v[sdst] = layer.v[ssrc]
        if do_shift:
            if self.hparams.rope_type != RopeType.NONE:
                self._k_shift(
                    dict(
                        ext_factor=ext_factor,
                        attn_factor=attn_factor,
                        beta_fast=beta_fast,
                        beta_slow=beta_slow,
                        n_ctx_orig=n_ctx_orig,
                    ),
                    k_rot,
                )
            for c in self._cells:
                c.reset_shift()
        return True

    def k_shift_input(self) -> npt.NDArray[np.int32]:
        """set_input_k_shift: int32 [n_stream * size], each cell's pending shift, 0 for empty cells."""
        from .mask_kernels import k_shift_input  # on first use: the mask twin is not loaded with the cache

        return k_shift_input(self).reshape(-1)

    # how the ggml CPU build that runs the shift rounds (FMA, libm): the 0.3.36 wheel on AVX2/FMA by default; assign
    # kshift.RopeKernel(fma=False) on a memory to follow a build without FMA contraction (kvref.memory.kshift)
    rope_kernel: RopeKernel = GGML_CPU

    def _rope_params(self, il: int, **yarn: Unpack[YarnParams]) -> RopeParams:
        hp = self.hparams
        swa = hp.is_swa(il)
        base = hp.rope_freq_base_swa if swa and hp.rope_freq_base_swa is not None else hp.rope_freq_base
        scale = hp.rope_freq_scale_swa if swa and hp.rope_freq_scale_swa is not None else hp.rope_freq_scale
        # M-RoPE models are shifted as NEOX over the whole rotated vector (llama.cpp's workaround)
        mode = ROPE_NEOX if hp.rope_type in (RopeType.MROPE, RopeType.IMROPE) else int(hp.rope_type)
        return RopeParams(n_dims=hp.n_rot_l(il), mode=mode, freq_base=base, freq_scale=scale, **yarn)

    def _k_shift(self, yarn: YarnParams, k_rot: int = 0) -> None:
        """build_graph_shift: rope every layer's K (all streams, all cells) by the cells' shifts."""
        hp = self.hparams
        shift = self.k_shift_input()
        for layer in self.layers:
            il = layer.il
            # Profile.kshift_skips_nope: layers without rope are left alone (else every layer is roped)
            if not hp.has_rope(il) and self.profile.kshift_skips_nope:
                continue
            p = self._rope_params(il, **yarn)
            n_embd_head_k = hp.n_embd_head_k_l(il)
            # DeepSeek-style heads keep the rotated dims after the "nope" part (llama.cpp: n_lora_kv > 0)
            n_embd_nope = n_embd_head_k - p.n_dims if hp.n_lora_kv > 0 else 0
            flat = layer.k.reshape(-1, layer.k.shape[-1])  # all streams, as the ggml view spans them
            if traits(self.type_k).is_quantized:  # dequantize, unrotate, rope, rotate, quantize
                n_head_kv = hp.n_head_kv_l(il)
                shift_quantized_k_rows(flat, self.type_k, n_head_kv, n_embd_head_k, shift, p, k_rot, self.rope_kernel)
                continue
            shift_k_rows(flat, self.type_k, hp.n_head_kv_l(il), n_embd_head_k, shift, p, n_embd_nope, self.rope_kernel)

    # ------------------------------------------------------------------ slots
    def find_slot(self, ubatch: UBatch, cont: bool = False) -> SlotInfo | None:
        """Cells for the ubatch (None when it does not fit); nothing is changed."""
        return _slots.find_slot(self, ubatch, cont)

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch) -> None:
        """Write the ubatch's tokens into the cells of ``sinfo`` (llama_kv_cache::apply_ubatch).

        The cells and heads change here; ``cpy_k`` / ``cpy_v`` store the K/V rows.
        """
        _slots.apply_ubatch(self, sinfo, ubatch)

    def prepare(self, ubatches: Sequence[UBatch]) -> list[SlotInfo]:
        """Slots for all ubatches, or [] when one does not fit (as llama.cpp); cells/heads restored."""
        return _slots.prepare(self, list(ubatches))

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, SlotInfo]]:
        """Split the allocator's batch and prepare it: ``[(ubatch, slot), ...]``; NoSlotError when it fails.

        llama.cpp returns a context with status FAILED_PREPARE; kvref raises instead.
        """
        del embd_all  # unused by llama_kv_cache too
        if self.n_stream == 1:
            ubatches = balloc.split_whole("simple", n_ubatch)
        else:
            ubatches = balloc.split_whole("equal", n_ubatch, sequential=True)
        if ubatches is None:
            raise NoSlotError("the batch could not be split into ubatches for this cache")
        sinfos, checked = _slots.prepare_checked(self, ubatches)
        if not sinfos:
            raise NoSlotError(f"no KV slot for a batch of {balloc.get_n_tokens()} tokens")
        # one ubatch, only checked by prepare: decode_batch applies it next, to the cells prepare checked it against
        self._checked = (sinfos[0], ubatches[0], checked) if checked is not None and len(ubatches) == 1 else None
        return list(zip(ubatches, sinfos, strict=True))

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, SlotInfo], None] | None = None,
    ) -> list[tuple[UBatch, SlotInfo]]:
        """What llama_decode does to the memory (`kvref.memory.base.decode_batch`): validate, apply pending
        updates, place every ubatch; ``k`` / ``v`` rows are stored at the placed cells. Raises NoSlotError when
        the batch does not fit; the cells and heads are then as prepare() leaves them after a failure: the
        pending update applied and, with SWA, any purge done while trying earlier ubatches kept (as in
        llama.cpp)."""
        if balloc is None and not embd_all and self.n_stream == 1:  # _single leaves a batch over n_batch to it
            step = self._decode_single(batch, n_ubatch)
            if step is not None:  # the common step, done in one call: what decode_batch would have done
                ub, slot = step
                if k or v or on_ubatch is not None:
                    store_rows(self, ub, slot, k, v, on_ubatch)
                return [(ub, slot)]
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _single(self, batch: Batch, n_ubatch: int, write: bool) -> SinglePlan | None:
        """The common step of a one-stream cache in one call into the slots twins: token ids without embeddings, one
        sequence id per token, one position each (no M-RoPE), one ubatch, nothing pending (no K-shift, no stream
        copy), at most n_batch tokens. ``write``: placed into empty cells (``place_single``), else only planned
        (``plan_single``). None, with nothing changed, for any other step or when a part declines: decode_batch then
        does each part in turn, raising its errors in its order."""
        if self._sc_src or not one_call_batch(batch, n_ubatch, self.cparams):
            return None
        tokens, pos = batch.tokens, batch.pos
        cells = self._cells[0]
        if cells.get_has_shift() or self._mrope:
            return None
        kernel = _kernels.impl.place_single if write else _kernels.impl.plan_single
        plan: SinglePlan | None = kernel(
            cells, self.heads[0], tokens, pos, batch.seq_ids, self._seq_bound, self.n_swa, self.swa_type
        )
        return plan

    def _decode_single(self, batch: Batch, n_ubatch: int) -> tuple[UBatch, SlotInfo] | None:
        """decode_batch's validation, update, split, prepare and apply for the common step (`_single`) in one
        kernel call, when every token gets an empty cell. None, with nothing changed, for any other step or when
        any part declines. The ubatch's fields are made at once (``UBatch.whole_single``)."""
        placed = self._single(batch, n_ubatch, True)
        if placed is None:
            return None
        idxs = placed[0].tolist()
        self.heads[0] = idxs[-1] + 1
        self._checked = None
        logits: npt.NDArray[np.bool_] | None = batch.logits  # type: ignore[assignment]  # _single checked it
        ub = UBatch.whole_single(placed[3], placed[1], placed[2], logits if logits is None else logits.copy())
        return ub, SlotInfo.one_stream(idxs)

    def _commit_single(self, plan: SinglePlan) -> SlotInfo:
        """Write a planned step (``_single(..., write=False)``, nothing changed since) as apply_ubatch does: a used
        target (a sliding-window cache reuses masked cells, each holding one sequence) is cleared first, remembering
        the highest position removed per sequence; the tokens go in with one ``place``; then
        `kvref.memory.slots.purge_below` (as apply_ubatch ends).
        Nothing can refuse: the plan checked it all."""
        idxs = plan[0].tolist()
        cells = self._cells[0]
        removed: dict[int, int] = {}  # overwritten sequence -> highest position removed
        if self.swa_type != SWAType.NONE:  # without a window find_slot only picks empty cells
            for idx in idxs:
                if not cells.is_empty(idx):
                    sid, p = cells.seq_get(idx), cells.pos_get(idx)
                    if p > removed.get(sid, -1):
                        removed[sid] = p
                    cells.rm(idx)
        if not _kernels.impl.place_planned(cells, plan):
            raise AssertionError("a planned decode step could not be placed")  # plan_single checked every value
        if removed:
            _slots.purge_below(self, removed)
        self.heads[0] = idxs[-1] + 1
        self._checked = None
        return SlotInfo(0, 0, [0], [idxs])

    # decode_batch's steps
    def _decode_n_seq_max(self) -> int:
        return self.n_seq_max

    def _apply(self, sinfo: SlotInfo, ubatch: UBatch) -> SlotInfo:
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] is sinfo and checked[1] is ubatch:
            _slots.apply_checked(self, sinfo, ubatch, checked[2])  # nothing ran since init_batch checked it
        else:
            self.apply_ubatch(sinfo, ubatch)
        return sinfo

    def _owner(self, il: int, sinfo: SlotInfo) -> tuple[KVCache, SlotInfo]:
        return self, sinfo

    # ------------------------------------------------------------------ graph inputs and K/V rows
    def get_n_kv(self, sinfo: SlotInfo) -> int:
        """Cells the attention looks at: used_max_p1 padded to max(n_pad, ``Profile.get_n_kv_pad``), at most
        size; max over the slot's streams (``Profile.get_n_kv_streams`` ``"slot"``) or every stream (``"all"``)."""
        profile = self.profile
        n_pad_cur = profile.get_n_kv_pad
        if self.n_pad > n_pad_cur:  # max(), without the builtin's call cost (get_n_kv runs once per ubatch and layer)
            n_pad_cur = self.n_pad
        result = 0
        cells = self._cells
        for s in range(self.n_stream) if profile.get_n_kv_streams == "all" else sinfo.strm:
            padded = cells[s].n_kv(n_pad_cur)
            if padded > result:
                result = padded
        return result

    def k_idxs(self, ubatch: UBatch, sinfo: SlotInfo) -> npt.NDArray[np.int64]:
        """set_input_k_idxs: int64 row index of each token in the stream-merged K tensor."""
        self._check_slot_tokens(ubatch, sinfo)
        return self._flat_idxs(sinfo)

    def v_idxs(self, ubatch: UBatch, sinfo: SlotInfo) -> npt.NDArray[np.int64]:
        """set_input_v_idxs: rows like K, or with a transposed V one element index per (token, component)."""
        if not self.v_trans:
            return self.k_idxs(ubatch, sinfo)
        self._check_slot_tokens(ubatch, sinfo)
        size = self.get_size()
        n_embd = self.hparams.n_embd_v_gqa_max()
        out = []
        for s, strm in enumerate(sinfo.strm):
            idx = np.asarray(sinfo.idxs[s], dtype=np.int64)
            out.append((strm * size * n_embd + np.arange(n_embd)[None, :] * size + idx[:, None]).reshape(-1))
        return np.concatenate(out)

    def _check_slot_tokens(self, ubatch: UBatch, sinfo: SlotInfo) -> None:
        if int(ubatch.n_tokens) != sinfo.size() * sinfo.n_stream():
            raise KVRefError(f"slot holds {sinfo.size() * sinfo.n_stream()} cells for {ubatch.n_tokens} tokens")

    def _layer(self, il: int) -> CacheLayer:
        try:
            return self.layers[self.map_layer_ids[il]]
        except KeyError:
            raise KVRefError(f"layer {il} has no KV cache") from None

    def _rows_as_type(self, rows: npt.ArrayLike, t: GGMLType, n_embd: int) -> npt.NDArray[np.uint8]:
        """Rows given as floats (converted) or as raw bytes of the cache type (taken as they are)."""
        rows = np.asarray(rows)
        if rows.dtype == np.uint8:
            if rows.shape[-1] != row_size(t, n_embd):
                raise KVRefError(f"raw rows of {rows.shape[-1]} bytes, expected {row_size(t, n_embd)}")
            return rows
        if rows.shape[-1] != n_embd:
            raise KVRefError(f"rows of {rows.shape[-1]} values, expected {n_embd}")
        return from_f32(rows, t)

    def cpy_k(self, il: int, k_cur: npt.ArrayLike, sinfo: SlotInfo) -> None:
        """Store a ubatch's K rows (n_tokens, n_embd_k_gqa) at the slot's cells (ggml_set_rows)."""
        layer = self._layer(il)
        rows = self._rows_as_type(k_cur, self.type_k, self.hparams.n_embd_k_gqa(il))
        flat = layer.k.reshape(-1, layer.k.shape[-1])
        flat[self._flat_idxs(sinfo)] = rows

    def cpy_v(self, il: int, v_cur: npt.ArrayLike, sinfo: SlotInfo) -> None:
        """Store a ubatch's V rows; transposed V gets one element per (component, cell), zero-padded."""
        layer = self._layer(il)
        if layer.v is None:
            raise KVRefError(f"layer {il} has no V cache (MLA)")
        n_embd = self.hparams.n_embd_v_gqa(il)
        if not self.v_trans:
            rows = self._rows_as_type(v_cur, self.type_v, n_embd)
            layer.v.reshape(-1, layer.v.shape[-1])[self._flat_idxs(sinfo)] = rows
            return
        rows = np.asarray(v_cur)
        if rows.dtype != np.uint8:
            n_max = layer.v.shape[1]
            if rows.shape[-1] != n_embd:
                raise KVRefError(f"rows of {rows.shape[-1]} values, expected {n_embd}")
            # [TAG_V_CACHE_VARIABLE]: narrower layers are padded with zeros up to n_embd_v_gqa_max
            rows = from_f32(np.pad(rows.astype(np.float32), ((0, 0), (0, n_max - n_embd))), self.type_v)
        elements = typed(rows, self.type_v)  # (n_tokens, n_max)
        view = typed(layer.v, self.type_v)  # (n_stream, n_max, size)
        n = sinfo.size()
        for s, strm in enumerate(sinfo.strm):
            view[strm][:, sinfo.idxs[s]] = elements[s * n : (s + 1) * n].T

    def _flat_idxs(self, sinfo: SlotInfo) -> npt.NDArray[np.int64]:
        size = self.get_size()
        parts = [
            strm * size + np.asarray(idxs, dtype=np.int64) for strm, idxs in zip(sinfo.strm, sinfo.idxs, strict=True)
        ]
        return np.concatenate(parts)

    def _streams(self, sinfo: SlotInfo | None) -> slice[int, int, None]:
        return slice(0, self.n_stream) if sinfo is None else slice(sinfo.s0, sinfo.s1 + 1)

    def get_k(self, il: int, n_kv: int, sinfo: SlotInfo | None = None) -> CellRows:
        """View of the first n_kv cells' K rows, (streams, n_kv, row): float32/float16 (bf16 as uint16 bits),
        raw bytes for quantized types. Streams s0..s1 of the slot, or all."""
        k = self._layer(il).k[self._streams(sinfo), :n_kv]
        return k if traits(self.type_k).is_quantized else typed(k, self.type_k)

    def get_v(self, il: int, n_kv: int, sinfo: SlotInfo | None = None) -> CellRows:
        """Like get_k; a transposed V gives (streams, n_embd_v_gqa_max, n_kv)."""
        layer = self._layer(il)
        if layer.v is None:
            raise KVRefError(f"layer {il} has no V cache (MLA)")
        if self.v_trans:
            return typed(layer.v[self._streams(sinfo)], self.type_v)[:, :, :n_kv]
        v = layer.v[self._streams(sinfo), :n_kv]
        return v if traits(self.type_v).is_quantized else typed(v, self.type_v)

    # ------------------------------------------------------------------ state (kvref.memory.kv_state)
    def state_sections(self, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> list[KVSection]:
        """The sections ``state_write`` serializes, in order: one ``kvref.state.KVSection`` (its rows copies, or with
        ``copy=False`` views of a run of cells, valid until the cache changes)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return [_kv_state.state_section(self, seq_id, flags, copy=copy)]

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of llama_kv_cache::state_write: every stream, or one sequence's unmasked cells."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _kv_state.state_write(self, seq_id, flags)

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        """The byte count of ``state_write(seq_id, flags)`` (what llama_state_get_size counts for this cache)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _kv_state.state_size(self, seq_id, flags)

    def state_write_into(self, dst: Buffer | BinaryIO, seq_id: int = -1, flags: int = 0) -> int:
        """``state_write`` into a writable buffer of at least ``state_size()`` bytes (or a binary file), each row
        block copied once from the cache, as llama_state_get_data fills its caller's buffer; returns the count."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _kv_state.state_write_into(self, dst, seq_id, flags)

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Parse, validate and dry-run the section at ``offset``; returns ``(commit, end)``. Changes nothing."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _kv_state.stage_state(self, data, seq_id, flags, offset)

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore a section (see kvref.memory.kv_state); returns the bytes read. A failure leaves the cache untouched,
        or with ``atomic=False`` as llama.cpp leaves it."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _kv_state.state_read(self, data, seq_id, flags, atomic=atomic)

    def state_read_failed(self, seq_id: int, exc: Exception) -> None:
        """Leave the cache as llama.cpp does after its section failed to restore (kvref.memory.kv_state)."""
        _kv_state.state_read_failed(self, seq_id, exc)

    @property
    def attn_rot_k(self) -> bool:
        """Does llama.cpp rotate this cache's K rows (Walsh-Hadamard, `kvref.ggml.rotation`)? Quantized ``type_k``,
        one head size over the cache's layers, layer 0's a multiple of 64, LLAMA_ATTN_ROT_DISABLE unset."""
        hp = self.hparams
        sizes = [hp.n_embd_head_k_l(layer.il) for layer in self.layers]
        rot = _rotation.attn_rot(self.type_k, _rotation.shared_head_size(sizes), hp.n_embd_head_k_l(0))
        # llama.cpp always rotates a DeepSeek-style lightning indexer's keys: any cache of these archs whose
        # full-attention head size is the indexer's (the DSA indexer cache), whatever the type or the environment
        indexer = hp.arch in _INDEXER_ROT_ARCHS and hp.n_embd_head_k == hp.indexer_head_size
        return self.profile.attn_rotation and (rot or indexer)

    @property
    def attn_rot_v(self) -> bool:
        """Like `attn_rot_k` for V (never for an MLA cache, which stores no V)."""
        hp = self.hparams
        sizes = [] if hp.is_mla() else [hp.n_embd_head_v_l(layer.il) for layer in self.layers]
        rot = _rotation.attn_rot(self.type_v, _rotation.shared_head_size(sizes), hp.n_embd_head_v_l(0))
        return self.profile.attn_rotation and rot

    @property
    def compat(self) -> str:
        """The name of the cache's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        used = [c.get_used() for c in self._cells]
        return (
            f"KVCache(size={self.get_size()}, n_stream={self.n_stream}, layers={len(self.layers)}, "
            f"type_k={self.type_k.name.lower()}, type_v={self.type_v.name.lower()}, used={used}, "
            f"heads={self.heads})"
        )


__all__ = ["CacheLayer", "KVCache", "SlotInfo"]
