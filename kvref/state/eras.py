"""The state-file layouts of llama.cpp's eras, and conversion of a loaded state between them.

One layout per era (what the containers look like; ``kvref.profile`` says how the memories behave):

=========== ===================== ======= === ======= ======== === ==========
era         llama-cpp-python      session seq outputs n_stream ext seq prefix
=========== ===================== ======= === ======= ======== === ==========
``2024-05`` 0.2.58 .. 0.2.67      5       1   yes     no       0   no
``2024-06`` 0.2.68 .. 0.2.82      6       1   yes     no       0   no
``2024-07`` 0.2.83                7       1   yes     no       0   no
``2024-08`` 0.2.84 .. 0.2.90      8       2   yes     no       0   no
``2024-09`` 0.3.0 .. 0.3.9        9       2   yes     no       0   no
``2025-07`` 0.3.10 .. 0.3.14      9       2   yes     no       0   no
``2025``    0.3.15 .. 0.3.16      9       2   yes     yes      0   no
``0.3.17``  0.3.17 .. 0.3.22      9       2   no      yes      8   no
``2026-08`` 0.3.23 .. 0.3.35      9       2   no      yes      8   yes
``2026-10`` 0.3.36 (current)      10      3   no      yes      12  yes
=========== ===================== ======= === ======= ======== === ==========

"ext" is the cell ext a cache with one writes (M-RoPE models; from 0.3.36 also PLE models); "seq prefix" is the
``io_magic, seq_id`` prefix of llama_state_seq_get_data blobs. Until 0.2.90 a context state also carries the sampler's
rng string (`kvref.state.legacy`), and until 0.3.9 the KV cells of a sequence save carry no sequence id (``n_seq_id`` 0;
the restore requires that, where later llama.cpp writes and requires the one id). `to_era` rewrites a loaded state
object into an era's layout where that layout can hold the content, and raises a `ConversionError` naming what it cannot
hold. ``2024-05`` .. ``2024-07`` (session versions 5 .. 7, sequence version 1, `kvref.state.legacy`; a session needs
the model) are read and written back as read, never written from another era: a session's header is the writing
build's hparams struct. A state blob of 2024-06 matches 2024-07 too (the same bytes), one of 2024-05 only 2024-05 (no
v_trans field); their sequence saves match all three (2024-05's V is always transposed).
`matching_eras` says which eras write a given object's layout.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..archs import ARCH_ROPE_TYPE
from ..constants import RopeType
from ..errors import ConversionError, KVRefError
from ..profile import NAMED, RELEASES, Profile, resolve, value_at
from . import Cells, KVSection, KVStream, MemorySections, Outputs, RecurrentSection, StateObject
from .files import (
    LegacySeqFile,
    LegacySeqStateBlob,
    LegacySessionFile,
    LegacyStateBlob,
    SeqFile,
    SeqStateBlob,
    SessionFile,
    StateBlob,
)
from .legacy import SESSION_VERSIONS_RAW_KV, rng_text

LLAMA_TOKEN_NULL = -1


@dataclass(frozen=True)
class Era:
    """One era's state-file layout: container versions, the v9 output block, the sequence-blob prefix, and the
    oldest and newest llama-cpp-python release. The ``n_stream`` field and the cell ext size are behaviours the
    memory's `Profile` already dates (``kv_streams``, ``cell_ext_size``): read from ``kvref.profile.TABLE``, not
    restated here."""

    name: str
    first: str
    last: str
    session_version: int
    seq_version: int
    outputs: bool
    seq_header: bool
    rng: bool = False  # session version 8: the sampler's rng string after the arch (`kvref.state.legacy`)
    seq_kv_ids: bool = True  # the KV cells of a sequence save list the saved id (False: n_seq_id 0, in 2024)

    @property
    def n_stream_field(self) -> bool:
        """A ``u32 n_stream`` precedes each KV section (PR #14363)."""
        return bool(value_at("kv_streams", self.first))

    @property
    def ext_size(self) -> int:
        """Bytes of cell ext a cache with one writes (0, 8 or 12)."""
        return int(cast(int, value_at("cell_ext_size", self.first)))  # the row of an int field

    @property
    def releases(self) -> str:
        """The llama-cpp-python releases of the era, as ``"0.3.15 .. 0.3.16"``."""
        return self.first if self.first == self.last else f"{self.first} .. {self.last}"


ERAS: dict[str, Era] = {
    e.name: e
    for e in (
        # session versions 5 (0.2.58 .. 0.2.67; 0.2.57 writes 4), 6 (0.2.68 .. 0.2.82) and 7 differ in the v_trans
        # field (from 6) and the hparams struct (kvref.state.legacy); 0.2.67, 0.2.82 and 0.2.83 are the releases
        # whose sources and goldens were read
        Era("2024-05", "0.2.58", "0.2.67", 5, 1, True, False, rng=True, seq_kv_ids=False),
        Era("2024-06", "0.2.68", "0.2.82", 6, 1, True, False, rng=True, seq_kv_ids=False),
        Era("2024-07", "0.2.83", "0.2.83", 7, 1, True, False, rng=True, seq_kv_ids=False),
        Era("2024-08", "0.2.84", "0.2.90", 8, 2, True, False, rng=True, seq_kv_ids=False),
        # 0.3.0 (goldens legacy-0.3.0-*) .. 0.3.9 (state code read): 2024-08 without the rng string (the sampler
        # refactor dropped it, session version 9), sequence saves still without seq ids; 0.3.10's unified cache
        # writes the id (read in its sources: the 2025-07 layout)
        Era("2024-09", "0.3.0", "0.3.9", 9, 2, True, False, seq_kv_ids=False),
        Era("2025-07", "0.3.10", "0.3.14", 9, 2, True, False),
        Era("2025", "0.3.15", "0.3.16", 9, 2, True, False),
        Era("0.3.17", "0.3.17", "0.3.22", 9, 2, False, False),
        Era("2026-08", "0.3.23", "0.3.35", 9, 2, False, True),
        Era("2026-10", "0.3.36", "0.3.36", 10, 3, False, True),
    )
}
CURRENT = "2026-10"


# the first llama-cpp-python release whose llama.cpp has the iSWA cache (two KV sections; before it gemma2's window
# masks one full cache: kvref.compat.for_llama_cpp_python)
FIRST_ISWA_RELEASE = "0.3.10"


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("."))


