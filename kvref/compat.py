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
SWA cache size                    padded to 256                 as 2026-10                  padded to the cache's
(``kv_cache_iswa``)                                                                         ``n_pad``
sequence saves with SWA           cells masked for the          as 2026-10                  every non-empty cell of
(``kv_state.written_cells``)      sequence's last position                                  the sequence is written
                                  are left out
cell ext (``kv_state``)           12 bytes (x, y, tok) per      8 bytes (x, y), M-RoPE      never written or read
                                  cell for M-RoPE / PLE         only
K-shift                           refused for M-RoPE (and       as 2026-10                  always allowed
(``KVCache.get_can_shift``)       step35)
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
``kv_unified`` did not exist (every memory is unified), the KV section has no ``u32 n_stream``, an empty KV
section still carries the data header (``v_trans``, ``n_layer``, every layer's type and row size), a sequence
restore of an empty section fails (``find_slot`` of zero tokens finds nothing), and a whole restore always began
with ``clear(true)`` -- even of an empty section (``kv_state.stage_state``). Only its KV cache and iSWA cache are
pinned by goldens: 0.3.12 aborts on the recurrent and multi-sequence cases (``conformance/driver.py``,
``skip_cases``), so ``"mid-2025"`` recurrent rules are assumed there.

Every release: behaviour boundaries
-----------------------------------
``for_llama_cpp_python`` maps every release 0.3.12 .. 0.3.36 (sources of each read: llama-kv-cache(-unified).cpp,
llama-kv-cells.h, llama-context.cpp, llama-memory-recurrent.cpp, llama-batch.cpp, llama.h). kvref asks one
question, ``since(compat, BEHAVIOUR)``, against this table of first releases; a release that behaves as a named
generation maps to its name, any other to the first release of its era (``"0.3.15"``, ``"0.3.17"``, ``"0.3.24"``,
``"0.3.26"``, ``"0.3.34"``), and every release string in ``RELEASES`` is itself a valid compat value:

===========================  ======  ============================================================================
behaviour                    from    what changes there
===========================  ======  ============================================================================
``STREAMS``                  0.3.15  PR #14363: ``u32 n_stream``, ``kv_unified``, per-stream cells; empty streams
                                     skipped in state files (no data header, no failing empty restore)
``KV_SEQ_RM_ALL``            0.3.16  KV ``seq_rm(-1, ...)`` works again: 0.3.15 alone hit ``GGML_ASSERT(seq_id
                                     >= 0 ...)`` first (an abort; SequenceError, ``kv_seq_rm_all_asserts``)
``GEN_2026``                 0.3.17  n_ctx padded to 256 (cache ``n_pad`` 1, SWA cache padded to 256); 8-byte
                                     M-RoPE cell ext; ``get_can_shift`` false for M-RoPE / step35;
                                     ``get_n_kv`` over the slot's streams padded to 256; sequence restore with
                                     ``find_slot(cont=false)``; recurrent: tail rule ``0 < p0 <= pos < p1``,
                                     ``split_equal(sequential=true)`` (was ``false``); no v9 output block
``RS_ROLLBACK``              0.3.24  ``n_rs_seq`` (rollback snapshots, ``RS_ROLLBACK_ARCHS_2026_08``); recurrent
                                     state rows read from the cell's ``src`` (was: the cell itself)
``SWA_SEQ_SKIP``             0.3.26  sequence saves leave out SWA-masked cells
``RS_ROLLBACK_EQUAL_SPLIT``  0.3.34  with ``n_rs_seq > 0`` the recurrent memory splits ``split_equal(...,
                                     n_rs_seq + 1)`` (0.3.24 .. 0.3.33: ``split_seq``)
``KSHIFT_SKIPS_NOPE``        0.3.35  the K-shift skips layers without rope (``!hparams.has_rope(il)``)
``GEN_2026_10``              0.3.36  the ``"2026-10"`` column above vs ``"2026-08"``
===========================  ======  ============================================================================

Era map: 0.3.12 - 0.3.14 ``"2025-07"``; 0.3.15 ``"0.3.15"``; 0.3.16 ``"2025"``; 0.3.17 - 0.3.23 ``"0.3.17"``;
0.3.24 - 0.3.25 ``"0.3.24"``; 0.3.26 - 0.3.33 ``"0.3.26"``; 0.3.34 ``"0.3.34"``; 0.3.35 ``"2026-08"``; 0.3.36
``"2026-10"``. Newer releases map to the default, older ones to ``"2025-07"`` with a CompatWarning.

Change points judged not to change what kvref models: 0.3.13 recurrent ``init_batch`` (0.3.12 checked
``n_used < n_tokens`` inside the split loop: a batch needing several ubatches kept none, and one that fits looped
for ever appending empty ubatches; kvref does not reproduce that); 0.3.16 ``find_slot`` (debug logging only); 0.3.19
recurrent whole restore bounds seq ids by ``n_seq_max`` (was: only ``>= 0``; the memory has ``max(1,
n_seq_max)`` cells, so no id changes outcome); 0.3.20 / 0.3.21 / 0.3.33 / 0.3.35 Hadamard K/V rotation for
quantized caches (graph only); 0.3.23
``read_to`` -> ``read`` / ``read_tensor`` and the sequence-blob prefix (file layer: ``seq_header=``); 0.3.24 the
KQ mask filled as f16 directly (same values as the f32 mask cast); 0.3.27 ``n_layer`` -> ``n_layer_all``
(rename); 0.3.28 caches sharing another cache's cells (``mem_other``: draft / MTP contexts, not modelled);
0.3.35 ``state_read`` catches an exception of ``state_read_data`` and clears (sequence / cache) like a failed
check -- kvref validates before it applies, so a truncated data block always ends as in 0.3.35 (before, the
restored cells stayed: not modelled). Not in the sources read (llama-arch.cpp, llama-kv-cache-iswa.cpp,
llama-memory-hybrid.cpp): the rollback arch list is assumed to be 0.3.35's from 0.3.24 on, the SWA cache
padding to follow ``GEN_2026``, and the hybrid restore undo to be 0.3.36's alone.

The state-file framing (session v9 with an output block vs v9 without it vs v10, sequence files v2 vs v3,
the sequence-blob prefix -- from 0.3.23) is the file layer's business: ``kvref.state.load`` takes it as hints
(``outputs``, ``seq_header``, ``ext_size``); the memory only writes and reads its own sections.
"""

from __future__ import annotations

import re
import warnings

from .errors import KVRefError

COMPAT_2026_10 = "2026-10"  # llama.cpp as vendored by llama-cpp-python 0.3.36 (October 2026)
COMPAT_2026_08 = "2026-08"  # llama.cpp 4df29be as vendored by llama-cpp-python 0.3.35 (August 2026)
COMPAT_2025 = "2025"  # llama.cpp 4227c9b as vendored by llama-cpp-python 0.3.16 (2025)
COMPAT_2025_07 = "2025-07"  # llama.cpp as vendored by llama-cpp-python 0.3.12 (July 2025, before PR #14363)
# the named generations (goldens pin each); any llama-cpp-python release in RELEASES is a compat value too
COMPATS = (COMPAT_2026_10, COMPAT_2026_08, COMPAT_2025, COMPAT_2025_07)
# the 2025 generations: "2025-07" is "2025" without streams (see ``no_streams``)
ERA_2025 = (COMPAT_2025, COMPAT_2025_07)
DEFAULT = COMPAT_2026_10
# the llama.cpp commit the default generation follows (vendored by llama-cpp-python 0.3.36, 2026-10-01)
REFERENCE_COMMIT = "0c1e570"

# every llama-cpp-python release whose vendored llama.cpp sources were read (oldest first)
RELEASES = tuple(f"0.3.{i}" for i in range(12, 37))
# the release each named generation is (its goldens were produced with it)
NAMED = {COMPAT_2025_07: "0.3.12", COMPAT_2025: "0.3.16", COMPAT_2026_08: "0.3.35", COMPAT_2026_10: "0.3.36"}

# --------------------------------------------------------------------------------- behaviour boundaries
# Each behaviour kvref models differently per generation, with the first llama-cpp-python release whose
# vendored llama.cpp has it (from reading every release's sources, 0.3.12 .. 0.3.36). ``since(compat, B)``
# is the one question the memories ask; the docstring table above says what each behaviour is.
STREAMS = "streams"  # PR #14363: n_stream field, kv_unified, per-stream cells
KV_SEQ_RM_ALL = "kv_seq_rm_all"  # KV seq_rm(-1, ...) works again (0.3.15 asserts seq_id >= 0)
GEN_2026 = "gen_2026"  # ctx padding, 8-byte M-RoPE ext, K-shift refusal, get_n_kv, seq restore placement,
#                        recurrent tail rule and sequential equal splits
RS_ROLLBACK = "rs_rollback"  # n_rs_seq rollback snapshots; recurrent state rows taken from ``src``
SWA_SEQ_SKIP = "swa_seq_skip"  # sequence saves leave out SWA-masked cells
RS_ROLLBACK_EQUAL_SPLIT = "rs_rollback_equal_split"  # rollback keeps the tail in split_equal (not split_seq)
KSHIFT_SKIPS_NOPE = "kshift_skips_nope"  # K-shift leaves layers without rope alone
GEN_2026_10 = "gen_2026_10"  # 12-byte ext, decode bound n_seq_max, whole restore clears once, "current"
#                              recurrent rules, rollback arch list, hybrid restore undo
BEHAVIOURS = {
    STREAMS: "0.3.15",
    KV_SEQ_RM_ALL: "0.3.16",
    GEN_2026: "0.3.17",
    RS_ROLLBACK: "0.3.24",
    SWA_SEQ_SKIP: "0.3.26",
    RS_ROLLBACK_EQUAL_SPLIT: "0.3.34",
    KSHIFT_SKIPS_NOPE: "0.3.35",
    GEN_2026_10: "0.3.36",
}


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("."))


def release_of(compat: str) -> str:
    """The llama-cpp-python release whose behaviour ``compat`` reproduces (a named generation's release)."""
    return NAMED.get(compat, compat)


def since(compat: str, behaviour: str) -> bool:
    """True when the llama.cpp of ``compat`` has ``behaviour`` (one of BEHAVIOURS)."""
    return _key(release_of(compat)) >= _key(BEHAVIOURS[behaviour])


def kv_seq_rm_all_asserts(compat: str) -> bool:
    """llama-cpp-python 0.3.15 only: the first multi-stream KV cache (PR #14363) asserted ``seq_id >= 0`` in
    ``seq_rm`` before its ``seq_id < 0`` branch, so ``seq_rm(-1, ...)`` aborted; 0.3.16 fixed it."""
    return since(compat, STREAMS) and not since(compat, KV_SEQ_RM_ALL)


def no_streams(compat: str) -> bool:
    """True before PR #14363 (``"2025-07"``, 0.3.12 .. 0.3.14): one cache for all sequences (``kv_unified`` did
    not exist yet), no ``u32 n_stream`` before the KV section, and a whole restore clears the cache even for an
    empty section."""
    return not since(compat, STREAMS)


def cell_ext_size(compat: str) -> int:
    """Bytes of llama_kv_cell_ext per cell in the state when the cache has one (kvref.kv_state.has_cell_ext)."""
    return 12 if since(compat, GEN_2026_10) else 8 if since(compat, GEN_2026) else 0


# bytes of llama_kv_cell_ext per cell in the state, when the cache has one (kvref.kv_state.has_cell_ext)
CELL_EXT_SIZES = {c: cell_ext_size(c) for c in COMPATS}


def check(compat: str) -> str:
    """``compat`` when it names a known generation or a release in RELEASES, else ValueError."""
    if compat not in COMPATS and compat not in RELEASES:
        raise ValueError(
            f"compat must be one of {COMPATS} or a llama-cpp-python release {RELEASES[0]} .. "
            f"{RELEASES[-1]}, got {compat!r}"
        )
    return compat


def _signature(release: str) -> tuple[bool, ...]:
    return (*(since(release, b) for b in BEHAVIOURS), kv_seq_rm_all_asserts(release))


def era(release: str) -> str:
    """The compat value of a release in RELEASES: the named generation that behaves the same where kvref
    models a difference, else the first release of its era (so releases that behave alike share one value)."""
    sig = _signature(release)
    for name, rel in NAMED.items():
        if _signature(rel) == sig:
            return name
    return next(r for r in RELEASES if _signature(r) == sig)


class CompatWarning(UserWarning):
    """A llama-cpp-python release outside the range whose sources kvref was checked against."""


def for_llama_cpp_python(version: str | None) -> str:
    """The compat of the llama.cpp a llama-cpp-python release vendors (None: the default).

    Every release 0.3.12 .. 0.3.36 maps to its era (``era``). A newer release maps to the newest generation
    (the default); an older one to the oldest (``"2025-07"``) with a CompatWarning: kvref never read those
    sources (llama.cpp before July 2025 may differ in ways kvref does not model). Local version suffixes
    ("0.3.16+cu121", "0.3.16.post1") are ignored; anything else that is not ``MAJOR.MINOR.PATCH`` is a
    KVRefError.
    """
    if version is None:
        return DEFAULT
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:[.+\-].*|[a-z]+\d*)?", str(version).strip())
    if m is None:
        raise KVRefError(f"not a llama-cpp-python version: {version!r}")
    key = tuple(int(x) for x in m.groups())
    release = ".".join(m.groups())
    if key > _key(RELEASES[-1]):
        return DEFAULT
    if key < _key(RELEASES[0]):
        warnings.warn(
            f"llama-cpp-python {version} is older than {RELEASES[0]}, the oldest release kvref was checked "
            f"against; using compat {COMPAT_2025_07!r}",
            CompatWarning,
            stacklevel=2,
        )
        return COMPAT_2025_07
    return era(release)


__all__ = [
    "BEHAVIOURS",
    "CELL_EXT_SIZES",
    "COMPATS",
    "COMPAT_2025",
    "COMPAT_2025_07",
    "COMPAT_2026_08",
    "COMPAT_2026_10",
    "DEFAULT",
    "ERA_2025",
    "GEN_2026",
    "GEN_2026_10",
    "KSHIFT_SKIPS_NOPE",
    "KV_SEQ_RM_ALL",
    "NAMED",
    "RELEASES",
    "RS_ROLLBACK",
    "RS_ROLLBACK_EQUAL_SPLIT",
    "STREAMS",
    "SWA_SEQ_SKIP",
    "CompatWarning",
    "cell_ext_size",
    "check",
    "era",
    "for_llama_cpp_python",
    "kv_seq_rm_all_asserts",
    "no_streams",
    "release_of",
    "since",
]
