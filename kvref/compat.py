"""Which llama.cpp generation a memory reproduces: the ``compat`` switch.

kvref follows llama.cpp as vendored by llama-cpp-python 0.3.36 (October 2026) by default. Where an older
llama.cpp behaves differently, a memory built with its ``compat`` value reproduces the older behaviour:
``"2026-08"`` is llama.cpp 4df29be as vendored by llama-cpp-python 0.3.35 (August 2026), ``"2025"`` is
llama.cpp 4227c9b as vendored by llama-cpp-python 0.3.16 (August 2025). ``create_memory(..., compat=...)``
passes the switch down to every memory it builds; each difference is documented where it applies:

================================  ============================  ==========================  ==========================
difference                        ``"2026-10"`` (default)       ``"2026-08"``               ``"2025"``
================================  ============================  ==========================  ==========================
context sizing                    n_ctx padded to 256; non-     as 2026-10                  no context padding; the
(``memory.context_params``)       unified streams ``pad(n_ctx                               memory pads: 32 cells (256
                                  / n_seq_max, 256)`` cells;                                with flash attention),
                                  cache ``n_pad`` 1                                         streams ``pad(ceil(n_ctx /
                                                                                            n_seq_max), pad)``; cache
                                                                                            ``n_pad`` = that pad;
                                                                                            ``n_batch`` at least 64
recurrent rollback archs          ``memory.RS_ROLLBACK_ARCHS``  qwen35(moe), deepseek4,     none (no ``n_rs_seq``)
(``memory.context_params``)                                     nemotron_h(_moe)
SWA cache size (``kv_cache_iswa``)  padded to 256               as 2026-10                  padded to the cache's
                                                                                            ``n_pad``
sequence saves with SWA           cells masked for the          as 2026-10                  every non-empty cell of
(``kv_state.written_cells``)      sequence's last position                                  the sequence is written
                                  are left out
cell ext (``kv_state``)           12 bytes (x, y, tok) per      8 bytes (x, y), M-RoPE      never written or read
                                  cell for M-RoPE / PLE         only
K-shift (``KVCache.get_can_shift``) refused for M-RoPE (and     as 2026-10                  always allowed
                                  step35)
decode seq-id bound               the context's ``n_seq_max``,  as 2025                     ``LLAMA_MAX_SEQ`` when
(each memory's ``decode``)        unified or not                                            unified, else
                                  (llama_batch_ext)                                         ``n_seq_max``
whole restore (``kv_state``)      ``clear(true)`` once, then    every non-empty stream's    as 2026-08
                                  every stream                  read begins with
                                                                ``clear(true)``: only the
                                                                last one survives; an
                                                                all-empty section changes
                                                                nothing
recurrent ``seq_rm`` and state    ``rules="current"``           ``rules="2026-08"``         ``rules="mid-2025"``
(``recurrent``)                                                                             (see ``kvref.recurrent``)
================================  ============================  ==========================  ==========================

``"2025-07"`` is llama.cpp a0374a6 as vendored by llama-cpp-python 0.3.12 (July 2025, before PR #14363): it
behaves as ``"2025"`` everywhere above, except that there were no streams (``no_streams``): the context's
``kv_unified`` did not exist (every memory is unified), the KV section has no ``u32 n_stream``, and a whole
restore always began with ``clear(true)`` -- even of an empty section (``kv_state.stage_state``). Only its
KV cache and iSWA cache are pinned by goldens: 0.3.12 aborts on the recurrent and multi-sequence cases
(``conformance/driver.py``, ``skip_cases``), so ``"mid-2025"`` recurrent rules are assumed there.

The state-file framing (session v9 with an output block vs v9 without it vs v10, sequence files v2 vs v3,
the sequence-blob prefix) is the file layer's business: ``kvref.state.load`` takes it as hints (``outputs``,
``seq_header``, ``ext_size``); the memory only writes and reads its own sections.
"""

from __future__ import annotations

from .errors import KVRefError

COMPAT_2026_10 = "2026-10"  # llama.cpp as vendored by llama-cpp-python 0.3.36 (October 2026)
COMPAT_2026_08 = "2026-08"  # llama.cpp 4df29be as vendored by llama-cpp-python 0.3.35 (August 2026)
COMPAT_2025 = "2025"  # llama.cpp 4227c9b as vendored by llama-cpp-python 0.3.16 (2025)
COMPAT_2025_07 = "2025-07"  # llama.cpp as vendored by llama-cpp-python 0.3.12 (July 2025, before PR #14363)
COMPATS = (COMPAT_2026_10, COMPAT_2026_08, COMPAT_2025, COMPAT_2025_07)
# the 2025 generations: "2025-07" is "2025" without streams (see ``no_streams``)
ERA_2025 = (COMPAT_2025, COMPAT_2025_07)
DEFAULT = COMPAT_2026_10

# llama-cpp-python releases whose vendored llama.cpp kvref has checked against goldens
_PRODUCERS = {"0.3.12": COMPAT_2025_07, "0.3.16": COMPAT_2025, "0.3.35": COMPAT_2026_08, "0.3.36": COMPAT_2026_10}

# bytes of llama_kv_cell_ext per cell in the state, when the cache has one (kvref.kv_state.has_cell_ext)
CELL_EXT_SIZES = {COMPAT_2026_10: 12, COMPAT_2026_08: 8, COMPAT_2025: 0, COMPAT_2025_07: 0}


def no_streams(compat: str) -> bool:
    """True before PR #14363 (``"2025-07"``): one cache for all sequences (``kv_unified`` did not exist yet), no
    ``u32 n_stream`` before the KV section, and a whole restore clears the cache even for an empty section."""
    return compat == COMPAT_2025_07


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


__all__ = [
    "CELL_EXT_SIZES",
    "COMPATS",
    "COMPAT_2025",
    "COMPAT_2025_07",
    "COMPAT_2026_08",
    "COMPAT_2026_10",
    "DEFAULT",
    "ERA_2025",
    "check",
    "for_llama_cpp_python",
    "no_streams",
]
