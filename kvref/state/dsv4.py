"""The DeepSeek-V4 memory section (llama_kv_cache_dsv4::state_write / state_read, src/llama-kv-cache-dsv4.cpp).

Layout, all integers little-endian::

    u32 magic 0x34565344 ('DSV4')   u32 version (1)   u32 mode (0 full, 1 partial: LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    the raw iSWA cache's sections (kvref.state.KVSection: base then SWA; the SWA one only when partial)
    when full: three compressed K caches, CSA (ratio 4), HCA (ratio 128), lightning indexer (ratio 4), each
        u32 version (2; 1 is read when it carries every row)  u32 n_rows  u32 n_stream  u32 n_layer
        per layer: u32 il, then a tensor block
    three compressor states, CSA, HCA, lightning indexer, each
        u32 version (1)  u32 ratio  u32 state_size  u32 n_embd_state  u32 n_stream  u32 n_layer
        per layer: u32 il, then a tensor block for the kv plane and one for the score plane

A tensor block is ``i32 type, u64 ne0, u64 rows, u64 row_size`` then ``n_stream`` runs of ``rows * row_size`` bytes
(nothing when that is 0). The compressed caches hold no cell metadata: their rows are graph outputs, their
positions are implied (row r of a stream is the block of tokens [r * ratio, (r + 1) * ratio)).

This module only reads and writes the bytes (`DSV4Header`, `KCacheSection`, `CompStateSection`); what they must
agree with is the memory's business (kvref.memory.kv_cache_dsv4).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..errors import FormatError

DSV4_STATE_MAGIC = 0x34565344  # 'DSV4'
DSV4_STATE_VERSION = 1
DSV4_STATE_MODE_FULL = 0
DSV4_STATE_MODE_PARTIAL = 1
DSV4_K_CACHE_STATE_VER = 2
DSV4_COMP_STATE_VER = 1

# the order of the compressed parts in the state, with their compression ratios
COMP_PARTS = (("csa", 4), ("hca", 128), ("lid", 4))


class _Reader:
    """A cursor over state bytes that names the field and offset of whatever it cannot read."""

    def __init__(self, data: memoryview, offset: int) -> None:
        self.data = data
        self.pos = offset

    def _take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise FormatError(f"truncated DSV4 state: {what} needs {n} bytes", field=what, offset=self.pos)
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self._take(4, what))[0])

    def i32(self, what: str) -> int:
        return int(struct.unpack("<i", self._take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self._take(8, what))[0])

    def rows(self, n: int, what: str) -> npt.NDArray[np.uint8]:
        return np.frombuffer(self._take(n, what), dtype=np.uint8)


@dataclass
class DSV4Header:
    """The three words in front of the DSV4 memory section."""

    magic: int = DSV4_STATE_MAGIC
    version: int = DSV4_STATE_VERSION
    mode: int = DSV4_STATE_MODE_FULL

    @property
    def partial(self) -> bool:
        return self.mode == DSV4_STATE_MODE_PARTIAL

    def to_bytes(self) -> bytes:
        return struct.pack("<III", self.magic, self.version, self.mode)

    @classmethod
    def read(cls, r: _Reader) -> DSV4Header:
        at = r.pos
        magic = r.u32("dsv4_magic")
        version = r.u32("dsv4_version")
        if magic != DSV4_STATE_MAGIC:
            raise FormatError(f"DSV4 state magic mismatch: {magic:#x}", field="dsv4_magic", offset=at)
        if version != DSV4_STATE_VERSION:
            raise FormatError(f"DSV4 state version mismatch: {version}", field="dsv4_version", offset=at + 4)
        mode = r.u32("dsv4_mode")
        if mode not in (DSV4_STATE_MODE_FULL, DSV4_STATE_MODE_PARTIAL):
            raise FormatError(f"DSV4 state mode mismatch: {mode}", field="dsv4_mode", offset=at + 8)
        return cls(magic, version, mode)


@dataclass
class TensorStreams:
    """dsv4_state_{write,read}_tensor_streams: a tensor's first ``rows`` rows of ``n_stream`` streams."""

    type: int
    ne0: int
    rows: int
    row_size: int
    data: npt.NDArray[np.uint8]  # (n_stream, rows * row_size)
    offset: int = -1  # where the block starts in the bytes it was read from

    def to_bytes(self) -> bytes:
        head = struct.pack("<iQQQ", self.type, self.ne0, self.rows, self.row_size)
        if self.rows * self.row_size == 0:
            return head
        return head + np.ascontiguousarray(self.data).tobytes()

    def nbytes(self) -> int:
        return 28 + (self.data.size if self.rows * self.row_size else 0)

    @classmethod
    def read(cls, r: _Reader, n_stream: int, what: str) -> TensorStreams:
        at = r.pos
        t = r.i32(what + "_type")
        ne0 = r.u64(what + "_ne0")
        rows = r.u64(what + "_rows")
        row_size = r.u64(what + "_row_size")
        size = rows * row_size
        if size == 0:
            return cls(t, ne0, rows, row_size, np.zeros((n_stream, 0), np.uint8), at)
        if size * n_stream > len(r.data) - r.pos:
            raise FormatError(
                f"DSV4 tensor of {n_stream} x {rows} rows of {row_size} bytes is larger than the remaining "
                f"{len(r.data) - r.pos} bytes",
                field=what + "_data",
                offset=r.pos,
            )
        data = r.rows(size * n_stream, what + "_data").reshape(n_stream, size)
        return cls(t, ne0, rows, row_size, data, at)


