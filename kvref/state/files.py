"""The four containers llama.cpp writes around a memory section, declared once.

    session file   (llama_state_save_file)    u32 magic 'ggsn', u32 version, u32 n_token_count, i32 tokens[],
                                              context state
    sequence file  (llama_state_seq_save_file) u32 magic 'ggsq', u32 version, u32 n_token_count, i32 tokens[],
                                              memory (of one sequence)
    state blob     (llama_state_get_data)     context state
    seq state blob (llama_state_seq_get_data) [u32 io_magic 0xaf143cd8, i32 seq_id], memory (of one sequence)

    context state  = string arch, [v8 rng string], [v9 output block], memory
    v9 outputs     = u32 n_outputs, i32 output_pos[n_outputs], u64 logits_size, f32 logits[logits_size],
                     u64 embd_size, f32 embeddings[embd_size]

The output block was removed by PR #18862 (2026) without a version bump, so a version-9 session may or may
not carry it; version 10 never does. The io_magic + seq_id prefix of sequence blobs appeared with
LLAMA_STATE_SEQ_FLAGS_ON_DEVICE (2026); sequence *files* never carry it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from .atomic import atomic_write
from .codec import Writer
from .constants import SEQ_VERSIONS, SESSION_VERSIONS, Magic
from .dsl import I32, U32, U64, Array, Env, Field, Param, Record, Str, Struct, When, env_flag, write_root
from .legacy import (
    RNG,
    SEQ_VERSION_RAW_KV,
    RawKV,
    RawSeq,
    read_raw_kv,
    read_seq_v1,
    write_raw_kv,
    write_seq_v1,
)
from .sections import MEMORY, MemorySections
from .summary import Summary, summarize

Check = Callable[[int, Env], str | None]


def _check_magic(want: Magic) -> Check:
    tag = want.to_bytes(4, "big").decode("latin-1")

    def check(v: int, env: Env) -> str | None:
        return None if v == want else f"bad magic: expected 0x{int(want):08x} ({tag!r}), found 0x{v:08x}"

    return check


def _check_version(known: tuple[int, ...], oldest: str) -> Check:
    """``oldest``: the oldest version kvref reads and its release, for files older still."""

    def check(v: int, env: Env) -> str | None:
        if v in known:
            return None
        if 0 < v < known[0]:
            return (
                f"version {v} is older than kvref reads ({oldest}). Load it in the llama.cpp that wrote it and save "
                "it again with a release kvref reads; `kvref convert` upgrades that file"
            )
        return f"unknown version {v}, expected one of {known}"

    return check


def _written(f: BinaryIO, write: Callable[[Writer], object]) -> int:
    """The bytes ``write`` streams to ``f`` through a `Writer`: how every container writes itself."""
    w = Writer(f)
    write(w)
    return w.n


class StateObject(Record):
    """What every container offers: bytes, streaming save, and a summary (see `kvref.state.summary`)."""

    kind: str
    memory: MemorySections
    # set by `load` when it had to choose between readings that mean the same (it says which it took)
    note: str | None = None

    def to_bytes(self) -> bytes:
        """The container's encoding, as bytes (what llama.cpp writes)."""
        buf = BytesIO()
        self.write_to(buf)
        return buf.getvalue()

    def write_to(self, f: BinaryIO) -> int:
        """Stream the encoding to ``f``; tensor rows are written straight from their (memory-mapped) views."""
        return _written(f, lambda w: write_root(STRUCTS[self.kind], self, w))

    def save(self, path: str | os.PathLike[str], *, durable: bool = True) -> int:
        """Write the container to ``path`` through a temporary file (`kvref.state.save`); returns the byte count."""
        return save(self, path, durable=durable)

    def summary(self) -> Summary:
        """A JSON-ready description (`kvref.state.summary.summarize`): what ``kvref inspect --json`` prints."""
        return summarize(self)

    def __repr__(self) -> str:
        """One line (the rows are not printed): ``<SeqFile version 3: kv memory, 1 stream, 10 cells, 10 tokens>``."""
        version = getattr(self, "version", None)
        streams = [st for sec in self.memory.kv_sections for st in sec.streams]
        cells = sum(st.cells.n for st in streams if st.cells is not None)
        cells += sum(sec.cell_count for sec in self.memory.recurrent_sections)
        parts = [f"{self.memory.layout} memory", f"{len(streams)} stream{'s' if len(streams) != 1 else ''}",
                 f"{cells} cell{'s' if cells != 1 else ''}"]  # fmt: skip
        tokens = getattr(self, "tokens", None)
        if tokens is not None:
            parts.append(f"{len(tokens)} token{'s' if len(tokens) != 1 else ''}")
        arch = getattr(self, "arch", None)
        if arch:
            parts.insert(0, f"arch {arch!r}")
        head = type(self).__name__ + (f" version {version}" if version is not None else "")
        return f"<{head}: {', '.join(parts)}>"


