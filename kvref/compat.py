"""Which llama.cpp generation a memory reproduces: the ``compat`` switch.

kvref follows llama.cpp as vendored by llama-cpp-python 0.3.36 (October 2026) by default. Where the
llama.cpp of 2025 (vendored by llama-cpp-python 0.3.16, commit 4227c9b) behaves differently, a memory
built with ``compat="2025"`` reproduces the older behaviour. ``create_memory(..., compat=...)`` passes the
switch down to every memory it builds; each difference is documented where it applies:

================================  ======================================  ======================================
difference                        ``"2026-10"`` (default)                  ``"2025"``
================================  ======================================  ======================================
context sizing                    n_ctx padded to 256; non-unified         no context padding; the memory pads:
(``memory.context_params``)       streams ``pad(n_ctx / n_seq_max, 256)``  32 cells (256 with flash attention),
                                  cells; cache ``n_pad`` 1                 streams ``pad(ceil(n_ctx / n_seq_max),
                                                                           pad)``; cache ``n_pad`` = that pad;
                                                                           ``n_batch`` at least 64
SWA cache size (``kv_cache_iswa``)  padded to 256                          padded to the cache's ``n_pad``
sequence saves with SWA           cells masked for the sequence's last     every non-empty cell of the sequence
(``kv_state.written_cells``)      position are left out                    is written
cell ext (``kv_state``)           12 bytes per cell for M-RoPE / PLE       never written or read
K-shift (``KVCache.get_can_shift``) refused for M-RoPE (and step35)        always allowed
decode seq-id bound               the context's ``n_seq_max``, unified     ``LLAMA_MAX_SEQ`` when unified, else
(each memory's ``decode``)        or not (llama_batch_ext)                 ``n_seq_max``
recurrent ``seq_rm`` and state    ``rules="current"``                      ``rules="mid-2025"`` (see
(``recurrent``)                                                            ``kvref.recurrent``)
================================  ======================================  ======================================

The state-file framing (session v9 with an output block vs v10, sequence files v2 vs v3, the sequence-blob
prefix) is the file layer's business: ``kvref.state.load`` takes it as hints (``outputs``, ``seq_header``,
``ext_size``); the memory only writes and reads its own sections.
"""

from __future__ import annotations

from .errors import KVRefError

COMPAT_2026_10 = "2026-10"  # llama.cpp as vendored by llama-cpp-python 0.3.36 (October 2026)
COMPAT_2025 = "2025"  # llama.cpp 4227c9b as vendored by llama-cpp-python 0.3.16 (2025)
COMPATS = (COMPAT_2026_10, COMPAT_2025)
DEFAULT = COMPAT_2026_10

# llama-cpp-python releases whose vendored llama.cpp kvref has checked against goldens
_PRODUCERS = {"0.3.16": COMPAT_2025, "0.3.36": COMPAT_2026_10}


def check(compat: str) -> str:
    """``compat`` when it names a known generation, else ValueError."""
    if compat not in COMPATS:
        raise ValueError(f"compat must be one of {COMPATS}, got {compat!r}")
    return compat


def for_llama_cpp_python(version: str | None) -> str:
    """The compat of the llama.cpp a llama-cpp-python release vendors (None: the default)."""
    if version is None:
        return DEFAULT
    try:
        return _PRODUCERS[version]
    except KeyError:
        raise KVRefError(
            f"no compat mode is known for llama-cpp-python {version} (known: {', '.join(sorted(_PRODUCERS))})"
        ) from None


__all__ = ["COMPATS", "COMPAT_2025", "COMPAT_2026_10", "DEFAULT", "check", "for_llama_cpp_python"]