@dataclass
class KCacheSection:
    """dsv4_state_write_k_cache: one compressed K cache (K-only, no cell metadata)."""

    name: str
    version: int
    n_rows: int
    n_stream: int
    layers: list[tuple[int, TensorStreams]] = field(default_factory=list)
    offset: int = -1

    def to_bytes(self) -> bytes:
        out = [struct.pack("<IIII", self.version, self.n_rows, self.n_stream, len(self.layers))]
        for il, t in self.layers:
            out.append(struct.pack("<I", il))
            out.append(t.to_bytes())
        return b"".join(out)

    def nbytes(self) -> int:
        return 16 + sum(4 + t.nbytes() for _, t in self.layers)

    @classmethod
    def read(cls, r: _Reader, name: str) -> KCacheSection:
        at = r.pos
        version = r.u32(f"{name}_k_version")
        n_rows = r.u32(f"{name}_k_n_rows")
        ns = r.u32(f"{name}_k_n_stream")
        n_layer = r.u32(f"{name}_k_n_layer")
        if version not in (1, DSV4_K_CACHE_STATE_VER):
            raise FormatError(f"DSV4 K-cache state version mismatch: {version}", field=f"{name}_k_version", offset=at)
        if n_layer > (len(r.data) - r.pos) // 32:
            raise FormatError(f"DSV4 K-cache n_layer {n_layer} is more than the bytes hold",
                              field=f"{name}_k_n_layer", offset=at + 12)  # fmt: skip
        sec = cls(name, version, n_rows, ns, [], at)
        for _ in range(n_layer):
            il = r.u32(f"{name}_k_il")
            sec.layers.append((il, TensorStreams.read(r, ns, f"{name}_k")))
        return sec


@dataclass
class CompStateSection:
    """llama_dsv4_comp_state::state_write: a compressor's running state (f32 kv and score planes per layer)."""

    name: str
    version: int
    ratio: int
    state_size: int
    n_embd_state: int
    n_stream: int
    layers: list[tuple[int, TensorStreams, TensorStreams]] = field(default_factory=list)
    offset: int = -1

    def to_bytes(self) -> bytes:
        head = (self.version, self.ratio, self.state_size, self.n_embd_state, self.n_stream, len(self.layers))
        out = [struct.pack("<IIIIII", *head)]
        for il, kv, score in self.layers:
            out.append(struct.pack("<I", il))
            out.append(kv.to_bytes())
            out.append(score.to_bytes())
        return b"".join(out)

    def nbytes(self) -> int:
        return 24 + sum(4 + kv.nbytes() + sc.nbytes() for _, kv, sc in self.layers)

    @classmethod
    def read(cls, r: _Reader, name: str) -> CompStateSection:
        at = r.pos
        version = r.u32(f"{name}_state_version")
        ratio = r.u32(f"{name}_state_ratio")
        state_size = r.u32(f"{name}_state_size")
        n_embd_state = r.u32(f"{name}_state_n_embd")
        ns = r.u32(f"{name}_state_n_stream")
        n_layer = r.u32(f"{name}_state_n_layer")
        if version != DSV4_COMP_STATE_VER:
            raise FormatError(f"DSV4 compressor state version mismatch: {version}",
                              field=f"{name}_state_version", offset=at)  # fmt: skip
        if n_layer > (len(r.data) - r.pos) // 60:
            raise FormatError(f"DSV4 compressor state n_layer {n_layer} is more than the bytes hold",
                              field=f"{name}_state_n_layer", offset=at + 20)  # fmt: skip
        sec = cls(name, version, ratio, state_size, n_embd_state, ns, [], at)
        for _ in range(n_layer):
            il = r.u32(f"{name}_state_il")
            kv = TensorStreams.read(r, ns, f"{name}_state_kv")
            score = TensorStreams.read(r, ns, f"{name}_state_score")
            sec.layers.append((il, kv, score))
        return sec


