"""The public path of the graph inputs (``from kvref.mask import fill_kq_mask``); the module is
``kvref.memory.mask``."""

from __future__ import annotations

from .memory.mask import (
    BACKEND,
    NonCausalType,
    attention_cache,
    fill_k_shift_raw,
    fill_kq_mask,
    fill_kq_mask_raw,
    fill_pos_bucket,
    fill_pos_bucket_raw,
    k_idxs,
    k_shift_input,
    mask_n_kv,
    relative_position_bucket,
    v_idxs,
)

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