def era(which: Era | Profile | str | None = None) -> Era:
    """The era of ``which``: an era name (`ERAS`), a compat generation (``"2025"``), a llama-cpp-python release
    (``"0.3.20"``) or a ``Profile`` (by its release; a custom profile by its cell ext size). None: the current."""
    if which is None:
        return ERAS[CURRENT]
    if isinstance(which, Era):
        return which
    if isinstance(which, str) and which in ERAS:
        return ERAS[which]
    name = which.name if isinstance(which, Profile) else str(which)
    release = NAMED.get(name, name)
    older = _older_era(release)
    if older is not None:
        return older
    if release not in RELEASES:
        if isinstance(which, Profile):  # a custom profile: its cell ext size says which layout it writes
            if not which.kv_seq_save_ids:
                return ERAS["2024-08"]  # kvref.compat.profile_2024
            ext = which.cell_ext_size
            return ERAS[{0: "2025" if which.kv_streams else "2025-07", 8: "2026-08"}.get(ext, CURRENT)]
        try:
            return era(resolve(name))
        except KVRefError:
            raise ConversionError(
                f"unknown era {which!r}: expected one of {', '.join(ERAS)}, a compat name or a release "
                f"{RELEASES[0]} .. {RELEASES[-1]}"
            ) from None
    for e in ERAS.values():
        if _key(e.first) <= _key(release) <= _key(e.last):
            return e
    raise ConversionError(f"no era for release {release}")  # pragma: no cover - ERAS covers RELEASES


