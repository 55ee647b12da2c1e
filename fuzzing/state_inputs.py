#!/usr/bin/env python3
"""Structure-aware fuzzer of kvref's state-file parsing and of every memory's ``state_read``.

Inputs are mutations of the committed goldens (``conformance/golden/*/`` session files, sequence files and
blobs). The golden is parsed with its case's load options; the parse records where every field starts, so the
mutations can target count fields (cell_count, n_seq_id, n_layer, n_stream, token count, row sizes, string
lengths, element sizes, V widths), type ids, flags and sequence ids, cut the input at or near a field, insert or
delete bytes there, or flip random bytes. Input ``i`` of seed ``S`` depends on nothing else.

Each input is checked in a child process (address space capped, watched for hangs):

- ``kvref.state.load`` (with the golden's options, or with every option left to inference) raises nothing but
  kvref errors; whatever parses writes back byte-identical (``obj.to_bytes() == input``);
- the peak RSS growth over the input stays under 2 x its size plus a constant (and, with ``--tracemalloc``, the
  traced peak of load + to_bytes too), and an allocation over the address-space cap is reported as a blow-up;
- the mutated memory section, fed to ``state_read`` of a memory built as the golden's case describes (and
  holding the golden's state), raises nothing but kvref errors, and when it refuses, every sequence's
  ``state_write`` and position range are unchanged.

With ``--target gguf`` the inputs are hostile GGUF models instead: a committed tiny model
(``conformance/models/``) with 1-3 of its metadata fields changed in place (an integer or float value, a value's or
an array's element type, an array's count, a byte of a string value or of a key, a string's length), or cut,
or with bytes inserted or deleted among its key/value pairs. Each is given, as the model, to
``HParams.from_gguf``, the vocabulary reader, ``kvref.restore`` / ``kvref.state.load`` / the tensors export /
``check_file`` of the goldens written with that model, and (when its hyper-parameters load) to a memory that
decodes, shifts, writes and reads back a few tokens. Checks: nothing but kvref errors (a MemoryError for a cache
the model really asks for, beyond the child's address-space cap, is no finding), and both twins the same.

    python fuzzing/state_inputs.py --inputs 100000 --seed 1 --jobs 2          # a long campaign
    python fuzzing/state_inputs.py --target gguf --inputs 3000 --seed 1 --jobs 2
    python fuzzing/state_inputs.py --replay fuzz-out/state/<finding>.json     # re-run one saved input
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_common import (
    BACKENDS,
    ROOT,
    Finding,
    Report,
    apply_known,
    campaign,
    child_main,
    exception_signature,
    first_diff,
    format_exc,
    maxrss,
    twin_findings,
)

GOLDEN = ROOT / "conformance" / "golden"
GOLDEN_DIRS = (GOLDEN, ROOT / "conformance" / "golden-v7")
DEFAULT_OUT = Path(tempfile.gettempdir()) / "kvref-fuzz" / "state"

# Findings that belong to modules this fuzzer's owner may not change, not fixed yet:
# "category:signature" fnmatch patterns (write a literal [ as [[]) -> why it is known and whose it is.
KNOWN_ISSUES: dict[str, str] = {}

# load()'s own argument checks: the fuzzer chooses those options, so these ValueErrors are not findings
OPTION_ERRORS = ("kind must be", "layout must be", "ext_size must be", "the options given exclude")

# peak RSS growth allowed per input: 2 x the input plus this (the memories' copies during a restore)
RSS_SLACK = 48 << 20
TRACED_SLACK = 1 << 20

# --------------------------------------------------------------------------------------------- field offsets
# the scalar fields of kvref.state's layouts (by the DSL field name under which Record.offsets keeps them)
U64_FIELDS = {"k_row_size", "v_row_size", "s_row_size", "r_row_size", "p_row_size", "logits", "embeddings"}
SCALAR_FIELDS = U64_FIELDS | {
    "magic",
    "version",
    "tokens",  # the n_token_count prefix
    "arch",  # its length prefix
    "output_pos",  # n_outputs
    "io_magic",
    "io_seq_id",
    "n_stream",
    "cell_count",
    "v_trans",
    "n_layer",
    "k_type",
    "v_type",
    "v_el_size",
    "n_embd_v_gqa",
    "s_trans",
    "r_type",
    "s_type",
    "s_el_size",
    "n_embd_s",
}
TYPE_FIELDS = {"k_type", "v_type", "r_type", "s_type"}
COUNT_FIELDS = {"tokens", "arch", "output_pos", "logits", "embeddings", "n_stream", "cell_count", "n_layer"}
KNOWN_TYPES = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 28, 30, 34, 35, 39, 40, 41, 42]
BAD_TYPES = [4, 5, 31, 36, 43, 44, 100, -1, 0x7FFFFFFF, -0x80000000]


@dataclass(frozen=True)
class FieldAt:
    name: str
    offset: int
    size: int


def field_offsets(obj: Any) -> list[FieldAt]:
    """Every scalar field of a parsed state with its byte offset (cells included, one record per cell)."""
    out: list[FieldAt] = []

    def walk(o: Any) -> None:
        offs = getattr(o, "offsets", None) or {}
        for name, off in offs.items():
            if name not in SCALAR_FIELDS:
                continue
            if name == "p_row_size" and getattr(o, "p_row_size", None) is None:
                continue
            if name == "n_stream" and not getattr(o, "has_n_stream", True):
                continue
            if name in ("io_magic", "io_seq_id") and not getattr(o, "has_header", False):
                continue
            out.append(FieldAt(name, off, 8 if name in U64_FIELDS else 4))
        cells = getattr(o, "cells", None)
        if cells is not None and "cells" in offs and hasattr(cells, "seq_start"):
            at = offs["cells"]
            ext = cells.ext_size
            for i in range(cells.n):
                n = int(cells.seq_start[i + 1] - cells.seq_start[i])
                out.append(FieldAt("pos", at, 4))
                out.append(FieldAt("n_seq_id", at + 4, 4))
                for k in range(ext // 4):
                    out.append(FieldAt("ext", at + 8 + 4 * k, 4))
                for j in range(n):
                    out.append(FieldAt("seq_id", at + 8 + ext + 4 * j, 4))
                at += 8 + ext + 4 * n
        for attr in ("outputs", "memory", "sections", "streams", "data", "k", "v", "r", "s"):
            v = getattr(o, attr, None)
            if isinstance(v, list):
                for x in v:
                    walk(x)
            elif v is not None and not isinstance(v, int | str | bytes) and not hasattr(v, "dtype"):
                walk(v)

    walk(obj)
    return sorted(set(out), key=lambda f: f.offset)


# --------------------------------------------------------------------------------------------- the goldens
@dataclass(frozen=True)
class Artefact:
    case_id: str
    file: str
    hints: tuple[tuple[str, Any], ...]  # kvref.state.load options of the golden
    seq_id: int  # what state_read restores it into (-1: the whole memory)
    flags: int


@cache
def artefacts() -> tuple[Artefact, ...]:
    """Every golden artefact a case's trace saves, in a stable order."""
    from kvref.jobs import conformance as C

    out = []
    for d in sorted(GOLDEN.iterdir()):
        if not (d / "case.json").exists():
            continue
        case = json.loads((d / "case.json").read_text())
        for file, op in sorted(C.save_ops(case).items()):
            if not (d / file).exists():
                continue
            seq_id = op.get("seq_id", -1)
            seq_id = -1 if seq_id is None or op.get("scope") == "context" else seq_id
            hints = C.artefact_hints(op, case.get("producer"))
            out.append(Artefact(case["id"], file, tuple(sorted(hints.items())), seq_id, op.get("flags", 0) or 0))
    return tuple(out)


