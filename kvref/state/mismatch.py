"""Messages for a state that does not fit the memory it is restored into, each naming the setting that fixes it.

The parse-time checks (``sections.py``, while reading against a cache) and the whole-section checks
(``cache_api.py``) both word a mismatch through these, so a user sees the same hint whichever check fires first.
"""

from __future__ import annotations

from ..ggml.types import type_name


def n_stream(found: int, cache: int) -> str:
    fix = "kv_unified=True" if found == 1 else f"kv_unified=False and n_seq_max={found}"
    return f"n_stream {found}, the cache has {cache}: the file was written by a context with {fix}"


def v_trans(found: int, cache: bool) -> str:
    # llama.cpp transposes V exactly when flash attention is off
    fa = "off" if found else "on"
    return (
        f"v_trans {found}, the cache has {int(cache)}: the file was written with flash attention {fa}; "
        f"build the memory with flash_attn={not found}"
    )


def layer_type(il: int, prefix: str, found: int, want: int) -> str:
    return (
        f"layer {il}: {prefix} type {type_name(found)}, the cache has {type_name(want)}: the file was written with "
        f"type_{prefix}={type_name(found)!r}; build the memory with that type, or retype the file"
    )


def row_size(il: int, prefix: str, found: int, want: int) -> str:
    return (
        f"layer {il}: {prefix} row size {found}, the cache has {want}: the file was written by a model of another "
        "shape (head count or head size)"
    )


def cell_count(found: int, size: int) -> str:
    return (
        f"cell_count {found} exceeds the cache size {size}: build the memory with a larger n_ctx "
        f"(at least {found} cells per stream)"
    )
