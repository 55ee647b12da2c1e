"""DeepSeek-V4's memory: llama.cpp's ``llama_kv_cache_dsv4`` (src/llama-kv-cache-dsv4.{h,cpp}, 0.3.36).

The structure (what the constructor builds; every part keeps one stream per sequence, ``n_seq_max`` streams,
whatever ``kv_unified`` says):

- ``raw``: a `KVCacheISWA` over every layer (the MTP blocks too: the hparams copy has ``n_layer_nextn = 0``),
  K-only (llama.cpp sets both MLA head sizes to the K head size, so no V is stored), ``n_ctx_seq`` cells, never
  unified. DeepSeek-V4 marks every layer SWA, so the base half has no layer; its cells are still placed and
  saved like any iSWA base cache.
- three compressed K caches, `KVCache` objects that never get a cell: ``csa`` over the layers with compress
  ratio 4, ``hca`` over those with ratio 128, ``lid`` (the lightning indexer's keys: one head of
  ``indexer_head_size``, rope NEOX) over the ratio-4 layers; ``pad(max(1, ceil(n_ctx_seq / ratio)), 256)``
  rows per stream. Row ``r`` of a stream is the compression of tokens ``[r * ratio, (r + 1) * ratio)``; the
  graph writes it (``state_write_idxs``), kvref never computes it.
- three compressor states (llama_dsv4_comp_state, `CompState`): per layer an f32 ``kv`` and ``score`` buffer of
  ``n_stream * (1 + n_rs_seq)`` planes of ``state_size`` rows: CSA ``8 x 2*head``, HCA ``128 x head``,
  indexer ``8 x 2*indexer_head``. Plane ``d * n_stream + s`` is stream ``s``'s state ``d`` tokens back
  (``d = 0``: now; ``d >= 1``: the rollback snapshots of ``n_rs_seq``).
- ``rs_idx``: per sequence, the rollback a partial ``seq_rm`` left pending (0: none); the next decode of the
  sequence restores that snapshot plane, the state of a sequence save is that plane.

The slot plan (``init_batch``; `DSV4Slot`): the batch is split like an iSWA cache's (simple with one sequence,
else equal and sequential, keeping the last ``n_rs_seq + 1`` tokens of a sequence together; ``split_seq`` when a
token belongs to several sequences). A ubatch with such coupled tokens is written into the raw caches as one
copy of each token per sequence (``raw_ubatch``); the raw SWA slot it reads is the first token's sequence's.
Only the raw caches get cells. Each ubatch also gets a compression plan per compressed cache (`CompPlan`,
llama_kv_cache_dsv4_context::comp_plan; built on demand for the graph inputs): which rows of the compressor
state each token updates, which compressed rows complete (every ``ratio``-th position) and what they read,
the restore / snapshot copies of the rollback planes, and how many compressed rows each token sees (its mask).

Sequence operations: ``seq_rm`` of a whole sequence clears its compressed rows and states; a tail removal
beyond the last position is a no-op that succeeds; removing the last ``k <= n_rs_seq`` positions arms the
rollback (once); anything else returns false. ``seq_cp`` copies whole sequences only (llama.cpp asserts
``p0 <= 0 && p1 < 0``), the states by a queued stream copy; ``seq_add`` / ``seq_div`` reach the raw caches only;
the memory cannot shift (``get_can_shift`` false); ``seq_pos_min`` answers the raw cache's *maximum*, so that
a server never tries to reuse a prefix inside the window.

The state (kvref.state.dsv4): the DSV4 header, the raw iSWA sections, then (unless partial) the three
compressed K caches (every row of every stream; for a sequence, the ``(pos_max + 1) // ratio`` rows written
so far of its stream), then the three compressor states (for a sequence, its ``rs_idx`` plane). Reading
clears the sequence's compressed rows and states first and resets ``rs_idx``.

The graph inputs (llm_graph_input_dsv4 / _dsv4_raw, `KVCacheDSV4.graph_input`): the raw SWA cache's KQ mask and
K row indices (the attention cache, `attention_cache(swa=True)`), and per compressed cache its plan's index vectors
(``dsv4_<csa|hca|lid>_state_*``) and mask (``kq_mask_dsv4_<cache>``).

Where llama.cpp dies, kvref raises and changes nothing: ``seq_cp`` of a partial range, ``seq_keep`` / a whole
``seq_rm`` of an id past ``n_seq_max``, a restore into such an id, a decode whose positions need compressed rows past
the caches' (the graph's asserts), and what llama.cpp throws while preparing a ubatch (coupled sequences of unequal
lengths, non-contiguous CSA positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import numpy as np
import numpy.typing as npt

from ..args import as_buffer, as_range, as_seq_id, as_state_args
from ..constants import LLAMA_MAX_SEQ
from ..errors import ArgumentError, FormatError, KVRefError, NoSlotError, SequenceError
from ..ggml.types import GGMLType, row_size
from ..hparams import HParams, SWAType
from ..profile import DEFAULT, Profile, resolve
from ..state import dsv4 as _st
from .base import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, ContextParams, decode_batch
from .batch import BatchAllocr, UBatch
from .kv_cache import KVCache
from .kv_cache_iswa import ISWASlot, KVCacheISWA
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .batch import Batch

DSV4_CSA_RATIO = 4
DSV4_HCA_RATIO = 128
GGML_TYPE_F32 = 0


def comp_size(kv_size: int, ratio: int) -> int:
    """dsv4_comp_size: compressed rows for ``kv_size`` tokens (at least 1)."""
    return max(1, (kv_size + ratio - 1) // ratio)


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def k_only(hp: HParams, head: int | None = None, **extra: object) -> HParams:
    """dsv4_make_k_only on a copy of ``hp`` (no MTP split): both MLA head sizes set to the K head size, so the
    cache stores no V. ``head`` also replaces every head size (the indexer cache), ``extra`` other fields."""
    kw: dict[str, object] = {"n_layer_nextn": 0}
    if head is not None:
        kw.update(n_embd_head_k=head, n_embd_head_v=head, n_embd_head_k_swa=head, n_embd_head_v_swa=head)
    kw.update(extra)
    k = int(kw.get("n_embd_head_k", hp.n_embd_head_k))  # type: ignore[call-overload]
    kw.update(n_embd_head_k_mla=k, n_embd_head_v_mla=k)
    return dataclasses.replace(hp, **kw)  # type: ignore[arg-type]


class IndexerKVCache(KVCache):
    """The lightning indexer's K cache: llama_kv_cache always rotates the K of a DeepSeek indexer cache (its head
    size is the model's ``indexer_head_size``), whatever its type."""

    @property
    def attn_rot_k(self) -> bool:
        return self.profile.attn_rotation


