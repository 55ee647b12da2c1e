"""Graph inputs a KV cache fills: the KQ mask, T5 position buckets, the K-shift, K/V row indices.

Callers use this module only; ``KVREF_BACKEND`` picks the twin that does the work (``_mask_c`` or
``_mask_py``, see ``kvref.memory.mask_kernels``). The twins take raw arrays (``fill_kq_mask_raw`` and friends, also
exported here); the functions below gather those arrays from a ``KVCache`` and a ``UBatch`` (the K-shift input,
which a KV cache gathers for itself, is ``kvref.memory.mask_kernels.k_shift_input``, re-exported here):

    placed = cache.decode(batch)                    # [(ubatch, slot_info), ...]
    ub, sinfo = placed[-1]
    mask = fill_kq_mask(cache, ub, sinfo=sinfo)     # (n_stream, n_tps, n_kv) float32, 0 / -inf

A caller that steps repeatedly keeps its buffer, as llama.cpp refills its mask tensor: ``fill_kq_mask(cache, ub, buf,
sinfo=sinfo)`` fills ``buf`` (float32 or float16, C-contiguous, writeable, of the mask's shape: n_kv is
``cache.get_n_kv(sinfo)``) and returns it; a buffer of another dtype, shape or layout raises ``ArgumentTypeError`` /
``ArgumentError`` naming ``out``, before anything is written.

The semantics (which cells a token attends) are documented in ``kvref/memory/_mask_py.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..constants import POS_MAX
from ..errors import ArgumentError, ArgumentTypeError, KVRefError
from . import mask_kernels as _kernels
from .mask_kernels import (
    BACKEND,
    NonCausalType,
    fill_k_shift_raw,
    fill_kq_mask_raw,
    fill_pos_bucket_raw,
    k_shift_input,
    relative_position_bucket,
)
from .slots import SlotInfo

if TYPE_CHECKING:
    from ._mask_py import MaskArray
    from .base import Memory
    from .batch import UBatch
    from .hybrid import HybridSlot
    from .kv_cache import KVCache
    from .kv_cache_iswa import ISWASlot


def attention_cache(
    memory: Memory[object], sinfo: SlotInfo | ISWASlot | HybridSlot | None = None, *, swa: bool = False
) -> tuple[KVCache, SlotInfo | None]:
    """The KVCache (and its slot info) whose mask a memory's graph uses.

    A hybrid memory masks through its attention part; an iSWA memory has two masks, llama.cpp's
    ``kq_mask`` over the base cache and ``kq_mask_swa`` over the SWA cache (``swa=True``). The slot infos
    that ``decode`` returns for those memories (HybridSlot, ISWASlot) are unwrapped the same way.
    """
    own = getattr(memory, "attention_cache", None)  # every memory with attention layers says which cache
    if own is None:
        raise KVRefError(f"{type(memory).__name__} has no attention cache, so no KQ mask")
    cache: KVCache
    part: SlotInfo | None
    cache, part = own(sinfo, swa=swa)
    return cache, part


def _mask_streams(cache: KVCache, ubatch: UBatch, sinfo: SlotInfo | None) -> list[int]:
    """The cache streams the ubatch touches (``sinfo.strm``; derived from the ubatch without a slot)."""
    if sinfo is not None:
        return [int(s) for s in sinfo.strm]
    return sorted({int(cache.seq_to_stream[s]) for s in ubatch.seq_id_unq})


def mask_n_kv(cache: KVCache, ubatch: UBatch, sinfo: SlotInfo | None = None) -> int:
    """get_n_kv for the streams of ``sinfo`` (or of the ubatch's sequences): the mask's column count."""
    return int(cache.get_n_kv(SlotInfo(strm=_mask_streams(cache, ubatch, sinfo))))


def fill_kq_mask(
    cache: Memory[object],
    ubatch: UBatch,
    out: MaskArray | None = None,
    *,
    dtype: npt.DTypeLike = np.float32,
    causal: bool | None = None,
    sinfo: SlotInfo | ISWASlot | HybridSlot | None = None,
    n_kv: int | None = None,
    n_swa: int | None = None,
    swa_type: int | None = None,
    non_causal_type: int | None = None,
    alibi: bool | None = None,
    swa: bool = False,
) -> MaskArray:
    """llama_kv_cache::set_input_kq_mask for ``ubatch`` over ``cache``: ``(n_stream, n_tps, n_kv)``.

    ``cache`` may be any memory with attention: a hybrid memory's attention part is used, and for an
    iSWA memory the base cache's mask, or the SWA cache's with ``swa=True`` (see ``attention_cache``).

    ``n_stream`` is 1 for a unified cache, else the ubatch's number of distinct sequences;
    ``n_kv`` defaults to ``get_n_kv`` over the slot's streams; ``dtype`` is float32 (or float16, the
    flash-attention mask). ``causal`` defaults to ``hparams.causal_attn``; ``n_swa`` / ``swa_type`` to the
    cache's own window (the SWA half of an iSWA cache has one, the base half none); ``non_causal_type``
    and ``alibi`` to the hparams (HParams' default ``non_causal_type`` is 0, ALL). ``out`` is
    filled and returned when given (the caller's buffer, kept between steps): a writeable C-contiguous NumPy array of
    the mask's shape, whose dtype (float32 or float16) overrides ``dtype``; anything else raises ArgumentTypeError
    (not an array, another dtype) or ArgumentError (shape, layout) and writes nothing.
    """
    kv, slot = attention_cache(cache, sinfo, swa=swa)
    hp = kv.hparams
    n_tokens = int(ubatch.n_tokens)
    n_stream = 1 if kv.n_stream == 1 else int(ubatch.n_seqs_unq)
    if n_stream == 0 or n_tokens % n_stream:
        raise KVRefError(f"{n_tokens} tokens do not split over {n_stream} streams")
    if n_kv is None:
        n_kv = mask_n_kv(kv, ubatch, slot)
    shape = (n_stream, n_tokens // n_stream, int(n_kv))
    if out is None:
        out = np.empty(shape, dtype=dtype)
    elif not isinstance(out, np.ndarray):
        raise ArgumentTypeError("out: expected a NumPy array")  # the twins' words for it
    elif out.shape != shape:
        raise ArgumentError(f"out: shape {out.shape}, expected {shape}")
    pos = np.asarray(ubatch.pos, dtype=np.int32)
    tok_x = tok_y = None
    if ubatch.is_pos_2d():
        # llama_ubatch keeps the M-RoPE position blocks as (t, y, x, ...), n_tokens each
        tok_y = pos[n_tokens : 2 * n_tokens]
        tok_x = pos[2 * n_tokens : 3 * n_tokens]
    cells = [kv.cells(s) for s in range(kv.n_stream)]
    if len(ubatch.seq_id_unq) == 1:  # one sequence: every token's (only) id
        tok_seq = np.full(n_tokens, ubatch.seq_id_unq[0], dtype=np.int32)
    else:
        tok_seq = _kernels.impl.first_seq_ids(ubatch.seq_id, n_tokens)
    # through impl (not the name bound above): tests wrap the twin by replacing kvref.memory.mask_kernels.impl
    mask: MaskArray = _kernels.impl.fill_kq_mask_raw(
        out,
        [c.pos for c in cells],
        [c.seq for c in cells],
        [c.ext for c in cells] if tok_x is not None else None,
        # one stream holds every sequence: no map to read
        np.asarray(kv.seq_to_stream, dtype=np.int32) if kv.n_stream > 1 else None,
        pos[:n_tokens],
        tok_seq,
        tok_x=tok_x,
        tok_y=tok_y,
        n_swa=kv.n_swa if n_swa is None else n_swa,
        swa_type=int(kv.swa_type if swa_type is None else swa_type),
        causal=bool(hp.causal_attn if causal is None else causal),
        non_causal_type=int(hp.non_causal_type if non_causal_type is None else non_causal_type),
        alibi=bool(hp.use_alibi if alibi is None else alibi),
    )
    if n_tokens > 1 and not (hp.use_alibi if alibi is None else alibi):
        _stale_wrapped_cells(mask, kv, pos[:n_tokens], tok_seq, kv.n_swa if n_swa is None else n_swa)
    return mask


def _stale_wrapped_cells(
    mask: MaskArray, kv: KVCache, pos: npt.NDArray[np.int32], tok_seq: npt.NDArray[np.int32], n_swa: int
) -> None:
    """What llama.cpp's row reuse leaves in the mask near INT32_MAX. set_input_kq_mask computes the first token of
    each sequence (per stream) in full and copies its row to the sequence's later tokens, recomputing only the cells
    it recorded: those with ``p0 + (int32)(n_swa + 32) >= the sequence's lowest position in the ubatch``, an int32
    sum. Where that sum wraps (a cell within n_swa + 32 of INT32_MAX) the cell is not recorded, and the later tokens
    keep the first token's value for it. Everywhere else the copy equals the row computed afresh."""
    n_stream, n_tps, n_kv = mask.shape
    w = (int(n_swa) + 32 + 2**31) % 2**32 - 2**31  # (int32_t)(n_swa + 32)
    cells = [kv.cells(s) for s in range(kv.n_stream)]
    if w <= 0 or not any(n_kv and int(np.max(c.pos[:n_kv])) > POS_MAX - w for c in cells):
        return  # no sum can wrap: the common case, one comparison per stream
    seq_min: dict[int, int] = {}
    for p, sq in zip(pos.tolist(), tok_seq.tolist(), strict=True):
        seq_min[sq] = min(seq_min.get(sq, p), p)
    for s in range(n_stream):
        first: dict[int, int] = {}
        for ii in range(n_tps):
            sq = int(tok_seq[s * n_tps + ii])
            if sq not in first:
                first[sq] = ii
                continue
            c = cells[int(kv.seq_to_stream[sq]) if kv.n_stream > 1 else 0]
            p0 = c.pos[:n_kv].astype(np.int64)
            has = (c.seq[:n_kv, sq >> 6] >> np.uint64(sq & 63)) & np.uint64(1)
            stale = (p0 + w > POS_MAX) & (p0 + w >= seq_min[sq]) & (has != 0)
            mask[s, ii, stale] = mask[s, first[sq], stale]


def fill_pos_bucket(
    cache: KVCache | None,
    ubatch: UBatch,
    n_buckets: int | None = None,
    out: npt.NDArray[np.int32] | None = None,
    *,
    n_kv: int | None = None,
) -> npt.NDArray[np.int32]:
    """T5 relative-position buckets, int32 ``(n_tokens, n_kv)``.

    With a cache: llama_kv_cache::set_input_pos_bucket (key = cell position, -1 when empty; one-directional;
    one stream only, and not for equal-split ubatches, as in llama.cpp). With ``cache=None``: the
    cache-less encoder input (llm_graph_input_pos_bucket: token against token, bidirectional).
    ``n_buckets`` defaults to ``hparams.n_rel_attn_bkts``.
    """
    n_tokens = int(ubatch.n_tokens)
    tok_pos = np.asarray(ubatch.pos, dtype=np.int32)[:n_tokens]
    if ubatch.equal_seqs:
        raise KVRefError("position buckets need a ubatch from split_simple (llama.cpp asserts !equal_seqs)")
    if cache is None:
        if n_buckets is None:
            raise ArgumentError("n_buckets is required without a cache")
        key_pos, bidirectional = tok_pos, True
    else:
        if cache.n_stream != 1:
            raise KVRefError("position buckets support one stream only (as in llama.cpp)")
        if n_buckets is None:
            n_buckets = cache.hparams.n_rel_attn_bkts
        if n_kv is None:
            n_kv = mask_n_kv(cache, ubatch)
        key_pos, bidirectional = np.asarray(cache.cells(0).pos)[:n_kv], False
    if out is None:
        out = np.empty((n_tokens, key_pos.shape[0]), dtype=np.int32)
    buckets: npt.NDArray[np.int32] = _kernels.impl.fill_pos_bucket_raw(out, key_pos, tok_pos, n_buckets, bidirectional)
    return buckets


def k_idxs(cache: KVCache, ubatch: UBatch, sinfo: SlotInfo) -> npt.NDArray[np.int64]:
    """set_input_k_idxs: int64 row of each token in the stream-merged K tensor (the cache's own method)."""
    return cache.k_idxs(ubatch, sinfo)


def v_idxs(cache: KVCache, ubatch: UBatch, sinfo: SlotInfo) -> npt.NDArray[np.int64]:
    """set_input_v_idxs: V rows, or one element index per (token, component) for a transposed V."""
    return cache.v_idxs(ubatch, sinfo)


__all__ = [
    "BACKEND",
    "NonCausalType",
    "attention_cache",
    "fill_k_shift_raw",
    "fill_kq_mask",
    "fill_kq_mask_raw",
    "fill_pos_bucket",
    "fill_pos_bucket_raw",
    "k_idxs",
    "k_shift_input",
    "mask_n_kv",
    "relative_position_bucket",
    "v_idxs",
]