@dataclass
class Golden:
    art: Artefact
    data: bytes
    fields: list[FieldAt]
    mem_off: int  # where the memory section starts


@cache
def golden(index: int) -> Golden:
    import kvref.state as S

    art = artefacts()[index]
    data = (GOLDEN / art.case_id / art.file).read_bytes()
    obj = S.load(data, **dict(art.hints))
    return Golden(art, data, field_offsets(obj), obj.offsets["memory"])


@cache
def case(case_id: str) -> dict:
    return json.loads((GOLDEN / case_id / "case.json").read_text())


# --------------------------------------------------------------------------------------------- mutation
@dataclass
class Input:
    """One fuzz input: the bytes, the load options, and where its memory section starts."""

    index: int
    art_index: int
    data: bytes
    load_kw: dict[str, Any]
    mem_off: int
    restore_seq: int
    ops: list[str] = field(default_factory=list)
    flags: int = 0  # of the state_read


def _interesting(f: FieldAt, cur: int, rng: random.Random) -> int:
    bits = 8 * f.size
    if f.name in TYPE_FIELDS:
        return rng.choice(KNOWN_TYPES + BAD_TYPES)
    common = [0, 1, 2, 3, cur - 1, cur + 1, cur * 2, cur // 2, 255, 256, 257, 4096, 65535, 65536]
    common += [0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, rng.getrandbits(32), rng.randrange(64)]
    if f.size == 8:
        common += [1 << 32, (1 << 32) + cur, 1 << 62, 1 << 63, (1 << 64) - 1, cur * (1 << 20)]
    if f.name in ("seq_id", "io_seq_id"):
        common += [-1, 255, 256, 1, 2, 3, 4, 5, 7, 8, -(1 << 31)]
    if f.name in ("pos", "ext"):
        common += [-1, -2, -(1 << 31), (1 << 31) - 1, cur + 1000]
    if f.name in ("v_el_size", "s_el_size"):
        common += [1, 2, 4, 34]
    if f.name in ("n_seq_id",):
        common += [0, 2, 3, 256, 257]
    return rng.choice(common) & ((1 << bits) - 1)


def mutate(g: Golden, rng: random.Random) -> tuple[bytes, int, list[str]]:
    """Mutate a golden: 1-3 structural or byte mutations. Returns (bytes, shift of the memory start, ops)."""
    b = bytearray(g.data)
    shift = 0
    ops: list[str] = []
    fields = g.fields
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        what = rng.random()
        f = rng.choice(fields) if fields else FieldAt("byte", 0, 4)
        if f.offset + f.size > len(b):
            f = FieldAt("byte", rng.randrange(max(1, len(b))), 1)
        if what < 0.55 and f.name != "byte":
            # a count / type / id / size field gets an interesting value (counts are favoured)
            if f.name not in COUNT_FIELDS and rng.random() < 0.3:
                cands = [x for x in fields if x.name in COUNT_FIELDS and x.offset + x.size <= len(b)]
                f = rng.choice(cands) if cands else f
            cur = int.from_bytes(b[f.offset : f.offset + f.size], "little")
            v = _interesting(f, cur, rng) & ((1 << (8 * f.size)) - 1)
            b[f.offset : f.offset + f.size] = v.to_bytes(f.size, "little")
            ops.append(f"set {f.name}@{f.offset} {cur} -> {v}")
        elif what < 0.70:
            # truncate at, inside or just after a field (or anywhere)
            at = f.offset + rng.choice((0, 1, 2, f.size - 1, f.size, f.size + 1)) if rng.random() < 0.7 else None
            at = rng.randrange(len(b) + 1) if at is None else min(at, len(b))
            ops.append(f"cut @{at} (of {len(b)})")
            del b[at:]
        elif what < 0.80:
            at = min(f.offset + rng.choice((0, f.size)), len(b))
            n = rng.choice((1, 2, 4, 4, 8, 12, 16))
            # duplicate what follows (a repeated record), or random bytes
            chunk = (bytes(b[at : at + n]) or bytes(n)) if rng.random() < 0.5 else rng.randbytes(n)
            b[at:at] = chunk
            if at < g.mem_off + shift:
                shift += len(chunk)
            ops.append(f"insert {len(chunk)} @{at}")
        elif what < 0.88:
            at = min(f.offset, len(b))
            n = rng.choice((1, 2, 4, 4, 8, 12, 16, f.size))
            n = min(n, len(b) - at)
            del b[at : at + n]
            if at < g.mem_off + shift:
                shift -= min(n, g.mem_off + shift - at)
            ops.append(f"delete {n} @{at}")
        else:
            # random bytes: a few flips, favouring the metadata (the first cells of each section)
            for _ in range(rng.choice((1, 1, 2, 4, 8))):
                if not b:
                    break
                at = rng.randrange(len(b)) if rng.random() < 0.5 else min(f.offset + rng.randrange(16), len(b) - 1)
                old = b[at]
                b[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256), old ^ (1 << rng.randrange(8))))
                ops.append(f"byte @{at} {old:#04x} -> {b[at]:#04x}")
    return bytes(b), shift, ops