@dataclass(eq=False)
class Outputs(Record):
    """The v9 output block: which batch positions had outputs, and their logits and embeddings."""

    output_pos: npt.NDArray[np.int32]
    logits: npt.NDArray[np.float32]
    embeddings: npt.NDArray[np.float32]


@dataclass(eq=False, repr=False)
class SessionFile(StateObject):
    """A session file (llama_state_save_file, magic 'ggsn'): version, tokens, then the context state.

    The context state is the arch, the v9 output block when present, and the memory.
    """

    version: int
    tokens: npt.NDArray[np.int32]
    arch: str
    outputs: Outputs | None
    memory: MemorySections
    magic: int = Magic.SESSION
    rng: str | None = None  # session version 8 only (`kvref.state.legacy`)

    kind = "session"


@dataclass(eq=False, repr=False)
class SeqFile(StateObject):
    """A sequence file (llama_state_seq_save_file, magic 'ggsq'): version, tokens, then one sequence's memory."""

    version: int
    tokens: npt.NDArray[np.int32]
    memory: MemorySections
    magic: int = Magic.STATE_SEQ

    kind = "seq"


@dataclass(eq=False, repr=False)
class StateBlob(StateObject):
    """A llama_state_get_data blob: the context state (arch, the v9 output block when present, memory)."""

    arch: str
    outputs: Outputs | None
    memory: MemorySections
    rng: str | None = None  # the llama.cpp of session version 8 only (`kvref.state.legacy`)

    kind = "state"


@dataclass(eq=False, repr=False)
class SeqStateBlob(StateObject):
    """``seq_id`` is the id the blob was saved from (None for blobs without the io_magic prefix)."""

    memory: MemorySections
    seq_id: int | None = None
    has_header: bool = True

    kind = "seq_state"


@dataclass(eq=False, repr=False)
class LegacySessionFile(SessionFile):
    """A session file of version 5, 6 or 7 (`kvref.state.legacy`): written back as read, its KV section from ``raw_kv``
    (``memory`` is what a later llama.cpp writes for the same cache); `kvref.state.eras.to_era` upgrades it."""

    hparams_raw: bytes = b""  # the writer's struct llama_hparams, as written
    raw_kv: RawKV | None = None

    def write_to(self, f: BinaryIO) -> int:
        return _written(f, lambda w: write_raw_kv(self, w))


@dataclass(eq=False, repr=False)
class LegacyStateBlob(StateBlob):
    """A state blob of the llama.cpp of session versions 5 .. 7 (llama_copy_state_data); see `LegacySessionFile`."""

    raw_kv: RawKV | None = None

    def write_to(self, f: BinaryIO) -> int:
        return _written(f, lambda w: write_raw_kv(self, w))


@dataclass(eq=False, repr=False)
class LegacySeqFile(SeqFile):
    """A sequence file of version 1 (`kvref.state.legacy.read_seq_v1`): written back as read from ``raw_seq``;
    ``memory`` is the same cells and rows in the layout of version 2 (cells without seq id, as in 2024)."""

    raw_seq: RawSeq | None = None

    def write_to(self, f: BinaryIO) -> int:
        assert self.raw_seq is not None
        raw, tokens = self.raw_seq, np.asarray(self.tokens, np.int32)
        return _written(f, lambda w: write_seq_v1(raw, tokens, w))


@dataclass(eq=False, repr=False)
class LegacySeqStateBlob(SeqStateBlob):
    """A llama_state_seq_get_data blob of the llama.cpp of sequence version 1; see `LegacySeqFile`."""

    raw_seq: RawSeq | None = None

    def write_to(self, f: BinaryIO) -> int:
        assert self.raw_seq is not None
        raw = self.raw_seq
        return _written(f, lambda w: write_seq_v1(raw, None, w))


