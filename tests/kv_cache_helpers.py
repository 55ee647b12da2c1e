"""Shared helpers of the KV cache tests: a small hyper-parameter object, hand-built ubatches, snapshots."""

from __future__ import annotations

import numpy as np

from kvref.hparams import HParams, RopeType, SWAType
from kvref.memory.batch import UBatch
from kvref.memory.kv_cache import KVCache

LLAMA_MAX_SEQ = 256


def HP(
    n_layer: int = 2,
    n_head_kv: int = 2,
    n_embd_head: int = 8,
    n_embd_head_v: int | None = None,
    swa: list[bool] | None = None,
    rope_type: RopeType = RopeType.NORM,
    n_rot: int = 8,
    rope_freq_base: float = 10000.0,
    rope_freq_scale: float = 1.0,
    rope_freq_base_swa: float | None = None,
    rope_freq_scale_swa: float | None = None,
    n_pos: int = 1,
    kv_from_start: int = -1,
) -> HParams:
    """A small HParams for cache tests; ``n_pos=4`` makes it an M-RoPE model."""
    return HParams(
        n_layer=n_layer, n_head=n_head_kv, n_head_kv=n_head_kv, n_embd_head_k=n_embd_head,
        n_embd_head_v=n_embd_head_v or n_embd_head, swa_layers=swa or False,
        swa_type=SWAType.STANDARD if swa else SWAType.NONE, n_swa=4 if swa else 0,
        rope_type=RopeType.MROPE if n_pos == 4 else rope_type, n_rot=n_rot, rope_freq_base=rope_freq_base,
        rope_freq_scale=rope_freq_scale, rope_freq_base_swa=rope_freq_base_swa,
        rope_freq_scale_swa=rope_freq_scale_swa, n_layer_kv_from_start=kv_from_start,
    )  # fmt: skip


def ub(
    tokens: list[tuple[int | list[int], int]], token_ids: bool = True, pos2d: list[tuple[int, int]] | None = None
) -> UBatch:
    """A ubatch from ``(seq id(s), pos)`` per token, in the given order (no splitter involved)."""
    seq_id = [[s] if isinstance(s, int) else list(s) for s, _ in tokens]
    n = len(tokens)
    pos = np.array([p for _, p in tokens], np.int32)
    n_pos = 1
    if pos2d is not None:
        # M-RoPE layout: blocks of n_tokens: t, y, x, (4th section)
        ys = np.array([y for _, y in pos2d], np.int32)
        xs = np.array([x for x, _ in pos2d], np.int32)
        pos = np.concatenate([pos, ys, xs, np.zeros(n, np.int32)])
        n_pos = 4
    unq: list[int] = []
    for ids in seq_id:
        for s in ids:
            if s not in unq:
                unq.append(s)
    unq.sort()
    idx = np.full(LLAMA_MAX_SEQ, -1, np.int32)
    for k, s in enumerate(unq):
        idx[s] = k
    n_seqs_unq = len(unq)
    return UBatch(
        equal_seqs=False, n_tokens=n, n_seq_tokens=n // max(1, n_seqs_unq) if n_seqs_unq else n,
        n_seqs=n_seqs_unq, n_seqs_unq=n_seqs_unq, n_pos=n_pos,
        token=np.arange(100, 100 + n, dtype=np.int32) if token_ids else None,
        embd=None if token_ids else np.zeros((n, 4), np.float32),
        pos=pos, n_seq_id=np.array([len(s) for s in seq_id], np.int32), seq_id=seq_id, seq_id_unq=unq,
        seq_idx=idx, output=np.zeros(n, np.int8), batch_idxs=np.arange(n, dtype=np.int32),
    )  # fmt: skip


def seq_run(seq: int, p0: int, n: int) -> list[tuple[int, int]]:
    return [(seq, p) for p in range(p0, p0 + n)]


def snapshot(cache: KVCache) -> tuple:
    """Everything observable about the cells and heads, for before/after comparisons."""
    streams = []
    for s in range(cache.get_n_stream()):
        c = cache.cells(s)
        streams.append((
            np.asarray(c.pos).tolist(), np.asarray(c.shift).tolist(), np.asarray(c.ext).tolist(),
            np.asarray(c.seq).tolist(), c.get_used(), c.get_has_shift(),
            tuple(tuple(c.seq_pos_get(q)) for q in range(LLAMA_MAX_SEQ)),
        ))  # fmt: skip
    return tuple(streams), tuple(cache.heads), tuple(cache.pending_stream_copies())


def layout(cache: KVCache, stream: int = 0) -> list[str]:
    """Compact cell picture: '.' empty, else 'pos:seqs' (e.g. '3:0' or '5:0,1')."""
    c = cache.cells(stream)
    out = []
    for i in range(c.size()):
        if c.is_empty(i):
            out.append(".")
        else:
            out.append(f"{c.pos_get(i)}:{','.join(map(str, c.seq_get_all(i)))}")
    return out


def place(cache: KVCache, tokens: list[tuple[int | list[int], int]], cont: bool = False):
    """find_slot + apply_ubatch for one hand-built ubatch (what decode does for a single ubatch)."""
    u = ub(tokens)
    sinfo = cache.find_slot(u, cont)
    assert sinfo is not None, "no slot"
    cache.apply_ubatch(sinfo, u)
    return sinfo
