"""`load`: open a state file or blob (memory-mapped), decide what it is, and parse it.

Nothing in the bytes says which memory layout follows, whether cells carry an ext, whether a version-9
session still has its output block or whether its KV sections start with ``n_stream``. The caller may say
so; whatever it leaves open is *inferred*: every remaining combination is parsed (metadata only, the rows are
views) and exactly one must consume the input to its last byte. (A sniff of the header fields first rules out,
without parsing them, the combinations that cannot: usually all but one; see `_Sniff`.) Candidates that are
indistinguishable in the bytes they describe (say, ext sizes when no cell is present) count as one. Two genuinely
different readings raise a FormatError on field ``layout`` that names them; none raises the error of the reading
that got furthest.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import sys
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict, TypeVar, cast, overload, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..archs import HYBRID_ARCHS, RECURRENT_ARCHS
from ..constants import LLAMA_MAX_LAYERS, LLAMA_MAX_SEQ
from ..errors import ArgumentError, FormatError
from .constants import LAYOUTS, SEQ_VERSIONS, SESSION_VERSIONS, Magic
from .dsl import _MAX_DIM, List, Record, Str, Struct, Switch, read_root
from .dsv4 import DSV4_STATE_MAGIC, DSV4Section, skip_tail
from .files import (
    STATE,
    STRUCTS,
    SeqFile,
    SeqStateBlob,
    SessionFile,
    StateBlob,
    StateObject,
    read_legacy,
    read_legacy_seq,
)
from .legacy import raw_kv_kind, rng_present, seq_v1_kind
from .sections import (
    _KNOWN_TYPES,
    KV_DATA,
    KV_STREAM,
    R_LAYER,
    RECURRENT_SECTION,
    KVSection,
    KVStream,
    RecurrentSection,
    _type_size,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

KINDS = ("session", "seq", "state", "seq_state")


@runtime_checkable
class LlamaStateLike(Protocol):
    """llama-cpp-python's ``LlamaState`` (what ``Llama.save_state()`` returns), as `load` reads it: ``llama_state``
    holds the bytes of llama_state_get_data (a context state blob), ``llama_state_size`` their count."""

    llama_state: bytes
    llama_state_size: int


# what `load` reads: a path (memory-mapped), the bytes of a blob, or a llama-cpp-python LlamaState
Source = str | os.PathLike[str] | bytes | bytearray | memoryview | LlamaStateLike

# (has_outputs, n_stream_field, ext sizes) per container version, oldest first. Cell ext came after n_stream
# (July 2025); 12-byte ext with the version bump of #27742; the v9 output block went away with #18862.
# (has the v9 output block, has the n_stream field, possible cell ext sizes) per file version
Variant = tuple[bool, bool, tuple[int, ...]]
_SESSION_VARIANTS: dict[int, list[Variant]] = {
    8: [(True, False, (0,))],  # and the rng string after the arch (`legacy.RNG`, which reads it by the version)
    9: [(True, False, (0,)), (True, True, (0, 8)), (False, True, (0, 8))],
    10: [(False, True, (0, 12))],
}
_SEQ_VARIANTS: dict[int, list[Variant]] = {
    2: [(False, False, (0,)), (False, True, (0, 8))],
    3: [(False, True, (0, 12))],
}


NState = int | Literal["scan"] | None  # layers with recurrent state: a count, every layer (None), or scanned


class LoadOptions(TypedDict, total=False):
    """The keyword options of `load`: what the caller pinned down (None: infer it)."""

    ext_size: int | None
    n_stream_field: bool | None
    has_v: bool | None
    outputs: bool | None
    ple: bool
    n_state_layers: int | None
    seq_header: bool | None
    model: object  # a GGUF path or HParams: what a session of version 5 .. 7 needs to be read (`files.read_legacy`)


class Options(TypedDict):
    """One reading spelled out as the read options of `read_root` (the DSL's env at the root)."""

    kind: str
    layout: str
    has_outputs: bool
    n_stream_field: bool
    ext_size: int
    has_v: bool
    ple: bool
    n_state_layers: NState
    seq_header: bool
    seq_scope: bool


def _open(src: Source) -> memoryview:
    if isinstance(src, bytes | bytearray | memoryview):
        return memoryview(src).cast("B")
    if isinstance(src, LlamaStateLike):
        data = memoryview(src.llama_state).cast("B")
        size = int(src.llama_state_size)
        if not 0 <= size <= data.nbytes:
            raise FormatError(f"LlamaState.llama_state_size is {size}, its llama_state holds {data.nbytes} bytes",
                              field="llama_state_size")  # fmt: skip
        return data[:size]
    with open(os.fspath(src), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _u32(buf: memoryview, at: int) -> int | None:
    return int.from_bytes(buf[at : at + 4], "little") if len(buf) >= at + 4 else None


_EXPECTED = (
    "a state starts with the magic 'ggsn' (0x6767736e, session file) or 'ggsq' (0x67677371, sequence file), "
    "with io_magic 0xaf143cd8 (llama_state_seq_get_data blob, 2026), or with the arch string's length "
    "(llama_state_get_data blob)"
)


def _shown(buf: memoryview, n: int = 8) -> str:
    head = bytes(buf[:n])
    text = head.decode("latin-1")
    return f"{head.hex(' ')}" + (f" ({text!r})" if text.isprintable() else "")


def detect_kind(buf: memoryview) -> list[str]:
    """The container kinds worth trying, from the first bytes (a FormatError when they rule out every kind)."""
    head = _u32(buf, 0)
    if head is None:
        raise FormatError(f"truncated: {len(buf)} bytes cannot hold a state", field="magic", offset=0)
    if head == Magic.SESSION:
        return ["session"]
    if head == Magic.STATE_SEQ:
        return ["seq"]
    if head == Magic.SEQ_BLOB:
        return ["seq_state"]
    if bytes(buf[:4]) == b"GGUF":
        raise FormatError(
            "this is a GGUF model file, not a llama.cpp state: pass it as the model (--model) and the session, "
            "slot or state file as the input",
            field="magic",
            offset=0,
        )
    if head >> 16 == 0x6767 or head & 0xFFFF == 0x6767:  # a 'gg..' llama.cpp magic, but not one of ours
        raise FormatError(f"bad magic 0x{head:08x}: {_EXPECTED}", field="magic", offset=0)
    if (
        sum(a != b for a, b in zip(head.to_bytes(4, "little"), int(Magic.SEQ_BLOB).to_bytes(4, "little"), strict=True))
        == 1
    ):
        raise FormatError(
            f"bad io_magic 0x{head:08x}: a llama_state_seq_get_data blob starts with 0x{int(Magic.SEQ_BLOB):08x}",
            field="io_magic",
            offset=0,
        )
    arch = bytes(buf[4 : 4 + head]) if 0 < head <= 64 else b""
    if len(arch) == head and arch.replace(b"_", b"").replace(b"-", b"").replace(b".", b"").isalnum():
        return ["state", "seq_state"]
    return ["seq_state", "state"]


# One way to read the input: (kind, layout, has_outputs, n_stream_field, ext_size, has_v, ple, n_state_layers,
# seq_header); `_as_options` spells it out as the read options of `read_root`.
Reading = tuple[str, str, bool, bool, int, bool, bool, NState, bool]
# readings with the same signature describe the input identically: one entry per signature
Found = dict[tuple[object, ...], tuple[Options, StateObject]]


def _readings(kind: str, buf: memoryview, layout: str, opts: LoadOptions, auto_kind: bool = True) -> list[Reading]:
    # what the list depends on in the bytes: a file's version, whether a blob starts with the io_magic
    version = _u32(buf, 4) if kind in ("session", "seq") else None
    magic = kind == "seq_state" and _u32(buf, 0) == Magic.SEQ_BLOB
    return list(_readings_of(kind, version, magic, layout, tuple(sorted(opts.items())), auto_kind))


# readings grouped by what they share first: the container header ((kind, has_outputs, seq_header)), then the
# first section's part ("kv", n_stream_field, ext_size, has_v) / ("rec", ple, n_state_layers, last) / ("none",)
Groups = dict[tuple[str, bool, bool], dict[tuple[object, ...], tuple[Reading, ...]]]


def _groups(readings: Sequence[Reading]) -> Groups:
    """`_Sniff.verdicts`' grouping of ``readings`` (in their order, repeats kept)."""
    out: dict[tuple[str, bool, bool], dict[tuple[object, ...], list[Reading]]] = {}
    for r in readings:
        parts = LAYOUTS[r[1]]
        first: tuple[object, ...]
        if not parts:
            first = ("none",)
        elif parts[0] == "kv":
            first = ("kv", r[3], r[4], r[5])
        elif parts[0] == "dsv4":
            first = ("dsv4", r[3], r[4], r[5])
        else:
            first = ("rec", r[6], r[7], len(parts) == 1)
        out.setdefault((r[0], r[2], r[8]), {}).setdefault(first, []).append(r)
    return {h: {f: tuple(rs) for f, rs in fs.items()} for h, fs in out.items()}


@lru_cache(maxsize=256)
def _groups_of(
    kind: str, version: int | None, magic: bool, layout: str, opt_items: tuple[tuple[str, object], ...], auto_kind: bool
) -> Groups:
    """`_groups` of `_readings_of` (the same arguments), computed once."""
    return _groups(_readings_of(kind, version, magic, layout, opt_items, auto_kind))


def _readings_groups(
    kind: str, buf: memoryview, layout: str, opts: LoadOptions, auto_kind: bool = True
) -> tuple[list[Reading], Groups]:
    """`_readings` and their `_groups`."""
    version = _u32(buf, 4) if kind in ("session", "seq") else None
    magic = kind == "seq_state" and _u32(buf, 0) == Magic.SEQ_BLOB
    key = (kind, version, magic, layout, tuple(sorted(opts.items())), auto_kind)
    return list(_readings_of(*key)), _groups_of(*key)


@lru_cache(maxsize=256)  # keyed by a u32 of the input: bounded
def _readings_of(
    kind: str, version: int | None, magic: bool, layout: str, opt_items: tuple[tuple[str, object], ...], auto_kind: bool
) -> tuple[Reading, ...]:
    """`_readings` of an input whose version (files) and io_magic test (sequence blobs) are given: computed once."""
    opts = cast("LoadOptions", dict(opt_items))
    table = _SESSION_VARIANTS if kind in ("session", "state") else _SEQ_VARIANTS
    every = list(dict.fromkeys(v for vs in table.values() for v in vs))
    # files say their version; blobs do not. Explicit options win over the version table (a caller who says
    # outputs=True for a v10 file gets that reading), and an unknown version fails on its own check.
    variants = table.get(version, every) if version is not None else every
    if not any(_matches(v, opts) for v in variants):
        variants = every
    if kind in ("seq", "seq_state"):
        variants = list(dict.fromkeys((False, n, e) for _, n, e in variants))
    # a memoryless context ("none") must be asked for: in "auto" it would make every state cut right after
    # its arch string a valid reading
    # "none" is never inferred from readings (only when nothing else parses, see load); "dsa" and "msa" read as
    # "iswa" (the same two KV sections) and are named from the arch string or the model
    layouts = [name for name in LAYOUTS if name not in ("none", "dsa", "msa")] if layout == "auto" else [layout]
    # blobs of the current format carry the io_magic prefix; asked for a seq_state, assume it (a corrupt magic
    # is then reported as such) unless the bytes are being guessed (kind "auto") and do not start with it
    headers = [True] if kind != "seq_state" or auto_kind is False else [magic]
    asked_header = opts["seq_header"]
    if asked_header is not None:
        headers = [asked_header]
    ple = bool(opts["ple"])
    out: list[Reading] = []
    for (has_outputs, n_stream_field, exts), lay, header in itertools.product(variants, layouts, headers):
        if not _matches((has_outputs, n_stream_field, exts), opts):
            continue
        if header and kind == "seq_state" and not n_stream_field and opts["n_stream_field"] is None:
            continue  # the io_magic prefix (2026) is younger than n_stream (July 2025)
        kinds = LAYOUTS[lay]
        asked_ext = opts["ext_size"]
        if asked_ext is not None:
            exts = (asked_ext,)
        elif "kv" not in kinds:
            exts = (0,)
        asked_v = opts["has_v"]
        has_vs = [asked_v] if asked_v is not None else ([True, False] if "kv" in kinds else [True])
        if "dsv4" in kinds:
            has_vs = [False]  # llama_kv_cache_dsv4's raw caches are K-only
        n_state: NState = opts["n_state_layers"]
        if n_state is None and "recurrent" in kinds:
            n_state = "scan"
        for ext, has_v in itertools.product(exts, has_vs):
            out.append((kind, lay, has_outputs, n_stream_field, ext, has_v, ple, n_state, header))
    return tuple(out)


def _as_options(r: Reading) -> Options:
    kind, lay, has_outputs, n_stream_field, ext, has_v, ple, n_state, header = r
    return {
        "kind": kind,
        "layout": lay,
        "has_outputs": has_outputs,
        "n_stream_field": n_stream_field,
        "ext_size": ext,
        "has_v": has_v,
        "ple": ple,
        "n_state_layers": n_state,
        "seq_header": header,
        "seq_scope": kind in ("seq", "seq_state"),
    }


def _matches(variant: Variant, opts: LoadOptions) -> bool:
    has_outputs, n_stream_field, _ = variant
    return (opts["outputs"] is None or has_outputs == opts["outputs"]) and (
        opts["n_stream_field"] is None or n_stream_field == opts["n_stream_field"]
    )


def _signature(obj: StateObject) -> tuple[object, ...]:
    """What a reading says about the bytes; readings with equal signatures describe the input identically."""
    sig: list[object] = [obj.kind, getattr(obj, "outputs", None) is not None]
    for s in obj.memory.sections:
        if isinstance(s, KVSection):
            sig.append(("kv", s.has_n_stream, tuple(_stream_sig(st) for st in s.streams)))
        elif isinstance(s, RecurrentSection):
            sig.append(("rec", s.cell_count, len(s.r), tuple(x.p_data is not None for x in s.r)))
        elif isinstance(s, DSV4Section):
            sig.append(("dsv4", s.header.mode, tuple(tuple(_stream_sig(st) for st in r.streams) for r in s.raw)))
    return tuple(sig)


def _stream_sig(st: KVStream) -> tuple[int, ...]:
    if st.cells is None or st.data is None:
        return (0,)
    return (st.cells.n, st.cells.ext_size, st.data.v_trans, len(st.data.k), len(st.data.v))


def _family(layout: str) -> str:
    kinds = LAYOUTS[layout]
    if "dsv4" in kinds:
        return "dsv4"
    if "recurrent" not in kinds:
        return "attention"
    return "recurrent" if len(kinds) == 1 else "hybrid"


# archs whose two-section memory is llama_kv_cache_dsa (MLA, indexer), which no bytes tell from an iSWA memory
_DSA_ARCHS = frozenset({"glm-dsa", "deepseek32", "hy_v4"})


def _arch_family(buf: memoryview, kind: str) -> str | None:
    """The memory family the arch string names (session files and state blobs carry one), if readable."""
    at = {"state": 0, "session": None}.get(kind, -1)
    if at is None:  # after the token list
        n_tokens = _u32(buf, 8)
        at = -1 if n_tokens is None else 12 + 4 * n_tokens
    n = _u32(buf, at) if at >= 0 else None
    if n is None or not 0 < n <= 64 or len(buf) < at + 4 + n:
        return None
    arch = bytes(buf[at + 4 : at + 4 + n]).decode("latin-1")
    if arch == "deepseek4":
        return "dsv4"
    return "recurrent" if arch in RECURRENT_ARCHS else "hybrid" if arch in HYBRID_ARCHS else "attention"


def _by_arch(found: Found) -> Found:
    """Break a tie with the arch string: a recurrent arch has a recurrent memory, and so on."""
    arch = getattr(next(iter(found.values()))[1], "arch", None)
    if arch is None:
        return found
    want = "recurrent" if arch in RECURRENT_ARCHS else "hybrid" if arch in HYBRID_ARCHS else "attention"
    if arch == "deepseek4":
        want = "dsv4"
    kept = {k: v for k, v in found.items() if _family(v[0]["layout"]) == want}
    return kept or found


def _plausible(found: Found) -> Found:
    """Break a tie with what llama.cpp never writes: a used KV cell always belongs to a sequence (but for the
    sequence saves of 2024, `legacy`, whose KV cells list no id at all)."""

    def ok(obj: StateObject) -> bool:
        seq_scope = obj.kind in ("seq", "seq_state")
        for sec in obj.memory.kv_sections:
            for st in sec.streams:
                if st.cells is None or not (st.cells.n_seq_id == 0).any():
                    continue
                if not (seq_scope and len(st.cells.seq_id) == 0):
                    return False
        return True

    kept = {k: v for k, v in found.items() if ok(v[1])}
    return kept or found


def _empty(obj: StateObject) -> bool:
    """No section holds a cell: every reading of such bytes restores the same thing (nothing)."""
    mem = obj.memory
    kv_empty = all(st.cells is None or st.cells.n == 0 for s in mem.kv_sections for st in s.streams)
    return kv_empty and all(s.cell_count == 0 for s in mem.recurrent_sections)


def _looks_right(obj: StateObject) -> bool:
    """Do the reading's layer records look like its layout's? A recurrent state's R and S rows differ in size, a
    KV cache's K and V rows usually do not."""
    for s in obj.memory.sections:
        if isinstance(s, RecurrentSection):
            return any(r.row_size != x.row_size for r, x in zip(s.r, s.s, strict=False))
        for st in s.streams:
            if st.data is not None:
                pairs = zip(st.data.k, st.data.v, strict=False)
                return all(getattr(a, "row_size", None) == getattr(b, "row_size", None) for a, b in pairs)
    return False


def _by_rows(found: Found) -> Found:
    """Break a tie between a KV and a recurrent reading of a sequence save of 2024 (no arch string, and no seq
    id in either's cells) by `_looks_right`; the caller's ``layout=`` decides where the rows do not."""
    objs = [obj for _, obj in found.values()]
    if any(o.kind not in ("seq", "seq_state") for o in objs) or any(
        st.cells is not None and len(st.cells.seq_id) for o in objs for s in o.memory.kv_sections for st in s.streams
    ):
        return found
    kept = {k: v for k, v in found.items() if _looks_right(v[1])}
    return kept if len(kept) == 1 else found


def _pick_empty(found: Found) -> StateObject:
    """Several layouts read these bytes and none holds a cell (say, a sequence saved after it was emptied):
    they mean the same empty state, so take one. Prefer the reading whose layer records look like its
    layout's (`_looks_right`)."""
    readings = list(found.values())
    chosen = next((r for r in readings if _looks_right(r[1])), readings[0])
    others = [describe(c) for c, _ in readings if c is not chosen[0]]
    chosen[1].note = (
        f"{len(readings)} readings parse and none holds a cell; read as {describe(chosen[0])} "
        f"(also: {'; '.join(others)}); pass layout= to choose"
    )
    return chosen[1]


def describe(opts: Options) -> str:
    """One reading in words, as errors and notes name it."""
    bits = [opts["kind"], f"layout={opts['layout']}"]
    if opts["kind"] in ("session", "state"):
        bits.append(f"outputs={opts['has_outputs']}")
    bits += [f"n_stream_field={opts['n_stream_field']}", f"ext_size={opts['ext_size']}", f"has_v={opts['has_v']}"]
    return " ".join(bits)


# --- sniffing: which readings can parse at all, decided from a few header fields --------------------------------
# Parsing every candidate reading in full costs a walk of every cell table per reading (a wrong cell ext size
# often reads a uniform table as half as many wider cells, then walks the second half cell by cell before it
# fails). `_Sniff` follows the same wire layout as the DSL (sections.py, files.py) without building anything:
# it only answers "can this reading parse?", sharing what readings have in common (the container header, each
# section at a given offset, each cell table) and jumping over runs of equal cells with NumPy instead of walking
# them. It is conservative: a reading is dropped only when the parser would fail on its own path. Only the kept
# readings are parsed (usually one); when none of them parses, every reading is parsed as before, so the error
# raised (the best-supported failure, with ``readings``) does not depend on the sniff.
#
# One shortcut: a cell table whose first, middle and last cells agree is *assumed* uniform (its end computed
# from cell_count, ext size and n_seq_id) rather than checked cell by cell. After the kept readings are parsed,
# every assumed table is confirmed: by a parsed reading that read that very table and found it ending there (the
# usual case: the right reading and its has_v=False twin share the table), else by checking it cell by cell;
# should one be wrong, the dropped readings are sniffed again without assumptions. So the table every reading
# shares is checked once, by the parser.

_U32S = struct.Struct("<I")
_I32S = struct.Struct("<i")
_U64S = struct.Struct("<Q")
_ROW_HEAD = struct.Struct("<iQ")  # type, row_size
_TRANS_HEAD = struct.Struct("<iII")  # type, el_size, n_embd
_TYPE_SIZE = {t: _type_size(t) for t in _KNOWN_TYPES}


def _item_min(container: Struct[Record], name: str) -> dict[bool, int]:
    """The smallest encoding of one element of the list field ``name`` (per Switch case when it is one)."""
    f = next(x for x in container.fields if x.name == name)
    cases = f.cases if isinstance(f, Switch) else {False: f}
    return {k: v.item.min_size for k, v in cases.items() if isinstance(v, List)}


_STREAM_MIN = KV_STREAM.min_size
_K_MIN = _item_min(KV_DATA, "k")[False]
_V_MIN = _item_min(KV_DATA, "v")
_R_MIN = R_LAYER.min_size
_S_MIN = _item_min(RECURRENT_SECTION, "s")
_ARCH_MAX = next(f.max_len for f in STATE.fields if isinstance(f, Str))
_GALLOP = 8  # equal cells walked one by one before the rest of the run is checked in NumPy blocks
_ASSUME_MIN = 256  # smaller tables are checked cell by cell right away (cheaper than confirming them later)

Table = tuple[str, int, int, int]  # ("cells", offset, cell_count, ext_size)
CellsEnd = tuple[int, frozenset[int]]  # where a cell table ends, and the n_seq_id values it holds
V = TypeVar("V")


def _once(memo: dict[tuple[object, ...], V], key: tuple[object, ...], make: Callable[[], V]) -> V:
    if key not in memo:
        memo[key] = make()
    return memo[key]


class _Sniff:
    """Cheap, shared, conservative "can this reading parse?" over one input (see above). With ``exact``, no
    cell table is assumed uniform."""

    def __init__(self, buf: memoryview, exact: bool = False) -> None:
        self.buf = buf
        self.end = len(buf)
        self.exact = exact
        # what readings share, computed once: where a part ends (header, section, K/V data), cell tables, K heads
        self.ends: dict[tuple[object, ...], int | None] = {}
        self.tables: dict[tuple[object, ...], CellsEnd | None] = {}
        self.heads: dict[tuple[object, ...], tuple[int, int, int] | None] = {}
        self.assumed: dict[Table, tuple[int, frozenset[int]]] = {}  # the tables assumed uniform, as assumed

    def viable(self, r: Reading) -> bool:
        """False when the parse of reading ``r`` is certain to fail (given the tables assumed uniform are)."""
        try:
            return self._viable(*r)
        except Exception:  # anything unforeseen: keep the reading, the parser decides
            return True

    def verdicts(self, groups: Groups) -> dict[Reading, bool]:
        """`viable` of every reading of ``groups`` (`_groups`): a group whose header, or whose first section, does
        not parse is dropped whole, the others' readings are asked one by one."""
        out: dict[Reading, bool] = {}
        ends = self.ends
        for (kind, outputs, hdr), firsts in groups.items():
            try:
                key: tuple[object, ...] = ("head", kind, outputs, hdr)
                at = _once(ends, key, partial(self._header, kind, outputs, hdr))
            except Exception:  # anything unforeseen: each reading on its own (`viable` keeps it)
                at = -1
            if at is None:
                for rs in firsts.values():
                    out.update(dict.fromkeys(rs, False))
                continue
            scope = kind in ("seq", "seq_state")
            for first, rs in firsts.items():
                end: int | None = -1
                if at != -1 and first[0] != "none":
                    try:
                        r0 = rs[0]  # the group's readings agree on the fields of its first part
                        if first[0] == "kv":
                            key = ("kv", at, r0[3], r0[4], r0[5], scope)
                            end = _once(ends, key, partial(self._kv_section, at, r0[3], r0[4], r0[5], scope))
                        elif first[0] == "dsv4":
                            end = self._dsv4_section(at, r0[3], r0[4], r0[5], scope)
                        else:
                            last = bool(first[3])
                            key = ("rec", at, r0[6], r0[7], scope, last)
                            end = _once(ends, key, partial(self._rec_section, at, r0[6], r0[7], scope, last))
                    except Exception:
                        end = -1
                if end is None:
                    out.update(dict.fromkeys(rs, False))
                    continue
                for r in rs:
                    if r not in out:
                        out[r] = self.viable(r)
        return out

    def confirm(self, read: dict[Table, int]) -> bool:
        """Whether every table assumed uniform is: ``read`` holds where the parser found tables to end."""
        exact = _Sniff(self.buf, exact=True)
        return all(read.get(t) == got[0] or exact._cells(*t[1:]) == got for t, got in self.assumed.items())

    def _viable(
        self,
        kind: str,
        layout: str,
        outputs: bool,
        n_stream_field: bool,
        ext: int,
        has_v: bool,
        ple: bool,
        ns: NState,
        hdr: bool,
    ) -> bool:
        ends = self.ends
        key: tuple[object, ...] = ("head", kind, outputs, hdr)
        at = ends.get(key, -1)  # -1: not computed yet (offsets are never negative)
        if at == -1:
            at = _once(ends, key, partial(self._header, kind, outputs, hdr))
        if at is None:
            return False
        scope = kind in ("seq", "seq_state")
        parts = LAYOUTS[layout]
        last_i = len(parts) - 1
        for i, part in enumerate(parts):
            if part == "dsv4":
                got = self._dsv4_section(at, n_stream_field, ext, has_v, scope)
            elif part == "kv":
                # llama_memory_hybrid_idx's indexer section: no V, a cell ext only with PLE (sections.py)
                x, v = (ext if ple else 0, False) if layout == "hybrid_idx" and i == 2 else (ext, has_v)
                key = ("kv", at, n_stream_field, x, v, scope)
                got = ends.get(key, -1)
                if got == -1:
                    got = _once(ends, key, partial(self._kv_section, at, n_stream_field, x, v, scope))
            else:
                key = ("rec", at, ple, ns, scope, i == last_i)
                got = ends.get(key, -1)
                if got == -1:
                    got = _once(ends, key, partial(self._rec_section, at, ple, ns, scope, i == last_i))
            if got is None:
                return False
            at = got
        return at == self.end  # else: trailing bytes, or a failure (None)

    # scalars: None when the field does not fit (the parser's "truncated")
    def _u32(self, at: int) -> int | None:
        return _U32S.unpack_from(self.buf, at)[0] if at + 4 <= self.end else None

    def _u64(self, at: int) -> int | None:
        return _U64S.unpack_from(self.buf, at)[0] if at + 8 <= self.end else None

    def _array(self, at: int, count: int | None, width: int) -> int | None:
        """A count prefix of ``width`` bytes then ``count`` 4-byte elements: the offset after them."""
        if count is None:
            return None
        at += width
        return None if count * 4 > self.end - at else at + count * 4

    def _header(self, kind: str, has_outputs: bool, seq_header: bool) -> int | None:
        """Where the memory starts (files.py: magic, version, tokens, arch, the v9 output block, io_magic)."""
        at: int | None = 0
        if kind in ("session", "seq"):
            magic, versions = (
                (Magic.SESSION, SESSION_VERSIONS) if kind == "session" else (Magic.STATE_SEQ, SEQ_VERSIONS)
            )
            if self._u32(0) != magic or self._u32(4) not in versions:
                return None
            at = self._array(8, self._u32(8), 4)  # n_token_count, tokens
        elif kind == "seq_state" and seq_header:
            if self._u32(0) != Magic.SEQ_BLOB or self.end < 8:  # io_magic, io_seq_id
                return None
            at = 8
        if at is not None and kind in ("session", "state"):
            n = self._u32(at)
            if n is None or n > _ARCH_MAX or n > self.end - at - 4:
                return None
            at += 4 + n
            if rng_present(self.buf, at, self._u32(4) if kind == "session" else None):
                n = self._u32(at)
                at = None if n is None or n > self.end - at - 4 else at + 4 + n
            if at is not None and has_outputs:
                at = self._array(at, self._u32(at), 4)  # n_outputs, output_pos
                at = None if at is None else self._array(at, self._u64(at), 8)  # logits_size, logits
                at = None if at is None else self._array(at, self._u64(at), 8)  # embd_size, embeddings
        return at

    def _dsv4_section(self, at: int, n_stream_field: bool, ext: int, has_v: bool, scope: bool) -> int | None:
        """A DSV4 section (kvref.state.dsv4): its header, one or two KV sections, the compressed parts."""
        if self._u32(at) != DSV4_STATE_MAGIC or self._u32(at + 4) != 1:
            return None
        mode = self._u32(at + 8)
        if mode not in (0, 1):
            return None
        got: int | None = at + 12
        for _ in range(1 if mode else 2):
            got = None if got is None else self._kv_section(got, n_stream_field, ext, has_v, scope)
        return None if got is None else skip_tail(self.buf, got, self.end, bool(mode))

    def _kv_section(self, at: int, n_stream_field: bool, ext: int, has_v: bool, scope: bool) -> int | None:
        n_stream = 1
        if n_stream_field:
            n = self._u32(at)
            if n is None or not 1 <= n <= LLAMA_MAX_SEQ:
                return None
            n_stream, at = n, at + 4
        if n_stream * _STREAM_MIN > self.end - at:
            return None
        for _ in range(n_stream):
            cell_count = self._u32(at)
            if cell_count is None:
                return None
            at += 4
            if cell_count > 0:
                table = _once(self.tables, ("cells", at, cell_count, ext), partial(self._cells, at, cell_count, ext))
                if table is None or (scope and not table[1] <= {0, 1}):
                    return None
                at = table[0]
            if cell_count > 0 or not n_stream_field:
                end = _once(self.ends, ("data", at, cell_count, has_v), partial(self._kv_data, at, cell_count, has_v))
                if end is None:
                    return None
                at = end
        return at

    def _kv_data(self, at: int, cell_count: int, has_v: bool) -> int | None:
        head = _once(self.heads, ("k", at, cell_count), partial(self._kv_k, at, cell_count))
        if head is None:
            return None
        v_trans, n_layer, at = head
        n_v = n_layer if has_v else 0
        if n_v * _V_MIN[bool(v_trans)] > self.end - at:
            return None
        return self._transposed(at, cell_count, n_v) if v_trans else self._rows(at, cell_count, n_v)

    def _kv_k(self, at: int, cell_count: int) -> tuple[int, int, int] | None:
        v_trans, n_layer = self._u32(at), self._u32(at + 4)
        if v_trans not in (0, 1) or n_layer is None or n_layer > LLAMA_MAX_LAYERS:
            return None
        at += 8
        if n_layer * _K_MIN > self.end - at:
            return None
        end = self._rows(at, cell_count, n_layer)
        return None if end is None else (v_trans, n_layer, end)

    def _rows(self, at: int, n_rows: int, count: int, ple: bool = False) -> int | None:
        """``count`` records of ``i32 type, u64 row_size, rows`` (with ``u64 p_row_size, p rows`` when ``ple``)."""
        end, buf, sizes = self.end, self.buf, _TYPE_SIZE
        for _ in range(count):
            if at + 12 > end:
                return None
            t, row = _ROW_HEAD.unpack_from(buf, at)
            size = sizes.get(t)
            if size is None or row % size:
                return None
            at += 12
            if n_rows * row > end - at or row > _MAX_DIM or n_rows > _MAX_DIM:
                return None
            at += n_rows * row
            if ple:
                p = self._u64(at)
                if p is None:
                    return None
                at += 8
                if n_rows * p > end - at or p > _MAX_DIM or n_rows > _MAX_DIM:
                    return None
                at += n_rows * p
        return at

    def _transposed(self, at: int, n_cells: int, count: int) -> int | None:
        """``count`` records of ``i32 type, u32 el_size, u32 n_embd, n_embd rows of n_cells * el_size``."""
        end, buf = self.end, self.buf
        for _ in range(count):
            if at + 12 > end:
                return None
            t, el, n_embd = _TRANS_HEAD.unpack_from(buf, at)
            if el != _TYPE_SIZE.get(t):
                return None
            at += 12
            cols = n_cells * el
            if n_embd * cols > end - at or max(n_embd, cols) > _MAX_DIM:
                return None
            at += n_embd * cols
        return at

    def _rec_section(self, at: int, ple: bool, n_state: NState, scope: bool, last: bool) -> int | None:
        cell_count = self._u32(at)
        if cell_count is None:
            return None
        at += 4
        table = _once(self.tables, ("cells", at, cell_count, 0), partial(self._cells, at, cell_count, 0))
        # a sequence blob of seq_id -1 (llama_state_seq_get_data(ctx, -1): every sequence) carries the cells' ids
        if table is None:
            return None
        at = table[0]
        s_trans, n_layer = self._u32(at), self._u32(at + 4)
        if s_trans not in (0, 1) or n_layer is None or n_layer > LLAMA_MAX_LAYERS:
            return None
        at += 8
        if n_state is None:
            n_state = n_layer
        elif n_state == "scan":
            n_state = self._scan(at, n_layer, cell_count, s_trans, ple, last)
        elif n_state > n_layer:
            return None
        if n_state * _R_MIN > self.end - at:
            return None
        after = self._rows(at, cell_count, n_state, ple)
        if after is None or n_state * _S_MIN[bool(s_trans)] > self.end - after:
            return None
        return self._transposed(after, cell_count, n_state) if s_trans else self._rows(after, cell_count, n_state)

    def _scan(self, at: int, n_layer: int, cell_count: int, s_trans: int, ple: bool, last: bool) -> int:
        """sections._scan_state_layers (how many layers carry state), with struct reads instead of NumPy ones."""
        if s_trans:
            return n_layer
        end = self.end
        if ple:
            fits = []
            for k in range(n_layer, -1, -1):
                k_r, pos = self._records(at, cell_count, True, k)
                if k_r != k:
                    continue
                k_s, stop = self._records(pos, cell_count, False, k)
                if k_s == k:
                    fits.append((stop != end, k))
            exact = [k for at_end, k in fits if not at_end]
            if last:
                return exact[0] if exact else n_layer
            return max(k for _, k in fits) if fits else n_layer
        if not last:
            # sections.uniform_halves: the R records share one row head, the S records another
            from .sections import uniform_halves

            heads: list[tuple[object, ...]] = []
            pos = at
            while len(heads) < 2 * n_layer:
                count, nxt = self._records(pos, cell_count, False, 1)
                if count == 0:
                    break
                heads.append(_ROW_HEAD.unpack_from(self.buf, pos))
                pos = nxt
            k = uniform_halves(heads)
            return k if k else n_layer
        count, pos = self._records(at, cell_count, False, 2 * n_layer)
        if count % 2 or (last and pos != end) or (not last and count == 0):
            return n_layer
        return count // 2

    def _records(self, pos: int, cell_count: int, with_p: bool, limit: int) -> tuple[int, int]:
        """sections._walk_records: consecutive ``type, row_size, rows [, p_row_size, p rows]`` records that fit."""
        count, end, buf = 0, self.end, self.buf
        while count < limit and pos + 12 <= end:
            t, row = _ROW_HEAD.unpack_from(buf, pos)
            size = _TYPE_SIZE.get(t)
            if size is None:
                break
            nxt = pos + 12 + row * cell_count
            if row % size or nxt > end:
                break
            if with_p:
                if nxt + 8 > end:
                    break
                nxt += 8 + _U64S.unpack_from(buf, nxt)[0] * cell_count
                if nxt > end:
                    break
            pos, count = nxt, count + 1
        return count, pos

    def _cells(self, at: int, n: int, ext_size: int) -> CellsEnd | None:
        """The end of a cell table and the n_seq_id values it holds (cells.py: the uniform view, else the walk).
        The values are exact only as far as a rejection needs: the first cell's is always among them."""
        if n * (8 + ext_size) > self.end - at:
            return None
        if n == 0:
            return at, frozenset()
        k, words = ext_size // 4, (self.end - at) // 4
        first = self._u32(at + 4)
        if words < 2 or first is None or first > LLAMA_MAX_SEQ:
            return None
        stride = 2 + k + first
        # the reader's fast path: every cell like the first
        if n * stride <= words and self._probe(at, n, stride, k, first):
            out = at + 4 * n * stride, frozenset((first,))
            if not self.exact and n >= _ASSUME_MIN:
                self.assumed["cells", at, n, ext_size] = out
                return out
            rec = np.frombuffer(self.buf, "<u4", n * stride, at).reshape(n, stride)
            if (rec[:, 1] == first).all() and (first == 0 or rec[:, 2 + k :].max() < LLAMA_MAX_SEQ):
                return out
        return self._walk(at, n, k, words)

    def _probe(self, at: int, n: int, stride: int, k: int, first: int) -> bool:
        """Whether the first, middle and last cells of a table of ``n`` cells of ``stride`` words (the first cell's
        n_seq_id ``first``) each hold ``first`` ids, all below LLAMA_MAX_SEQ (struct reads: three cells)."""
        buf = self.buf
        for i in (0, n // 2, n - 1):
            w = at + 4 * i * stride
            if _U32S.unpack_from(buf, w + 4)[0] != first:
                return False
            if first and max(struct.unpack_from(f"<{first}I", buf, w + 8 + 4 * k)) >= LLAMA_MAX_SEQ:
                return False
        return True

    def _walk(self, at: int, n: int, k: int, words: int) -> CellsEnd | None:
        """The reader's per-cell walk (each n_seq_id at most LLAMA_MAX_SEQ, each seq id in [0, LLAMA_MAX_SEQ), each
        cell within the input); a run of equal cells is checked in NumPy blocks of growing size."""
        w32 = self.buf[at : at + 4 * words].cast("I")
        arr: npt.NDArray[np.uint32] | None = None
        w = i = rep = 0
        prev = -1
        seen: set[int] = set()
        while i < n:
            if w + 2 > words:
                return None
            m = w32[w + 1]
            step = 2 + k + m
            if m > LLAMA_MAX_SEQ or w + step > words:
                return None
            if m and (w32[w + 2 + k] if m == 1 else max(w32[w + 2 + k : w + step])) >= LLAMA_MAX_SEQ:
                return None  # ids are u32 here: a negative i32 id is >= LLAMA_MAX_SEQ too
            w, i = w + step, i + 1
            if m != prev:
                seen.add(m)
                prev, rep = m, 1
                continue
            rep += 1
            if rep >= _GALLOP and i < n:
                if arr is None:
                    arr = np.frombuffer(self.buf, "<u4", words, at)
                run = _run(arr, w, step, k, m, min(n - i, (words - w) // step))
                w, i, rep = w + run * step, i + run, 0
        return at + 4 * w, frozenset(seen)


def _run(arr: npt.NDArray[np.uint32], w: int, step: int, k: int, m: int, limit: int) -> int:
    """How many cells from word ``w`` on (at most ``limit``) have ``n_seq_id == m`` and valid seq ids."""
    j, block = 0, 512
    while j < limit:
        b = min(block, limit - j)
        rec = arr[w + j * step : w + (j + b) * step].reshape(b, step)
        bad_n = rec[:, 1] != m
        ids = rec[:, 2 + k] if m == 1 else rec[:, 2 + k : 2 + k + m]
        if not bad_n.any() and (m == 0 or ids.max() < LLAMA_MAX_SEQ):
            j, block = j + b, block * 4
            continue
        good = int(np.argmax(bad_n)) if bad_n.any() else b  # cells before the first other n_seq_id ...
        if m:
            bad_id = np.asarray(ids[:good] >= LLAMA_MAX_SEQ)
            if m > 1:
                bad_id = np.asarray(bad_id.any(axis=1))
            if bad_id.any():  # ... and before the first bad seq id
                good = int(np.argmax(bad_id))
        return j + good
    return j


def _tables_read(objs: list[StateObject]) -> dict[Table, int]:
    """Where each cell table the parser read ends: ("cells", offset, cell_count, ext_size) -> end offset."""
    out: dict[Table, int] = {}
    for obj in objs:
        # a DSV4 section's cell tables are its raw KV sections'
        secs: list[KVSection | RecurrentSection] = [*obj.memory.kv_sections, *obj.memory.recurrent_sections]
        for sec in secs:
            parts = sec.streams if isinstance(sec, KVSection) else [sec]
            for part in parts:
                cells, at = part.cells, part.offsets.get("cells")
                if cells is not None and at is not None:
                    key = ("cells", at, cells.n, cells.ext_size)
                    out[key] = at + cells.n * (8 + cells.ext_size) + 4 * len(cells.seq_id)
    return out


def _parse(r: Reading, buf: memoryview) -> StateObject | None:
    """Reading ``r`` of ``buf``, or None when it does not parse (its error is not kept: see `_parsed`)."""
    try:
        obj: StateObject = read_root(STRUCTS[r[0]], buf, _as_options(r))
    except FormatError:
        return None
    return obj


def _parsed(
    buf: memoryview, readings: list[Reading], groups: list[Groups] | None = None
) -> list[StateObject | None] | None:
    """Each reading's object when it parses (None when it does not, or cannot), or None when no reading parses
    or there is nothing to sniff: then `load` parses every reading in turn, as it always did, for its error.
    ``groups``: the readings' `_groups` (one per kind), when the caller has them."""
    if len(readings) < 2 or sys.byteorder != "little":  # the sniff reads native u32 words
        return None
    sniff = _Sniff(buf)
    verdict: dict[Reading, bool] = {}
    for g in groups if groups is not None else [_groups(readings)]:
        verdict.update(sniff.verdicts(g))
    # blob variants overlap: a reading can repeat
    done: dict[Reading, StateObject | None] = {r: _parse(r, buf) for r, ok in verdict.items() if ok}
    parsed = [o for o in done.values() if o is not None]
    if not parsed:
        return None
    if sniff.assumed and not sniff.confirm(_tables_read(parsed)):
        exact = _Sniff(buf, exact=True)  # an assumed table was not uniform: sniff again, assuming nothing
        for r in verdict:
            if r not in done and exact.viable(r):
                done[r] = _parse(r, buf)
    return [done.get(r) for r in readings]


@overload
def load(
    src: Source, kind: Literal["session"], layout: str = "auto", **options: Unpack[LoadOptions]
) -> SessionFile: ...


@overload
def load(src: Source, kind: Literal["seq"], layout: str = "auto", **options: Unpack[LoadOptions]) -> SeqFile: ...


@overload
def load(src: Source, kind: Literal["state"], layout: str = "auto", **options: Unpack[LoadOptions]) -> StateBlob: ...


@overload
def load(
    src: Source, kind: Literal["seq_state"], layout: str = "auto", **options: Unpack[LoadOptions]
) -> SeqStateBlob: ...


@overload
def load(src: Source, kind: str = "auto", layout: str = "auto", **options: Unpack[LoadOptions]) -> StateObject: ...


def load(
    src: Source,
    kind: str = "auto",
    layout: str = "auto",
    *,
    ext_size: int | None = None,
    n_stream_field: bool | None = None,
    has_v: bool | None = None,
    outputs: bool | None = None,
    ple: bool = False,
    n_state_layers: int | None = None,
    seq_header: bool | None = None,
    model: object = None,
) -> StateObject:
    """Parse a state file (path, memory-mapped), blob (bytes) or llama-cpp-python ``LlamaState`` (its
    ``llama_state`` bytes, a context state blob) into its object model.

    ``kind``: "session" ('ggsn' file), "seq" ('ggsq' file), "state" (llama_state_get_data blob),
    "seq_state" (llama_state_seq_get_data blob) or "auto". ``layout``: one of ``LAYOUTS`` ("kv", "iswa",
    "recurrent", "hybrid", "hybrid_iswa", "hybrid_idx", "none") or "auto". The keyword options pin down what
    the bytes cannot tell (cell ext size 0/8/12, the pre-#14363 KV section without ``n_stream``, MLA caches
    without V, the v9 output block, PLE rows in recurrent layers, how many layers carry recurrent state, the
    io_magic prefix of sequence blobs); any left as None is inferred. ``model`` (a GGUF path or
    `kvref.hparams.HParams`) is needed by session versions 5 .. 7 only (`kvref.state.legacy`). Raises FormatError.
    """
    if kind != "auto" and kind not in KINDS:
        raise ArgumentError(f"kind must be 'auto' or one of {KINDS}, not {kind!r}")
    if layout != "auto" and layout not in LAYOUTS:
        raise ArgumentError(f"layout must be 'auto' or one of {tuple(LAYOUTS)}, not {layout!r}")
    if ext_size is not None and ext_size not in (0, 8, 12):
        raise ArgumentError(f"ext_size must be 0, 8 or 12, not {ext_size!r}")
    if isinstance(src, LlamaStateLike) and kind == "auto":
        kind = "state"  # a LlamaState holds llama_state_get_data's bytes
    buf = _open(src)
    old = raw_kv_kind(buf, kind)
    if old is not None:  # llama.cpp before July 2024: another format, read with the model's layer widths
        return read_legacy(buf, old, model)
    old = seq_v1_kind(buf, kind)
    if old == "seq":
        return read_legacy_seq(buf, old)
    if old == "seq_state":  # or a later blob whose cell_count is 8: only a whole parse tells
        try:
            return read_legacy_seq(buf, old)
        except FormatError:
            pass
    opts: LoadOptions = {
        "ext_size": ext_size,
        "n_stream_field": n_stream_field,
        "has_v": has_v,
        "outputs": outputs,
        "ple": ple,
        "n_state_layers": n_state_layers,
        "seq_header": seq_header,
    }
    kinds = detect_kind(buf) if kind == "auto" else [kind]
    plans = [_readings_groups(k, buf, layout, opts, kind == "auto") for k in kinds]
    readings = [r for rs, _ in plans for r in rs]
    if not readings:
        raise ArgumentError("the options given exclude every reading of this input")
    found: Found = {}
    best: FormatError | None = None
    best_key: tuple[int, int, int, int] = (0, 0, 0, 0)
    want_family = _arch_family(buf, kinds[0])
    failures: list[tuple[str, str]] = []
    # the sniff's pick (usually one reading); when none of its readings parses, every reading, as before
    objs = _parsed(buf, readings, [g for _, g in plans])
    for i, r in enumerate(readings):
        if objs is not None:
            obj = objs[i]
            if obj is None:
                continue  # does not parse (or cannot: dropped by the sniff), and another reading does
            c = _as_options(r)
        else:
            c = _as_options(r)
            try:
                obj = read_root(STRUCTS[c["kind"]], buf, c)
            except FormatError as e:
                failures.append((describe(c), str(e)))
                # the best-supported explanation: among the likeliest readings (no cell ext, V present: what
                # most models write), one that did not stumble on a sequence id no llama.cpp can write (the mark
                # of reading misaligned bytes), the one that got furthest into the input
                msg = str(e)
                misaligned = e.field in ("n_seq_id", "seq_id") and ("LLAMA_MAX_SEQ" in msg or "[0, 256)" in msg)
                family = want_family is None or _family(c["layout"]) == want_family
                key = (int(family), int(c["ext_size"] == 0 and c["has_v"]), int(not misaligned), e.offset or 0)
                if best is None or key > best_key:
                    best, best_key = e, key
                continue
        found.setdefault(_signature(obj), (c, obj))
    if len(found) > 1:
        found = _by_arch(_plausible(found))
    if len(found) > 1 and not all(_empty(obj) for _, obj in found.values()):
        found = _by_rows(found)
    if len(found) > 1 and all(_empty(obj) for _, obj in found.values()):
        return _pick_empty(found)
    if len(found) == 1:
        c, obj = next(iter(found.values()))
        if layout == "auto" and want_family == "hybrid" and _family(c["layout"]) != "hybrid":
            # a hybrid model writes an attention and a recurrent section; the input holds only one of them
            raise FormatError(
                f"the arch string names a hybrid model, but the input ends after a {c['layout']} section: the "
                "other section is missing (a truncated file?); pass layout= to read it anyway",
                field="cell_count",
                offset=len(buf),
            )
        if layout == "auto" and c["layout"] == "iswa" and getattr(obj, "arch", None) in _DSA_ARCHS:
            obj.memory.layout = "dsa"  # the same bytes as an iSWA memory's: the arch string says which
        if layout == "auto" and obj.memory.layout == "iswa" and getattr(obj, "arch", None) == "minimax-m3":
            obj.memory.layout = "msa"  # the same two KV sections: llama_kv_cache_msa's base and indexer caches
        return obj
    if not found:
        assert best is not None
        if (
            kind == "auto"
            and (best.offset or 0) <= 8
            and _u32(buf, 0) not in (Magic.SESSION, Magic.STATE_SEQ, Magic.SEQ_BLOB)
        ):
            # nothing got past the first fields: the bytes do not start like any state
            best = FormatError(
                f"not a llama.cpp state: it starts with {_shown(buf)}; {_EXPECTED}", field="magic", offset=0
            )
        version = _u32(buf, 4)
        if kinds in (["session"], ["seq"]) and best.field == "version" and version is not None:
            other = _SEQ_VARIANTS if kinds == ["session"] else _SESSION_VARIANTS
            if version in other:  # the version is right for the other container: its magic was damaged
                name = "sequence file ('ggsq')" if kinds == ["session"] else "session file ('ggsn')"
                best = FormatError(
                    f"magic 0x{_u32(buf, 0):08x} names a {kinds[0]} file, but version {version} is a {name} "
                    "version: the magic does not match the file",
                    field="magic",
                    offset=0,
                )
        best.readings = failures
        if layout == "auto" and best.offset == len(buf):
            # every memory reading stops where its first section would start, at the end: a state without a
            # memory section (a draft context over another context's cache, gemma4-assistant with ctx_other,
            # writes none; so does a context without memory)
            try:
                empty: StateObject = load(
                    buf,
                    kind,
                    "none",
                    ext_size=ext_size,
                    n_stream_field=n_stream_field,
                    has_v=has_v,
                    outputs=outputs,
                    ple=ple,
                    n_state_layers=n_state_layers,
                    seq_header=seq_header,
                )
            except FormatError:
                raise best from None
            empty.note = (
                "no memory section (read as layout none): a context without memory or a draft over another's cache"
            )
            return empty
        raise best
    which = "; ".join(describe(c) for c, _ in found.values())
    raise FormatError(
        f"cannot decide how to read this input, {len(found)} readings parse: {which}; pass kind=/layout=/options",
        field="layout",
        offset=0,
    )


__all__ = ["KINDS", "describe", "detect_kind", "load"]
