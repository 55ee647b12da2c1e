"""Type stub of the Cython mask twin; the API is the Python twin's (``kvref/memory/_mask_py.py``)."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvref.memory._mask_py import LLAMA_MAX_SEQ as LLAMA_MAX_SEQ
from kvref.memory._mask_py import N_SWA_MAX as N_SWA_MAX
from kvref.memory._mask_py import NonCausalType as NonCausalType
from kvref.memory._mask_py import is_masked_swa as is_masked_swa

def fill_kq_mask_raw(
    out: np.ndarray,
    cell_pos: Sequence[np.ndarray],
    cell_seq: Sequence[np.ndarray],
    cell_ext: Sequence[np.ndarray] | None,
    seq_to_stream: Any,
    tok_pos: Any,
    tok_seq: Any,
    *,
    tok_x: Any = None,
    tok_y: Any = None,
    n_swa: int = 0,
    swa_type: int = 0,
    causal: bool = True,
    non_causal_type: int = 0,
    alibi: bool = False,
) -> np.ndarray: ...
def relative_position_bucket(x: Any, y: Any, n_buckets: int, bidirectional: bool) -> np.ndarray: ...
def fill_pos_bucket_raw(
    out: np.ndarray, key_pos: Any, tok_pos: Any, n_buckets: int, bidirectional: bool = False
) -> np.ndarray: ...
def fill_k_shift_raw(
    out: np.ndarray, cell_pos: Sequence[np.ndarray], cell_shift: Sequence[np.ndarray]
) -> np.ndarray: ...
def first_seq_ids(seq_id: list[list[int]], n_tokens: int) -> np.ndarray: ...

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