def reader(data: memoryview, offset: int) -> _Reader:
    """A cursor over ``data`` from ``offset`` (for the memory's stage_state)."""
    return _Reader(data, offset)


__all__ = [
    "COMP_PARTS",
    "DSV4_COMP_STATE_VER",
    "DSV4_K_CACHE_STATE_VER",
    "DSV4_STATE_MAGIC",
    "DSV4_STATE_MODE_FULL",
    "DSV4_STATE_MODE_PARTIAL",
    "DSV4_STATE_VERSION",
    "CompStateSection",
    "DSV4Header",
    "KCacheSection",
    "TensorStreams",
    "reader",
]


@dataclass(eq=False)
class DSV4Section:
    """The whole DSV4 memory section as kvref.state objects: the header, the raw iSWA's KV sections (base then
    SWA; the SWA one only when partial), the compressed K caches (none when partial), the compressor states."""

    header: DSV4Header
    raw: list  # list[KVSection]
    k_caches: list[KCacheSection]
    states: list[CompStateSection]

    kind = "dsv4"

    @property
    def partial(self) -> bool:
        return self.header.partial

    def tail_bytes(self) -> bytes:
        """The bytes after the raw sections (compressed caches, then states)."""
        return b"".join([k.to_bytes() for k in self.k_caches] + [s.to_bytes() for s in self.states])


def read_tail(buf: memoryview, offset: int, partial: bool) -> tuple[list[KCacheSection], list[CompStateSection], int]:
    """The compressed caches (unless ``partial``) and the compressor states from ``offset``; returns them and the
    offset after them."""
    r = _Reader(buf, offset)
    ks = [] if partial else [KCacheSection.read(r, name) for name, _ in COMP_PARTS]
    ss = [CompStateSection.read(r, name) for name, _ in COMP_PARTS]
    return ks, ss, r.pos


def skip_tail(buf: memoryview, offset: int, end: int, partial: bool) -> int | None:
    """Where the compressed caches and states from ``offset`` end, walking only their headers (None: they do not
    fit or do not parse): the loader's sniff."""

    def u32(at: int) -> int | None:
        return struct.unpack_from("<I", buf, at)[0] if at + 4 <= end else None

    def tensor(at: int, ns: int) -> int | None:
        if at + 28 > end:
            return None
        _t, _ne0, rows, rs = struct.unpack_from("<iQQQ", buf, at)
        n = rows * rs * ns
        return at + 28 + n if n <= end - at - 28 else None

    at: int | None = offset
    for _ in range(0 if partial else 3):
        if at is None or u32(at) not in (1, DSV4_K_CACHE_STATE_VER):
            return None
        ns, n_layer = u32(at + 8), u32(at + 12)
        if ns is None or n_layer is None:
            return None
        at += 16
        for _ in range(n_layer):
            at = None if at is None else tensor(at + 4, ns)
    for _ in range(3):
        if at is None or u32(at) != DSV4_COMP_STATE_VER:
            return None
        ns, n_layer = u32(at + 16), u32(at + 20)
        if ns is None or n_layer is None:
            return None
        at += 24
        for _ in range(n_layer):
            at = None if at is None else tensor(at + 4, ns)
            at = None if at is None else tensor(at, ns)
    return at


__all__ += ["DSV4Section", "read_tail", "skip_tail"]
