"""Shared helpers of the mask tests: the twins fixture, raw cell builders and a per-cell oracle.

The oracle is a literal cell-by-cell statement of llama_kv_cache::set_input_kq_mask's rules (written from
the C++ conditions, not from either twin), used by the hypothesis cross-checks.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from conftest import NOT_BUILT

from kvref._backend import _load_compiled
from kvref.hparams import is_masked_swa
from kvref.memory import _mask_py

NEG_INF = float("-inf")


MASK_C = _load_compiled("memory.mask")  # None only in a KVREF_BACKEND=python run (see conftest.pytest_configure)


def twin_params() -> list:
    c = pytest.param(MASK_C, id="c")
    if MASK_C is None:
        c = pytest.param(None, id="c", marks=pytest.mark.skip(reason=NOT_BUILT))
    return [pytest.param(_mask_py, id="py"), c]


def need(mod: ModuleType | None) -> ModuleType:
    if mod is None:
        pytest.fail("KVREF_BACKEND=cython but the extension kvref.memory._mask_c is not built")
    return mod


def seq_bits(sets: list[set[int] | list[int]]) -> np.ndarray:
    """uint64[n, 4] bitsets from per-cell lists of sequence ids."""
    out = np.zeros((len(sets), 4), dtype=np.uint64)
    for j, ids in enumerate(sets):
        for s in ids:
            out[j, s >> 6] |= np.uint64(1) << np.uint64(s & 63)
    return out


def cells(pos: list[int], seqs: list[set[int] | list[int]] | None = None, ext: list[tuple[int, int]] | None = None):
    """(pos, seq, ext) arrays of one stream; default: every used cell in sequence 0."""
    p = np.asarray(pos, dtype=np.int32)
    if seqs is None:
        seqs = [set() if q == -1 else {0} for q in pos]
    e = np.zeros((len(pos), 3), dtype=np.int32)
    e[:, 2] = -1
    if ext is not None:
        e[:, :2] = np.asarray(ext, dtype=np.int32).reshape(len(pos), 2)
    return p, seq_bits(seqs), e


def oracle(
    shape: tuple[int, int, int],
    dtype,
    cell_pos,
    cell_seq,
    cell_ext,
    seq_to_stream,
    tok_pos,
    tok_seq,
    tok_x=None,
    tok_y=None,
    n_swa=0,
    swa_type=0,
    causal=True,
    non_causal_type=0,
    alibi=False,
) -> np.ndarray:
    """The mask, cell by cell, from the C++ conditions."""
    n_kv = shape[2]
    n_tokens = len(tok_pos)
    if seq_to_stream is None:
        seq_to_stream = [0] * 256
    if not causal and non_causal_type == 1:  # SWA_ONLY: only windowed caches go bidirectional
        causal = swa_type == 0
    pos_min: dict[int, int] = {}
    for i in range(n_tokens):
        s = int(tok_seq[i])
        pos_min[s] = min(pos_min.get(s, 2**31), int(tok_pos[i]))
    res = np.full((n_tokens, n_kv), NEG_INF, dtype=np.float32)
    for i in range(n_tokens):
        s = int(tok_seq[i])
        st = int(seq_to_stream[s])
        p1 = int(tok_pos[i])
        for j in range(n_kv):
            p0 = int(cell_pos[st][j])
            if p0 == -1:
                continue
            if not (int(cell_seq[st][j, s >> 6]) >> (s & 63)) & 1:
                continue
            if causal:
                if p0 > p1:
                    continue
                if tok_x is not None and p0 == p1:
                    cx, cy = int(cell_ext[st][j, 0]), int(cell_ext[st][j, 1])
                    if cy > int(tok_y[i]) or (cy == int(tok_y[i]) and cx > int(tok_x[i])):
                        continue
            if swa_type != 0:
                in_span = (not causal) and non_causal_type == 2 and p0 >= pos_min[s]
                if not in_span and is_masked_swa(n_swa, swa_type, p0, p1):
                    continue
            res[i, j] = np.float32(-abs(p0 - p1)) if alibi else 0.0
    with np.errstate(over="ignore"):  # ALiBi distances beyond float16 become -inf, as in llama.cpp
        return res.astype(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit (so +0 / -0 and the -inf pattern count)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