def _older_era(release: str) -> Era | None:
    """The era of a release older than the profiles kvref has (`kvref.profile.RELEASES`): only its file layout is
    known, read off its vendored sources."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", release) or _key(release) >= _key(RELEASES[0]):
        return None
    return next((e for e in ERAS.values() if _key(e.first) <= _key(release) <= _key(e.last)), None)


def is_mrope_arch(arch: str | None) -> bool | None:
    """True / False when ``arch`` is known to use / not use M-RoPE (so its KV cells carry an ext); None: unknown."""
    if arch is None:
        return None
    rope = ARCH_ROPE_TYPE.get(arch)
    if rope is None:
        return None
    return rope in (RopeType.MROPE, RopeType.IMROPE, RopeType.VISION)


def ext_unknown(obj: StateObject, target: Era | Profile | str | None = None) -> bool:
    """Whether the cell ext ``obj`` needs in the layout of ``target`` cannot be known from ``obj`` alone: the target
    writes an ext for M-RoPE models, ``obj`` names no arch (a sequence save) and its cells carry none, which
    llama.cpp before 0.3.17 wrote for every model. The writer's arch decides (`is_mrope_arch`)."""
    return (
        bool(era(target).ext_size)
        and is_mrope_arch(getattr(obj, "arch", None)) is None
        and _ext_sizes(obj) == {0}
        and _kv_cells(obj.memory)
        and any(ERAS[m].ext_size == 0 for m in matching_eras(obj))
    )


# ------------------------------------------------------------------------------------------- which eras
def _ext_sizes(obj: StateObject) -> set[int]:
    return {st.cells.ext_size for s in obj.memory.kv_sections for st in s.streams if st.cells is not None}


def matching_eras(obj: StateObject) -> list[str]:
    """The eras whose layout is the layout of ``obj`` (oldest first): version, output block, ``n_stream`` field,
    cell ext size and sequence-blob prefix must all be what the era writes."""
    out = []
    exts = _ext_sizes(obj)
    n_stream = {s.has_n_stream for s in obj.memory.kv_sections}
    ple = any(layer.p_data is not None for s in obj.memory.recurrent_sections for layer in s.r)
    legacy = isinstance(obj, LegacySessionFile | LegacyStateBlob | LegacySeqFile | LegacySeqStateBlob)
    for e in ERAS.values():
        if legacy != (e.session_version in SESSION_VERSIONS_RAW_KV):
            continue
        if legacy and _v5_only(obj) is not None and _v5_only(obj) != (e.session_version == 5):
            continue
        if obj.kind == "session" and getattr(obj, "version", None) != e.session_version:
            continue
        if obj.kind == "seq" and getattr(obj, "version", None) != e.seq_version:
            continue
        if obj.kind in ("session", "state") and (getattr(obj, "outputs", None) is not None) != e.outputs:
            continue
        if obj.kind in ("session", "state") and (getattr(obj, "rng", None) is not None) != e.rng:
            continue
        if obj.kind == "seq_state" and getattr(obj, "has_header", False) != e.seq_header:
            continue
        if n_stream and n_stream != {e.n_stream_field}:
            continue
        if exts - {0, e.ext_size}:
            continue
        if exts == {0} and e.ext_size and is_mrope_arch(getattr(obj, "arch", None)):
            continue  # an M-RoPE cache of this era writes an ext
        if (ple or obj.memory.layout in _CURRENT_ONLY) and e.name != CURRENT:
            continue
        if obj.memory.layout in ("iswa", "hybrid_iswa") and _key(e.last) < _key(FIRST_ISWA_RELEASE):
            continue  # no SWA cache before 0.3.10
        # a sequence save's KV cells list the saved id from 2025 on, none in 2024 (llama.cpp since 2025 writes none
        # only for an id >= n_seq_max, a file its restore refuses: such a file is taken for 2024's)
        if obj.kind in ("seq", "seq_state") and _kv_cells(obj.memory) and _kv_seq_ids(obj.memory) != e.seq_kv_ids:
            continue
        out.append(e.name)
    return out