def make_input(seed: int, index: int) -> Input:
    """Input ``index`` of campaign ``seed`` (deterministic)."""
    rng = random.Random(f"state:{seed}:{index}")
    arts = artefacts()
    ai = rng.randrange(len(arts))
    g = golden(ai)
    data, shift, ops = mutate(g, rng)
    hints = dict(g.art.hints)
    r = rng.random()
    if r < 0.2:
        load_kw: dict[str, Any] = {}  # everything inferred (kind too)
    elif r < 0.3:
        load_kw = {"kind": hints["kind"]}
    elif r < 0.35:
        load_kw = {"kind": hints["kind"], "layout": hints["layout"]}
    elif r < 0.45:
        # one option the bytes cannot tell, chosen differently from the golden's (still a valid option)
        load_kw = dict(hints)
        key = rng.choice(["outputs", "n_stream_field", "ext_size", "has_v", "seq_header", "ple", "n_state_layers"])
        load_kw[key] = {
            "ext_size": rng.choice([0, 8, 12]),
            "n_state_layers": rng.choice([0, 1, 2, 3, 64]),
        }.get(key, rng.random() < 0.5)
        if (
            key in ("outputs", "seq_header")
            and load_kw["kind"] not in (("session", "state"), ("seq_state",))[key == "seq_header"]
        ):
            load_kw.pop(key)
    else:
        load_kw = hints
    flags = g.art.flags if rng.random() < 0.9 else rng.choice([0, 1, 2, 3])
    restore_seq = g.art.seq_id
    n_seq = (case(g.art.case_id).get("observed_context") or {}).get("n_seq_max") or 1
    if restore_seq >= 0 and n_seq > 1 and rng.random() < 0.25:
        restore_seq = (restore_seq + 1) % n_seq  # a sequence state restored into another sequence
    return Input(index, ai, data, load_kw, g.mem_off + shift, restore_seq, ops, flags)