class CompState:
    """llama_dsv4_comp_state: the compressor's running state of the layers ``filter`` keeps.

    ``kv[il]`` and ``score[il]`` are f32 arrays ``(n_stream * (1 + n_rs_seq), state_size, n_embd_state)``,
    zero at first; plane ``d * n_stream + s`` is stream ``s`` ``d`` tokens back. ``seq_cp`` queues a stream copy
    of plane ``s`` (``apply_copies``); the copy's destination is cleared at once.
    """

    def __init__(
        self,
        name: str,
        hp: HParams,
        n_seq_max: int,
        ratio: int,
        state_size: int,
        n_embd_state: int,
        n_rs_seq: int,
        layer_filter: Callable[[int], bool],
    ) -> None:
        self.name = name
        self.ratio = ratio
        self.state_size = state_size
        self.n_embd_state = n_embd_state
        self.n_stream = n_seq_max  # llama.cpp passes unified = false
        self.n_rs_seq = n_rs_seq
        self.layer_ids = [il for il in range(hp.n_layer) if layer_filter(il)]
        n_planes = self.n_stream * (1 + n_rs_seq)
        shape = (n_planes, state_size, n_embd_state)
        self.kv = {il: np.zeros(shape, np.float32) for il in self.layer_ids}
        self.score = {il: np.zeros(shape, np.float32) for il in self.layer_ids}
        self.sc_src: list[int] = []
        self.sc_dst: list[int] = []

    def get_n_rows(self) -> int:
        """Rows of the current plane of every stream (llama_dsv4_comp_state::get_n_rows)."""
        return self.state_size * self.n_stream

    def total_size(self) -> int:
        """Bytes of the state buffers."""
        return sum(a.nbytes for a in self.kv.values()) + sum(a.nbytes for a in self.score.values())

    def clear(self, seq_id: int, data: bool = True) -> None:
        """Zero every plane of stream ``seq_id`` (every stream for -1)."""
        if not data:
            return
        if seq_id < 0:
            for a in (*self.kv.values(), *self.score.values()):
                a.fill(0)
            return
        planes = [d * self.n_stream + seq_id for d in range(self.n_rs_seq + 1)]
        for a in (*self.kv.values(), *self.score.values()):
            a[planes] = 0

    def seq_cp(self, src: int, dst: int) -> None:
        """Queue a copy of stream ``src``'s current plane onto ``dst`` (cleared now)."""
        if src == dst:
            return
        self.clear(dst, True)
        self.sc_src.append(src)
        self.sc_dst.append(dst)

    def apply_copies(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the queued planes (llama_dsv4_comp_state::apply_copies)."""
        for s, d in zip(src, dst, strict=True):
            for a in (*self.kv.values(), *self.score.values()):
                a[d] = a[s]

    def section(self, seq_id: int, rs_idx: Sequence[int]) -> _st.CompStateSection:
        """The state section of every stream, or of ``seq_id``'s stream at its rollback plane."""
        ns = self.n_stream if seq_id < 0 else 1
        s0 = max(seq_id, 0) if self.n_stream > 1 else 0
        if seq_id >= 0 and self.n_stream > 1 and seq_id >= self.n_stream:
            raise SequenceError(f"DSV4 state sequence id {seq_id} out of stream range (llama.cpp throws)")
        planes = []
        for s in range(ns):
            seq = seq_id if seq_id >= 0 else s0 + s
            if seq >= len(rs_idx) or rs_idx[seq] > self.n_rs_seq:
                raise SequenceError("DSV4 recurrent state rollback index out of range (llama.cpp throws)")
            planes.append(rs_idx[seq] * self.n_stream + s0 + s)
        rs = self.n_embd_state * 4
        sec = _st.CompStateSection(self.name, _st.DSV4_COMP_STATE_VER, self.ratio, self.state_size,
                                   self.n_embd_state, ns)  # fmt: skip
        for il in self.layer_ids:
            kv = self.kv[il][planes].reshape(ns, -1).view(np.uint8)
            sc = self.score[il][planes].reshape(ns, -1).view(np.uint8)
            sec.layers.append((
                il,
                _st.TensorStreams(GGML_TYPE_F32, self.n_embd_state, self.state_size, rs, kv),
                _st.TensorStreams(GGML_TYPE_F32, self.n_embd_state, self.state_size, rs, sc),
            ))  # fmt: skip
        return sec

    def check_section(self, sec: _st.CompStateSection, seq_id: int) -> int:
        """The first stream ``sec`` restores into, or FormatError (what llama_dsv4_comp_state::state_read throws)."""
        if sec.ratio != self.ratio or sec.state_size != self.state_size or sec.n_embd_state != self.n_embd_state:
            raise FormatError(f"DSV4 compressor state metadata mismatch ({self.name})",
                              field=f"{self.name}_state_ratio", offset=sec.offset + 4)  # fmt: skip
        if len(sec.layers) != len(self.layer_ids):
            raise FormatError(f"DSV4 compressor state layer count mismatch ({self.name})",
                              field=f"{self.name}_state_n_layer", offset=sec.offset + 20)  # fmt: skip
        s0 = _dst_stream(self.n_stream, seq_id, sec.n_stream, f"{self.name}_state_n_stream", sec.offset + 16)
        rs = self.n_embd_state * 4
        for (il_ref, kv, sc), il in zip(sec.layers, self.layer_ids, strict=True):
            if il_ref != il:
                raise FormatError(f"DSV4 compressor state layer id mismatch ({self.name})",
                                  field=f"{self.name}_state_il", offset=kv.offset - 4)  # fmt: skip
            for t in (kv, sc):
                _check_tensor(t, GGML_TYPE_F32, self.n_embd_state, self.state_size, rs, self.state_size, self.name)
        return s0

    def restore(self, sec: _st.CompStateSection, s0: int) -> None:
        """Write a checked section's rows into the current planes from stream ``s0`` on."""
        ns = sec.n_stream
        for il, kv, sc in sec.layers:
            self.kv[il][s0 : s0 + ns] = kv.data.view(np.float32).reshape(ns, self.state_size, self.n_embd_state)
            self.score[il][s0 : s0 + ns] = sc.data.view(np.float32).reshape(ns, self.state_size, self.n_embd_state)


def _dst_stream(n_stream: int, seq_id: int, ns: int, field: str, offset: int) -> int:
    """dsv4_state_dst_stream_range: the first stream a section of ``ns`` streams restores into."""
    if seq_id >= 0:
        if ns != 1:
            raise FormatError("DSV4 sequence state stream count mismatch", field=field, offset=offset)
        if n_stream > 1 and seq_id >= n_stream:
            raise FormatError("DSV4 state sequence id out of stream range", field=field, offset=offset)
        return seq_id if n_stream > 1 else 0
    if ns != n_stream:
        raise FormatError("DSV4 full state stream count mismatch", field=field, offset=offset)
    return 0


def _check_tensor(
    t: _st.TensorStreams, type_: int, ne0: int, rows: int, rsize: int, tensor_rows: int, name: str
) -> None:
    if t.type != type_ or t.ne0 != ne0 or t.rows != rows or t.row_size != rsize:
        raise FormatError(f"DSV4 state tensor metadata mismatch ({name})", field=f"{name}_type", offset=t.offset)
    if rows > tensor_rows:
        raise FormatError(f"DSV4 state tensor row count exceeds storage ({name})", field=f"{name}_rows",
                          offset=t.offset + 12)  # fmt: skip


class CompPlan(NamedTuple):
    """llama_kv_cache_dsv4_context::comp_plan: one ubatch's recipe for one compressed cache (the graph inputs
    ``dsv4_<name>_*``)."""

    state_pos: npt.NDArray[np.int32]
    state_persist_src_idxs: npt.NDArray[np.int32]
    state_persist_dst_idxs: npt.NDArray[np.int32]
    state_restore_src_idxs: npt.NDArray[np.int32]
    state_restore_dst_idxs: npt.NDArray[np.int32]
    state_snapshot_src_idxs: npt.NDArray[np.int32]
    state_snapshot_dst_idxs: npt.NDArray[np.int32]
    state_read_idxs: npt.NDArray[np.int32]
    state_write_idxs: npt.NDArray[np.int64]
    state_write_pos: npt.NDArray[np.int32]
    n_visible: npt.NDArray[np.int32]
    n_stream: int
    n_kv: int


class DSV4Slot(NamedTuple):
    """Where one ubatch went: the raw caches' write slots (of ``raw_ubatch``), the raw SWA slot the graph
    reads, and what the compression plans need (the ubatch and the rollbacks pending when it was prepared)."""

    raw: ISWASlot
    swa_read: SlotInfo
    raw_ubatch: UBatch
    ubatch: UBatch
    rs_idx: tuple[int, ...]


def _has_coupled(ub: UBatch) -> bool:
    return bool((np.asarray(ub.n_seq_id[: ub.n_tokens]) > 1).any())


def raw_write_ubatch(ub: UBatch) -> UBatch:
    """dsv4_build_raw_write_ubatch: a ubatch with coupled tokens as one single-sequence copy of each token per
    sequence (sequence by sequence, in ``seq_id_unq`` order), which the raw caches place; others as they are."""
    if not _has_coupled(ub):
        return ub
    if ub.embd is not None:
        raise KVRefError("DSV4 coupled embedding ubatches are not supported (llama.cpp throws)")
    n = ub.n_tokens
    member = np.zeros((len(ub.seq_id_unq), n), dtype=bool)
    for i in range(n):  # per token: its sequence list (n_seq_id entries)
        for s in ub.seq_id[i]:
            member[ub.seq_id_unq.index(s), i] = True
    counts = member.sum(axis=1)
    if int(counts.sum()) == 0:
        return ub
    if (counts != counts[0]).any():
        raise KVRefError("DSV4 coupled raw writes require equal sequence lengths (llama.cpp throws)")
    rows, cols = np.nonzero(member)  # sequence by sequence, tokens in order
    n_new = len(cols)
    pos = np.asarray(ub.pos).reshape(ub.n_pos, n)[:, cols].reshape(-1).astype(np.int32)
    seq_idx = np.full(LLAMA_MAX_SEQ, -1, np.int32)
    for s, sid in enumerate(ub.seq_id_unq):
        seq_idx[sid] = s
    return UBatch(
        equal_seqs=True,
        n_tokens=n_new,
        n_seq_tokens=int(counts[0]),
        n_seqs=len(ub.seq_id_unq),
        n_seqs_unq=len(ub.seq_id_unq),
        n_pos=ub.n_pos,
        token=None if ub.token is None else np.asarray(ub.token)[cols].astype(np.int32),
        embd=None,
        pos=pos,
        n_seq_id=np.ones(n_new, np.int32),
        seq_id=[[ub.seq_id_unq[r]] for r in rows],
        seq_id_unq=list(ub.seq_id_unq),
        seq_idx=seq_idx,
        output=np.zeros(n_new, np.int8),
        batch_idxs=np.asarray(ub.batch_idxs)[cols].astype(np.int32),
    )


class KVCacheDSV4:
    """llama_kv_cache_dsv4 (see the module docstring). ``kv_size`` is ``n_ctx_seq``."""

    kind = "dsv4"

    def __init__(
        self,
        hparams: HParams,
        *,
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        swa_full: bool = False,
        kv_size: int = 256,
        n_seq_max: int = 1,
        n_ubatch: int = 512,
        n_pad: int = 1,
        n_rs_seq: int = 0,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        hp = hparams
        if hp.swa_type == SWAType.NONE:
            raise KVRefError("deepseek4 needs a sliding window (llama.cpp asserts swa_type != NONE)")
        ratios = list(hp.dsv4_compress_ratios)
        if len(ratios) < hp.n_layer:
            raise KVRefError(f"dsv4_compress_ratios has {len(ratios)} entries for {hp.n_layer} layers")
        self.hparams = hp
        self.profile = resolve(compat)
        self.cparams = cparams
        self.kv_unified = False  # every part keeps a stream per sequence (unified_raw / unified_compressed)
        self.n_seq_max = int(n_seq_max)
        self.n_rs_seq = int(n_rs_seq)
        self.rs_idx = [0] * self.n_seq_max
        self.ratios = ratios
        kv_size = int(kv_size)

        def is_csa(il: int) -> bool:
            return ratios[il] == DSV4_CSA_RATIO

        def is_hca(il: int) -> bool:
            return ratios[il] == DSV4_HCA_RATIO

        self.hparams_raw = k_only(hp)
        self.raw = KVCacheISWA(
            self.hparams_raw, type_k=type_k, type_v=type_v, v_trans=v_trans, swa_full=swa_full, kv_unified=False,
            kv_size=kv_size, n_seq_max=n_seq_max, n_ubatch=n_ubatch, n_pad=n_pad, compat=self.profile,
        )  # fmt: skip
        self.hparams_comp = k_only(hp)
        n_head = hp.indexer_head_size
        self.hparams_lid = k_only(hp, n_head, n_head_kv=1, rope_type=2)  # LLAMA_ROPE_TYPE_NEOX

        def comp_cache(h: HParams, ratio: int, f: Callable[[int], bool]) -> KVCache:
            cls = IndexerKVCache if h is self.hparams_lid else KVCache
            return cls(
                h, type_k=type_k, type_v=type_v, v_trans=v_trans, kv_unified=False,
                kv_size=_pad(comp_size(kv_size, ratio), 256), n_seq_max=n_seq_max, n_pad=n_pad,
                n_swa=0, swa_type=SWAType.NONE, layer_filter=f, compat=self.profile,
            )  # fmt: skip

        self.csa = comp_cache(self.hparams_comp, DSV4_CSA_RATIO, is_csa)
        self.hca = comp_cache(self.hparams_comp, DSV4_HCA_RATIO, is_hca)
        self.lid = comp_cache(self.hparams_lid, DSV4_CSA_RATIO, is_csa)
        head = hp.n_embd_head_k
        self.csa_state = CompState("csa", hp, n_seq_max, 4, 8, 2 * head, self.n_rs_seq, is_csa)
        self.hca_state = CompState("hca", hp, n_seq_max, 128, 128, head, self.n_rs_seq, is_hca)
        self.lid_state = CompState("lid", hp, n_seq_max, 4, 8, 2 * n_head, self.n_rs_seq, is_csa)
        self._failed_after_raw: Callable[[], None] | None = None  # what a failed restore leaves (state_read)
        self._raw_failed = False

    # --- parts and sizes -------------------------------------------------------------------------------

    @property
    def comp_caches(self) -> list[KVCache]:
        """The compressed K caches in state order: CSA, HCA, lightning indexer."""
        return [self.csa, self.hca, self.lid]

    @property
    def comp_states(self) -> list[CompState]:
        """The compressor states in state order: CSA, HCA, lightning indexer."""
        return [self.csa_state, self.hca_state, self.lid_state]

    def get_raw(self) -> KVCacheISWA:
        """The raw token cache (llama_kv_cache_dsv4::get_raw)."""
        return self.raw

    def attention_cache(self, sinfo: DSV4Slot | None = None, *, swa: bool = False) -> tuple[KVCache, SlotInfo | None]:
        """The cache the raw KQ mask (``attn_inp_kq_mask``) is built over: the raw SWA cache, with the slot the
        graph reads; ``swa=False`` gives the (layer-less) base cache."""
        if swa:
            return self.raw.swa, None if sinfo is None else sinfo.swa_read
        return self.raw.base, None if sinfo is None else sinfo.raw.base

    def get_n_stream(self) -> int:
        return self.n_seq_max

    def get_can_shift(self) -> bool:
        """False: compressed rows have block-derived positions (llama_kv_cache_dsv4::get_can_shift)."""
        return False

    def total_size(self) -> int:
        """Bytes of every buffer (raw, compressed, states)."""
        return (
            self.raw.total_size()
            + sum(c.total_size() for c in self.comp_caches)
            + sum(s.total_size() for s in self.comp_states)
        )

    # --- sequence operations ---------------------------------------------------------------------------

    def _check_seq(self, seq_id: object, name: str = "seq_id") -> int:
        seq_id = as_seq_id(seq_id, name)
        if not 0 <= seq_id < self.n_seq_max:
            raise SequenceError(f"{name} {seq_id} is outside [0, {self.n_seq_max}) (llama.cpp asserts)")
        return seq_id

    def check_op(self, op: str, *args: object) -> tuple[int, ...]:
        """The arguments of ``op`` normalised, or the error llama.cpp's abort stands for; changes nothing."""
        if op == "seq_cp":
            src, dst = as_seq_id(args[0], "seq_id_src"), as_seq_id(args[1], "seq_id_dst")
            p0, p1 = as_range(*args[2:])
            if not (p0 <= 0 and p1 < 0):
                raise ArgumentError(f"seq_cp [{p0}, {p1}): DSV4 only supports full sequence copies (llama.cpp asserts)")
            self._check_seq(src, "seq_id_src")
            self._check_seq(dst, "seq_id_dst")
            return self.raw.check_op(op, src, dst, p0, p1)
        if op == "seq_keep":
            return (self._check_seq(args[0]),)
        return self.raw.check_op(op, *args)

    def clear(self, data: bool = True) -> None:
        """Clear the raw caches, then every compressed row and state (always zeroed), and the rollbacks."""
        self.raw.clear(data)
        self._clear_compressed(-1)

    def _clear_compressed(self, seq_id: int) -> None:
        if seq_id < 0:
            for c in self.comp_caches:
                c.clear(True)
        else:
            for c in self.comp_caches:
                c.seq_rm(seq_id, -1, -1)
                for layer in c.layers:
                    layer.k[seq_id] = 0
        for s in self.comp_states:
            s.clear(seq_id, True)
        if seq_id >= 0:
            self.rs_idx[seq_id] = 0
        else:
            self.rs_idx = [0] * self.n_seq_max

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """llama_kv_cache_dsv4::seq_rm (see the module docstring): False for a bounded range, for a tail
        removal inside the sequence without rollback room, and for a second pending rollback."""
        seq_id, p0, p1 = as_seq_id(seq_id), *as_range(p0, p1)
        if p1 >= 0:
            return False
        if p0 > 0:
            if not 0 <= seq_id < self.n_seq_max:
                return False
            pos_max = self.raw.seq_pos_max(seq_id)
            if p0 > pos_max:
                res = self.raw.seq_rm(seq_id, p0, -1)
                for c, r in zip(self.comp_caches, (4, 128, 4), strict=True):
                    res = c.seq_rm(seq_id, p0 // r, -1) and res
                return res
            if self.n_rs_seq == 0:
                return False
            rollback = pos_max - (p0 - 1)
            if not 1 <= rollback <= self.n_rs_seq or self.rs_idx[seq_id] != 0:
                return False
            res = self.raw.seq_rm(seq_id, p0, p1)
            if res:
                self.rs_idx[seq_id] = rollback
            return res
        if seq_id >= self.n_seq_max:
            self._check_seq(seq_id)  # the raw cache asserts first
        res = self.raw.seq_rm(seq_id, p0, p1)
        if res:
            self._clear_compressed(seq_id)
        return res

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy a whole sequence: the raw cells, the compressed caches' streams and the states (queued until
        ``update``); the destination's pending rollback is dropped."""
        src, dst, p0, p1 = self.check_op("seq_cp", seq_id_src, seq_id_dst, p0, p1)
        self.raw.seq_cp(src, dst, p0, p1)
        for c in self.comp_caches:
            c.seq_cp(src, dst, -1, -1)
        for s in self.comp_states:
            s.seq_cp(src, dst)
        if src != dst:
            self.rs_idx[dst] = 0

    def seq_keep(self, seq_id: int) -> None:
        """Keep ``seq_id`` in the raw caches; remove every other sequence and clear its compressed rows."""
        (seq_id,) = self.check_op("seq_keep", seq_id)
        self.raw.seq_keep(seq_id)
        for other in range(self.n_seq_max):
            if other != seq_id:
                self.raw.seq_rm(other, -1, -1)
                self._clear_compressed(other)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """seq_add on the raw caches only."""
        self.raw.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """seq_div on the raw caches only."""
        self.raw.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """The raw cache's *maximum* position of ``seq_id`` (-1 outside [0, n_seq_max)): nothing before the last
        token can be rolled back to (llama_kv_cache_dsv4::seq_pos_min)."""
        seq_id = as_seq_id(seq_id)
        if not 0 <= seq_id < self.n_seq_max:
            return -1
        return self.raw.seq_pos_max(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """The raw cache's maximum position of ``seq_id`` (-1 outside [0, n_seq_max))."""
        seq_id = as_seq_id(seq_id)
        if not 0 <= seq_id < self.n_seq_max:
            return -1
        return self.raw.seq_pos_max(seq_id)

    # --- batches ---------------------------------------------------------------------------------------

    def update(self, **kw: object) -> bool:
        """init_update + apply: the raw caches' shifts and copies, the compressed caches' stream copies, then the
        states' queued copies."""
        res = self.raw.update(**kw)  # type: ignore[arg-type]
        for c in self.comp_caches:
            res = c.update() or res
        for s in self.comp_states:
            if s.sc_src:
                src, dst = s.sc_src, s.sc_dst
                s.sc_src, s.sc_dst = [], []
                s.apply_copies(src, dst)
                res = True
        return res

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, DSV4Slot]]:
        """llama_kv_cache_dsv4::init_batch: a simple split with one stream, else an equal sequential split keeping
        each sequence's last ``n_rs_seq + 1`` tokens together (``split_seq`` when tokens are coupled); the raw
        caches prepare the raw write ubatches."""
        per_seq = self.n_seq_max > 1
        coupled = bool((np.asarray(balloc.n_seq_id[: balloc.get_n_tokens()]) > 1).any())
        tail = self.n_rs_seq + 1 if self.n_rs_seq > 0 else 0
        tries: list[tuple[str, bool, int]] = []
        if not per_seq:
            tries.append(("simple", False, 0))
        tries.append(("seq", False, 0) if coupled else ("equal", per_seq, tail))
        for kind, sequential, keep in tries:
            ubatches = balloc.split_whole(kind, n_ubatch, sequential=sequential, n_keep_tail=keep)  # type: ignore[arg-type]
            if ubatches is None:
                continue
            raws = [raw_write_ubatch(ub) for ub in ubatches]
            slots = self.raw.prepare(raws)
            if not slots:
                continue
            for ub in ubatches:
                if self.n_seq_max <= 1 and ub.n_seqs_unq > 1:
                    raise KVRefError("DSV4 single compressed stream cannot serve multiple sequences (llama.cpp throws)")
                self._check_comp_rows(ub)
            rs = tuple(self.rs_idx)
            out = []
            for ub, raw_ub, slot in zip(ubatches, raws, slots, strict=True):
                out.append((ub, DSV4Slot(slot, _read_sinfo(slot.swa, ub), raw_ub, ub, rs)))
            # reset_rs_idx_for_ubatches: the context consumed the pending rollbacks of every sequence it touches
            if self.n_rs_seq > 0:
                for ub in ubatches:
                    for ids in ub.seq_id:
                        for s in ids:
                            if 0 <= s < self.n_seq_max:
                                self.rs_idx[s] = 0
            return out
        raise NoSlotError("the batch does not fit in the DSV4 raw caches (failed to prepare)")

    def _check_comp_rows(self, ub: UBatch) -> None:
        """A token completing a compressed block (``(pos + 1) % ratio == 0``, int32 arithmetic) writes row
        ``pos / ratio`` of its stream: past the cache's rows the graph's set_rows asserts (GGML_ASSERT(i1 >= 0 &&
        i1 < ne1) in ggml-cpu), after the memory was prepared. Refused here, before anything changes."""
        pos = np.asarray(ub.pos[: ub.n_tokens], dtype=np.int32)
        with np.errstate(over="ignore"):
            nxt = pos + np.int32(1)  # wraps like llama.cpp's int32 sum (INT32_MAX + 1 completes a block)
        for c, ratio in ((self.lid, DSV4_CSA_RATIO), (self.hca, DSV4_HCA_RATIO)):
            # the plan's mask width, pad(max visible rows, 256), past the cache's rows: the CSA layers' indexer
            # asserts building the graph (GGML_ASSERT(n_lid <= indexer_k->ne[2]) in src/models/deepseek4.cpp);
            # for HCA (a wider mask than its K view) inferred, not seen: the indexer asserts first in the model
            if c.layers and len(nxt) and _pad(max(int(np.max(nxt)) // ratio, 1), 256) > c.get_size():
                raise KVRefError(
                    f"position {int(np.max(pos))} sees {int(np.max(nxt)) // ratio} compressed rows, more than the "
                    f"{c.get_size()} of the ratio-{ratio} cache: llama.cpp's graph asserts (GGML_ASSERT(n_lid <= "
                    "indexer_k->ne[2]))"
                )
        for c, ratio in ((self.csa, DSV4_CSA_RATIO), (self.hca, DSV4_HCA_RATIO)):
            if not c.layers:
                continue
            done = np.fmod(nxt, ratio) == 0  # C's remainder
            rows = pos[done].astype(np.int64) // ratio
            if rows.size and int(rows.max()) >= c.get_size():
                p = int(pos[done][int(np.argmax(rows))])
                raise KVRefError(
                    f"position {p} completes compressed row {p // ratio} of a {c.get_size()}-row cache (ratio "
                    f"{ratio}): llama.cpp's graph asserts (GGML_ASSERT(i1 >= 0 && i1 < ne1) in ggml set_rows)"
                )

    def _decode_n_seq_max(self) -> int:
        return self.n_seq_max

    def _apply(self, slot: DSV4Slot, ubatch: UBatch) -> DSV4Slot:
        self.raw.apply_ubatch(slot.raw, slot.raw_ubatch)
        return slot

    def _owner(self, il: int, slot: DSV4Slot) -> tuple[KVCache, SlotInfo]:
        if self.hparams_raw.is_swa(il):
            return self.raw.swa, slot.raw.swa
        return self.raw.base, slot.raw.base

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, DSV4Slot], None] | None = None,
    ) -> list[tuple[UBatch, DSV4Slot]]:
        """What llama_decode does to the memory (`decode_batch`). Where llama.cpp's graph dies on positions that need
        compressed rows past the caches' (`_check_comp_rows`), the memory must be left as it was, so the batch's
        positions are checked once it validates, before the memory update and the ubatches' preparation change
        anything (the SWA cache's purge); kvref then refuses such a batch even where it would not fit (llama.cpp
        returns 1 there)."""
        if balloc is None and self._may_abort(batch):
            probe = BatchAllocr(self.hparams.n_pos_per_embd())
            probe.init(batch, memory=self, n_seq_max=self._decode_n_seq_max(), output_all=embd_all)
            probe.split_reset()
            self._check_comp_rows(probe.split_simple(probe.get_n_tokens()))
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _may_abort(self, batch: Batch) -> bool:
        """Could a position of ``batch`` need a compressed row past the caches' (a bound: given positions, or the
        highest stored position plus the batch's tokens)?"""
        if batch.pos is not None:
            pos = np.asarray(batch.pos).reshape(-1)
            top = int(pos.max()) if pos.size else -1
        else:
            top = max(self.seq_pos_max(s) for s in range(self.n_seq_max)) + int(batch.n_tokens) + 1
        limits = [c.get_size() * r - 1 for c, r in ((self.csa, 4), (self.lid, 4), (self.hca, 128)) if c.layers]
        return bool(limits) and top >= min(limits)

    # --- state ---------------------------------------------------------------------------------------------

    def _k_rows(self, c: KVCache, ratio: int, seq_id: int) -> int:
        if seq_id < 0:
            return c.get_size()
        pos_max = self.raw.seq_pos_max(seq_id)
        return 0 if pos_max < 0 else min(c.get_size(), (pos_max + 1) // ratio)

    def _k_section(self, c: KVCache, name: str, ratio: int, seq_id: int) -> _st.KCacheSection:
        n_stream = c.get_n_stream()
        if seq_id >= 0 and n_stream > 1 and seq_id >= n_stream:
            raise SequenceError(f"DSV4 state sequence id {seq_id} out of stream range (llama.cpp throws)")
        s0, ns = (seq_id if n_stream > 1 else 0, 1) if seq_id >= 0 else (0, n_stream)
        n_rows = self._k_rows(c, ratio, seq_id)
        sec = _st.KCacheSection(name, _st.DSV4_K_CACHE_STATE_VER, n_rows, ns)
        for layer in c.layers:
            n_embd = c.hparams.n_embd_k_gqa(layer.il)
            rs = row_size(c.type_k, n_embd)
            data = layer.k[s0 : s0 + ns, :n_rows].reshape(ns, -1)
            sec.layers.append((layer.il, _st.TensorStreams(int(c.type_k), n_embd, n_rows, rs, data)))
        return sec

    def state_sections(self, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> list[_st.DSV4Section]:
        """What ``state_write`` serializes: one `kvref.state.dsv4.DSV4Section` (the header, the raw iSWA's KV
        sections, the compressed caches' rows unless partial, the compressor states)."""
        seq_id, flags = as_state_args(seq_id, flags)
        partial = bool(flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        head = _st.DSV4Header(mode=_st.DSV4_STATE_MODE_PARTIAL if partial else _st.DSV4_STATE_MODE_FULL)
        raw = self.raw.state_sections(seq_id, flags, copy=copy)
        ks = [] if partial else [
            self._k_section(c, name, ratio, seq_id) for c, (name, ratio) in zip(self.comp_caches, _st.COMP_PARTS,
                                                                                 strict=True)
        ]  # fmt: skip
        ss = [s.section(seq_id, self.rs_idx) for s in self.comp_states]
        if copy:
            for k in ks:
                for _, t in k.layers:
                    t.data = t.data.copy()
            for c in ss:
                for _, kv, sc in c.layers:
                    kv.data, sc.data = kv.data.copy(), sc.data.copy()
        return [_st.DSV4Section(head, list(raw), ks, ss)]

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of llama_kv_cache_dsv4::state_write."""
        from ..state import section_bytes

        return section_bytes(*self.state_sections(seq_id, flags, copy=False))  # type: ignore[arg-type]

    def copy_rows_from(self, sec: _st.DSV4Section, seq_id: int) -> None:
        """Put a saved section's compressed rows and compressor states where this memory's save of ``seq_id``
        (-1: all) reads them (the conformance replay: those rows are graph outputs kvref does not compute)."""
        for c, k in zip(self.comp_caches, sec.k_caches, strict=False):  # none when partial
            n_stream = c.get_n_stream()
            s0 = (seq_id if n_stream > 1 else 0) if seq_id >= 0 else 0
            for il, t in k.layers if k.n_rows else ():
                layer = c.layers[c.map_layer_ids[il]]
                layer.k[s0 : s0 + k.n_stream, : k.n_rows] = t.data.reshape(k.n_stream, k.n_rows, -1)
        for st, cs in zip(self.comp_states, sec.states, strict=True):
            ns = cs.n_stream
            s0 = (seq_id if st.n_stream > 1 else 0) if seq_id >= 0 else 0
            planes = [self.rs_idx[seq_id if seq_id >= 0 else s0 + s] * st.n_stream + s0 + s for s in range(ns)]
            for il, kv, sc in cs.layers:
                st.kv[il][planes] = kv.data.view(np.float32).reshape(ns, st.state_size, st.n_embd_state)
                st.score[il][planes] = sc.data.view(np.float32).reshape(ns, st.state_size, st.n_embd_state)

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        """The byte count of ``state_write(seq_id, flags)``."""
        from ..state.cache_api import sections_size

        return sections_size(*self.state_sections(seq_id, flags, copy=False))  # type: ignore[arg-type]

    def state_write_into(self, dst: Buffer | BinaryIO, seq_id: int = -1, flags: int = 0) -> int:
        """``state_write`` into a writable buffer of at least ``state_size()`` bytes, or a binary file; returns the
        byte count."""
        from ..state.cache_api import write_sections_into

        return write_sections_into(dst, *self.state_sections(seq_id, flags, copy=False))  # type: ignore[arg-type]

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Parse and check the DSV4 section at ``offset`` (header, raw sections, compressed caches, states) without
        changing anything; returns ``(commit, end)``."""
        seq_id, flags = as_state_args(seq_id, flags)
        commit, end, _ = self._stage(as_buffer(data), seq_id, flags, offset)
        return commit, end

    def _stage(
        self, mv: memoryview, seq_id: int, flags: int, offset: int
    ) -> tuple[Callable[[], None], int, Callable[[], None] | None]:
        self._failed_after_raw = None
        self._raw_failed = False
        r = _st.reader(mv, offset)
        head = _st.DSV4Header.read(r)
        if head.partial != bool(flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY):
            raise FormatError("DSV4 state flags mismatch", field="dsv4_mode", offset=offset + 8)
        try:
            commit_raw, end = self.raw.stage_state(mv, seq_id, flags, r.pos)
        except KVRefError:
            self._raw_failed = True
            raise
        r.pos = end
        stage: list[Callable[[], None]] = []
        try:
            if not head.partial:
                for c, (name, _) in zip(self.comp_caches, _st.COMP_PARTS, strict=True):
                    sec = _st.KCacheSection.read(r, name)
                    stage.append(self._check_k(c, sec, seq_id))
            for s in self.comp_states:
                csec = _st.CompStateSection.read(r, s.name)
                s0 = s.check_section(csec, seq_id)
                stage.append(partial(s.restore, csec, s0))
        except KVRefError:
            # llama.cpp restored the raw part and cleared the compressed part before the failing read
            def after_raw() -> None:
                commit_raw()
                if not head.partial:
                    self._clear_compressed(seq_id)

            self._failed_after_raw = after_raw
            raise
        if seq_id >= self.n_seq_max:
            # GGML_ASSERT(seq_id < n_seq_max) once every part is read (llama.cpp dies with the raw part restored)
            raise SequenceError(f"seq_id {seq_id} is outside [0, {self.n_seq_max}) (llama.cpp asserts)")
        is_partial = head.partial

        def commit() -> None:
            commit_raw()
            if not is_partial:
                self._clear_compressed(seq_id)
            for f in stage:
                f()
            if seq_id >= 0:
                self.rs_idx[seq_id] = 0
            else:
                self.rs_idx = [0] * self.n_seq_max

        return commit, r.pos, None

    def _check_k(self, c: KVCache, sec: _st.KCacheSection, seq_id: int) -> Callable[[], None]:
        """dsv4_state_read_k_cache's checks; returns the write of the section's rows."""
        size = c.get_size()
        name = sec.name
        if (sec.version == 1 and sec.n_rows != size) or sec.n_rows > size:
            raise FormatError(f"DSV4 K-cache state size mismatch ({name}): {sec.n_rows} rows, cache {size}",
                              field=f"{name}_k_n_rows", offset=sec.offset + 4)  # fmt: skip
        s0 = _dst_stream(c.get_n_stream(), seq_id, sec.n_stream, f"{name}_k_n_stream", sec.offset + 8)
        ids = c.get_layer_ids()
        if len(sec.layers) != len(ids):
            raise FormatError(f"DSV4 K-cache layer count mismatch ({name})", field=f"{name}_k_n_layer",
                              offset=sec.offset + 12)  # fmt: skip
        for (il_ref, t), il in zip(sec.layers, ids, strict=True):
            if il_ref != il:
                raise FormatError(f"DSV4 K-cache layer id mismatch ({name})", field=f"{name}_k_il",
                                  offset=t.offset - 4)  # fmt: skip
            n_embd = c.hparams.n_embd_k_gqa(il)
            _check_tensor(t, int(c.type_k), n_embd, sec.n_rows, row_size(c.type_k, n_embd), size, name)
        n_rows, ns = sec.n_rows, sec.n_stream

        def write() -> None:
            for il, t in sec.layers if n_rows else ():
                layer = c.layers[c.map_layer_ids[il]]
                layer.k[s0 : s0 + ns, :n_rows] = t.data.reshape(ns, n_rows, -1)

        return write

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore a DSV4 section; returns the bytes read. A failure leaves the memory untouched, or with
        ``atomic=False`` as llama.cpp leaves it: a failing raw section as the iSWA cache leaves it; a failure after
        it with the raw part restored and the sequence's compressed rows and states cleared."""
        seq_id, flags = as_state_args(seq_id, flags)
        mv = as_buffer(data)
        try:
            commit, end, _ = self._stage(mv, seq_id, flags, 0)
        except SequenceError:
            raise  # an abort: nothing changes
        except KVRefError:
            if not atomic:
                if self._failed_after_raw is not None:
                    self._failed_after_raw()
                elif self._raw_failed:
                    self.raw.state_read(mv[12:], seq_id, flags, atomic=False)  # fails again, as llama.cpp leaves it
            raise
        if end != len(mv):
            raise FormatError(f"{len(mv) - end} trailing bytes after the memory sections", field="trailing", offset=end)
        commit()
        return end

    # --- graph inputs ----------------------------------------------------------------------------------------

    def comp_plan(self, name: str, slot: DSV4Slot) -> CompPlan:
        """The compression plan of ``slot``'s ubatch for cache ``name`` ("csa", "hca" or "lid")."""
        cache = {"csa": self.csa, "hca": self.hca, "lid": self.lid}[name]
        state = {"csa": self.csa_state, "hca": self.hca_state, "lid": self.lid_state}[name]
        return build_comp_plan(
            slot.ubatch, state.ratio, name != "hca", state.state_size, cache.get_size(), state.n_stream,
            self.n_rs_seq, slot.rs_idx,
        )  # fmt: skip

    def graph_input(
        self, tensor: str, ub: UBatch, slot: object, *, swa: bool, f16: bool, causal: bool | None
    ) -> npt.NDArray[np.int32 | np.int64 | np.float32 | np.float16] | None:
        """The DSV4 graph inputs (llm_graph_input_dsv4::set_input), as conformance/capture.py names them:
        ``dsv4_<csa|hca|lid>_state_<field>`` (a compression plan's index vector) and ``kq_mask_dsv4_<cache>`` (its
        mask, ``(n_stream, n_tokens / n_stream, n_kv)``: 0 for the first ``n_visible`` rows of each token, -inf
        after; f16 where llama.cpp makes it f16); None for other names (the raw SWA cache's ``kq_mask`` and
        ``k_idxs`` are the attention cache's, `attention_cache`)."""
        if not isinstance(slot, DSV4Slot):
            return None
        is_mask = tensor.startswith("kq_mask_dsv4_")
        if not (is_mask or tensor.startswith("dsv4_")):
            return None
        name = tensor[len("kq_mask_dsv4_") :] if is_mask else tensor[5:8]
        if name not in ("csa", "hca", "lid"):
            return None
        plan = self.comp_plan(name, slot)
        if is_mask:
            n = len(plan.n_visible)
            cols = np.arange(plan.n_kv)[None, :]
            flat = np.where(cols < plan.n_visible[:, None], np.float32(0), np.float32(-np.inf))
            mask: npt.NDArray[np.float32] = flat.astype(np.float32).reshape(
                plan.n_stream, n // plan.n_stream, plan.n_kv
            )
            if f16:
                half: npt.NDArray[np.float16] = mask.astype(np.float16)
                return half
            return mask
        fld = tensor[9:]
        if fld in CompPlan._fields and fld.startswith("state_"):
            vec: npt.NDArray[np.int32 | np.int64] = getattr(plan, fld)
            return vec
        return None

    @property
    def compat(self) -> str:
        return self.profile.name

    def __repr__(self) -> str:
        return (
            f"KVCacheDSV4(raw={self.raw!r}, csa={self.csa.get_size()}, hca={self.hca.get_size()}, "
            f"lid={self.lid.get_size()} rows/stream, streams={self.n_seq_max}, n_rs_seq={self.n_rs_seq})"
        )


def _read_sinfo(swa: SlotInfo, ub: UBatch) -> SlotInfo:
    """dsv4_build_raw_read_sinfos: a coupled ubatch reads the raw SWA stream of its first token's sequence."""
    if not _has_coupled(ub):
        return swa
    seq = ub.seq_id[0][0]
    for i, strm in enumerate(swa.strm):
        if strm == seq:
            return SlotInfo(s0=strm, s1=strm, strm=[strm], idxs=[swa.idxs[i]])
    raise KVRefError("DSV4 raw write stream not found for coupled read (llama.cpp throws)")


def _stream_off(n_stream: int, seq_id: int, size: int) -> int:
    if n_stream <= 1:
        return 0
    if not 0 <= seq_id < n_stream:
        raise KVRefError("DSV4 sequence id out of stream range (llama.cpp throws)")
    return seq_id * size


def build_comp_plan(
    ub: UBatch,
    ratio: int,
    overlap: bool,
    state_size: int,
    kv_size: int,
    n_stream: int,
    n_rs_seq: int,
    rs_idx: Sequence[int],
) -> CompPlan:
    """dsv4_build_comp_plan: one ubatch's compression recipe (see `CompPlan`). Built per ubatch for the graph
    inputs only; the loops run over the ubatch's tokens and the compressor's ``ratio``-row windows."""
    n = ub.n_tokens
    pos = [int(p) for p in np.asarray(ub.pos)[:n]]
    seqs = [list(s) for s in ub.seq_id[:n]]
    coupled = any(len(s) > 1 for s in seqs)
    g_stream = 1 if (n_stream <= 1 or ub.n_seqs_unq <= 1 or coupled) else ub.n_seqs_unq
    if n_stream <= 1 and ub.n_seqs_unq > 1:
        raise KVRefError("DSV4 single compressed stream cannot serve multiple sequences (llama.cpp throws)")
    state_rows = state_size * n_stream
    n_visible = [0] * n
    n_kv = 0
    state_pos: list[int] = []
    persist: dict[int, list[int]] = {}  # dst -> [src, pos]
    prev_reads: list[int] = []
    cur_reads: list[int] = []
    read_idxs: list[int] = []
    write_idxs: list[int] = []
    write_pos: list[int] = []
    counts: dict[int, int] = {}
    cur_tok = {}
    for i in range(n):
        for s in seqs[i]:
            cur_tok[(s, pos[i])] = i

    def src_idx(seq: int, p: int) -> int:
        if p < 0:
            return state_rows + n
        if (seq, p) in cur_tok:
            return state_rows + cur_tok[(seq, p)]
        return _stream_off(n_stream, seq, state_size) + p % state_size

    for i in range(n):
        p = pos[i]
        if p < 0:
            continue
        state_pos.append(p % ratio)
        n_visible[i] = (p + 1) // ratio
        n_kv = max(n_kv, n_visible[i])
        for s in seqs[i]:
            dst = _stream_off(n_stream, s, state_size) + p % state_size
            row = persist.get(dst)
            if row is None:
                persist[dst] = [i, p]
            elif p > row[1]:
                row[0], row[1] = i, p
            if (p + 1) % ratio:
                continue
            start = p + 1 - ratio
            write_idxs.append(_stream_off(n_stream, s, kv_size) + p // ratio)
            write_pos.append(start)
            counts[s] = counts.get(s, 0) + 1
            if overlap:
                prev_reads.extend(src_idx(s, start - ratio + j) for j in range(ratio))
                cur_reads.extend(src_idx(s, start + j) for j in range(ratio))
            else:
                read_idxs.extend(src_idx(s, start + j) for j in range(ratio))

    def dummy(seq: int, i: int) -> None:
        src = src_idx(seq, pos[i])
        write_idxs.append(_stream_off(n_stream, seq, kv_size) + kv_size - 1)
        write_pos.append(0)
        if overlap:
            prev_reads.extend([src] * ratio)
            cur_reads.extend([src] * ratio)
        else:
            read_idxs.extend([src] * ratio)

    if ratio == DSV4_CSA_RATIO and state_pos:
        if coupled:
            if not write_idxs:
                i = next(j for j in range(n) if pos[j] >= 0)
                dummy(seqs[i][0], i)
        else:
            n_blocks = (max(1, ub.n_seq_tokens) + ratio - 1) // ratio
            for s in ub.seq_id_unq:
                nw = counts.get(s, 0)
                if nw >= n_blocks:
                    continue
                if nw + 1 != n_blocks:
                    raise KVRefError("DSV4 CSA sequence positions are not contiguous (llama.cpp throws)")
                i = next(j for j in range(n) if pos[j] >= 0 and s in seqs[j])
                dummy(s, i)
    if ratio == DSV4_HCA_RATIO and state_pos and not write_idxs:
        i = next(j for j in range(n) if pos[j] >= 0)
        seq = seqs[i][0]
        src = src_idx(seq, pos[i])
        write_idxs.append(_stream_off(n_stream, seq, kv_size) + kv_size - 1)
        write_pos.append(0)
        read_idxs.extend([src] * ratio)
    if overlap:
        read_idxs = read_idxs + prev_reads + cur_reads
    n_kv = max(_pad(n_kv, 256), 256)
    dsts = sorted(persist)
    restore_src: list[int] = []
    restore_dst: list[int] = []
    snap_src: list[int] = []
    snap_dst: list[int] = []
    if n_rs_seq > 0:
        for stream in range(n_stream):
            seq = -1
            if n_stream == 1:
                seq = ub.seq_id_unq[0] if ub.n_seqs_unq > 0 else -1
            elif stream in ub.seq_id_unq:
                seq = stream
            off = stream * state_size
            rb = rs_idx[seq] if 0 <= seq < len(rs_idx) else 0
            plane = rb * state_rows if 0 < rb <= n_rs_seq else 0
            restore_src.extend(plane + off + r for r in range(state_size))
            restore_dst.extend(off + r for r in range(state_size))
            toks = [i for i in range(n) if seq >= 0 and seq in seqs[i]]
            scratch = state_rows * (1 + n_rs_seq)
            for d in range(1, n_rs_seq + 1):
                dplane = d * state_rows
                prefix = len(toks) - d if d <= len(toks) else 0
                for r in range(state_size):
                    src = off + r
                    for j in range(prefix):
                        it = toks[j]
                        if pos[it] >= 0 and pos[it] % state_size == r:
                            src = scratch + it
                    if not toks:
                        src = dplane + off + r
                    snap_src.append(src)
                    snap_dst.append(dplane + off + r)

    def i32(x: list[int]) -> npt.NDArray[np.int32]:
        return np.asarray(x, dtype=np.int32)

    return CompPlan(
        state_pos=i32(state_pos),
        state_persist_src_idxs=i32([persist[d][0] for d in dsts]),
        state_persist_dst_idxs=i32(dsts),
        state_restore_src_idxs=i32(restore_src),
        state_restore_dst_idxs=i32(restore_dst),
        state_snapshot_src_idxs=i32(snap_src),
        state_snapshot_dst_idxs=i32(snap_dst),
        state_read_idxs=i32(read_idxs),
        state_write_idxs=np.asarray(write_idxs, dtype=np.int64),
        state_write_pos=i32(write_pos),
        n_visible=i32(n_visible),
        n_stream=g_stream,
        n_kv=n_kv,
    )


__all__ = ["CompPlan", "CompState", "DSV4Slot", "KVCacheDSV4", "build_comp_plan", "comp_size", "raw_write_ubatch"]