def _v5_only(obj: StateObject) -> bool | None:
    """Whether a raw-KV era's object is one only version 5's llama.cpp writes (a context state without the v_trans
    field), one it cannot write (a context state with it, a sequence save with row-wise V), or None: either."""
    raw = getattr(obj, "raw_kv", None)
    if raw is not None:
        return not raw.v_trans_field
    seq = getattr(obj, "raw_seq", None)
    return False if seq is not None and len(seq.pos) and not seq.v_trans else None


def _kv_cells(mem: MemorySections) -> bool:
    """Does any KV section hold a cell?"""
    return any(st.cells is not None and st.cells.n for s in mem.kv_sections for st in s.streams)


def _kv_seq_ids(mem: MemorySections) -> bool:
    """Does any KV cell of the memory list a sequence id?"""
    return any(st.cells is not None and len(st.cells.seq_id) for s in mem.kv_sections for st in s.streams)


# ------------------------------------------------------------------------------------------- conversion
def _seq_cells(mem: MemorySections, seq_id: int | None) -> MemorySections:
    """A sequence save's KV cells with the one id ``seq_id`` each (None: with no id, as in 2024). Only streams
    whose cells are the other way change: a stream whose cells already list ids keeps them."""
    if mem.layout == "dsv4":  # the current layout only: its cells already list the id
        return mem
    out: list[KVSection | RecurrentSection] = []
    for sec in mem.sections:
        if isinstance(sec, RecurrentSection):
            out.append(sec)
            continue
        streams = []
        for st in sec.streams:
            c = st.cells
            if c is None or bool(len(c.seq_id)) == (seq_id is not None):  # already as wanted
                streams.append(st)
                continue
            if seq_id is None:
                ids, start = np.zeros(0, np.int32), np.zeros(c.n + 1, np.int64)
            else:
                ids, start = np.full(c.n, seq_id, np.int32), np.arange(c.n + 1, dtype=np.int64)
            streams.append(KVStream(Cells(c.pos, ids, start, c.ext, c.ext_size), st.data))
        out.append(KVSection(streams, has_n_stream=sec.has_n_stream))
    return MemorySections(mem.layout, out)


def _ext_cells(cells: Cells, want: int, where: str, target: Era) -> Cells:
    """``cells`` with a ``want``-byte ext, or a ConversionError when that ext cannot hold what the cells carry."""
    have = cells.ext_size
    if have == want:
        return cells
    n = cells.n
    pos = cells.pos.astype(np.int32)
    ext = cells.ext
    if want == 0:
        if have == 12 and (ext[:, 2] != LLAMA_TOKEN_NULL).any():
            raise ConversionError(
                f"{where}: the cells carry token ids in their 12-byte ext; the {target.name} layout "
                f"({target.releases}) has no cell ext and cannot hold them"
            )
        if (ext[:, 0] != pos).any() or (ext[:, 1] != pos).any():
            raise ConversionError(
                f"{where}: the cells carry 2-D M-RoPE positions (ext x, y); the {target.name} layout "
                f"({target.releases}) has no cell ext and cannot hold them"
            )
        new = np.zeros((n, 0), np.int32)
    elif want == 8:
        if have == 12:
            if (ext[:, 2] != LLAMA_TOKEN_NULL).any():
                raise ConversionError(
                    f"{where}: the cells carry token ids in their 12-byte ext (x, y, tok); the {target.name} layout "
                    f"({target.releases}) has an 8-byte ext (x, y) and would drop them"
                )
            new = ext[:, :2]
        else:  # from no ext: a text token's 2-D position is (pos, pos)
            new = np.stack([pos, pos], axis=1)
    else:
        tok = np.full((n, 1), LLAMA_TOKEN_NULL, np.int32)
        new = np.concatenate([ext[:, :2], tok], axis=1) if have == 8 else np.stack([pos, pos, tok[:, 0]], axis=1)
    return Cells(cells.pos, cells.seq_id, cells.seq_start, np.ascontiguousarray(new, np.int32), want)


