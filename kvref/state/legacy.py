"""What the state files of llama.cpp before session version 9 add to the layouts of `files` and `sections`.

Session version 8 (llama.cpp from PR #8699, July 2024, to the sampler refactor of September 2024;
llama-cpp-python 0.2.84 .. 0.2.90) wrote the sampler's random-number generator into every context state::

    context state (v8) = string arch, string rng, v9 output block, memory

``rng`` is the ``std::mt19937`` of the context as the C++ standard library prints it: the 624 state words
then the index of the next word, in decimal, separated by single spaces (``"x0 x1 ... x623 624"``). Everything
else is the layout of the oldest version 9 (llama-cpp-python 0.3.12): the output block, a KV section without
``n_stream`` whose data header (``v_trans``, ``n_layer``, per layer the types and row sizes) is written even when
the section has no cell, sequence files of version 2, raw sequence blobs without a prefix. A recurrent model
(Mamba) kept its states in the KV cache under the names K and V with every layer present, which reads as the
recurrent section of 0.3.12.

`RNG` is the field: a session file carries it exactly when its version is 8; a state blob, which has no
version, carries it when the bytes after the arch string are such a string (nothing else llama.cpp writes
there can be: an output count or a stream count followed by at least 1,249 digits and spaces).

Session versions 7, 6 and 5 (llama.cpp before PR #8699: llama-cpp-python 0.2.83, 0.2.68 .. 0.2.82 and 0.2.58 ..
0.2.67, read in the vendored sources of 0.2.83, 0.2.82 and 0.2.67 and checked on their goldens) are another format,
read and written by `read_raw_kv` / `write_raw_kv`::

    session file (v5 .. v7) = u32 magic, u32 version, hparams (the writer's struct llama_hparams, raw),
                              u32 n_tokens, i32 tokens[], context state
    context state           = u64 rng_size, rng, u64 n_outputs, i32 output_pos[], u64 logits_size, f32 logits[],
                              u64 embd_size, f32 embd[], raw KV
    raw KV                  = u64 kv_buf_size, u32 kv_head, u32 kv_size, u32 kv_used, u32 v_trans (not in v5),
                              [per layer: K of cells [0, kv_head), V likewise (n_embd_v rows of kv_head elements
                              when v_trans, always in v5)], per cell of [0, kv_head): i32 pos, u64 n_seq_id,
                              i32 seq_id[]

Versions 6 and 7 write the same context state: llama.cpp bumped the version when LLAMA_MAX_LAYERS went from 256 to
512, which doubled the three per-layer arrays of struct llama_hparams (3236 bytes in 0.2.82, 6308 in 0.2.83).
Version 5 is version 6 without ``v_trans`` (flash attention's row-wise V came with 6); its hparams struct (120 bytes
in 0.2.67) has no per-layer arrays and puts n_head, n_head_kv before n_layer. The struct also changed between
releases of one version (0.2.70, version 6, still has 0.2.67's; 0.2.78's is like neither), so a session is read only
when its hparams have the size kvref read for its version (`RAW_KV_VERSIONS`), checked by the rng string that must
follow the token list. Version 4 (0.2.57 and older) has no output ids (``n_outputs``) and is not read.

The KV rows carry no layer count, type or row size: their widths are the model's (``n_embd_k_gqa(il)``, plus the
conv / SSM state widths of a recurrent model) and their types the context's, so reading one needs the model
(`HParams`); the types follow from ``kv_buf_size`` (bytes per cell). A state blob of the era
(llama_copy_state_data) is the context state alone: one without the v_trans field is version 5's. kvref keeps the
hparams as bytes and checks their ``n_vocab``, ``n_embd``, ``n_layer`` against the model's. The sequence files of that
llama.cpp (version 1, from 0.2.62) and its sequence blobs name their layer types and row sizes, so `read_seq_v1`
needs no model (layout at its definition).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import numpy.typing as npt

from ..constants import LLAMA_MAX_SEQ
from ..errors import ArgumentError, FormatError
from ..ggml.types import TYPE_TRAITS, GGMLType, row_size, type_name
from .cells import Cells
from .codec import Reader, Writer
from .dsl import Env, Field, Record, Str, env_int
from .sections import KVData, KVSection, KVStream, LayerRows, MemorySections, TransposedRows

if TYPE_CHECKING:
    from ..hparams import HParams

# the session version of the era, the oldest kvref reads
SESSION_VERSION_RNG = 8

_MT_N = 624  # std::mt19937's state words
_RNG_MIN = 2 * _MT_N + 1  # 625 numbers of one digit and 624 spaces
_RNG_MAX = 11 * (_MT_N + 1)  # 625 numbers of at most 10 digits, with their spaces
_RNG_CHARS = frozenset(b"0123456789 ")


def _mt19937_words(seed: int) -> list[int]:
    """The state words of ``std::mt19937(seed)`` (the standard's seeding recurrence)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, _MT_N):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return words


def rng_text(seed: int = 5489) -> str:
    """The text llama.cpp writes for a freshly seeded generator (5489: a default-constructed ``std::mt19937``)."""
    return " ".join(str(w) for w in [*_mt19937_words(seed), _MT_N])


def check_rng(text: str) -> str | None:
    """Why ``text`` is not a generator state llama.cpp can read back, or None."""
    parts = text.split(" ")
    if len(parts) != _MT_N + 1 or not all(p.isdigit() and p.isascii() for p in parts):
        return f"not {_MT_N + 1} decimal numbers separated by single spaces (a std::mt19937 state)"
    if any(int(p) > 0xFFFFFFFF for p in parts[:_MT_N]):
        return "a state word does not fit in 32 bits"
    if int(parts[-1]) > _MT_N:
        return f"index {parts[-1]} exceeds {_MT_N}"
    return None


def rng_length_at(buf: memoryview, at: int) -> int | None:
    """The length of the rng string whose ``u32`` length prefix starts at ``at``, or None when there is none."""
    if at + 4 > len(buf):
        return None
    n = int.from_bytes(buf[at : at + 4], "little")
    if not _RNG_MIN <= n <= _RNG_MAX or at + 4 + n > len(buf):
        return None
    body = bytes(buf[at + 4 : at + 4 + n])
    return n if _RNG_CHARS.issuperset(body) and check_rng(body.decode("ascii")) is None else None


def rng_present(buf: memoryview, at: int, version: int | None) -> bool:
    """Whether a context state's rng string starts at ``at``: by the version of a session file, else by the bytes."""
    if version is not None:
        return version <= SESSION_VERSION_RNG
    return rng_length_at(buf, at) is not None


class RngField(Field[object]):
    """``string rng`` after the arch string of session version 8 (see the module docstring)."""

    min_size = 0  # absent from every later version

    def __init__(self) -> None:
        self.name = self.attr = "rng"
        self._str = Str("rng", max_len=_RNG_MAX)

    @staticmethod
    def _version(env: Env) -> int | None:
        return env_int(env, "version") if "version" in env else None

    def read(self, r: Reader, env: Env) -> str | None:
        at = r.pos
        if not rng_present(r.buf[: r.end], at, self._version(env)):
            return None
        text = self._str.read(r, env)
        msg = check_rng(text)
        if msg:
            raise FormatError(msg, field="rng", offset=at + 4)
        return text

    def write(self, w: Writer, value: object, env: Env) -> None:
        version = self._version(env)
        want = value is not None if version is None else version <= SESSION_VERSION_RNG
        if want and value is None:
            raise FormatError(f"missing: session version {version} carries the rng string", field="rng", offset=w.n)
        if not want and value is not None:
            raise FormatError(f"present, but session version {version} has no rng string", field="rng", offset=w.n)
        if value is not None:
            msg = check_rng(value) if isinstance(value, str) else f"a {type(value).__name__}, not a str"
            if msg:
                raise FormatError(f"refusing to write: {msg}", field="rng", offset=w.n)
            self._str.write(w, value, env)


RNG = RngField()


# --- session versions 5 .. 7 (see the module docstring) ----------------------------------------------------------


@dataclass(frozen=True)
class RawKVVersion:
    """What tells the session versions of the raw-KV layout apart (see the module docstring)."""

    version: int
    first: str  # the llama-cpp-python releases that vendor it (read in their llama.h)
    last: str  # the release whose sources and goldens kvref read
    # sizeof(struct llama_hparams) (x86-64) in ``last``: other releases' structs may differ in size (a file of theirs
    # fails on the rng string after its token list, with an error saying so)
    hparams_size: int
    n_layer_at: int  # the file offset of the struct's n_layer (n_vocab is at 12 and n_embd at 20 in all three)
    v_trans_field: bool  # a u32 v_trans after kv_used (version 5 has none: its V is always transposed)

    @property
    def releases(self) -> str:
        return self.first if self.first == self.last else f"{self.first} .. {self.last}"


RAW_KV_VERSIONS = {
    x.version: x
    for x in (
        # 0.2.67's struct: no per-layer arrays, n_head and n_head_kv before n_layer
        RawKVVersion(5, "0.2.58", "0.2.67", 120, 32, False),
        # 0.2.83's struct with LLAMA_MAX_LAYERS 256: its three per-layer arrays of u32 are half as long
        RawKVVersion(6, "0.2.68", "0.2.82", 3236, 24, True),
        RawKVVersion(7, "0.2.83", "0.2.83", 6308, 24, True),
    )
}
SESSION_VERSION_RAW_KV = 7  # the newest version of the raw-KV layout
SESSION_VERSIONS_RAW_KV = tuple(RAW_KV_VERSIONS)  # the versions of it kvref reads, given the model (oldest first)
HPARAMS_SIZES = {v: x.hparams_size for v, x in RAW_KV_VERSIONS.items()}
SEQ_VERSION_RAW_KV = 1  # the sequence-file version of the same llama.cpp (`read_seq_v1`)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _u32(buf: memoryview, at: int) -> int | None:
    return int(_U32.unpack_from(buf, at)[0]) if at >= 0 and at + 4 <= len(buf) else None


def _u64(buf: memoryview, at: int) -> int | None:
    return int(_U64.unpack_from(buf, at)[0]) if at >= 0 and at + 8 <= len(buf) else None


def rng64_at(buf: memoryview, at: int) -> bool:
    """Whether a v5 .. v7 rng string (a ``u64`` length, then a std::mt19937 state) starts at ``at``."""
    n = _u64(buf, at)
    if n is None or not _RNG_MIN <= n <= _RNG_MAX or at + 8 + n > len(buf):
        return False
    body = bytes(buf[at + 8 : at + 8 + n])
    return _RNG_CHARS.issuperset(body) and check_rng(body.decode("ascii")) is None


def raw_kv_kind(buf: memoryview, kind: str) -> str | None:
    """ "session" for a session file of version 5 .. 7, "state" for a state blob of their llama.cpp (it starts with
    the rng string), else None. ``kind``: what the caller asked for ("auto" or a kind)."""
    if kind in ("auto", "session") and _u32(buf, 0) == 0x6767736E:
        return "session" if _u32(buf, 4) in SESSION_VERSIONS_RAW_KV else None
    if kind in ("auto", "state") and rng64_at(buf, 0):
        return "state"
    return None


@dataclass(eq=False)
class RawKV(Record):
    """The KV part of a v5 .. v7 context state as written: cells [0, kv_head) of the one cache, every layer's rows."""

    kv_buf_size: int
    kv_head: int
    kv_size: int
    kv_used: int
    v_trans: int  # 1 without the field (version 5)
    cells: Cells  # every cell of [0, kv_head), the empty ones (no seq id) included
    k: list[LayerRows]  # (kv_head, row_size) per layer; empty when kv_buf_size is 0
    v: list[LayerRows | TransposedRows]
    v_trans_field: bool = True  # False: written by the llama.cpp of version 5


def _model(model: object) -> HParams:
    from ..hparams import HParams

    if isinstance(model, HParams):
        return model
    try:
        return HParams.from_gguf(model)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(f"model must be a GGUF path or an HParams, not {type(model).__name__}") from None


def needs_model(version: int | None, kind: str) -> FormatError:
    """The error for a v5 .. v7 state read without the model (``version``: a session file's)."""
    if kind == "session" and version in RAW_KV_VERSIONS:
        what, releases = f"a session file of version {version}", RAW_KV_VERSIONS[version].releases
    else:  # a blob names no version (5 has no v_trans field; 6 and 7 write the same context state)
        what = "a state blob of session version 5, 6 or 7"
        releases = f"{RAW_KV_VERSIONS[5].first} .. {RAW_KV_VERSIONS[SESSION_VERSION_RAW_KV].last}"
    return FormatError(
        f"this is {what} (llama.cpp before July 2024, llama-cpp-python {releases}): its KV section is "
        "raw K/V bytes "
        "without layer types or row sizes, so reading it needs the model: pass model= (a GGUF path or HParams) "
        "to kvref.state.load, or --model M.gguf on the command line",
        field="version" if kind == "session" else "rng",
        offset=4 if kind == "session" else 0,
    )


def _widths(hp: HParams) -> list[tuple[int, int]]:
    """(K, V) elements per cell of every layer, as this llama.cpp sized its cache (attention models only: a
    recurrent one kept its conv / SSM states in K and V, which no golden of this era pins)."""
    return [(hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)) for il in range(hp.n_layer)]


