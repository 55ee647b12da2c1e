"""The shim of the bindings of 2024, which predate llama.cpp's memory API (``llama_memory_*``, ``llama_model_*``):
llama-cpp-python 0.2.x (generate_legacy.py) and 0.3.0 .. 0.3.9 (generate.py, autumn 2024).

In those bindings the cache is the context's (``llama_kv_cache_*`` take the context), and there is no
``seq_pos_min``. `install_shim` gives the module the names driver.py calls, each one the 2024 call that does the same,
so that the cases run the same scripts as every other golden (generate.py) and write the same case.json. Two 2024
calls answer differently and are replaced: ``llama_kv_cache_seq_pos_max`` gives 0 (not -1) for a sequence without
cells, so the positions come from the cache view, and ``llama_n_seq_max`` gives the cache size, so it gives the
context's ``n_seq_max`` instead. The context is seeded (`RNG_SEED`): the session files of this era carry the sampler's
random-number generator, which llama.cpp otherwise seeds from the clock, so a rerun writes identical files.
`record_caches` and `memory_block` describe the cache as its view reports it (that llama.cpp logs only buffer sizes).

generate.py and generate_legacy.py both import this module; generate_legacy.py also imports generate.py (its cases
and runner), and generate.py imports neither back.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llama_cpp as L  # noqa: E402

RNG_SEED = 1234  # llama_context_params.seed: the state of the rng string in every session file


_N_SEQ_MAX: dict[int, int] = {}  # context address -> its n_seq_max
_CACHES: list[dict] = []  # the cache of the context made last, as its view reports it
_RECURRENT: dict[int, bool] = {}  # context address -> the model is recurrent


def _key(ctx) -> int:
    return int(ctypes.cast(ctx, ctypes.c_void_p).value)


def _seq_pos_min_max(ctx, seq_id: int) -> tuple[int, int]:
    """The smallest and largest position of ``seq_id`` in the cache (-1, -1 when it holds none), from the
    cache view (positions include a pending shift: the cases here shift nothing)."""
    n_seq = _N_SEQ_MAX[_key(ctx)]
    view = L.llama_kv_cache_view_init(ctx, n_seq)
    try:
        L.llama_kv_cache_view_update(ctx, ctypes.byref(view))
        pos = [
            view.cells[i].pos
            for i in range(view.n_cells)
            if seq_id in view.cells_sequences[i * n_seq : (i + 1) * n_seq]
        ]
    finally:
        L.llama_kv_cache_view_free(ctypes.byref(view))
    return (min(pos), max(pos)) if pos else (-1, -1)


def meta(model, key: str) -> str | None:
    """A metadata value of the loaded model as llama.cpp holds it (llama_model_meta_val_str), or None."""
    buf = ctypes.create_string_buffer(256)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def _meta_int(model, name: str, default: int) -> int:
    """``<arch>.<name>`` as an int (these bindings have no llama_model_n_head & co.), or ``default``."""
    v = meta(model, f"{meta(model, 'general.architecture')}.{name}")
    return int(v) if v is not None else default


def install_shim() -> None:
    """Give the bindings of 2024 (0.2.x, 0.3.0 .. 0.3.9: no memory API) the names driver.py calls, each the call of
    that era that does the same."""

    def init_from_model(model, params):
        params.seed = RNG_SEED
        ctx = L.llama_new_context_with_model(model, params)
        if ctx:
            _N_SEQ_MAX[_key(ctx)] = int(params.n_seq_max)
            _RECURRENT[_key(ctx)] = bool(L.llama_model_is_recurrent(model))
            view = L.llama_kv_cache_view_init(ctx, 1)
            L.llama_kv_cache_view_update(ctx, ctypes.byref(view))
            _CACHES[:] = [
                {
                    # this llama.cpp logs only buffer sizes: the cell count is the view's, the layers the model's
                    "module": "llama_kv_cache (recurrent)" if _RECURRENT[_key(ctx)] else "llama_kv_cache",
                    "cells": int(view.n_cells),
                    "layers": int(L.llama_n_layer(model)),
                    "n_seq_max": int(params.n_seq_max),
                }
            ]
            L.llama_kv_cache_view_free(ctypes.byref(view))
        return ctx

    def can_shift(ctx) -> bool:
        # no such call in 2024: llama_kv_cache_seq_add shifts every cache (a recurrent one: its positions only),
        # and llama_kv_cache_update K-shifts a RoPE cache, aborting for DeepSeek2 only (no case uses it)
        return True

    # calls renamed since: the old name, where the bindings lack the new one (0.3.8 already has llama_model_*)
    renamed = {
        "llama_model_load_from_file": "llama_load_model_from_file",
        "llama_model_free": "llama_free_model",
        "llama_model_n_layer": "llama_n_layer",
        "llama_model_n_embd": "llama_n_embd",
        "llama_model_rope_type": "llama_rope_type",
        "llama_model_n_ctx_train": "llama_n_ctx_train",
        "llama_vocab_n_tokens": "llama_n_vocab",
    }
    for name, old in renamed.items():
        if not hasattr(L, name):
            setattr(L, name, getattr(L, old))
    missing = {
        # read off the model's metadata, with llama.cpp's defaults: no heads (Mamba), n_head_kv = n_head, no window
        "llama_model_n_head": lambda m: _meta_int(m, "attention.head_count", 0),
        "llama_model_n_head_kv": lambda m: _meta_int(
            m, "attention.head_count_kv", _meta_int(m, "attention.head_count", 0)
        ),
        "llama_model_n_swa": lambda m: _meta_int(m, "attention.sliding_window", 0),
        "llama_model_get_vocab": lambda m: m,
    }
    for name, fn in missing.items():
        if not hasattr(L, name):
            setattr(L, name, fn)
    # the context and its cache as driver.py reads them (the bindings' own llama_init_from_model, where it exists,
    # neither seeds the rng nor records the cache)
    L.llama_init_from_model = init_from_model
    names = {
        "llama_get_memory": lambda ctx: ctx,  # the cache is the context's
        "llama_memory_can_shift": can_shift,
        "llama_memory_seq_pos_min": lambda ctx, s: _seq_pos_min_max(ctx, s)[0],
        "llama_memory_seq_pos_max": lambda ctx, s: _seq_pos_min_max(ctx, s)[1],
        "llama_memory_seq_rm": L.llama_kv_cache_seq_rm,
        "llama_memory_seq_cp": L.llama_kv_cache_seq_cp,
        "llama_memory_seq_keep": L.llama_kv_cache_seq_keep,
        "llama_memory_seq_add": L.llama_kv_cache_seq_add,
        "llama_memory_seq_div": L.llama_kv_cache_seq_div,
        "llama_memory_clear": lambda ctx, data=True: L.llama_kv_cache_clear(ctx),
    }
    for name, fn in names.items():
        assert not hasattr(L, name), f"{name}: these bindings have it, do not replace it"
        setattr(L, name, fn)
    L.llama_n_seq_max = lambda ctx: _N_SEQ_MAX[_key(ctx)]


def record_caches() -> None:
    """Make driver.py's parse of llama.cpp's log list the cache of the context made last (`_CACHES`, as its view
    reports it): that llama.cpp logs only buffer sizes."""
    import driver

    parse_log = driver._parse_memory_log

    def parse_memory_log(lines) -> dict:
        log = parse_log(lines)
        return {**log, "caches": [*log["caches"], *_CACHES]}

    driver._parse_memory_log = parse_memory_log


def memory_block(case, hp: dict, octx: dict | None) -> dict:
    """generate.memory_block for the bindings of 2024: one cache of n_ctx cells (padded by llama.cpp), or
    max(1, n_seq_max) recurrent cells, as the cache view reports them (that llama.cpp logs only buffer sizes)."""
    import driver

    kind = driver.memory_kind(hp)
    mem = {
        "type": kind,
        "v_trans": (not case.flash_attn) if kind != "recurrent" else None,
        "n_stream": 1,
        "cell_ext": False,
        "kv_size": None,
        "kv_size_swa": None,
        "rs_size": None,
    }
    if octx is None:
        return mem
    (cache,) = octx["memory_log"]["caches"]
    if kind == "kv":
        mem["kv_size"] = cache["cells"]
        assert cache["cells"] == octx["n_ctx"], (case.id, cache, octx["n_ctx"])
    elif kind == "recurrent":
        mem["rs_size"] = cache["cells"]
        assert cache["cells"] == max(1, case.n_seq_max), (case.id, cache)
    else:
        raise ValueError(f"{kind}: llama.cpp of 2024 has no such memory")
    return mem
