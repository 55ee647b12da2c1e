"""A small driver of the real llama.cpp (llama-cpp-python's low-level ctypes API) for the live tests.

`Ctx` owns one context of a model loaded once per path: decode a prompt for a sequence, read the logits of the
last token, save / load session and sequence files, remove cells. Only tests marked ``live`` import it; importing
it skips the importing module, with the reason, where llama-cpp-python cannot be imported.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

try:
    import llama_cpp as L
except Exception as exc:  # not installed, or installed but broken (a missing shared library, ...)
    # raised while a test module imports this one: pytest skips that whole module, with the reason
    pytest.skip(
        f"llama_cpp cannot be imported ({type(exc).__name__}: {exc}): the live tests need the real llama.cpp "
        "(pip install llama-cpp-python)",
        allow_module_level=True,
    )

GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
_models: dict[str, object] = {}


@L.llama_log_callback
def _quiet(level, text, user):  # type: ignore[no-untyped-def]
    return None


def _model(path: Path) -> object:
    key = str(path)
    if key not in _models:
        L.llama_log_set(_quiet, None)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        m = L.llama_model_load_from_file(key.encode(), mp)
        assert m, f"llama.cpp could not load {path}"
        _models[key] = m
    return _models[key]


class Ctx:
    """One llama.cpp context: ``n_ctx``, ``n_seq_max``, ``kv_unified``, ``flash_attn``, f16 K/V, one thread."""

    def __init__(self, model: Path, n_ctx: int = 256, n_seq_max: int = 1, kv_unified: bool = True,
                 flash_attn: bool = False, swa_full: bool = False) -> None:  # fmt: skip
        self.model = _model(model)
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq_max
        p.n_threads = p.n_threads_batch = 1
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = GGML_TYPES["f16"]
        p.kv_unified, p.swa_full = kv_unified, swa_full
        p.offload_kqv = p.op_offload = False
        p.no_perf, p.embeddings = True, False
        self.ctx = L.llama_init_from_model(self.model, p)
        assert self.ctx, "llama_init_from_model failed"
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def close(self) -> None:
        """Free the context (the model stays loaded for the next one)."""
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> Ctx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pos_max(self, seq: int) -> int:
        """llama_memory_seq_pos_max."""
        return int(L.llama_memory_seq_pos_max(self.mem, seq))

    def decode(self, tokens: list[int], seq: int = 0, start: int | None = None) -> np.ndarray:
        """Decode ``tokens`` for ``seq`` at positions after its last one (or from ``start``); returns the logits of
        the last token (a copy)."""
        if start is None:
            start = self.pos_max(seq) + 1
        n = len(tokens)
        b = L.llama_batch_init(n, 0, 1)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = int(t), start + i, 1
            b.seq_id[i][0] = seq
            b.logits[i] = int(i == n - 1)
        ret = int(L.llama_decode(self.ctx, b))
        L.llama_batch_free(b)
        assert ret == 0, f"llama_decode returned {ret}"
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """llama_memory_seq_rm."""
        return bool(L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def save_session(self, path: Path, tokens: list[int]) -> None:
        """llama_state_save_file."""
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        assert L.llama_state_save_file(self.ctx, str(path).encode(), arr, len(tokens))

    def save_seq(self, path: Path, seq: int, tokens: list[int]) -> None:
        """llama_state_seq_save_file."""
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        assert L.llama_state_seq_save_file(self.ctx, str(path).encode(), seq, arr, len(tokens)) > 0

    def load_session(self, path: Path) -> list[int]:
        """llama_state_load_file; returns the token list (asserts success)."""
        arr = (L.llama_token * 4096)()
        n = ctypes.c_size_t(0)
        ok = L.llama_state_load_file(self.ctx, str(path).encode(), arr, 4096, ctypes.byref(n))
        assert ok, f"llama_state_load_file refused {path}"
        return [int(arr[i]) for i in range(n.value)]

    def load_seq(self, path: Path, dest: int) -> list[int]:
        """llama_state_seq_load_file into ``dest``; returns the token list (asserts success)."""
        arr = (L.llama_token * 4096)()
        n = ctypes.c_size_t(0)
        ret = L.llama_state_seq_load_file(self.ctx, str(path).encode(), dest, arr, 4096, ctypes.byref(n))
        assert ret > 0, f"llama_state_seq_load_file refused {path}"
        return [int(arr[i]) for i in range(n.value)]
