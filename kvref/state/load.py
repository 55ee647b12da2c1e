"""`load`: open a state file or blob (memory-mapped), decide what it is, and parse it.

Nothing in the bytes says which memory layout follows, whether cells carry an ext, whether a version-9
session still has its output block or whether its KV sections start with ``n_stream``. The caller may say
so; whatever it leaves open is *inferred*: every remaining combination is parsed (metadata only, the rows are
views) and exactly one must consume the input to its last byte. Candidates that are indistinguishable in the
bytes they describe (say, ext sizes when no cell is present) count as one. Two genuinely different
readings raise a FormatError on field ``layout`` that names them; none raises the error of the reading that
got furthest.
"""

from __future__ import annotations

import itertools
import mmap
import os
from typing import Any, Literal, overload

from ..archs import HYBRID_ARCHS, RECURRENT_ARCHS
from ..errors import ArgumentError, FormatError
from .constants import LAYOUTS, Magic
from .dsl import read_root
from .files import STRUCTS, SeqFile, SeqStateBlob, SessionFile, StateBlob, StateObject
from .sections import KVSection, RecurrentSection

KINDS = ("session", "seq", "state", "seq_state")
# what `load` reads: a path (memory-mapped) or the bytes of a blob
Source = str | os.PathLike[str] | bytes | bytearray | memoryview

# (has_outputs, n_stream_field, ext sizes) per container version, oldest first. Cell ext came after n_stream
# (July 2025); 12-byte ext with the version bump of #27742; the v9 output block went away with #18862.
# (has the v9 output block, has the n_stream field, possible cell ext sizes) per file version
Variant = tuple[bool, bool, tuple[int, ...]]
_SESSION_VARIANTS: dict[int, list[Variant]] = {
    9: [(True, False, (0,)), (True, True, (0, 8)), (False, True, (0, 8))],
    10: [(False, True, (0, 12))],
}
_SEQ_VARIANTS: dict[int, list[Variant]] = {
    2: [(False, False, (0,)), (False, True, (0, 8))],
    3: [(False, True, (0, 12))],
}


def _open(src: Any) -> memoryview:
    if isinstance(src, bytes | bytearray | memoryview):
        return memoryview(src).cast("B")
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


def _candidates(
    kind: str, buf: memoryview, layout: str, opts: dict[str, Any], auto_kind: bool = True
) -> list[dict[str, Any]]:
    table = _SESSION_VARIANTS if kind in ("session", "state") else _SEQ_VARIANTS
    every = list(dict.fromkeys(v for vs in table.values() for v in vs))
    # files say their version; blobs do not. Explicit options win over the version table (a caller who says
    # outputs=True for a v10 file gets that reading), and an unknown version fails on its own check.
    version = _u32(buf, 4) if kind in ("session", "seq") else None
    variants = table.get(version, every) if version is not None else every
    if not any(_matches(v, opts) for v in variants):
        variants = every
    if kind in ("seq", "seq_state"):
        variants = list(dict.fromkeys((False, n, e) for _, n, e in variants))
    # a memoryless context ("none") must be asked for: in "auto" it would make every state cut right after
    # its arch string a valid reading
    layouts = [name for name in LAYOUTS if name != "none"] if layout == "auto" else [layout]
    # blobs of the current format carry the io_magic prefix; asked for a seq_state, assume it (a corrupt magic
    # is then reported as such) unless the bytes are being guessed (kind "auto") and do not start with it
    headers = [True] if kind != "seq_state" or auto_kind is False else [_u32(buf, 0) == Magic.SEQ_BLOB]
    if opts["seq_header"] is not None:
        headers = [opts["seq_header"]]
    out = []
    for (has_outputs, n_stream_field, exts), lay, header in itertools.product(variants, layouts, headers):
        if not _matches((has_outputs, n_stream_field, exts), opts):
            continue
        if header and kind == "seq_state" and not n_stream_field and opts["n_stream_field"] is None:
            continue  # the io_magic prefix (2026) is younger than n_stream (July 2025)
        kinds = LAYOUTS[lay]
        if opts["ext_size"] is not None:
            exts = (opts["ext_size"],)
        elif "kv" not in kinds:
            exts = (0,)
        has_vs = [opts["has_v"]] if opts["has_v"] is not None else ([True, False] if "kv" in kinds else [True])
        n_state = opts["n_state_layers"]
        if n_state is None and "recurrent" in kinds:
            n_state = "scan"
        for ext, has_v in itertools.product(exts, has_vs):
            out.append(
                {
                    "kind": kind,
                    "layout": lay,
                    "has_outputs": has_outputs,
                    "n_stream_field": n_stream_field,
                    "ext_size": ext,
                    "has_v": has_v,
                    "ple": bool(opts["ple"]),
                    "n_state_layers": n_state,
                    "seq_header": header,
                    "seq_scope": kind in ("seq", "seq_state"),
                }
            )
    return out