# --------------------------------------------------------------------------------------------- checks
def _kvref_error(exc: BaseException) -> bool:
    from kvref.errors import KVRefError

    return isinstance(exc, KVRefError)


class MemoryUnderTest:
    """A memory built as a case describes, holding the case's whole state and the golden's sequence."""

    def __init__(self, art: Artefact) -> None:
        import kvref.state as S
        from kvref.errors import KVRefError
        from kvref.jobs import conformance as C

        c = case(art.case_id)
        self.n_seq = c["observed_context"]["n_seq_max"]
        self.mem = C.create_memory_for(c, C.hparams_from_case(c))
        # fill it: the first whole-context save of the case, then the golden itself into its sequence
        arts = artefacts()
        first = next((a for a in arts if a.case_id == art.case_id and a.seq_id == -1 and a.flags == 0), None)
        for a in (first, art):
            if a is None:
                continue
            blob = (GOLDEN / a.case_id / a.file).read_bytes()
            off = S.load(blob, **dict(a.hints)).offsets["memory"]
            with contextlib.suppress(KVRefError):  # a golden llama.cpp refused too: keep what there is
                self.mem.state_read(blob[off:], a.seq_id, a.flags)
        self.snap = self.snapshot()

    def snapshot(self) -> tuple[Any, ...]:
        m = self.mem
        seqs = range(self.n_seq)
        return (
            m.state_write(-1),
            tuple(m.state_write(s) for s in seqs),
            tuple((m.seq_pos_min(s), m.seq_pos_max(s)) for s in seqs),
        )


_memories: dict[int, MemoryUnderTest | None] = {}


def _memory_for(ai: int) -> MemoryUnderTest | None:
    if ai not in _memories:
        art = artefacts()[ai]
        # no memory when llama.cpp refused the case's context; any other failure to build one is a finding
        _memories[ai] = MemoryUnderTest(art) if case(art.case_id).get("observed_context") else None
    return _memories[ai]


def _what(exc: BaseException) -> str:
    return f"{type(exc).__name__}:{getattr(exc, 'field', None)}:{getattr(exc, 'offset', None)}"


def check_input(inp: Input, backend: str, *, traced: bool = False) -> tuple[list[Finding], dict[str, Any]]:
    """Every check on one input; returns the findings (empty when it passes) and what happened (the outcome
    the twins must agree on)."""
    import kvref.state as S

    found: list[Finding] = []
    outcome: dict[str, Any] = {}

    def add(category: str, signature: str, message: str, detail: str = "") -> None:
        found.append(Finding(category, signature, message, inp.index, backend, detail))

    g = golden(inp.art_index)
    kind = dict(g.art.hints)["kind"]
    rss0 = maxrss()
    if traced:
        tracemalloc.start()
    obj = None
    try:
        obj = S.load(inp.data, **inp.load_kw)
        outcome["load"] = f"{obj.kind}/{obj.memory.layout}"
    except MemoryError as e:
        outcome["load"] = "MemoryError"
        add("memory", f"MemoryError@load:{kind}", f"load: MemoryError on a {len(inp.data)}-byte input", format_exc(e))
    except Exception as e:
        outcome["load"] = _what(e)
        if not _kvref_error(e) and not (isinstance(e, ValueError) and str(e).startswith(OPTION_ERRORS)):
            add("exception", f"load:{exception_signature(e)}", f"load: {type(e).__name__}: {e}", format_exc(e))
    if obj is not None:
        try:
            back = obj.to_bytes()
            if back != inp.data:
                at = next((i for i, (x, y) in enumerate(zip(back, inp.data, strict=False)) if x != y), None)
                at = min(len(back), len(inp.data)) if at is None else at
                add(
                    "roundtrip",
                    f"{obj.kind}:{obj.memory.layout}",
                    f"parsed as {obj.kind}/{obj.memory.layout} but writes back {len(back)} bytes for "
                    f"{len(inp.data)}, first difference at byte {at}",
                )
        except MemoryError as e:
            add("memory", "MemoryError@to_bytes", "to_bytes: MemoryError", format_exc(e))
        except Exception as e:
            add("roundtrip", f"to_bytes:{exception_signature(e)}", f"to_bytes: {type(e).__name__}: {e}", format_exc(e))
    if traced:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        if peak > 2 * len(inp.data) + TRACED_SLACK:
            add(
                "memory", f"traced:{kind}", f"load + to_bytes traced peak {peak} bytes for a {len(inp.data)}-byte input"
            )
    del obj
    read_found, outcome["state_read"] = check_state_read(inp, backend)
    found.extend(read_found)
    grew = maxrss() - rss0
    if grew > 2 * len(inp.data) + RSS_SLACK:
        add("memory", f"rss:{kind}", f"peak RSS grew by {grew} bytes on a {len(inp.data)}-byte input")
    return found, outcome


