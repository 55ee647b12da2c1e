"""The public path of the KV cells (``from kvref.cells import KVCells``): the selector is ``kvref.memory.cells``."""

from __future__ import annotations

from .memory.cells import BACKEND, LLAMA_MAX_SEQ, N_SEQ_WORDS, POS_MAX, TOKEN_NULL, KVCells

__all__ = ["BACKEND", "LLAMA_MAX_SEQ", "N_SEQ_WORDS", "POS_MAX", "TOKEN_NULL", "KVCells"]