def read_legacy_seq(buf: memoryview, kind: str) -> LegacySeqFile | LegacySeqStateBlob:
    """A sequence file ("seq") or blob ("seq_state") of version 1 (llama-cpp-python 0.2.62 .. 0.2.83). Raises
    FormatError."""
    tokens, raw, memory = read_seq_v1(buf, kind)
    if tokens is not None:
        return LegacySeqFile(version=SEQ_VERSION_RAW_KV, tokens=tokens, memory=memory, raw_seq=raw)
    return LegacySeqStateBlob(memory=memory, seq_id=None, has_header=False, raw_seq=raw)


def read_legacy(buf: memoryview, kind: str, model: object) -> LegacySessionFile | LegacyStateBlob:
    """A session file of version 5 .. 7 ("session") or a state blob of their llama.cpp ("state"), read given
    ``model`` (`kvref.state.legacy.read_raw_kv`)."""
    p = read_raw_kv(buf, kind, model)
    outputs = Outputs(p.output_pos, p.logits, p.embd)
    if p.kind == "session":
        assert p.version is not None  # a session file's, 5 .. 7
        return LegacySessionFile(
            version=p.version, tokens=p.tokens, arch=p.arch, outputs=outputs, memory=p.memory,
            rng=p.rng, hparams_raw=p.hparams, raw_kv=p.raw,
        )  # fmt: skip
    return LegacyStateBlob(arch=p.arch, outputs=outputs, memory=p.memory, rng=p.rng, raw_kv=p.raw)


OUTPUTS = Struct(
    Outputs,
    Array("output_pos", np.int32, U32("n_outputs")),
    Array("logits", np.float32, U64("logits_size")),
    Array("embeddings", np.float32, U64("embd_size")),
)


def _has_outputs(o: SessionFile | StateBlob, env: Env) -> bool:
    return o.outputs is not None


def _context_fields() -> tuple[Field[SessionFile | StateBlob], ...]:
    return (
        Str("arch", max_len=1 << 16),
        RNG,
        Param("has_outputs", derive=_has_outputs),
        When(lambda env: env_flag(env, "has_outputs"), OUTPUTS.named("outputs")),
        MEMORY,
    )


SESSION = Struct(
    SessionFile,
    U32("magic", check=_check_magic(Magic.SESSION)),
    # versions 5 .. 7 are read before this layout is tried (`read_legacy`)
    U32("version", check=_check_version(SESSION_VERSIONS, "5, given the model: llama-cpp-python 0.2.67")),
    Array("tokens", np.int32, U32("n_token_count")),
    *_context_fields(),
)

SEQ = Struct(
    SeqFile,
    U32("magic", check=_check_magic(Magic.STATE_SEQ)),
    # version 1 is read before this layout is tried (`read_legacy_seq`)
    U32("version", check=_check_version(SEQ_VERSIONS, "1: llama-cpp-python 0.2.62 .. 0.2.83")),
    Array("tokens", np.int32, U32("n_token_count")),
    MEMORY,
)

STATE = Struct(StateBlob, *_context_fields())

SEQ_STATE = Struct(
    SeqStateBlob,
    Param("seq_header", attr="has_header"),
    When(
        lambda env: env_flag(env, "seq_header"),
        U32("io_magic", derive=lambda o, env: Magic.SEQ_BLOB, check=_check_magic(Magic.SEQ_BLOB)),
    ),
    When(lambda env: env_flag(env, "seq_header"), I32("io_seq_id", attr="seq_id")),
    MEMORY,
)

STRUCTS: dict[str, Struct[StateObject]] = {"session": SESSION, "seq": SEQ, "state": STATE, "seq_state": SEQ_STATE}


def save(obj: StateObject, path: str | os.PathLike[str], *, durable: bool = True) -> int:
    """Write ``obj`` to ``path`` without assembling it in memory, crash-safe (`kvref.state.atomic`; ``durable=False``
    skips the fsyncs: the file is still replaced whole or not at all when the process dies, but a power loss may
    lose it, as with llama.cpp's own save); returns the byte count. Saving over the file the object was loaded from
    (and is still memory-mapped from) is safe."""
    return atomic_write(path, obj.write_to, durable=durable)


__all__ = [
    "SEQ",
    "SEQ_STATE",
    "SESSION",
    "STATE",
    "STRUCTS",
    "LegacySessionFile",
    "LegacyStateBlob",
    "Outputs",
    "SeqFile",
    "SeqStateBlob",
    "SessionFile",
    "StateBlob",
    "StateObject",
    "read_legacy",
    "save",
]
