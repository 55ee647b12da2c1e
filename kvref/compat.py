"""Which llama.cpp a memory reproduces: the ``compat`` switch, resolved to a ``kvref.profile.Profile``.

kvref follows llama.cpp as vendored by llama-cpp-python 0.3.36 by default. Where an older llama.cpp behaves
differently, a memory built with its ``compat`` value reproduces the older behaviour. ``compat`` is a
``Profile`` (``kvref.profile``: one named field per behaviour, e.g. ``cell_ext_size``, ``n_kv_pad``,
``recurrent_seq_rm_rule``), a named generation or a llama-cpp-python release; strings resolve through
``kvref.profile.TABLE``, the one place that says which release changed which behaviour. The named generations
(their goldens pin each) are:

- ``"2026-10"`` (default): llama.cpp 0c1e570 as vendored by llama-cpp-python 0.3.36;
- ``"2026-08"``: llama.cpp 4df29be as vendored by llama-cpp-python 0.3.35;
- ``"2025"``: llama.cpp 4227c9b as vendored by llama-cpp-python 0.3.16;
- ``"2025-07"``: llama.cpp a0374a6 as vendored by llama-cpp-python 0.3.12 (before PR #14363). Only its KV
  cache and iSWA cache are pinned by goldens: 0.3.12 aborts on the recurrent and multi-sequence cases
  (``conformance/driver.py``, ``skip_cases``), so its recurrent behaviour is TABLE's, unchecked there.

Every release: behaviour boundaries
-----------------------------------
``for_llama_cpp_python`` maps every release 0.3.12 .. 0.3.36 to the profile of its era: releases whose
profiles (``Profile.signature``) are equal share one; a release that behaves as a named generation is named
after it, any other after the first release of its era (``era``: ``"0.3.15"``, ``"0.3.17"``, ``"0.3.24"``,
``"0.3.26"``, ``"0.3.34"``), and every release string in ``RELEASES`` is itself a valid compat value. Newer
releases map to the default, older ones to ``"2025-07"`` with a CompatWarning (0.2.84 .. 0.2.90 and 0.3.0 ..
0.3.9: ``profile_2024``, warning but for 0.3.0, which goldens check). ``since(compat, BEHAVIOUR)``
and the behaviour names below are kept for callers of the older API; each is the first release (read off
TABLE) of the profile field named beside it.

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
llama-memory-hybrid.cpp): TABLE assumes the rollback arch list of 0.3.35 from 0.3.24 on, the SWA cache
padding to change with the context padding, and the hybrid restore undo to be 0.3.36's alone.

The state-file framing (session v9 with an output block vs v9 without it vs v10, sequence files v2 vs v3,
the sequence-blob prefix -- from 0.3.23) is the file layer's business: ``kvref.state.load`` takes it as hints
(``outputs``, ``seq_header``, ``ext_size``); the memory only writes and reads its own sections.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

from .errors import CompatWarning, KVRefError
from .profile import (
    COMPAT_2025,
    COMPAT_2025_07,
    COMPAT_2026_08,
    COMPAT_2026_10,
    COMPATS,
    DEFAULT,
    NAMED,
    RELEASES,
    Profile,
    first_release,
    name_of,
    resolve,
)
from .profile import _key as _key
from .profile import _signature as _release_signature

# the 2025 generations: "2025-07" is "2025" without streams (``Profile.kv_streams``)
ERA_2025 = (COMPAT_2025, COMPAT_2025_07)
# the llama.cpp commit the default generation follows (vendored by llama-cpp-python 0.3.36)
REFERENCE_COMMIT = "0c1e570"

# --------------------------------------------------------------------------------- behaviour boundaries
# The older API's behaviour names: each is the first release (read off kvref.profile.TABLE) where the profile
# field beside it takes the value beside it.
STREAMS = "streams"  # Profile.kv_streams
KV_SEQ_RM_ALL = "kv_seq_rm_all"  # Profile.kv_seq_rm_all_asserts fixed again
GEN_2026 = "gen_2026"  # Profile.n_ctx_pad (and the other fields that change with it)
RS_ROLLBACK = "rs_rollback"  # Profile.recurrent_rows_from_src (and rs_rollback_archs)
SWA_SEQ_SKIP = "swa_seq_skip"  # Profile.seq_save_keeps_masked_swa
RS_ROLLBACK_EQUAL_SPLIT = "rs_rollback_equal_split"  # Profile.recurrent_rollback_split
KSHIFT_SKIPS_NOPE = "kshift_skips_nope"  # Profile.kshift_skips_nope
GEN_2026_10 = "gen_2026_10"  # Profile.cell_ext_size 12 (and the other fields that change with it)
BEHAVIOURS = {
    STREAMS: first_release("kv_streams", True),
    KV_SEQ_RM_ALL: first_release("kv_seq_rm_all_asserts", False, after=first_release("kv_seq_rm_all_asserts", True)),
    GEN_2026: first_release("n_ctx_pad", 256),
    RS_ROLLBACK: first_release("recurrent_rows_from_src", True),
    SWA_SEQ_SKIP: first_release("seq_save_keeps_masked_swa", False),
    RS_ROLLBACK_EQUAL_SPLIT: first_release("recurrent_rollback_split", "equal"),
    KSHIFT_SKIPS_NOPE: first_release("kshift_skips_nope", True),
    GEN_2026_10: first_release("cell_ext_size", 12),
}


def release_of(compat: Profile | str) -> str:
    """The llama-cpp-python release whose behaviour ``compat`` reproduces (a named generation's release)."""
    name = compat.name if isinstance(compat, Profile) else compat
    if name not in NAMED and name not in RELEASES:
        raise KVRefError(f"compat {name!r} is not a named generation or a release (a custom profile has none)")
    return NAMED.get(name, name)


def since(compat: Profile | str, behaviour: str) -> bool:
    """True when the llama.cpp of ``compat`` has ``behaviour`` (one of BEHAVIOURS)."""
    return _key(release_of(compat)) >= _key(BEHAVIOURS[behaviour])


def kv_seq_rm_all_asserts(compat: Profile | str) -> bool:
    """``Profile.kv_seq_rm_all_asserts`` of ``compat``."""
    return resolve(compat).kv_seq_rm_all_asserts


def no_streams(compat: Profile | str) -> bool:
    """``not Profile.kv_streams`` of ``compat``: one cache for all sequences, no ``u32 n_stream``."""
    return not resolve(compat).kv_streams


def cell_ext_size(compat: Profile | str) -> int:
    """``Profile.cell_ext_size`` of ``compat``: bytes of llama_kv_cell_ext per cell when the cache has one."""
    return resolve(compat).cell_ext_size


# bytes of llama_kv_cell_ext per cell in the state, when the cache has one (kvref.memory.kv_state.has_cell_ext)
CELL_EXT_SIZES = {c: cell_ext_size(c) for c in COMPATS}


def check(compat: Profile | str) -> Profile | str:
    """``compat`` when it is a Profile, a known generation or a release in RELEASES, else CompatError (a
    ValueError)."""
    resolve(compat)
    return compat


def era(release: str) -> str:
    """The compat value of a release in RELEASES: the named generation that behaves the same where kvref
    models a difference (equal ``Profile.signature``), else the first release of its era."""
    return name_of(_release_signature(release))


# the releases of session version 8 (kvref.state.eras "2024-08"): only their state files were read (kvref.state.legacy)
LEGACY_2024 = ("0.2.84", "0.2.90")
# the release of session version 7 (kvref.state.eras "2024-07") whose state code was read: its session files are read
# given the model; its cache behaviour was not read (its sequence files, version 1, have no seq ids at all)
LEGACY_2024_07 = "0.2.83"
# the releases of session version 6 (kvref.state.eras "2024-06"): 0.2.82 is read in its sources and
# replayed by the legacy-0.2.82-* goldens; the others write the same context state and sequence files, but a
# hparams struct of their own size at the head of a session file (kvref.state.legacy reads 0.2.82's)
LEGACY_2024_06 = ("0.2.68", "0.2.82")
# the releases of session version 5 (kvref.state.eras "2024-05"; 0.2.57 writes 4): 0.2.67 is read in its sources and
# replayed by the legacy-0.2.67-* goldens (sequence saves from 0.2.62); the others as LEGACY_2024_06's
LEGACY_2024_05 = ("0.2.58", "0.2.67")
# the releases of session version 9 whose KV sequence saves still carry no seq id (state code read in 0.3.0 .. 0.3.9;
# 0.3.10 writes the id): the 2024 profile; 0.3.0 is checked by goldens (legacy-0.3.0-*), the others are not
LEGACY_2024_V9 = ("0.3.0", "0.3.9")
CHECKED_2024_V9 = ("0.3.0", "0.3.8")  # releases the legacy goldens check


def profile_2024() -> Profile:
    """The profile kvref assumes for llama-cpp-python 0.2.84 .. 0.2.90: ``"2025-07"`` but for the one behaviour
    read in their sources, sequence saves without seq ids in the KV cells (a custom profile: the rest of their
    behaviour was not read; the ``legacy-0.2.90-*`` goldens replay with it)."""
    return dataclasses.replace(resolve(COMPAT_2025_07), kv_seq_save_ids=False, name="")


def for_llama_cpp_python(version: str | None) -> Profile:
    """The profile of the llama.cpp a llama-cpp-python release vendors (None: the default).

    Every release 0.3.12 .. 0.3.36 maps to its era's profile (named by ``era``). A newer release maps to the
    newest generation (the default); an older one to the oldest (``"2025-07"``) with a CompatWarning: kvref
    never read those sources (llama.cpp before July 2025 may differ in ways kvref does not model), except that
    0.2.58 .. 0.2.90 get `profile_2024` (their sequence saves, which kvref read, carry no seq ids; goldens of 0.2.67,
    0.2.82, 0.2.83 and 0.2.90 replay with it), and so do
    0.3.0 .. 0.3.9 (session version 9, read in their state code), without a warning for 0.3.0 and 0.3.8, which
    the ``legacy-0.3.0-*`` / ``legacy-0.3.8-*`` goldens check (not gemma2: before 0.3.10 llama.cpp has no SWA
    cache, kvref only iSWA). Local version suffixes ("0.3.16+cu121", "0.3.16.post1") are ignored; anything else
    that is not ``MAJOR.MINOR.PATCH`` is a KVRefError.
    """
    if version is None:
        return resolve(DEFAULT)
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:[.+\-].*|[a-z]+\d*)?", str(version).strip())
    if m is None:
        raise KVRefError(f"not a llama-cpp-python version: {version!r}")
    key = tuple(int(x) for x in m.groups())
    release = ".".join(m.groups())
    if key > _key(RELEASES[-1]):
        return resolve(DEFAULT)
    if key < _key(RELEASES[0]):
        checked = {LEGACY_2024_07: 7, LEGACY_2024_06[1]: 6, LEGACY_2024_05[1]: 5}
        if release in checked:
            v = checked[release]
            warnings.warn(
                f"llama-cpp-python {version}: kvref reads its session files (version {v}, given the model: "
                "kvref.state.legacy) and upgrades them, and models its cache as 0.2.84's (`profile_2024`: the "
                f"legacy-{release}-* goldens replay with it, graph inputs and sequence saves included)",
                CompatWarning,
                stacklevel=2,
            )
            return profile_2024()
        for first, last in (LEGACY_2024_05, LEGACY_2024_06):
            if _key(first) <= key < _key(last):
                warnings.warn(
                    f"llama-cpp-python {version} (session version {5 if last == LEGACY_2024_05[1] else 6}): kvref "
                    f"models its cache as {last}'s (`profile_2024`) but no golden checks it; its state blobs and "
                    f"sequence files read as {last}'s, its session files only if its struct llama_hparams is too",
                    CompatWarning,
                    stacklevel=2,
                )
                return profile_2024()
        if _key(LEGACY_2024[0]) <= key <= _key(LEGACY_2024[1]):
            warnings.warn(
                f"llama-cpp-python {version}: kvref reads and writes its state files (goldens of 0.2.90) and models "
                f"its cache as {RELEASES[0]}'s with the sequence saves of 2024 (kv_seq_save_ids=False); only the "
                "state code of these releases was read, their cache behaviour only replayed on those goldens",
                CompatWarning,
                stacklevel=2,
            )
            return profile_2024()
        if _key(LEGACY_2024_V9[0]) <= key <= _key(LEGACY_2024_V9[1]):
            if release not in CHECKED_2024_V9:
                warnings.warn(
                    f"llama-cpp-python {version}: kvref models its cache as {CHECKED_2024_V9[-1]}'s (the 2024 "
                    "profile: sequence saves without seq ids, read in its state code) but no golden checks it",
                    CompatWarning,
                    stacklevel=2,
                )
            # named after the release: kvref.state.eras.era(profile) then gives its layout (2024-09: version 9, no rng)
            return dataclasses.replace(profile_2024(), name=release)
        warnings.warn(
            f"llama-cpp-python {version} is older than {RELEASES[0]}, the oldest release kvref was checked "
            f"against; using compat {COMPAT_2025_07!r}",
            CompatWarning,
            stacklevel=2,
        )
        return resolve(COMPAT_2025_07)
    return resolve(era(release))


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
    "LEGACY_2024",
    "LEGACY_2024_05",
    "LEGACY_2024_06",
    "LEGACY_2024_07",
    "LEGACY_2024_V9",
    "NAMED",
    "RELEASES",
    "RS_ROLLBACK",
    "RS_ROLLBACK_EQUAL_SPLIT",
    "STREAMS",
    "SWA_SEQ_SKIP",
    "CompatWarning",
    "Profile",
    "cell_ext_size",
    "check",
    "era",
    "for_llama_cpp_python",
    "kv_seq_rm_all_asserts",
    "no_streams",
    "profile_2024",
    "release_of",
    "resolve",
    "since",
]