# memories only the newest layout has (llama_memory_hybrid_idx, llama_kv_cache_dsa / _dsa_iswa / _msa / _dsv4:
# October 2026): an older llama.cpp has none of their archs
_CURRENT_ONLY = ("hybrid_idx", "dsa", "dsa_iswa", "msa", "dsv4")


def convert_sections(
    mem: MemorySections, target: Era | str, *, has_ext: bool | None = None, where: str = ""
) -> MemorySections:
    """The memory sections as ``target`` writes them (rows shared, never copied).

    ``has_ext``: does the cache write a cell ext (M-RoPE)? None: when any cell carries one. Raises
    ConversionError where the target layout cannot hold the content (several streams or an empty section without
    its layer headers in the layout before ``n_stream``; ext values an older ext cannot hold; PLE rows; the
    hybrid_idx layout before 2026-10).
    """
    e = era(target)
    if mem.layout in _CURRENT_ONLY and e.name != CURRENT:
        raise ConversionError(f"the {mem.layout} memory exists only in the {CURRENT} layout, not in {e.name}")
    if mem.layout == "dsv4":  # nothing to convert within the current layout
        return mem
    if mem.layout in ("iswa", "hybrid_iswa") and _key(e.last) < _key(FIRST_ISWA_RELEASE):
        raise ConversionError(
            f"the {e.name} layout ({e.releases}) has no sliding-window cache: llama.cpp before "
            f"{FIRST_ISWA_RELEASE} keeps one KV cache for every layer and writes one section, this {mem.layout} "
            "state has a base and a SWA section"
        )
    if has_ext is None:
        has_ext = any(st.cells is not None and st.cells.ext_size > 0 for s in mem.kv_sections for st in s.streams)
    want_ext = e.ext_size if has_ext else 0
    out: list[KVSection | RecurrentSection] = []
    for i, sec in enumerate(mem.sections):
        here = f"{where}section {i}"
        if mem.layout == "hybrid_idx" and i == 2:
            out.append(sec)  # the indexer section (one era only): its cells carry an ext only for PLE, as written
            continue
        if isinstance(sec, RecurrentSection):
            if e.name != CURRENT and any(layer.p_data is not None for layer in sec.r):
                raise ConversionError(f"{here}: PLE rows exist only in the {CURRENT} layout, not in {e.name}")
            out.append(sec)
            continue
        if not e.n_stream_field and sec.n_stream != 1:
            raise ConversionError(
                f"{here}: {sec.n_stream} streams; the {e.name} layout ({e.releases}) has one cache for every "
                "sequence (no n_stream field): convert with streams='unified' first"
            )
        streams = []
        for s, st in enumerate(sec.streams):
            if st.cells is None:
                if not e.n_stream_field and st.data is None:
                    raise ConversionError(
                        f"{here}: an empty attention section of the {e.name} layout carries the cache's layer "
                        "headers (types, row sizes), which this state does not have"
                    )
                streams.append(KVStream(None, st.data if not e.n_stream_field else None))
                continue
            streams.append(KVStream(_ext_cells(st.cells, want_ext, f"{here} stream {s}", e), st.data))
        out.append(KVSection(streams, has_n_stream=e.n_stream_field))
    return MemorySections(mem.layout, out)


def _empty_outputs() -> Outputs:
    return Outputs(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.float32))