def _matches(variant: tuple[bool, bool, tuple[int, ...]], opts: dict[str, Any]) -> bool:
    has_outputs, n_stream_field, _ = variant
    return (opts["outputs"] is None or has_outputs == opts["outputs"]) and (
        opts["n_stream_field"] is None or n_stream_field == opts["n_stream_field"]
    )


def _signature(obj: StateObject) -> tuple[Any, ...]:
    """What a reading says about the bytes; readings with equal signatures describe the input identically."""
    sig: list[Any] = [obj.kind, getattr(obj, "outputs", None) is not None]
    for s in obj.memory.sections:
        if isinstance(s, KVSection):
            sig.append(("kv", s.has_n_stream, tuple(_stream_sig(st) for st in s.streams)))
        elif isinstance(s, RecurrentSection):
            sig.append(("rec", s.cell_count, len(s.r), tuple(x.p_data is not None for x in s.r)))
    return tuple(sig)


def _stream_sig(st: Any) -> tuple[Any, ...]:
    if st.cells is None:
        return (0,)
    return (st.cells.n, st.cells.ext_size, st.data.v_trans, len(st.data.k), len(st.data.v))


def _family(layout: str) -> str:
    kinds = LAYOUTS[layout]
    if "recurrent" not in kinds:
        return "attention"
    return "recurrent" if len(kinds) == 1 else "hybrid"


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
    return "recurrent" if arch in RECURRENT_ARCHS else "hybrid" if arch in HYBRID_ARCHS else "attention"


def _by_arch(found: dict[Any, tuple[dict[str, Any], StateObject]]) -> dict[Any, tuple[dict[str, Any], StateObject]]:
    """Break a tie with the arch string: a recurrent arch has a recurrent memory, and so on."""
    arch = getattr(next(iter(found.values()))[1], "arch", None)
    if arch is None:
        return found
    want = "recurrent" if arch in RECURRENT_ARCHS else "hybrid" if arch in HYBRID_ARCHS else "attention"
    kept = {k: v for k, v in found.items() if _family(v[0]["layout"]) == want}
    return kept or found


def _plausible(found: dict[Any, tuple[dict[str, Any], StateObject]]) -> dict[Any, tuple[dict[str, Any], StateObject]]:
    """Break a tie with what llama.cpp never writes: a used KV cell always belongs to a sequence."""

    def ok(obj: StateObject) -> bool:
        for sec in obj.memory.kv_sections:
            for st in sec.streams:
                if st.cells is not None and (st.cells.n_seq_id == 0).any():
                    return False
        return True

    kept = {k: v for k, v in found.items() if ok(v[1])}
    return kept or found


def _empty(obj: StateObject) -> bool:
    """No section holds a cell: every reading of such bytes restores the same thing (nothing)."""
    mem = obj.memory
    kv_empty = all(st.cells is None or st.cells.n == 0 for s in mem.kv_sections for st in s.streams)
    return kv_empty and all(s.cell_count == 0 for s in mem.recurrent_sections)


def _pick_empty(found: dict[Any, tuple[dict[str, Any], StateObject]]) -> StateObject:
    """Several layouts read these bytes and none holds a cell (say, a sequence saved after it was emptied):
    they mean the same empty state, so take one. Prefer the reading whose layer records look like its
    layout's: a recurrent state's R and S rows differ in size, a KV cache's K and V rows usually do not."""

    def looks_right(obj: StateObject) -> bool:
        for s in obj.memory.sections:
            if isinstance(s, RecurrentSection):
                return any(r.row_size != x.row_size for r, x in zip(s.r, s.s, strict=False))
            for st in s.streams:
                if st.data is not None:
                    pairs = zip(st.data.k, st.data.v, strict=False)
                    return all(getattr(a, "row_size", None) == getattr(b, "row_size", None) for a, b in pairs)
        return False

    readings = list(found.values())
    chosen = next((r for r in readings if looks_right(r[1])), readings[0])
    others = [describe(c) for c, _ in readings if c is not chosen[0]]
    chosen[1].note = (
        f"{len(readings)} readings parse and none holds a cell; read as {describe(chosen[0])} "
        f"(also: {'; '.join(others)}); pass layout= to choose"
    )
    return chosen[1]