def check_state_read(inp: Input, backend: str) -> tuple[list[Finding], str | None]:
    """Feed the mutated memory section to state_read; on a kvref error the memory must be unchanged.
    Returns the findings and the outcome (None when nothing was restored)."""
    g = golden(inp.art_index)
    data = inp.data[max(0, inp.mem_off) :]
    if data == g.data[g.mem_off :] and inp.restore_seq == g.art.seq_id and inp.flags == g.art.flags:
        return [], None  # the golden's own memory section: nothing to learn
    try:
        mut = _memory_for(inp.art_index)
    except Exception as e:
        msg = f"building the memory of {g.art.case_id} and restoring its goldens: {type(e).__name__}: {e}"
        category = "memory" if isinstance(e, MemoryError) else "exception"
        return [
            Finding(category, f"memory-setup:{exception_signature(e)}", msg, inp.index, backend, format_exc(e))
        ], None
    if mut is None:
        return [], None
    found: list[Finding] = []
    outcome = "ok"
    layout = dict(g.art.hints).get("layout")
    sig = f"{layout}:seq{'-1' if inp.restore_seq < 0 else 'N'}"
    try:
        outcome = f"ok:{mut.mem.state_read(data, inp.restore_seq, inp.flags)}"
    except MemoryError as e:
        outcome = "MemoryError"
        found.append(
            Finding(
                "memory",
                f"MemoryError@state_read:{layout}",
                "state_read: MemoryError",
                inp.index,
                backend,
                format_exc(e),
            )
        )
        _memories.pop(inp.art_index, None)
    except Exception as e:
        outcome = f"{_what(e)}:{e}"
        if not _kvref_error(e):
            msg = f"state_read({len(data)} bytes, seq {inp.restore_seq}): {type(e).__name__}: {e}"
            found.append(
                Finding("exception", f"state_read:{exception_signature(e)}", msg, inp.index, backend, format_exc(e))
            )
            _memories.pop(inp.art_index, None)
            return found, outcome
        now = mut.snapshot()
        if now != mut.snap:
            what = [
                n
                for n, a, b in zip(("state_write(-1)", "state_write(seq)", "seq_pos"), now, mut.snap, strict=True)
                if a != b
            ]
            field_name = getattr(e, "field", None)
            found.append(
                Finding(
                    "partial",
                    f"{sig}:{type(e).__name__}:{field_name}",
                    f"state_read refused ({type(e).__name__}: {e}) but changed {', '.join(what)}",
                    inp.index,
                    backend,
                )
            )
            _memories.pop(inp.art_index, None)
    else:
        _memories.pop(inp.art_index, None)  # restored: rebuild the memory for the next input
    return found, outcome


