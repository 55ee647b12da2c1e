"""Shared helpers of the recurrent / hybrid tests: hand-built ubatches and model hyper-parameters."""

from __future__ import annotations

import numpy as np

import kvref
from kvref.memory.batch import UBatch

LLAMA_MAX_SEQ = 256


def ubatch(*seqs: tuple[list[int] | int, list[int]]) -> UBatch:
    """An equal-split ubatch: ``seqs`` are ``(seq ids, positions)`` per sequence set, all the same length.

    Tokens are laid out sequence set after sequence set, as llama_batch_allocr::split_equal does.
    """
    seqs = [([s] if isinstance(s, int) else list(s), list(p)) for s, p in seqs]
    n_seq_tokens = len(seqs[0][1])
    assert all(len(p) == n_seq_tokens for _, p in seqs)
    seq_id = [ids for ids, p in seqs for _ in p]
    pos = np.array([x for _, p in seqs for x in p], np.int32)
    n = len(pos)
    unq = sorted({s for ids, _ in seqs for s in ids})
    idx = np.full(LLAMA_MAX_SEQ, -1, np.int32)
    for k, s in enumerate(unq):
        idx[s] = k
    return UBatch(
        equal_seqs=True,
        n_tokens=n,
        n_seq_tokens=n_seq_tokens,
        n_seqs=len(seqs),
        n_seqs_unq=len(unq),
        n_pos=1,
        token=np.zeros(n, np.int32),
        embd=None,
        pos=pos,
        n_seq_id=np.array([len(s) for s in seq_id], np.int32),
        seq_id=seq_id,
        seq_id_unq=unq,
        seq_idx=idx,
        output=np.zeros(n, np.int8),
        batch_idxs=np.arange(n, dtype=np.int32),
    )


def mamba_hparams(n_layer: int = 2, d_state: int = 8, **kw) -> kvref.HParams:
    """mamba-tiny of the conformance suite: d_conv 4, d_inner 64, d_state 8 -> n_embd_r 192, n_embd_s 512.

    ``kw`` (n_ctx_train, ...) goes to HParams as is.
    """
    return kvref.HParams(
        arch="mamba",
        n_layer=n_layer,
        n_embd=32,
        n_head=0,
        n_head_kv=0,
        recurrent_layers=True,
        rope_type=kvref.RopeType.NONE,
        ssm_d_conv=4,
        ssm_d_inner=64,
        ssm_d_state=d_state,
        **kw,
    )


def jamba_hparams(recurrent_layers: list[bool], arch: str = "jamba", **kw) -> kvref.HParams:
    """A jamba-like hybrid: n_embd 64, 2 heads of dim 32 on the attention layers (``recurrent_layers`` False),
    Mamba-1 d_conv 4, d_inner 128, d_state 8 on the others.  ``kw`` (n_head_kv, ...) goes to HParams as is."""
    return kvref.HParams(
        arch=arch,
        n_layer=len(recurrent_layers),
        n_embd=64,
        n_head=2,
        n_embd_head_k=32,
        n_embd_head_v=32,
        recurrent_layers=recurrent_layers,
        ssm_d_conv=4,
        ssm_d_inner=128,
        ssm_d_state=8,
        **kw,
    )