def describe(opts: dict[str, Any]) -> str:
    bits = [opts["kind"], f"layout={opts['layout']}"]
    if opts["kind"] in ("session", "state"):
        bits.append(f"outputs={opts['has_outputs']}")
    bits += [f"n_stream_field={opts['n_stream_field']}", f"ext_size={opts['ext_size']}", f"has_v={opts['has_v']}"]
    return " ".join(bits)


@overload
def load(
    src: Source,
    kind: Literal["session"],
    layout: str = "auto",
    *,
    ext_size: int | None = None,
    n_stream_field: bool | None = None,
    has_v: bool | None = None,
    outputs: bool | None = None,
    ple: bool = False,
    n_state_layers: int | None = None,
    seq_header: bool | None = None,
) -> SessionFile: ...


@overload
def load(
    src: Source,
    kind: Literal["seq"],
    layout: str = "auto",
    *,
    ext_size: int | None = None,
    n_stream_field: bool | None = None,
    has_v: bool | None = None,
    outputs: bool | None = None,
    ple: bool = False,
    n_state_layers: int | None = None,
    seq_header: bool | None = None,
) -> SeqFile: ...


@overload
def load(
    src: Source,
    kind: Literal["state"],
    layout: str = "auto",
    *,
    ext_size: int | None = None,
    n_stream_field: bool | None = None,
    has_v: bool | None = None,
    outputs: bool | None = None,
    ple: bool = False,
    n_state_layers: int | None = None,
    seq_header: bool | None = None,
) -> StateBlob: ...


@overload
def load(
    src: Source,
    kind: Literal["seq_state"],
    layout: str = "auto",
    *,
    ext_size: int | None = None,
    n_stream_field: bool | None = None,
    has_v: bool | None = None,
    outputs: bool | None = None,
    ple: bool = False,
    n_state_layers: int | None = None,
    seq_header: bool | None = None,
) -> SeqStateBlob: ...


@overload
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
) -> StateObject: ...


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
) -> StateObject:
    """Parse a state file (path, memory-mapped) or blob (bytes) into its object model.

    ``kind``: "session" ('ggsn' file), "seq" ('ggsq' file), "state" (llama_state_get_data blob),
    "seq_state" (llama_state_seq_get_data blob) or "auto". ``layout``: one of ``LAYOUTS`` ("kv", "iswa",
    "recurrent", "hybrid", "hybrid_iswa", "hybrid_idx", "none") or "auto". The keyword options pin down what
    the bytes cannot tell (cell ext size 0/8/12, the pre-#14363 KV section without ``n_stream``, MLA caches
    without V, the v9 output block, PLE rows in recurrent layers, how many layers carry recurrent state, the
    io_magic prefix of sequence blobs); any left as None is inferred. Raises FormatError.
    """
    if kind != "auto" and kind not in KINDS:
        raise ArgumentError(f"kind must be 'auto' or one of {KINDS}, not {kind!r}")
    if layout != "auto" and layout not in LAYOUTS:
        raise ArgumentError(f"layout must be 'auto' or one of {tuple(LAYOUTS)}, not {layout!r}")
    if ext_size is not None and ext_size not in (0, 8, 12):
        raise ArgumentError(f"ext_size must be 0, 8 or 12, not {ext_size!r}")
    buf = _open(src)
    opts = {
        "ext_size": ext_size,
        "n_stream_field": n_stream_field,
        "has_v": has_v,
        "outputs": outputs,
        "ple": ple,
        "n_state_layers": n_state_layers,
        "seq_header": seq_header,
    }
    kinds = detect_kind(buf) if kind == "auto" else [kind]
    candidates = [c for k in kinds for c in _candidates(k, buf, layout, opts, kind == "auto")]
    if not candidates:
        raise ArgumentError("the options given exclude every reading of this input")
    found: dict[tuple[Any, ...], tuple[dict[str, Any], StateObject]] = {}
    best: FormatError | None = None
    best_key: tuple[int, int, int, int] = (0, 0, 0, 0)
    want_family = _arch_family(buf, kinds[0])
    failures: list[tuple[str, str]] = []
    for c in candidates:
        try:
            obj = read_root(STRUCTS[c["kind"]], buf, c)
        except FormatError as e:
            failures.append((describe(c), str(e)))
            # the best-supported explanation: among the likeliest readings (no cell ext, V present: what most
            # models write), one that did not stumble on a sequence id no llama.cpp can write (the mark of
            # reading misaligned bytes), the one that got furthest into the input
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
        raise best
    readings = "; ".join(describe(c) for c, _ in found.values())
    raise FormatError(
        f"cannot decide how to read this input, {len(found)} readings parse: {readings}; pass kind=/layout=/options",
        field="layout",
        offset=0,
    )


__all__ = ["KINDS", "describe", "detect_kind", "load"]