# --------------------------------------------------------------------------------------------- hostile GGUF models
@cache
def gguf_models() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every committed model with the golden artefacts written with it (two per case at most), in a stable order."""
    by_model: dict[str, list[str]] = {}
    for root in GOLDEN_DIRS:
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            if not (d / "case.json").exists():
                continue
            m = json.loads((d / "case.json").read_text()).get("model") or {}
            path = ROOT / "conformance" / (m.get("path") or "-")
            if m.get("committed") and path.exists():
                files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix != ".json")[:2]
                by_model.setdefault(str(path), []).extend(str(p) for p in files)
    return tuple((m, tuple(arts[:8])) for m, arts in sorted(by_model.items()))


@dataclass(frozen=True)
class GGUFField:
    key: str
    key_at: int  # the key's bytes
    type_at: int  # its u32 value type
    value_at: int
    types: tuple[int, ...]


@cache
def gguf_fields(model: str) -> tuple[GGUFField, ...]:
    from kvref.hparams import _read_gguf_metadata

    out = []
    for key, v in _read_gguf_metadata(model).items():
        if key.startswith("GGUF."):
            continue
        at = v._offset  # the reader keeps where each value starts
        out.append(GGUFField(key, at - 4 - len(key.encode()), at - 4, at, tuple(v.types)))
    return tuple(out)


_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}


@dataclass
class GGUFInput:
    index: int
    model_index: int
    data: bytes
    ops: list[str] = field(default_factory=list)


def make_gguf_input(seed: int, index: int) -> GGUFInput:
    """Hostile GGUF ``index`` of campaign ``seed`` (deterministic): a committed model with 1-3 mutations."""
    import struct

    rng = random.Random(f"gguf:{seed}:{index}")
    models = gguf_models()
    mi = rng.randrange(len(models))
    model = models[mi][0]
    b = bytearray(Path(model).read_bytes())
    fields = [f for f in gguf_fields(model) if f.value_at < len(b)]
    kv_end = max(f.value_at for f in fields) + 16
    ops: list[str] = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        here = [f for f in fields if f.value_at + 12 <= len(b)]  # what an earlier cut or deletion left
        if not here:
            break
        f = rng.choice(here)
        t = f.types[0]
        r = rng.random()
        if r < 0.12:  # the structure: a key byte, a cut, bytes inserted or deleted among the pairs
            at = rng.randrange(min(kv_end, len(b)))
            how = rng.choice(["key", "cut", "insert", "delete"])
            if how == "key":
                b[f.key_at + rng.randrange(max(1, len(f.key)))] = rng.choice([0xFF, 0xC3, 0x80])
                ops.append(f"{f.key}: a key byte not UTF-8")
            elif how == "cut":
                del b[at:]
                ops.append(f"cut @{at}")
            elif how == "insert":
                n = rng.choice([1, 4, 8])
                b[at:at] = rng.randbytes(n)
                ops.append(f"insert {n} @{at}")
            else:
                n = rng.choice([1, 4, 8])
                del b[at : at + n]
                ops.append(f"delete {n} @{at}")
        elif r < 0.25:  # the value's type
            nt = rng.choice([0, 1, 4, 5, 6, 7, 8, 9, 10, 12, 13, 99])
            struct.pack_into("<I", b, f.type_at, nt)
            ops.append(f"{f.key}: type {t} -> {nt}")
        elif t in _SCALAR_FMT:
            fmt = "<" + _SCALAR_FMT[t]
            if t in (6, 12):
                v: Any = rng.choice([0.0, -1.0, 1e30, float("nan"), float("inf"), 0.5])
            else:
                size = struct.calcsize(fmt)
                cur = int.from_bytes(b[f.value_at : f.value_at + size], "little")
                v = rng.choice([0, 1, 2, 3, 7, 255, 4096, cur - 1, cur + 1, cur * 2, 2**31 - 1, 2**31, 2**32 - 1])
                v = rng.choice([v, 2**63, 2**64 - 1]) if size == 8 else v
                v &= (1 << (8 * size)) - 1
                if fmt[-1].islower():  # a signed type: the same bits
                    v = v - (1 << (8 * size)) if v >= 1 << (8 * size - 1) else v
            struct.pack_into(fmt, b, f.value_at, v)
            ops.append(f"{f.key} = {v}")
        elif t == 8:
            n = int.from_bytes(b[f.value_at : f.value_at + 8], "little")
            if n and rng.random() < 0.7 and f.value_at + 8 + n <= len(b):
                at = f.value_at + 8 + rng.randrange(n)
                b[at] = rng.choice([0xFF, 0xC3, 0x80, 0xED, 0x00])
                ops.append(f"{f.key}: string byte {at - f.value_at - 8} -> {b[at]:#04x}")
            else:
                nn = rng.choice([0, n + 1, n - 1 if n else 0, 2**31, 2**62])
                struct.pack_into("<Q", b, f.value_at, nn)
                ops.append(f"{f.key}: string length {n} -> {nn}")
        elif rng.random() < 0.5:  # an array's count
            cur = int.from_bytes(b[f.value_at + 4 : f.value_at + 12], "little")
            nn = rng.choice([0, 1, cur - 1 if cur else 0, cur + 1, 2**32, 2**62])
            struct.pack_into("<Q", b, f.value_at + 4, nn)
            ops.append(f"{f.key}: array count {cur} -> {nn}")
        else:  # an array's element type
            nt = rng.choice([0, 4, 5, 6, 7, 8, 9, 12, 99])
            struct.pack_into("<I", b, f.value_at, nt)
            ops.append(f"{f.key}: array element type -> {nt}")
    return GGUFInput(index, mi, bytes(b), ops)


_gguf_dir: list[Path] = []


def check_gguf_input(inp: GGUFInput, backend: str) -> tuple[list[Finding], dict[str, Any]]:
    """Every job that takes a model, on one hostile GGUF: kvref errors only. Returns the findings and the outcome."""
    import kvref
    from kvref import Batch
    from kvref.hparams import HParams
    from kvref.jobs.check import check_file
    from kvref.jobs.export import export_arrays
    from kvref.vocab import detokenize, vocabulary

    if not _gguf_dir:
        _gguf_dir.append(Path(tempfile.mkdtemp(prefix="kvref-fuzz-gguf-")))
    path = _gguf_dir[0] / "model.gguf"
    path.write_bytes(inp.data)
    found: list[Finding] = []
    outcome: dict[str, Any] = {}
    hp: list[Any] = []

    def memory() -> Any:
        mem = kvref.create_memory(hp[0], n_ctx=64, n_seq_max=2, type_k="f16", type_v="f16")
        mem.decode(Batch(tokens=[1, 2, 3, 4], seq_ids=[[0], [0], [1], [1]]))
        mem.seq_add(0, 0, -1, 3)
        mem.update()
        mem.state_read(mem.state_write(0), 1)
        return mem.seq_pos_max(1)

    _, arts = gguf_models()[inp.model_index]
    jobs: list[tuple[str, Any]] = [
        ("from_gguf", lambda: hp.append(HParams.from_gguf(path)) or hp[0].arch),
        ("vocabulary", lambda: len(detokenize([0, 1, 2], vocabulary(path)))),
        ("memory", lambda: memory() if hp else None),
    ]
    for art in arts[:2]:
        name = Path(art).parent.name + "/" + Path(art).name
        jobs += [
            (f"restore:{name}", lambda art=art: type(kvref.restore(art, model=path)).__name__),
            (f"load:{name}", lambda art=art: kvref.state.load(art, model=path).kind),
            (f"export:{name}", lambda art=art: len(export_arrays(art, model=path)[0])),
            (f"check:{name}", lambda art=art: check_file(art, path).ok),
        ]
    for job, run in jobs:
        try:
            outcome[job] = f"ok:{run()}"
        except MemoryError:  # a cache the model really asks for, beyond the child's cap: not a finding
            outcome[job] = "MemoryError"
        except Exception as e:
            outcome[job] = f"{type(e).__name__}: {str(e).replace(str(path), '<model>')}"
            if not _kvref_error(e):
                msg = f"{job} of a hostile {Path(gguf_models()[inp.model_index][0]).name}: {type(e).__name__}: {e}"
                found.append(
                    Finding("exception", f"gguf:{job.split(':')[0]}:{exception_signature(e)}", msg, inp.index,
                            backend, format_exc(e))
                )  # fmt: skip
    return found, outcome


# --------------------------------------------------------------------------------------------- reproducers
def save_reproducer(out_dir: Path, seed: int, f: Finding, target: str = "state") -> str:
    """Write the input's bytes (``.bin``, ``.gguf``) and what is needed to re-run it (``.json``); returns the json
    path."""
    if target == "gguf":
        g = make_gguf_input(seed, f.input_id)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"gguf-{f.category}-s{seed}-i{f.input_id}-{f.backend}"
        stem.with_suffix(".gguf").write_bytes(g.data)
        meta_g = {"target": "gguf", "seed": seed, "index": f.input_id, "backend": f.backend,
                  "model": gguf_models()[g.model_index][0], "mutations": g.ops, "finding": f.to_json()}  # fmt: skip
        stem.with_suffix(".json").write_text(json.dumps(meta_g, indent=1))
        return str(stem.with_suffix(".json"))
    inp = make_input(seed, f.input_id)
    art = artefacts()[inp.art_index]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{f.category}-s{seed}-i{f.input_id}-{f.backend}"
    stem.with_suffix(".bin").write_bytes(inp.data)
    meta = {
        "seed": seed,
        "index": f.input_id,
        "backend": f.backend,
        "golden": f"{art.case_id}/{art.file}",
        "load_kw": inp.load_kw,
        "memory_section_offset": inp.mem_off,
        "state_read": {"seq_id": inp.restore_seq, "flags": inp.flags},
        "mutations": inp.ops,
        "finding": f.to_json(),
    }
    stem.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    return str(stem.with_suffix(".json"))


# --------------------------------------------------------------------------------------------- campaigns
def _script_argv(seed: int, mem_cap_mb: int, traced: bool, target: str = "state") -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--seed", str(seed), "--target", target]
    argv += ["--mem-cap-mb", str(mem_cap_mb)] + (["--tracemalloc"] if traced else [])
    return argv


def run_campaign(
    inputs: int,
    seed: int = 0,
    *,
    jobs: int = 1,
    backends: tuple[str, ...] = ("alternate",),
    batch: int = 500,
    timeout: float = 20.0,
    mem_cap_mb: int = 1024,
    traced: bool = False,
    start: int = 0,
    out_dir: Path | None = DEFAULT_OUT,
    known: dict[str, str] | None = None,
    progress: bool = False,
    target: str = "state",
) -> Report:
    """Check inputs ``start .. start + inputs`` of ``seed`` (``target``: state files, or ``gguf`` models) under
    ``backends`` ("alternate": batches take turns)."""

    def on_kill(i: int, backend: str, status: str, info: str, where: str) -> Finding:
        first = info.strip().splitlines()[0] if info.strip() else status
        return Finding(status, f"{status}:{first}", f"{status} ({first}), {where}", i, backend, info)

    results, outcomes = campaign(
        lambda b: _script_argv(seed, mem_cap_mb, traced, target),
        list(range(start, start + inputs)),
        list(backends),
        jobs,
        batch,
        timeout,
        on_kill,
        progress,
    )
    report = Report(inputs=len({i for _, i in results}))
    report.extra["runs"] = len(results)
    for fs in results.values():
        report.findings.extend(fs)
    report.findings.extend(twin_findings(outcomes, lambda a, b: first_diff(a, b).split(":", 1)[0]))
    apply_known(report.findings, KNOWN_ISSUES if known is None else known)
    if out_dir is not None:
        seen: set[tuple[str, str]] = set()
        make = make_gguf_input if target == "gguf" else make_input
        for f in sorted(report.findings, key=lambda f: (len(make(seed, f.input_id).data), f.input_id)):
            if (f.category, f.signature) not in seen:
                seen.add((f.category, f.signature))
                f.repro = save_reproducer(out_dir, seed, f, target)
    return report


def replay(path: Path) -> int:
    """Re-run a saved reproducer in this process (KVREF_BACKEND decides the backend) and print what happens."""
    meta = json.loads(path.read_text())
    from kvref._backend import requested

    if meta.get("target") == "gguf":
        g = make_gguf_input(meta["seed"], meta["index"])
        found, out = check_gguf_input(g, requested())
        print(f"outcome: {out}\n{meta['model']} mutated by: {'; '.join(g.ops)}")
        for f in found:
            print(f"[{f.category}] {f.signature}: {f.message}\n{f.detail}")
        print("no finding" if not found else f"{len(found)} finding(s)")
        return 1 if found else 0
    inp = make_input(meta["seed"], meta["index"])
    findings, outcome = check_input(inp, requested())
    print(f"outcome: {outcome}")
    print(f"{meta['golden']} mutated by: {'; '.join(inp.ops)}")
    print(f"load options: {inp.load_kw}; state_read seq {inp.restore_seq} flags {inp.flags}")
    for f in findings:
        print(f"[{f.category}] {f.signature}: {f.message}\n{f.detail}")
    print("no finding" if not findings else f"{len(findings)} finding(s)")
    return 1 if findings else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=1000, help="how many inputs (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first input id (default 0)")
    p.add_argument("--jobs", type=int, default=1, help="child processes at a time")
    p.add_argument("--batch", type=int, default=500, help="inputs per child process")
    p.add_argument("--backend", choices=["alternate", "both", *BACKENDS], default="alternate")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds one input may take")
    p.add_argument("--mem-cap-mb", type=int, default=1024, help="address space a child may add (RLIMIT_AS)")
    p.add_argument("--tracemalloc", action="store_true", help="also bound the traced peak of load + to_bytes")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where reproducers go")
    p.add_argument("--replay", type=Path, help="re-run one saved reproducer (.json) in this process")
    p.add_argument("--target", choices=["state", "gguf"], default="state", help="state files, or GGUF models")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.replay:
        return replay(a.replay)
    if a.child:
        from kvref._backend import requested

        backend = requested()
        if a.target == "gguf":
            return child_main(lambda i: check_gguf_input(make_gguf_input(a.seed, i), backend), a.mem_cap_mb)
        return child_main(lambda i: check_input(make_input(a.seed, i), backend, traced=a.tracemalloc), a.mem_cap_mb)
    backends = list(BACKENDS) if a.backend == "both" else [a.backend]
    t0 = time.monotonic()
    report = run_campaign(
        a.inputs,
        a.seed,
        jobs=a.jobs,
        backends=tuple(backends),
        batch=a.batch,
        timeout=a.timeout,
        mem_cap_mb=a.mem_cap_mb,
        traced=a.tracemalloc,
        start=a.start,
        out_dir=a.out,
        progress=True,
        target=a.target,
    )
    report.extra["seconds"] = round(time.monotonic() - t0)
    report.print("state inputs" if a.target == "state" else "gguf models")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
