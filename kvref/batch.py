"""Batches and ubatches (llama.cpp's llama_batch / llama_ubatch and llama_batch_allocr's splitter).

CONTRACT (lead): the UBatch fields below mirror llama_ubatch and are what KVCache and the mask read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UBatch:
    """One micro-batch as llama_ubatch holds it.

    ``pos`` has ``n_tokens * n_pos`` entries laid out as llama.cpp lays them: ``n_pos`` blocks of
    ``n_tokens`` (block 0 the sequential position; for M-RoPE blocks 1 and 2 are y and x).
    ``seq_id[i]`` is the list of sequence ids of token i. ``seq_idx`` maps a seq id to its index in
    ``seq_id_unq`` (-1 when absent), like llama.cpp's [LLAMA_MAX_SEQ] array.
    """

    equal_seqs: bool
    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    n_seqs_unq: int
    n_pos: int
    token: np.ndarray | None  # int32[n_tokens]
    embd: np.ndarray | None  # float32[n_tokens, n_embd]
    pos: np.ndarray  # int32[n_tokens * n_pos]
    n_seq_id: np.ndarray  # int32[n_tokens]
    seq_id: list[list[int]]
    seq_id_unq: list[int]
    seq_idx: np.ndarray  # int32[LLAMA_MAX_SEQ]
    output: np.ndarray  # int8[n_tokens]
    batch_idxs: np.ndarray  # int32[n_tokens]: index of each token in the original batch

    def is_pos_2d(self) -> bool:
        return self.n_pos >= 3