def _row(t: int, n: int) -> int | None:
    tr = TYPE_TRAITS[GGMLType(t)]
    return None if n % tr.block_size else n // tr.block_size * tr.type_size


# the cache types that llama.cpp's context accepted (common's --cache-type-k/-v list of the time)
CACHE_TYPES = tuple(int(GGMLType[n]) for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q5_0", "Q5_1"))


def kv_types(per_cell: int, widths: list[tuple[int, int]], v_trans: bool) -> list[tuple[int, int]]:
    """Every cache (type_k, type_v) whose rows of ``widths`` take ``per_cell`` bytes a cell, likeliest first (one
    type for K and V, then f16)."""
    out = []
    for tk in CACHE_TYPES:
        ks = [_row(tk, k) for k, _ in widths]
        if None in ks:
            continue
        for tv in CACHE_TYPES:
            if v_trans and TYPE_TRAITS[GGMLType(tv)].block_size != 1:
                continue
            vs = [_row(tv, v) for _, v in widths]
            if None not in vs and sum(ks) + sum(vs) == per_cell:  # type: ignore[arg-type]
                out.append((tk, tv))
    return sorted(out, key=lambda p: (p[0] != p[1], p != (1, 1), p))


def _check_model(buf: memoryview, hp: HParams, v: RawKVVersion) -> None:
    """The hparams a v5 .. v7 session was written with must be the model's (n_vocab, n_embd, n_layer)."""
    got = {"n_vocab": _u32(buf, 12), "n_embd": _u32(buf, 20), "n_layer": _u32(buf, v.n_layer_at)}
    want = {"n_vocab": hp.n_vocab, "n_embd": hp.n_embd, "n_layer": hp.n_layer}
    if got != want:
        bad = ", ".join(f"{k} {got[k]} (model: {want[k]})" for k in got if got[k] != want[k])
        raise FormatError(f"wrong model: the session was written for another model: {bad}", field="hparams", offset=8)


@dataclass(eq=False)
class RawKVParts:
    """What `read_raw_kv` read, for `kvref.state.files.read_legacy` to build its object from."""

    kind: str
    version: int | None  # a session file's (5 .. 7); None for a state blob
    arch: str
    hparams: bytes  # empty for a state blob
    tokens: npt.NDArray[np.int32]
    rng: str
    output_pos: npt.NDArray[np.int32]
    logits: npt.NDArray[np.float32]
    embd: npt.NDArray[np.float32]
    raw: RawKV
    memory: MemorySections


def read_raw_kv(buf: memoryview, kind: str, model: object) -> RawKVParts:
    """The parts of a v5 .. v7 session file or state blob, read with ``model`` (see the module docstring). Raises
    FormatError."""
    version = _u32(buf, 4) if kind == "session" else None
    if model is None:
        raise needs_model(version, kind)
    hp = _model(model)
    if hp.memory_kind() != "kv":
        raise FormatError(
            f"kvref reads session versions 5 .. 7 of attention models with one KV cache; a {hp.arch} model's memory "
            f"is {hp.memory_kind()!r} (its 2024 layout in K and V was not checked against a golden)",
            field="version" if kind == "session" else "rng",
            offset=4 if kind == "session" else 0,
        )
    r = Reader(buf)
    hparams = b""
    tokens = np.zeros(0, np.int32)
    if kind == "session":
        assert version is not None
        v = RAW_KV_VERSIONS[version]
        r.pos = 8
        hparams = bytes(r.take(v.hparams_size, "hparams"))
        _check_model(buf, hp, v)
        n = r.u32("n_token_count")
        tokens = r.array(np.dtype(np.int32), n, "tokens", "n_token_count")
        if not rng64_at(buf, r.pos):
            # the hparams struct is written raw and its size is the writing build's: another size shifts the rest
            raise FormatError(
                "no rng string after the token list: damaged, or written by a build whose struct llama_hparams is "
                f"not {v.hparams_size} bytes (llama-cpp-python {v.last}'s, the one kvref read for version {version})",
                field="rng_size",
                offset=r.pos,
            )
        return _read_context(r, kind, version, hparams, tokens, hp, v.v_trans_field)
    # a blob names no version: the bytes tell (`_read_kv_rows`), and where a version-5 blob's first K bytes read as a
    # v_trans of 0 or 1, the reading without the field follows the one with it; the first one's error is raised
    try:
        return _read_context(r, kind, version, hparams, tokens, hp, None)
    except FormatError as e:
        try:
            return _read_context(Reader(buf), kind, version, hparams, tokens, hp, False)
        except FormatError:
            raise e from None


def _read_context(
    r: Reader, kind: str, version: int | None, hparams: bytes, tokens: npt.NDArray[np.int32], hp: HParams,
    v_trans_field: bool | None,
) -> RawKVParts:  # fmt: skip
    buf = r.buf
    at = r.pos
    rng = bytes(r.take(r.u64("rng_size"), "rng")).decode("latin-1")
    msg = check_rng(rng)
    if msg:
        raise FormatError(msg, field="rng", offset=at + 8)
    n_out = r.u64("n_outputs")
    output_pos = r.array(np.dtype(np.int32), n_out, "output_pos", "n_outputs")
    logits = r.array(np.dtype(np.float32), r.u64("logits_size"), "logits", "logits_size")
    embd = r.array(np.dtype(np.float32), r.u64("embd_size"), "embeddings", "embd_size")
    raw = _read_kv_rows(r, hp, v_trans_field)
    if r.pos != len(buf):
        raise FormatError(f"{len(buf) - r.pos} trailing bytes after the last KV cell", field="trailing", offset=r.pos)
    return RawKVParts(kind, version, hp.arch, hparams, tokens, rng, output_pos, logits, embd, raw, modern_memory(raw))


def _read_kv_rows(r: Reader, hp: HParams, v_trans_field: bool | None) -> RawKV:
    """``v_trans_field`` None: by the bytes, a u32 above 1 after kv_used being K data of version 5 (no field)."""
    at = r.pos
    kv_buf_size = r.u64("kv_buf_size")
    head_at = r.pos
    kv_head, kv_size, kv_used = (r.u32(f) for f in ("kv_head", "kv_size", "kv_used"))
    if v_trans_field is None:
        peek = _u32(r.buf[: r.end], r.pos)
        v_trans_field = peek is not None and peek <= 1
    v_trans = r.u32("v_trans") if v_trans_field else 1
    if kv_head > kv_size:
        raise FormatError(f"kv_head {kv_head} exceeds kv_size {kv_size}", field="kv_head", offset=head_at)
    if v_trans > 1:
        raise FormatError(f"v_trans {v_trans} is not 0 or 1", field="v_trans", offset=head_at + 12)
    if kv_buf_size > r.remaining():
        raise FormatError(
            f"kv_buf_size {kv_buf_size} exceeds the {r.remaining()} bytes left", field="kv_buf_size", offset=at
        )
    if (kv_buf_size == 0) != (kv_head == 0) or (kv_head and kv_buf_size % kv_head):
        raise FormatError(f"kv_buf_size {kv_buf_size} is not a whole number of bytes for each of the kv_head "
                          f"{kv_head} cells", field="kv_buf_size", offset=at)  # fmt: skip
    widths = _widths(hp)
    ks: list[LayerRows] = []
    vs: list[LayerRows | TransposedRows] = []
    trans = bool(v_trans)
    if kv_head:
        per_cell = kv_buf_size // kv_head
        types = kv_types(per_cell, widths, trans)
        if not types:
            raise FormatError(
                f"kv_buf_size {kv_buf_size} is {per_cell} bytes for each of {kv_head} cells, which no K/V type pair "
                f"gives the {hp.n_layer} layers of this model ({hp.arch}, K/V widths {widths[0]} ...): wrong model?",
                field="kv_buf_size",
                offset=at,
            )
        # the bytes do not name the types: one type for K and V is what llama.cpp's default and most setups use
        # (f16 over bf16, which is as wide); two mixed pairs of the same size cannot be told apart
        tk, tv = types[0]
        if len(types) > 1 and tk != tv:
            names = ", ".join(f"{type_name(a)}/{type_name(b)}" for a, b in types)
            raise FormatError(f"kv_buf_size fits several K/V type pairs ({names}): cannot tell the cache types",
                              field="kv_buf_size", offset=at)  # fmt: skip
        for nk, nv in widths:
            rk = row_size(tk, nk)
            ks.append(LayerRows(tk, rk, r.array(np.dtype(np.uint8), kv_head * rk, "k").reshape(kv_head, rk)))
            if trans:
                el = TYPE_TRAITS[GGMLType(tv)].type_size
                data = r.array(np.dtype(np.uint8), nv * kv_head * el, "v").reshape(nv, kv_head * el)
                vs.append(TransposedRows(tv, el, nv, data))
            else:
                rv = row_size(tv, nv)
                vs.append(LayerRows(tv, rv, r.array(np.dtype(np.uint8), kv_head * rv, "v").reshape(kv_head, rv)))
    pos = np.empty(kv_head, np.int32)
    start = np.zeros(kv_head + 1, np.int64)
    ids: list[int] = []
    for i in range(kv_head):
        pos[i] = r.i32("pos")
        n_at = r.pos
        n = r.u64("n_seq_id")
        if n > LLAMA_MAX_SEQ:
            raise FormatError(f"n_seq_id {n} exceeds LLAMA_MAX_SEQ {LLAMA_MAX_SEQ}", field="n_seq_id", offset=n_at)
        ids.extend(int(x) for x in r.array(np.dtype(np.int32), n, "seq_id", "n_seq_id"))
        start[i + 1] = len(ids)
    cells = Cells(pos, np.asarray(ids, np.int32), start)
    return RawKV(kv_buf_size, kv_head, kv_size, kv_used, v_trans, cells, ks, vs, v_trans_field)


def modern_memory(raw: RawKV) -> MemorySections:
    """The memory a later llama.cpp writes for the same cache: only the cells that hold a sequence, in cache order,
    in a KV section without ``n_stream`` (the layout of session version 8)."""
    used = np.flatnonzero(raw.cells.n_seq_id > 0)
    c = raw.cells
    lists = [c.seq_ids(int(i)) for i in used]
    cells = Cells.from_lists([int(c.pos[i]) for i in used], lists)
    every = len(used) == raw.kv_head

    def rows(x: LayerRows | TransposedRows) -> npt.NDArray[np.uint8]:
        if every:
            return x.data
        if isinstance(x, TransposedRows):
            el = x.el_size
            return x.data.reshape(x.n_embd, raw.kv_head, el)[:, used, :].reshape(x.n_embd, len(used) * el)
        return x.data[used]

    if not used.size:
        return MemorySections("kv", [KVSection([KVStream(None, None)], has_n_stream=False)])
    k = [LayerRows(x.type, x.row_size, rows(x)) for x in raw.k]
    v: list[LayerRows | TransposedRows] = [
        TransposedRows(x.type, x.el_size, x.n_embd, rows(x))
        if isinstance(x, TransposedRows)
        else LayerRows(x.type, x.row_size, rows(x))
        for x in raw.v
    ]
    return MemorySections("kv", [KVSection([KVStream(cells, KVData(raw.v_trans, k, v))], has_n_stream=False)])


# --- sequence version 1 (the sequence saves of session version 7's llama.cpp) --------------------------------------
#
#     sequence file (v1) = u32 magic 'ggsq', u32 version 1, u32 n_token_count, i32 tokens[], sequence state (v1)
#     sequence state (v1) = u32 size_t_size (8), u32 cell_count, u32 n_layer, u32 n_embd_v_gqa, i32 pos[cell_count],
#                           per layer: i32 k_type, u64 k_row_size, K rows; then per layer i32 v_type and
#                           u64 v_row_size, V rows, or (V transposed) u64 v_el_size, n_embd_v_gqa rows of cell_count
#                           elements
#
# A llama_state_seq_get_data blob of the era is the sequence state alone. The cells carry no sequence id (the
# restore gives them the destination's), as the KV cells of a version-2 sequence save in 2024. ``n_embd_v_gqa`` is
# layer 0's: the width of every transposed V layer when, as in every model of the era kvref reads, all layers agree
# (anything else leaves bytes over, which fails the read).

SIZE_T_SIZE = 8


@dataclass(eq=False)
class RawSeq(Record):
    """A v1 sequence state as written (its layer records are kept even without cells)."""

    size_t_size: int
    n_embd_v_gqa: int
    v_trans: int
    pos: npt.NDArray[np.int32]
    k: list[LayerRows]
    v: list[LayerRows | TransposedRows]


def seq_v1_kind(buf: memoryview, kind: str) -> str | None:
    """ "seq" for a sequence file of version 1, "seq_state" for what may be a v1 sequence blob (it starts with
    size_t_size 8; only a whole parse tells), else None."""
    if kind in ("auto", "seq") and _u32(buf, 0) == 0x67677371 and _u32(buf, 4) == SEQ_VERSION_RAW_KV:
        return "seq"
    if kind in ("auto", "seq_state") and _u32(buf, 0) == SIZE_T_SIZE and len(buf) >= 16:
        return "seq_state"
    return None


def read_seq_v1(buf: memoryview, kind: str) -> tuple[npt.NDArray[np.int32] | None, RawSeq, MemorySections]:
    """The tokens (a file's), the sequence state as written, and the memory of a v1 sequence file or blob."""
    r = Reader(buf)
    tokens = None
    if kind == "seq":
        r.pos = 8
        tokens = r.array(np.dtype(np.int32), r.u32("n_token_count"), "tokens", "n_token_count")
    at = r.pos
    size_t_size = r.u32("size_t_size")
    if size_t_size != SIZE_T_SIZE:
        raise FormatError(f"size_t_size {size_t_size}, not 8 (a 64-bit build)", field="size_t_size", offset=at)
    n = r.u32("cell_count")
    at = r.pos
    n_layer = r.u32("n_layer")
    if not 0 < n_layer <= 512:
        raise FormatError(f"n_layer {n_layer} is not in 1 .. 512", field="n_layer", offset=at)
    n_embd_v = r.u32("n_embd_v_gqa")
    pos = r.array(np.dtype(np.int32), n, "pos", "cell_count")
    k = [_seq_rows(r, n, "k") for _ in range(n_layer)]
    at = r.pos
    t0 = _seq_type(r, "v_type")
    second = r.u64("v_row_size")
    r.pos = at
    # a transposed layer writes its element size where a row-wise one writes the size of n_embd_v_gqa elements
    tr0 = TYPE_TRAITS[GGMLType(t0)]
    v_trans = int(n_embd_v > 1 and tr0.block_size == 1 and second == tr0.type_size)
    v: list[LayerRows | TransposedRows] = []
    for _ in range(n_layer):
        if not v_trans:
            v.append(_seq_rows(r, n, "v"))
            continue
        t_at = r.pos
        t = _seq_type(r, "v_type")
        el = r.u64("v_el_size")
        if el != TYPE_TRAITS[GGMLType(t)].type_size or TYPE_TRAITS[GGMLType(t)].block_size != 1:
            raise FormatError(f"v_el_size {el} is not the element size of {type_name(t)}", field="v_el_size",
                              offset=t_at + 4)  # fmt: skip
        data = r.array(np.dtype(np.uint8), n_embd_v * n * el, "v").reshape(n_embd_v, n * el)
        v.append(TransposedRows(t, el, n_embd_v, data))
    if r.pos != len(buf):
        raise FormatError(f"{len(buf) - r.pos} trailing bytes after the last V layer", field="trailing", offset=r.pos)
    raw = RawSeq(size_t_size, n_embd_v, v_trans, pos, k, v)
    if not n:
        return tokens, raw, MemorySections("kv", [KVSection([KVStream(None, None)], has_n_stream=False)])
    cells = Cells(pos, np.zeros(0, np.int32), np.zeros(n + 1, np.int64))
    return tokens, raw, MemorySections("kv", [KVSection([KVStream(cells, KVData(v_trans, k, v))], has_n_stream=False)])


def _seq_type(r: Reader, field: str) -> int:
    at = r.pos
    t = r.i32(field)
    if t not in CACHE_TYPES:
        raise FormatError(f"{t} is not a KV cache type", field=field, offset=at)
    return t


def _seq_rows(r: Reader, n: int, what: str) -> LayerRows:
    t = _seq_type(r, f"{what}_type")
    at = r.pos
    row = r.u64(f"{what}_row_size")
    size = TYPE_TRAITS[GGMLType(t)]
    if row == 0 or row % size.type_size:
        raise FormatError(f"{what}_row_size {row} is not whole {type_name(t)} blocks", field=f"{what}_row_size",
                          offset=at)  # fmt: skip
    return LayerRows(t, row, r.array(np.dtype(np.uint8), n * row, what).reshape(n, row))


def write_seq_v1(raw: RawSeq, tokens: npt.NDArray[np.int32] | None, w: Writer) -> None:
    """The v1 bytes of a sequence file (``tokens`` given) or blob, as read."""
    if tokens is not None:
        w.u32(0x67677371, "magic")
        w.u32(SEQ_VERSION_RAW_KV, "version")
        w.u32(len(tokens), "n_token_count")
        w.array(np.asarray(tokens, np.int32), "tokens")
    w.u32(raw.size_t_size, "size_t_size")
    w.u32(len(raw.pos), "cell_count")
    w.u32(len(raw.k), "n_layer")
    w.u32(raw.n_embd_v_gqa, "n_embd_v_gqa")
    w.array(np.asarray(raw.pos, np.int32), "pos")
    for x in [*raw.k, *raw.v]:
        w.i32(x.type, "type")
        w.u64(x.el_size if isinstance(x, TransposedRows) else x.row_size, "row_size")
        w.array(x.data, "rows")


class RawOutputs(Protocol):
    """The output block `write_raw_kv` writes (a `kvref.state.files.Outputs`)."""

    @property
    def output_pos(self) -> npt.NDArray[np.int32]: ...
    @property
    def logits(self) -> npt.NDArray[np.float32]: ...
    @property
    def embeddings(self) -> npt.NDArray[np.float32]: ...


class RawKVState(Protocol):
    """What `write_raw_kv` writes of a state of session version 5 .. 7 (a `kvref.state.files.LegacyStateBlob`, or a
    `RawKVSession`): its kind, rng, outputs and KV section as read."""

    @property
    def kind(self) -> str: ...
    @property
    def rng(self) -> str | None: ...
    @property
    def outputs(self) -> RawOutputs | None: ...
    @property
    def raw_kv(self) -> RawKV | None: ...


class RawKVSession(RawKVState, Protocol):
    """A `RawKVState` of kind "session" (a `kvref.state.files.LegacySessionFile`): its file header too."""

    @property
    def magic(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def hparams_raw(self) -> bytes: ...
    @property
    def tokens(self) -> npt.NDArray[np.int32]: ...


def write_raw_kv(obj: RawKVState, w: Writer) -> None:
    """The v5 .. v7 bytes of ``obj``: its header, tokens, rng and outputs, and its KV section as read (``raw_kv``)."""
    raw = obj.raw_kv
    if raw is None or obj.rng is None or obj.outputs is None:
        raise FormatError("a session version 5 .. 7 state is written back only as read (raw KV, rng, outputs)",
                          field="version", offset=w.n)  # fmt: skip
    if obj.kind == "session":
        f = cast("RawKVSession", obj)
        version, hparams = f.version, f.hparams_raw
        ver = RAW_KV_VERSIONS.get(version)
        # what `read_raw_kv` reads back: the hparams size and v_trans field of the version
        if ver is None or len(hparams) != ver.hparams_size or raw.v_trans_field != ver.v_trans_field:
            raise FormatError(f"session version {version} with a {len(hparams)}-byte hparams struct: kvref writes "
                              "versions 5 .. 7 back only as read", field="hparams", offset=w.n + 8)  # fmt: skip
        w.u32(f.magic, "magic")
        w.u32(f.version, "version")
        w.raw(f.hparams_raw)
        w.u32(len(f.tokens), "n_token_count")
        w.array(np.asarray(f.tokens, np.int32), "tokens")
    rng = obj.rng.encode("ascii")
    w.u64(len(rng), "rng_size")
    w.raw(rng)
    o = obj.outputs
    w.u64(len(o.output_pos), "n_outputs")
    w.array(np.asarray(o.output_pos, np.int32), "output_pos")
    w.u64(len(o.logits), "logits_size")
    w.array(np.asarray(o.logits, np.float32), "logits")
    w.u64(len(o.embeddings), "embd_size")
    w.array(np.asarray(o.embeddings, np.float32), "embeddings")
    w.u64(raw.kv_buf_size, "kv_buf_size")
    for name in ("kv_head", "kv_size", "kv_used", "v_trans")[: 4 if raw.v_trans_field else 3]:
        w.u32(getattr(raw, name), name)
    for k, v in zip(raw.k, raw.v, strict=True):
        w.array(k.data, "k")
        w.array(v.data, "v")
    c = raw.cells
    for i in range(c.n):
        w.i32(int(c.pos[i]), "pos")
        ids = c.seq_ids(i)
        w.u64(len(ids), "n_seq_id")
        for s in ids:
            w.i32(s, "seq_id")


__all__ = [
    "HPARAMS_SIZES",
    "RAW_KV_VERSIONS",
    "RNG",
    "SESSION_VERSIONS_RAW_KV",
    "SESSION_VERSION_RAW_KV",
    "SESSION_VERSION_RNG",
    "RawKV",
    "RawKVParts",
    "RawKVSession",
    "RawKVState",
    "RawKVVersion",
    "RawOutputs",
    "RawSeq",
    "RngField",
    "check_rng",
    "kv_types",
    "modern_memory",
    "needs_model",
    "raw_kv_kind",
    "read_raw_kv",
    "read_seq_v1",
    "rng64_at",
    "rng_length_at",
    "rng_present",
    "rng_text",
    "seq_v1_kind",
    "write_raw_kv",
    "write_seq_v1",
]
