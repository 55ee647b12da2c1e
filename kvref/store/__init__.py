"""kvref.store: llama.cpp prompt prefixes kept once, served token-exactly, on disk or on Redis.

A stored state is cut into chunks of tokens keyed by a hash chain (namespace, previous chunk, tokens), so a
prefix many prompts share is kept once; ``get`` serves the longest prefix a prompt shares with anything stored,
cut at the very token where they part, and only as far as the state really holds it (the SWA window before the
cut, a recurrent checkpoint), as the state file the caller's llama.cpp loads::

    store = kvref.store.open("/var/cache/kvref")      # or "redis://host:6379/0"; capacity_bytes=, chunk_tokens=
    store.put("slot0.bin", model="m.gguf")             # path | bytes | llama_cpp.LlamaState
    hit = store.get(tokens, model="m.gguf", kind="seq_state", seq_id=0)   # None, or .n_tokens and .data
    store.lookup(tokens, model="m.gguf")               # how much is servable, and why not more
    store.stats(); store.gc(max_bytes=...)
    llm.set_cache(kvref.store.LlamaCache("/var/cache/kvref", capacity_bytes=8 << 30))   # llama-cpp-python

Layers: `backend` (the interface; `sqlite_backend`, `redis_backend`), `model_id` (the weights' fingerprint),
`namespace` (what must match), `chunks` (records and the cut), `prefix` (the store), `llama_cache`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .prefix import KINDS, Hit, Lookup, Store, Stored

if TYPE_CHECKING:
    from .llama_cache import LlamaCache


def open(url: str | os.PathLike[str], *, capacity_bytes: int | None = None, chunk_tokens: int | None = None) -> Store:
    """A `Store` on ``url``: a directory (the embedded default, no server), ``sqlite:///path``,
    ``redis://host:port/db`` (or ``rediss://``, ``unix://``; shared by several servers) or ``memory:``.
    ``capacity_bytes`` bounds the bytes kept (least recently used chunks go first); ``chunk_tokens`` (default
    256) is fixed when the store is made."""
    from .backends import open_backend

    return Store(open_backend(url), capacity_bytes=capacity_bytes, chunk_tokens=chunk_tokens)


def __getattr__(name: str) -> object:
    if name == "LlamaCache":
        from .llama_cache import LlamaCache

        return LlamaCache
    raise AttributeError(f"module 'kvref.store' has no attribute {name!r}")


__all__ = ["KINDS", "Hit", "LlamaCache", "Lookup", "Store", "Stored", "open"]
