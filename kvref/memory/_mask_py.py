"""Pure-Python twin of the graph inputs a KV cache fills (llama.cpp's ``llama_kv_cache::set_input_*``).

This is the readable statement of the rules; ``_mask_c.pyx`` implements the same functions at C speed.
Both work on raw arrays, not on cache objects, so either can be driven by a KVCache, a state file or a
test. ``kvref/memory/mask.py`` gathers the arrays from a cache and a ubatch.

The KQ mask (``fill_kq_mask_raw``) has one row per ubatch token and one column per KV cell; the output
is ``(n_stream, n_tps, n_kv)`` with token ``i`` in row ``i`` of the flattened ``(n_tokens, n_kv)`` view.
A token is described by its position ``p1`` and its *first* sequence id (llama.cpp only looks at
``seq_id[i][0]``); it reads the cells of the cache stream ``seq_to_stream[seq]``. Cell ``j`` (position
``p0``) is attended, value 0 (or ``-|p0 - p1|`` under ALiBi), when all of these hold, else ``-inf``:

- the cell is used (``p0 != -1``: llama.cpp marks an empty cell with -1; a position below it is a cell a seq_div
  by a negative divisor moved there, attended like any other) and holds the token's sequence;
- causal: ``p0 <= p1``; with 2-D (M-RoPE) positions, a cell at ``p0 == p1`` is masked when its (x, y) comes
  after the token's: ``y_cell > y_tok`` or (``y_cell == y_tok`` and ``x_cell > x_tok``);
- with a sliding window (``swa_type != NONE``): not ``is_masked_swa(n_swa, swa_type, p0, p1)``, except that
  a non-causal SWA_FULL model never windows cells at or after the sequence's first position in the ubatch
  (the ubatch itself is attended in full);
- a non-causal SWA_ONLY model stays causal in a cache without a window (only SWA layers go bidirectional).

Cells ``[used_max_p1, n_kv)`` are empty, hence ``-inf``: ``n_kv`` padding needs no special case.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Sequence
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from ..constants import LLAMA_MAX_SEQ, N_SEQ_WORDS
from ..errors import ArgumentError, ArgumentTypeError
from ..hparams import is_masked_swa

N_SWA_MAX = 2**30  # n_swa beyond this is rejected (llama.cpp's int32 arithmetic on it would wrap)

_ROWS_PER_CHUNK_ELEMS = 1 << 20  # the vectorised mask works on blocks of about this many elements
# the KQ mask: float32, or float16 (the flash-attention mask)
MaskArray = npt.NDArray[np.float32] | npt.NDArray[np.float16]
_I32 = npt.NDArray[np.int32]
_U64 = npt.NDArray[np.uint64]


class NonCausalType(IntEnum):
    """llama_non_causal_type: what ``causal_attn = false`` means for windowed models."""

    ALL = 0  # every layer non-causal, the window still applies
    SWA_ONLY = 1  # only caches with a window go non-causal
    SWA_FULL = 2  # every layer non-causal, no window between tokens of the current ubatch


# --------------------------------------------------------------------------------------------- checks

_ZERO_STREAMS = np.zeros(4096, dtype=np.int32)  # every token in stream 0 (no seq_to_stream given)
_ZERO_STREAMS.flags.writeable = False
# Both twins run the same checks with the same messages: the Cython twin imports the argument checks and
# ``is_masked_swa`` from here and writes only its fill loops itself; tests compare raised types and messages.


def _as_i32_1d(name: str, a: npt.ArrayLike) -> npt.NDArray[np.int32]:
    arr = np.asarray(a)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ArgumentError(f"{name}: expected a 1-D integer array")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_cells(
    cell_pos: Sequence[npt.ArrayLike], cell_seq: Sequence[npt.ArrayLike], cell_ext: Sequence[npt.ArrayLike] | None
) -> tuple[list[_I32], list[_U64], list[_I32] | None]:
    if len(cell_pos) == 0 or len(cell_pos) != len(cell_seq):
        raise ArgumentError("cell_pos and cell_seq: expected one array per stream (at least one stream)")
    if cell_ext is not None and len(cell_ext) != len(cell_pos):
        raise ArgumentError("cell_ext: expected one array per stream")
    pos: list[_I32] = []
    seq: list[_U64] = []
    ext: list[_I32] = []
    for st in range(len(cell_pos)):
        p = np.asarray(cell_pos[st])
        s = np.asarray(cell_seq[st])
        if p.dtype != np.int32 or p.ndim != 1:
            raise ArgumentTypeError(f"cell_pos[{st}]: expected a 1-D int32 array")
        if s.dtype != np.uint64 or s.shape != (p.shape[0], N_SEQ_WORDS):
            raise ArgumentTypeError(f"cell_seq[{st}]: expected a uint64 array of shape ({p.shape[0]}, {N_SEQ_WORDS})")
        pos.append(p if p.flags.c_contiguous else np.ascontiguousarray(p))
        seq.append(s if s.flags.c_contiguous else np.ascontiguousarray(s))
        if cell_ext is not None:
            e = np.asarray(cell_ext[st])
            if e.dtype != np.int32 or e.shape != (p.shape[0], 3):
                raise ArgumentTypeError(f"cell_ext[{st}]: expected an int32 array of shape ({p.shape[0]}, 3)")
            ext.append(np.ascontiguousarray(e))
    return pos, seq, (ext if cell_ext is not None else None)


def _check_out(out: object, n_tokens: int, dtypes: tuple = (np.float32, np.float16)) -> tuple[int, int]:
    if not isinstance(out, np.ndarray):
        raise ArgumentTypeError("out: expected a NumPy array")
    if out.dtype not in dtypes:
        raise ArgumentTypeError(f"out: dtype {out.dtype} is not one of {', '.join(np.dtype(d).name for d in dtypes)}")
    if out.ndim != 3 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ArgumentError("out: expected a writeable C-contiguous array of shape (n_stream, n_tps, n_kv)")
    if out.shape[0] * out.shape[1] != n_tokens:
        raise ArgumentError(f"out: n_stream * n_tps = {out.shape[0] * out.shape[1]} != n_tokens = {n_tokens}")
    return out.shape[0], out.shape[2]


def _check_kq_args(
    out: object,
    cell_pos: Sequence[npt.ArrayLike],
    cell_seq: Sequence[npt.ArrayLike],
    cell_ext: Sequence[npt.ArrayLike] | None,
    seq_to_stream: npt.ArrayLike | None,
    tok_pos: npt.ArrayLike,
    tok_seq: npt.ArrayLike,
    tok_x: npt.ArrayLike | None,
    tok_y: npt.ArrayLike | None,
    n_swa: int,
    swa_type: int,
    non_causal_type: int,
) -> tuple[_I32, _I32, _I32, _I32 | None, _I32 | None, int, list[_I32], list[_U64], list[_I32] | None, int, int]:
    tok_pos = _as_i32_1d("tok_pos", tok_pos)
    tok_seq = _as_i32_1d("tok_seq", tok_seq)
    n_tokens = tok_pos.shape[0]
    if tok_seq.shape[0] != n_tokens:
        raise ArgumentError(f"tok_seq: {tok_seq.shape[0]} entries for {n_tokens} tokens")
    _, n_kv = _check_out(out, n_tokens)
    pos, seq, ext = _check_cells(cell_pos, cell_seq, cell_ext)
    if (tok_x is None) != (tok_y is None):
        raise ArgumentError("tok_x and tok_y: give both (2-D positions) or neither")
    x32: _I32 | None = None
    y32: _I32 | None = None
    if tok_x is not None and tok_y is not None:
        x32 = _as_i32_1d("tok_x", tok_x)
        y32 = _as_i32_1d("tok_y", tok_y)
        if x32.shape[0] != n_tokens or y32.shape[0] != n_tokens:
            raise ArgumentError("tok_x, tok_y: expected one entry per token")
        if ext is None:
            raise ArgumentError("cell_ext: required with 2-D token positions")
    tok_stream = _ZERO_STREAMS[:n_tokens]
    if n_tokens:
        if tok_pos.min() < 0:
            raise ArgumentError("tok_pos: positions must be >= 0")
        # one reduction per range check: read as unsigned, a negative id is larger than any valid one
        seq_hi = int(tok_seq.view(np.uint32).max())
        if seq_hi >= LLAMA_MAX_SEQ:
            raise ArgumentError(f"tok_seq: sequence ids must be in [0, {LLAMA_MAX_SEQ})")
        if seq_to_stream is not None:
            s2s = _as_i32_1d("seq_to_stream", seq_to_stream)
            if s2s.shape[0] <= seq_hi:
                raise ArgumentError(f"seq_to_stream: no entry for sequence {seq_hi}")
            tok_stream = s2s[tok_seq]
            if int(tok_stream.view(np.uint32).max()) >= len(pos):
                raise ArgumentError(f"seq_to_stream: stream ids must be in [0, {len(pos)})")
        elif n_tokens > _ZERO_STREAMS.shape[0]:
            tok_stream = np.zeros(n_tokens, dtype=np.int32)
    # n_kv must fit in every stream a token reads (all streams of a KVCache have the same size)
    if n_tokens and n_kv > min(p.shape[0] for p in pos):
        for st in np.unique(tok_stream):
            if n_kv > pos[st].shape[0]:
                raise ArgumentError(f"out: n_kv = {n_kv} exceeds the {pos[st].shape[0]} cells of stream {st}")
    swa_type = int(swa_type)
    n_swa = int(n_swa)
    if swa_type not in (0, 1, 2, 3):
        raise ArgumentError(f"swa_type: unknown value {swa_type}")
    if not 0 <= n_swa < N_SWA_MAX:
        raise ArgumentError(f"n_swa: {n_swa} is outside [0, {N_SWA_MAX})")
    if swa_type == 2 and n_swa == 0:
        raise ArgumentError("n_swa: a chunked window needs n_swa > 0")
    if int(non_causal_type) not in (0, 1, 2):
        raise ArgumentError(f"non_causal_type: unknown value {int(non_causal_type)}")
    return tok_pos, tok_seq, tok_stream, x32, y32, n_kv, pos, seq, ext, n_swa, swa_type


# --------------------------------------------------------------------------------------------- rules


def fill_kq_mask_raw(
    out: MaskArray,
    cell_pos: Sequence[npt.NDArray[np.int32]],
    cell_seq: Sequence[npt.NDArray[np.uint64]],
    cell_ext: Sequence[npt.NDArray[np.int32]] | None,
    seq_to_stream: npt.ArrayLike | None,
    tok_pos: npt.ArrayLike,
    tok_seq: npt.ArrayLike,
    *,
    tok_x: npt.ArrayLike | None = None,
    tok_y: npt.ArrayLike | None = None,
    n_swa: int = 0,
    swa_type: int = 0,
    causal: bool = True,
    non_causal_type: int = 0,
    alibi: bool = False,
) -> MaskArray:
    """Fill ``out`` (float32 or float16, ``(n_stream, n_tps, n_kv)``) with the KQ mask; return ``out``.

    ``cell_pos[st]`` int32[size], ``cell_seq[st]`` uint64[size, 4] and ``cell_ext[st]`` int32[size, 3] are the
    cells of cache stream ``st``; ``seq_to_stream`` maps a sequence id to its stream (None: all in stream 0).
    ``tok_pos`` / ``tok_seq`` are each token's position and first sequence id; ``tok_x`` / ``tok_y`` its 2-D
    M-RoPE position when the ubatch is 2-D (llama.cpp's ``pos[i + 2*n_tokens]`` and ``pos[i + n_tokens]``).
    """
    (tok_pos, tok_seq, tok_stream, tok_x, tok_y, n_kv, pos, seq, ext, n_swa, swa_type) = _check_kq_args(
        out,
        cell_pos,
        cell_seq,
        cell_ext,
        seq_to_stream,
        tok_pos,
        tok_seq,
        tok_x,
        tok_y,
        n_swa,
        swa_type,
        non_causal_type,
    )
    n_tokens = tok_pos.shape[0]
    # a non-causal SWA_ONLY model keeps the caches without a window causal
    if not causal and non_causal_type == NonCausalType.SWA_ONLY:
        causal = swa_type == 0
    causal = bool(causal)
    swa = swa_type != 0
    span = swa and not causal and non_causal_type == NonCausalType.SWA_FULL
    is_2d = tok_x is not None

    # each sequence's first position in the ubatch (the SWA_FULL span starts there)
    pos_min = np.full(LLAMA_MAX_SEQ, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(pos_min, tok_seq, tok_pos.astype(np.int64))

    rows = out.reshape(n_tokens, n_kv)
    # 0 and -inf are written as their bit patterns (float32 0xFF800000, float16 0xFC00): no float is computed
    # or converted for them; only ALiBi values go through float32 (then float16, rounded to nearest even)
    bits = rows.view(np.uint16 if out.dtype == np.float16 else np.uint32)
    keep, drop = np.zeros(1, out.dtype).view(bits.dtype)[0], np.full(1, -np.inf, out.dtype).view(bits.dtype)[0]
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(1, n_kv))
    for st in np.unique(tok_stream):
        toks = np.flatnonzero(tok_stream == st)
        p0 = pos[st][:n_kv].astype(np.int64)[None, :]
        words = seq[st][:n_kv]
        if is_2d and ext is not None:  # ext is given with 2-D positions (checked above)
            cx = ext[st][:n_kv, 0][None, :]
            cy = ext[st][:n_kv, 1][None, :]
        for c in range(0, toks.shape[0], step):
            idx = toks[c : c + step]
            p1 = tok_pos[idx].astype(np.int64)[:, None]
            s = tok_seq[idx]
            # the cell is used and holds the token's (first) sequence
            bit = (words[:, s >> 6].T >> (s & 63).astype(np.uint64)[:, None]) & np.uint64(1)
            att = (p0 != -1) & (bit != 0)
            if causal:
                att &= p0 <= p1
                if tok_x is not None and tok_y is not None:  # is_2d
                    x = tok_x[idx][:, None]
                    y = tok_y[idx][:, None]
                    later = (cy > y) | ((cy == y) & (cx > x))
                    att &= ~((p0 == p1) & later)
            if swa:
                masked = is_masked_swa(n_swa, swa_type, p0, p1)
                if span:
                    masked &= ~(p0 >= pos_min[s][:, None])
                att &= ~masked
            if not alibi:
                bits[idx] = np.where(att, keep, drop)
                continue
            # ALiBi: llama.cpp converts the int distance to float, then (f16 mask) the float to half
            val = (-np.abs(p0 - p1)).astype(np.float32)
            with np.errstate(over="ignore"):  # ALiBi distances beyond float16's range become -inf
                rows[idx] = np.where(att, val, np.float32(-np.inf)).astype(out.dtype)
    return out


# --------------------------------------------------------------------------------------------- T5 buckets


def _load_logf() -> Callable[[float], float] | None:
    name = ctypes.util.find_library("m")
    try:
        fn = ctypes.CDLL(name).logf if name else None
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


_LIBM_LOGF = _load_logf()


def _logf(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The C library's logf, elementwise: llama.cpp's bucket formula calls it, and neither NumPy's float32
    log nor a rounded float64 log agrees with glibc's logf to the last ulp, which can move a bucket."""
    x = np.asarray(x, dtype=np.float32)
    if _LIBM_LOGF is None:
        return np.log(x.astype(np.float64)).astype(np.float32)
    vals, inv = np.unique(x, return_inverse=True)
    res = np.array([_LIBM_LOGF(float(v)) for v in vals], dtype=np.float32)
    return res[inv].reshape(x.shape)


def relative_position_bucket(
    x: npt.ArrayLike, y: npt.ArrayLike, n_buckets: int, bidirectional: bool
) -> npt.NDArray[np.int32]:
    """llama_relative_position_bucket, elementwise: the T5 bucket of key position x seen from query y.

    Up to ``max_exact`` (half the buckets, of the half per direction when bidirectional) distances get
    their own bucket; beyond, buckets grow logarithmically up to ``max_distance = 128``. The arithmetic
    mirrors llama.cpp's mix of float and double steps (logf, then a double division, then floorf).
    """
    x = np.asarray(x, dtype=np.int32)
    y = np.asarray(y, dtype=np.int32)
    n_buckets = int(n_buckets)
    if n_buckets < 0 or n_buckets >= 2**32:
        raise ArgumentError(f"n_buckets: {n_buckets} is outside [0, 2**32)")
    max_distance = 128
    if bidirectional:
        n_buckets >>= 1
    max_exact = n_buckets >> 1
    if max_exact == 0:
        raise ArgumentError("n_buckets: needs at least 2 buckets (4 when bidirectional)")
    rel = x.astype(np.int64) - y.astype(np.int64)
    rel = ((rel + 2**31) % 2**32 - 2**31).astype(np.int64)  # llama.cpp subtracts in int32
    bucket = np.zeros(rel.shape, dtype=np.int64)
    if bidirectional:
        bucket += (rel > 0) * n_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    rel = np.where(rel == 2**31, -(2**31), rel)  # abs/negate of INT32_MIN stays INT32_MIN in C
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (rel.astype(np.float64) / max_exact).astype(np.float32)
        t = _logf(ratio) * np.float32(n_buckets - max_exact)
        u = max_exact + t.astype(np.float64) / math.log(max_distance / max_exact)
        large = np.floor(u.astype(np.float32))
    # float -> int32 of a NaN or out-of-range value is undefined in C; x86 gives INT32_MIN (hit when
    # max_exact >= max_distance, where the formula divides by log(1) = 0): both twins do the same
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(large) & (large >= -(2.0**31)) & (large < 2.0**31)
    large = np.where(ok, large, -(2.0**31)).astype(np.int64)
    large = np.minimum(large, n_buckets - 1)
    bucket += np.where(rel < max_exact, rel, large)
    return ((bucket + 2**31) % 2**32 - 2**31).astype(np.int32)


def fill_pos_bucket_raw(
    out: npt.NDArray[np.int32],
    key_pos: npt.ArrayLike,
    tok_pos: npt.ArrayLike,
    n_buckets: int,
    bidirectional: bool = False,
) -> npt.NDArray[np.int32]:
    """``out[i, j] = relative_position_bucket(key_pos[j], tok_pos[i], n_buckets, bidirectional)``.

    With a cache (set_input_pos_bucket) ``key_pos`` is the cells' positions, -1 for an empty cell, and the
    buckets are one-directional; without one (the encoder's input) ``key_pos`` is ``tok_pos`` and
    ``bidirectional`` is True.
    """
    key_pos = _as_i32_1d("key_pos", key_pos)
    tok_pos = _as_i32_1d("tok_pos", tok_pos)
    if not isinstance(out, np.ndarray) or out.dtype != np.int32:
        raise ArgumentTypeError("out: expected an int32 NumPy array")
    if out.shape != (tok_pos.shape[0], key_pos.shape[0]) or not out.flags.c_contiguous or not out.flags.writeable:
        shape = (tok_pos.shape[0], key_pos.shape[0])
        raise ArgumentError(f"out: expected a writeable C-contiguous array of shape {shape}")
    out[...] = relative_position_bucket(key_pos[None, :], tok_pos[:, None], n_buckets, bidirectional)
    return out


# --------------------------------------------------------------------------------------------- K-shift


def fill_k_shift_raw(
    out: npt.NDArray[np.int32], cell_pos: Sequence[npt.NDArray[np.int32]], cell_shift: Sequence[npt.NDArray[np.int32]]
) -> npt.NDArray[np.int32]:
    """set_input_k_shift: ``out[st, j]`` = the pending shift of cell j of stream st, 0 for an empty cell."""
    if not isinstance(out, np.ndarray) or out.dtype != np.int32:
        raise ArgumentTypeError("out: expected an int32 NumPy array")
    if len(cell_pos) != len(cell_shift) or out.ndim != 2 or out.shape[0] != len(cell_pos):
        raise ArgumentError("out: expected shape (n_stream, size) with one cell_pos and cell_shift per stream")
    for st in range(len(cell_pos)):
        p = np.asarray(cell_pos[st])
        sh = np.asarray(cell_shift[st])
        if p.dtype != np.int32 or sh.dtype != np.int32 or p.shape != (out.shape[1],) or sh.shape != p.shape:
            raise ArgumentTypeError(f"cell_pos[{st}], cell_shift[{st}]: expected int32 arrays of {out.shape[1]} cells")
        out[st] = np.where(p == -1, 0, sh)
    return out


def first_seq_ids(seq_id: list[list[int]], n_tokens: int) -> npt.NDArray[np.int32]:
    """Each token's first sequence id, ``seq_id[i][0]`` for the first ``n_tokens`` tokens of a ubatch, as int32 (the
    row's sequence in set_input_kq_mask)."""
    return np.fromiter((ids[0] for ids in seq_id[:n_tokens]), dtype=np.int32, count=n_tokens)


__all__ = [
    "LLAMA_MAX_SEQ",
    "N_SWA_MAX",
    "NonCausalType",
    "fill_k_shift_raw",
    "fill_kq_mask_raw",
    "fill_pos_bucket_raw",
    "first_seq_ids",
    "is_masked_swa",
    "relative_position_bucket",
]
