"""Auto-detection sniffs before it parses (issue 14): `load` parses only the readings that can parse.

No wall-clock assertions: these count the readings `read_root` parsed in full, and check that sniffing never
changes what `load` returns or raises (every reading that parses in full is still parsed, and when none does,
every reading is, for the same error).
"""

from __future__ import annotations

import glob
import importlib
import os
from typing import Any

import numpy as np
import pytest

import kvref.state as S
from kvref.ggml.types import GGMLType
from kvref.state.constants import LAYOUTS

L = importlib.import_module("kvref.state.load")  # the module (kvref.state.load is also the function's name)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTO = {
    "ext_size": None,
    "n_stream_field": None,
    "has_v": None,
    "outputs": None,
    "ple": False,
    "n_state_layers": None,
    "seq_header": None,
}


def _inputs() -> list[str]:
    pats = ("conformance/golden/*/*", "conformance/invalid/*", "fixtures/state/*")
    files = [f for p in pats for f in sorted(glob.glob(os.path.join(ROOT, p)))]
    return [f for f in files if not f.endswith(".json")]


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every reading `load` parses in full, in order."""
    seen: list[dict[str, Any]] = []
    real = L.read_root

    def counting(struct: Any, buf: Any, options: dict[str, Any], **kw: Any) -> Any:
        seen.append(options)
        return real(struct, buf, options, **kw)

    monkeypatch.setattr(L, "read_root", counting)
    return seen


def _cells(n: int, ext: int = 0, shared_at: tuple[int, ...] = ()) -> S.Cells:
    seqs = [[0, 1] if i in shared_at else [0] for i in range(n)]
    ext_arr = np.arange(n * (ext // 4), dtype=np.int32).reshape(n, -1) if ext else None
    return S.Cells.from_lists(np.arange(n, dtype=np.int32), seqs, ext=ext_arr, ext_size=ext)


def _stream(n: int, ext: int = 0, seed: int = 0, shared_at: tuple[int, ...] = ()) -> S.KVStream:
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 256, (n, 8), dtype=np.uint8)
    layers = [S.LayerRows(int(GGMLType.F16), 8, k) for _ in range(4)]
    return S.KVStream(_cells(n, ext, shared_at), S.KVData(0, layers, list(layers)))


def _recurrent(n: int, n_state: int) -> S.RecurrentSection:
    rng = np.random.default_rng(5)
    r = [S.RecurrentLayer(int(GGMLType.F32), 8, rng.integers(0, 256, (n, 8), dtype=np.uint8)) for _ in range(n_state)]
    s: list[Any] = [S.LayerRows(int(GGMLType.F32), 16, rng.integers(0, 256, (n, 16), dtype=np.uint8)) for _ in r]
    return S.RecurrentSection(_cells(n), 0, 4, r, s)


def _big(kind: str, layout: str, n: int = 32768, n_stream: int = 1, **kw: Any) -> S.StateObject:
    sections: list[Any] = []
    for i, part in enumerate(LAYOUTS[layout]):
        if part == "kv":
            sections.append(S.KVSection([_stream(n // n_stream, seed=10 * i + s, **kw) for s in range(n_stream)]))
        else:
            sections.append(_recurrent(n if layout == "recurrent" else 4, 4 if layout == "recurrent" else 2))
    mem = S.MemorySections(layout, sections)
    arch = {"recurrent": "mamba", "hybrid": "jamba"}.get(layout, "llama")
    if kind == "session":
        return S.SessionFile(10, np.arange(3, dtype=np.int32), arch, None, mem)
    if kind == "state":
        return S.StateBlob(arch, None, mem)
    return S.SeqStateBlob(mem, seq_id=0)


@pytest.mark.parametrize(
    ("kind", "layout", "kw"),
    [
        ("session", "kv", {}),
        ("session", "kv", {"n_stream": 4}),
        ("session", "kv", {"ext": 12, "n_stream": 2}),
        ("session", "iswa", {"n_stream": 2}),
        ("session", "recurrent", {}),
        ("session", "hybrid", {}),
        ("state", "kv", {}),
        ("state", "hybrid", {}),
    ],
)
def test_a_large_input_is_parsed_once(kind: str, layout: str, kw: dict[str, Any], parses: list[Any]) -> None:
    obj = _big(kind, layout, **kw)
    data = obj.to_bytes()
    buf = memoryview(data)
    n_readings = len({r for k in L.detect_kind(buf) for r in L._readings(k, buf, "auto", AUTO)})
    assert n_readings > 10  # what parsing every reading cost before
    got = S.load(data)
    assert len(parses) == 1, [L.describe(c) for c in parses]
    assert got.to_bytes() == data and got.memory.layout == layout
    parses.clear()
    pinned = S.load(data, kind=kind, layout=layout)
    assert L._signature(pinned) == L._signature(got) and len(parses) == 1


def test_a_table_that_only_looks_uniform_is_still_read_right(parses: list[Any]) -> None:
    """First, middle and last cells agree, one in between does not: the sniff assumes a uniform table, and a
    parse that reads the table ends elsewhere; the readings dropped on that assumption are sniffed again."""
    n = 4096
    obj = _big("session", "kv", n, shared_at=(1000,))
    data = obj.to_bytes()
    got = S.load(data)
    assert got.to_bytes() == data
    assert got.memory.kv_sections[0].streams[0].cells.seq_ids(1000) == (0, 1)
    assert len(parses) == 1


def _parsed_match(data: bytes, opts: dict[str, Any]) -> int:
    """Check `_parsed` against parsing every reading; returns how many readings it parsed."""
    buf = memoryview(data)
    try:
        kinds = L.detect_kind(buf)
    except S.FormatError:
        return 0
    readings = [r for k in kinds for r in L._readings(k, buf, "auto", opts)]
    full = [L._parse(r, buf) for r in readings]
    got = L._parsed(buf, readings)
    if not any(f is not None for f in full) or len(readings) < 2:
        assert got is None  # load then parses every reading, as before, for the error
        return 0
    assert got is not None
    for f, g in zip(full, got, strict=True):
        assert (f is None) == (g is None)
        if f is not None and g is not None:
            assert L._signature(g) == L._signature(f) and g.to_bytes() == f.to_bytes()
    return sum(g is not None for g in got)


def test_sniffing_keeps_every_reading_that_parses() -> None:
    """Over every golden, invalid input and fixture, and cut / damaged copies of them."""
    rng = np.random.default_rng(14)
    parsed = total = 0
    for path in _inputs():
        with open(path, "rb") as f:
            data = f.read()
        variants = [data]
        if len(data) > 16:
            cut = bytearray(data)
            cut[int(rng.integers(0, len(cut)))] ^= 0x41
            variants += [data[: int(rng.integers(8, len(data)))], bytes(cut)]
        for v in variants:
            for opts in (AUTO, {**AUTO, "ple": True}):
                parsed += _parsed_match(v, opts)
                total += 1
    assert total > 100 and parsed > 0


@pytest.mark.parametrize("path", _inputs(), ids=os.path.basename)
def test_every_input_loads_the_same_with_and_without_hints(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    try:
        auto = S.load(data)
    except S.FormatError as e:
        # the error comes from parsing every reading, as before the sniff: nothing was dropped
        assert e.field is not None
        return
    assert auto.to_bytes() == data
    try:
        header = {"seq_header": auto.has_header} if isinstance(auto, S.SeqStateBlob) else {}
        pinned = S.load(data, kind=auto.kind, layout=auto.memory.layout, **header)
    except S.FormatError as e:  # the hints leave several readings (say, ext sizes of a table-less input)
        assert e.field == "layout"
        return
    assert L._signature(pinned) == L._signature(auto)
    assert pinned.to_bytes() == data
