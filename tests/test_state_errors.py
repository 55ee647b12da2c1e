"""Malformed input: every error is a FormatError naming a field of the vocabulary and an offset, never a crash,
never a hang, never an allocation the input cannot justify."""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from _state_factory import CASES, load_options, make

import kvref.state as S
from kvref.errors import FormatError
from kvref.state.constants import FIELDS

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "state"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())

# a few representative shapes; every prefix of each is tried
TRUNCATION_CASES = [
    ("session", "kv", {"outputs": True, "ext_size": 8}),
    ("session", "kv", {"v_trans": 1, "ext_size": 12}),
    ("seq", "iswa", {"n_stream_field": False, "version": 2}),
    ("state", "hybrid", {"ple": True}),
    ("seq_state", "recurrent", {"s_trans": 1}),
]


@pytest.mark.parametrize("case", TRUNCATION_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_every_prefix_names_a_field(case: tuple) -> None:
    kind, layout, kw = case
    blob = make(kind, layout, 11, **kw).to_bytes()
    opts = load_options(kind, layout, **kw)
    for n in range(len(blob)):
        with pytest.raises(FormatError) as ei:
            S.load(blob[:n], **opts)
        assert ei.value.field in FIELDS, (n, ei.value)
        assert ei.value.offset is not None and 0 <= ei.value.offset <= n, (n, ei.value)


@pytest.mark.parametrize("case", TRUNCATION_CASES[:3], ids=lambda c: f"{c[0]}-{c[1]}")
def test_every_prefix_auto(case: tuple) -> None:
    """Inferring the layout: a prefix either fails with a field of the vocabulary or is itself a complete state
    of another layout (an iSWA file cut after its base section *is* a valid single-KV file), never garbage."""
    kind, layout, kw = case
    blob = make(kind, layout, 12, **kw).to_bytes()
    for n in range(0, len(blob), 3):
        try:
            obj = S.load(blob[:n])
        except FormatError as e:
            assert e.field in FIELDS
        else:
            assert obj.to_bytes() == blob[:n]
            assert obj.memory.layout != layout


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_fixture(name: str) -> None:
    meta = MANIFEST[name]
    path = FIXTURES / name
    kw = {"kind": meta["kind"], "layout": meta["layout"], **meta["options"]}
    if meta["expect"] == "ok":
        obj = S.load(path, **kw)
        assert obj.to_bytes() == path.read_bytes()
        assert obj.kind == meta["kind"] and obj.memory.layout == meta["layout"]
        # and the same without any hint
        assert S.load(path).to_bytes() == path.read_bytes()
    else:
        with pytest.raises(FormatError) as ei:
            S.load(path, **kw)
        assert ei.value.field == meta["field"], ei.value
        assert ei.value.offset is not None
        assert f"offset {ei.value.offset}" in str(ei.value)


def _session_prefix(n_tokens: int) -> bytes:
    return struct.pack("<III", 0x6767736E, 10, n_tokens)


@pytest.mark.parametrize(
    "blob, field",
    [
        (_session_prefix(1 << 31) + bytes(88), "n_token_count"),
        (_session_prefix(0) + struct.pack("<I", 0xFFFFFFF0) + b"ll", "arch_length"),
        (_session_prefix(0) + struct.pack("<I", 5) + b"llama" + struct.pack("<II", 1, 0x7FFFFFFF), "cell_count"),
        (
            _session_prefix(0) + struct.pack("<I", 5) + b"llama" + struct.pack("<IIiIiII", 1, 1, 0, 1, 0, 0, 0xFFFFFF),
            "n_layer",
        ),
        (
            _session_prefix(0)
            + struct.pack("<I", 5)
            + b"llama"
            + struct.pack("<IIiIiIIiQ", 1, 1, 0, 1, 0, 0, 1, 0, 1 << 60),
            "k_data",
        ),
    ],
    ids=["tokens", "arch", "cells", "layers", "rows"],
)
def test_lying_counts_allocate_nothing(blob: bytes, field: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as ei:
            S.load(blob, kind="session", layout="kv", ext_size=0, has_v=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ei.value.field == field, ei.value
    assert peak < 1 << 20, peak


def _kv_blob(**over: int) -> tuple[bytes, dict]:
    """A session with one stream of one cell and one layer, with fields overridable by name."""
    f = {"v_trans": 0, "k_type": 1, "k_row": 4, "v_type": 1, "v_el": 2, "n_embd": 2, "n_stream": 1, "seq": 0}
    f.update(over)
    body = struct.pack("<I", f["n_stream"]) + struct.pack("<IiIi", 1, 0, 1, f["seq"])
    body += struct.pack("<II", f["v_trans"], 1) + struct.pack("<iQ", f["k_type"], f["k_row"]) + bytes(f["k_row"])
    if f["v_trans"]:
        body += struct.pack("<iII", f["v_type"], f["v_el"], f["n_embd"]) + bytes(f["n_embd"] * f["v_el"])
    else:
        body += struct.pack("<iQ", f["v_type"], 4) + bytes(4)
    return _session_prefix(0) + struct.pack("<I", 5) + b"llama" + body, {
        "kind": "session",
        "layout": "kv",
        "ext_size": 0,
    }


@pytest.mark.parametrize(
    "over, field",
    [
        ({"v_trans": 2}, "v_trans"),
        ({"k_type": 99}, "k_type"),
        ({"k_type": 8, "k_row": 4}, "k_row_size"),
        ({"v_type": 77}, "v_type"),
        ({"v_trans": 1, "v_el": 4}, "v_el_size"),
        ({"n_stream": 0}, "n_stream"),
        ({"n_stream": 1000}, "n_stream"),
        ({"seq": -1}, "seq_id"),
        ({"seq": 256}, "seq_id"),
    ],
)
def test_field_checks(over: dict, field: str) -> None:
    blob, kw = _kv_blob(**over)
    with pytest.raises(FormatError) as ei:
        S.load(blob, **kw)
    assert ei.value.field == field, ei.value


def test_field_checks_baseline_is_valid() -> None:
    blob, kw = _kv_blob()
    assert S.load(blob, **kw).to_bytes() == blob
    blob, kw = _kv_blob(v_trans=1)
    assert S.load(blob, **kw).to_bytes() == blob


def test_arch_breaks_the_kv_recurrent_tie() -> None:
    """A pre-#14363 KV section and a recurrent section have the same shape; the arch string decides."""
    blob = (FIXTURES / "session_v9_outputs_no_n_stream.bin").read_bytes()
    obj = S.load(blob, kind="session", layout="kv", outputs=True, n_stream_field=False)
    as_llama = S.StateBlob("llama", obj.outputs, obj.memory).to_bytes()
    assert S.load(as_llama).memory.layout == "kv"
    as_mamba = S.StateBlob("mamba", obj.outputs, obj.memory).to_bytes()
    back = S.load(as_mamba)
    assert back.memory.layout == "recurrent" and back.to_bytes() == as_mamba
    # a reading can always be forced
    assert S.load(as_mamba, layout="kv").memory.layout == "kv"


def test_writer_refuses_inconsistent_objects() -> None:
    obj = make("session", "kv", 0)
    obj.memory.sections[0].streams[0].data.k[0].data = np.zeros((1, 3), np.uint8)
    with pytest.raises(FormatError) as ei:
        obj.to_bytes()
    assert ei.value.field == "k_data"
    obj = make("session", "kv", 0)
    obj.memory.layout = "iswa"
    with pytest.raises(FormatError) as ei:
        obj.to_bytes()
    assert ei.value.field == "layout"


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (lambda o: setattr(o, "version", "10"), "version", "expected an integer, got str"),
        (lambda o: setattr(o, "arch", b"llama"), "arch", "expected a str, got bytes"),
        (lambda o: setattr(o.memory.sections[0], "streams", None), "n_stream", "cannot compute it from the record"),
        (lambda o: o.memory.sections[0].streams.append(object()), "KVStream", "expected a KVStream, got object"),
        (lambda o: setattr(o.memory.sections[0].streams[0], "cells", [1, 2]), "cell_count", "cannot compute it"),
        (lambda o: setattr(o.memory.sections[0].streams[0].data, "k", 3), "n_layer", "cannot compute it"),
        (lambda o: setattr(o, "tokens", None), "tokens", "not an array of int32"),
        (lambda o: setattr(o, "tokens", [[1]]), "tokens", "expected a 1-D array"),
        (lambda o: setattr(o.memory.sections[0].streams[0].data.k[0], "data", [b"x"]), "k_data", "expected a NumPy"),
        (lambda o: setattr(o, "memory", {}), "memory", "expected MemorySections, got dict"),
    ],
)
def test_writer_names_the_field_of_a_value_of_the_wrong_type(edit, field: str, message: str) -> None:
    # objects are plain dataclasses a user may edit: a wrong type is a FormatError naming the field, not a crash
    obj = make("session", "kv", 0)
    edit(obj)
    with pytest.raises(FormatError, match=message) as ei:
        obj.to_bytes()
    assert ei.value.field == field


def test_empty_and_tiny_inputs() -> None:
    for blob in (b"", b"\x01", b"ggs", b"\xff" * 7):
        with pytest.raises(FormatError) as ei:
            S.load(blob)
        assert ei.value.field in FIELDS


def test_all_fixture_errors_use_the_vocabulary() -> None:
    for meta in MANIFEST.values():
        if meta["expect"] != "ok":
            assert meta["field"] in FIELDS


def test_every_case_has_a_fixture_free_round_trip() -> None:
    assert len(CASES) > 30


def test_rows_with_an_impossible_row_size_is_a_format_error():
    # zero cells times a u64 row size near 2**64: no array has that shape, the reader must refuse the file
    # (found by test_state_fuzz on a mutated session file)
    from kvref.state.codec import Reader
    from kvref.state.dsl import Rows

    with pytest.raises(FormatError, match="too large"):
        Rows("k_data", lambda env: (0, 2**64 - 1)).read(Reader(b""), {})


def test_a_lying_layer_count_is_refused_before_any_walk() -> None:
    """12 bytes claiming 2**31 - 1 layers once made the PLE layer scan loop forever; llama.cpp models have at
    most LLAMA_MAX_LAYERS layers, so the count is refused before anything walks over it (child process: a
    regression fails by timeout instead of hanging the run)."""
    import os
    import subprocess
    import sys

    code = (
        "import struct, kvref.state as S\n"
        "from kvref.errors import FormatError\n"
        "try:\n"
        "    S.load(struct.pack('<III', 0, 0, 0x7FFFFFFF), kind='seq_state', layout='recurrent',"
        " seq_header=False, ple=True)\n"
        "except FormatError as e:\n"
        "    print(e.field, e.offset, e)\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the installed kvref, not a checkout's kvref/ in cwd
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("n_layer 8 n_layer 2147483647 exceeds LLAMA_MAX_LAYERS (512)")


def test_a_model_file_is_recognised() -> None:
    gguf_file = Path(__file__).resolve().parent.parent / "conformance" / "models" / "llama-tiny.gguf"
    with pytest.raises(FormatError, match=re.escape("this is a GGUF model file, not a llama.cpp state")) as e:
        S.load(gguf_file)
    assert (e.value.field, e.value.offset) == ("magic", 0)


@pytest.mark.parametrize(
    ("data", "field", "text"),
    [
        (b"hello, a text file\n", "magic", "not a llama.cpp state: it starts with 68 65 6c 6c"),
        (b"ggxx" + bytes(40), "magic", "a state starts with the magic 'ggsn' (0x6767736e, session file)"),
        (struct.pack("<II", 0xAF143CD9, 0) + bytes(16), "io_magic", "starts with 0xaf143cd8"),
        (struct.pack("<III", 0x67677371, 10, 0) + bytes(8), "magic", "version 10 is a session file ('ggsn') version"),
    ],
)
def test_a_wrong_start_names_what_was_expected(data: bytes, field: str, text: str) -> None:
    with pytest.raises(FormatError, match=re.escape(text)) as e:
        S.load(data)
    assert (e.value.field, e.value.offset) == (field, 0)


def test_bundled_invalid_files_blame_their_field_without_hints() -> None:
    """Auto-detection reports the faulty field of (nearly) every bundled invalid file that needs no model."""
    root = Path(__file__).resolve().parent.parent / "conformance" / "invalid"
    entries = [e for e in json.loads((root / "manifest.json").read_text())["files"] if not e["needs_hparams"]]
    wrong = []
    for e in entries:
        try:
            S.load(root / e["file"])
            wrong.append(f"{e['file']}: accepted")
        except FormatError as x:
            if x.field not in {e["field"], *e.get("also_accept", [])}:
                wrong.append(f"{e['file']}: {x.field}")
    # the two left: a gemma2 session without its SWA section reads as a plain KV session (nothing in the bytes
    # says iSWA), and a sequence file whose trailing bytes a misaligned reading explains as a cell_count
    assert sorted(wrong) == ["iswa-missing-swa-section.ggsn: accepted", "seq-trailing-bytes.ggsq: cell_count"]


def test_readings_that_mean_the_same_empty_state_load() -> None:
    """A sequence file of an emptied sequence, as llama-cpp-python 0.3.16 writes it for a Mamba model: KV (no
    n_stream field) and recurrent readings both parse and both mean "nothing"; load picks one and says so."""
    data = struct.pack("<IIII", 0x67677371, 2, 0, 0) + struct.pack("<II", 0, 2)
    data += struct.pack("<iQ", 0, 768) * 2 + struct.pack("<iQ", 0, 2048) * 2  # R rows, then S rows: sizes differ
    obj = S.load(data)
    assert obj.memory.layout == "recurrent" and obj.to_bytes() == data
    assert obj.note is not None and "none holds a cell" in obj.note and "layout=kv" in obj.note
    assert S.load(data, layout="kv").memory.layout == "kv"  # the caller can pin the other reading