def to_era(
    obj: StateObject, target: Era | Profile | str | None = None, *, has_ext: bool | None = None,
    seq_id: int | None = None,
) -> StateObject:  # fmt: skip
    """``obj`` rewritten in the layout of ``target`` (an era, compat name, release or Profile; None: current).

    Versions become the era's; the v9 output block is added (empty: no logits) or dropped (llama.cpp since 0.3.17
    does not restore logits anyway); the v8 rng string is kept, written as a freshly seeded generator's, or
    dropped; the ``n_stream`` field, cell ext and sequence-blob prefix become the era's; the KV cells of a
    sequence save lose their id (2024) or, when they have none, get ``seq_id``.
    ``has_ext`` says whether the cache writes a cell ext (default: the arch string's rope type, else whether any
    cell carries one); ``seq_id`` is the id written in a sequence-blob prefix and in the
    cells of a sequence save that need one (default: the blob's prefix id, else 0). The
    rows are shared with ``obj``. Raises ConversionError where the target layout cannot hold the content.
    """
    e = era(target)
    if e.session_version in SESSION_VERSIONS_RAW_KV:
        raise ConversionError(
            f"kvref does not write the {e.name} layout (session version {e.session_version}, {e.releases}) from a "
            "loaded state: its header is the writing build's hparams struct; a file of that version is written back "
            "only as read (save)"
        )
    if has_ext is None:
        has_ext = is_mrope_arch(getattr(obj, "arch", None))
    if isinstance(obj, LegacySessionFile):  # the memory is already a later llama.cpp's; the raw KV stays behind
        obj = SessionFile(version=obj.version, tokens=obj.tokens, arch=obj.arch, outputs=obj.outputs,
                          memory=obj.memory, rng=obj.rng)  # fmt: skip
    elif isinstance(obj, LegacyStateBlob):
        obj = StateBlob(arch=obj.arch, outputs=obj.outputs, memory=obj.memory, rng=obj.rng)
    elif isinstance(obj, LegacySeqFile):
        obj = SeqFile(version=obj.version, tokens=obj.tokens, memory=obj.memory)
    elif isinstance(obj, LegacySeqStateBlob):
        obj = SeqStateBlob(memory=obj.memory, seq_id=None, has_header=False)
    new = copy.copy(obj)
    new.offsets = {}
    new.note = None
    new.memory = convert_sections(obj.memory, e, has_ext=has_ext)
    if obj.kind == "session":
        new.version = e.session_version  # type: ignore[attr-defined]
    elif obj.kind == "seq":
        new.version = e.seq_version  # type: ignore[attr-defined]
    if obj.kind in ("session", "state"):
        outputs = getattr(obj, "outputs", None)
        new.outputs = (outputs or _empty_outputs()) if e.outputs else None  # type: ignore[attr-defined]
        rng = getattr(obj, "rng", None)
        new.rng = (rng or rng_text()) if e.rng else None  # type: ignore[attr-defined]
    sid = getattr(obj, "seq_id", None)  # a sequence blob's prefix id
    if obj.kind == "seq_state":
        new.has_header = e.seq_header  # type: ignore[attr-defined]
        new.seq_id = (seq_id if seq_id is not None else sid or 0) if e.seq_header else None  # type: ignore[attr-defined]
    if obj.kind in ("seq", "seq_state"):
        new.memory = _seq_cells(new.memory, (seq_id if seq_id is not None else sid or 0) if e.seq_kv_ids else None)
    return new


def era_names() -> Sequence[str]:
    """The era names, oldest first."""
    return tuple(ERAS)


def describe_eras(names: Sequence[str]) -> str:
    """``names`` as a human line: ``"2025 (0.3.15 .. 0.3.16)"``, joined."""
    return ", ".join(f"{n} ({ERAS[n].releases})" for n in names) or "none"


__all__ = [
    "CURRENT",
    "ERAS",
    "ConversionError",
    "Era",
    "convert_sections",
    "describe_eras",
    "era",
    "era_names",
    "ext_unknown",
    "is_mrope_arch",
    "matching_eras",
    "to_era",
]
