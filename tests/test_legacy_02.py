"""Session version 8 (llama.cpp of July-August 2024, llama-cpp-python 0.2.84 .. 0.2.90): read, write back, detect,
upgrade.

The goldens ``conformance/golden/legacy-0.2.90-*`` were written by llama-cpp-python 0.2.90 built from source
(conformance/generate_legacy.py); every expected value here comes from those files and the case.json llama.cpp's
run wrote beside them, never from kvref. The live tests load the upgraded files into the installed
llama-cpp-python (0.3.36) and compare what it saves again with kvref's bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from golden import observed_ranges, sequence_ranges

import kvref
from kvref import state
from kvref.errors import ConversionError, FormatError
from kvref.state.eras import CURRENT, matching_eras, to_era

ROOT = Path(__file__).resolve().parent.parent / "conformance"
GOLDEN = ROOT / "golden"
# session version 8 (0.2.84 .. 0.2.90); the version 7 goldens of 0.2.83 are test_legacy_v7.py's
CASES = sorted(
    p.name
    for p in GOLDEN.glob("legacy-0.2.*")
    if (p / "case.json").exists() and json.loads((p / "case.json").read_text())["producer"]["session_version"] == 8
)
KINDS = {"session": "session", "seq": "seq", "state_data": "state", "seq_data": "seq_state"}


def _case(cid: str) -> dict[str, Any]:
    return json.loads((GOLDEN / cid / "case.json").read_text())


def _saves(cid: str) -> list[tuple[int, dict[str, Any]]]:
    return [(i, op) for i, op in enumerate(_case(cid)["trace"]) if op["op"] == "save" and op["ret"]]


ARTEFACTS = [pytest.param(cid, i, op, id=f"{cid}/{op['file']}") for cid in CASES for i, op in _saves(cid)]


def _path(cid: str, op: dict[str, Any]) -> Path:
    return GOLDEN / cid / op["file"]


def _layout(op: dict[str, Any]) -> str:
    return str(op["layout"])


def _positions(obj: state.StateObject) -> list[list[int]]:
    """Every section's cell positions, in file order."""
    out = []
    for sec in obj.memory.sections:
        parts = sec.streams if isinstance(sec, state.KVSection) else [sec]
        out.append([int(p) for part in parts if part.cells is not None for p in part.cells.pos])
    return out


def test_goldens_exist_and_name_their_producer() -> None:
    assert CASES, "no legacy-0.2.* goldens"
    for cid in CASES:
        prod = _case(cid)["producer"]
        assert prod["llama_cpp_python"].startswith("0.2.")
        assert (prod["session_version"], prod["seq_version"]) == (8, 2)
        assert prod["rng"] is True and prod["output_block"] is True and prod["n_stream_field"] is False


@pytest.mark.parametrize(("cid", "i", "op"), ARTEFACTS)
def test_reads_with_auto_detection_and_writes_back(cid: str, i: int, op: dict[str, Any]) -> None:
    path = _path(cid, op)
    raw = path.read_bytes()
    assert len(raw) == op["size"]
    obj = state.load(path)
    assert obj.kind == KINDS[op["kind"]]
    assert obj.memory.layout == _layout(op)
    assert obj.to_bytes() == raw
    if op["header"] is not None and "version" in op["header"]:
        assert obj.version == op["header"]["version"]  # type: ignore[attr-defined]
        assert [int(t) for t in obj.tokens] == op["tokens"]  # type: ignore[attr-defined]
    if obj.kind in ("session", "state"):
        assert obj.arch == op["arch"]  # type: ignore[attr-defined]
        assert obj.rng is not None  # type: ignore[attr-defined]
        assert obj.outputs is not None  # type: ignore[attr-defined]
    if op["scope"] == "context":
        assert sequence_ranges(obj) == observed_ranges(op)
    else:
        assert set(sequence_ranges(obj)) <= {op["seq_id"]} or obj.memory.layout == "recurrent"


@pytest.mark.parametrize(("cid", "i", "op"), ARTEFACTS)
def test_reads_with_the_layout_given(cid: str, i: int, op: dict[str, Any]) -> None:
    path = _path(cid, op)
    kind = KINDS[op["kind"]]
    opts: dict[str, Any] = {"n_stream_field": False, "ext_size": 0}
    if kind in ("session", "state"):
        opts["outputs"] = True
    if kind == "seq_state":
        opts["seq_header"] = False
    obj = state.load(path, kind, _layout(op), **opts)
    assert obj.to_bytes() == path.read_bytes()
    assert obj.to_bytes() == state.load(path).to_bytes()


@pytest.mark.parametrize("cid", CASES)
def test_rng_is_the_seeded_generator(cid: str) -> None:
    """llama.cpp writes its std::mt19937 as text; no sampling ran, so it is the generator of the context's seed."""
    from kvref.state.legacy import rng_text

    seed = _case(cid)["producer"]["rng_seed"]
    for _, op in _saves(cid):
        if op["kind"] in ("session", "state_data"):
            raw = _path(cid, op).read_bytes()
            text = rng_text(seed).encode()
            assert struct.pack("<I", len(text)) + text in raw
            assert state.load(_path(cid, op)).rng == text.decode()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("cid", "i", "op"), ARTEFACTS)
def test_detected_era(cid: str, i: int, op: dict[str, Any]) -> None:
    eras = matching_eras(state.load(_path(cid, op)))
    if op["kind"] in ("session", "state_data"):  # the rng string: 2024-08 only
        assert eras == ["2024-08"]
    elif op["layout"] == "kv":  # a KV sequence save without seq ids: 0.3.0 .. 0.3.9 write the same bytes
        assert eras == ["2024-08", "2024-09"]
    else:  # a recurrent sequence save is the same bytes up to 0.3.14 (no seq id there either)
        assert eras[:3] == ["2024-08", "2024-09", "2025-07"]


def test_summary_and_inspect_name_the_era() -> None:
    from kvref.jobs.cli_jobs import enrich_summary

    cid = CASES[0]
    op = next(op for _, op in _saves(cid) if op["kind"] == "session")
    obj = state.load(_path(cid, op))
    summary = enrich_summary(obj.summary(), obj, op["size"])
    assert summary["version"] == 8
    from kvref.state.legacy import rng_text

    assert summary["rng"] == {"bytes": len(rng_text(_case(cid)["producer"]["rng_seed"]))}
    assert summary["eras"] == [{"era": "2024-08", "llama_cpp_python": "0.2.84 .. 0.2.90"}]
    assert kvref.state.eras.era("0.2.90").name == "2024-08"


@pytest.mark.parametrize(("cid", "i", "op"), ARTEFACTS)
def test_upgrade_then_back(cid: str, i: int, op: dict[str, Any], tmp_path: Path) -> None:
    """Upgraded, the state has the current layout (version 10/3, n_stream, no rng, no output block) and the same
    cells and rows; written back in its own era it is the original file, but for the rng of a fresh generator."""
    path = _path(cid, op)
    out = tmp_path / "up"
    up = kvref.convert(path, out, arch="llama")  # a sequence save names no arch; the writer's decides the ext
    assert matching_eras(state.load(out))[-1] == CURRENT
    if op["kind"] in ("session", "seq"):
        assert matching_eras(state.load(out)) == [CURRENT]  # a file says its version; a blob does not
    orig = state.load(path)
    assert _positions(up) == _positions(orig)
    if op["scope"] == "context":
        assert sequence_ranges(up) == sequence_ranges(orig)
    elif orig.memory.layout == "kv":
        # 2024 writes no seq id into a sequence save's KV cells; llama.cpp since 2025 writes one and requires it
        assert all(not len(st.cells.seq_id) for st in orig.memory.kv_sections[0].streams if st.cells is not None)
        assert set(sequence_ranges(up)) == {0}
    raw = path.read_bytes()
    assert to_era(state.load(path), "2024-08").to_bytes() == raw
    back = to_era(state.load(out), "2024-08")
    if op["kind"] in ("session", "state_data"):
        orig = state.load(path)
        back.rng = orig.rng  # type: ignore[attr-defined]
        back.outputs = orig.outputs  # type: ignore[attr-defined]  # the output block is not carried forward
    assert back.to_bytes() == raw


def test_kv_sequence_save_restores_as_its_llama_cpp_restores_it() -> None:
    """A memory with the 2024 profile (``for_llama_cpp_python("0.2.90")``) restores the 2024 blob, whose KV cells
    list no seq id, and refuses one whose cells list one, as that llama.cpp does; a 2025 memory the other way
    round. Either lands at the positions the 2024 llama.cpp reported."""
    from kvref.compat import profile_2024
    from kvref.jobs import conformance as C

    cid = "legacy-0.2.90-llama-shared-prefix"
    case = _case(cid)
    op = next(op for _, op in _saves(cid) if op["kind"] == "seq_data" and op["seq_id"] == 1)
    obj = state.load(_path(cid, op))
    with_ids = to_era(obj, "2025-07", seq_id=1).to_bytes()
    mem = C.create_memory_for(case, C.hparams_from_case(case))  # the replay's profile, without the warning
    assert mem.profile == profile_2024() and not mem.profile.kv_seq_save_ids
    with pytest.raises(FormatError) as e:
        mem.state_read(with_ids, seq_id=1)
    assert e.value.field == "n_seq_id"
    mem.state_read(obj.to_bytes(), seq_id=1)
    assert mem.seq_pos_max(1) == observed_ranges(op)[1][1]
    assert mem.state_write(seq_id=1) == obj.to_bytes()  # written back as that llama.cpp wrote it
    hp = C.hparams_from_case(case)
    new = kvref.create_memory(hp, n_ctx=256, n_seq_max=3, kv_unified=True, flash_attn=False, compat="2025-07")
    with pytest.raises(FormatError):
        new.state_read(obj.to_bytes(), seq_id=1)
    new.state_read(with_ids, seq_id=1)
    assert new.seq_pos_max(1) == observed_ranges(op)[1][1]


def test_negative_controls() -> None:
    cid = CASES[0]
    op = next(op for _, op in _saves(cid) if op["kind"] == "session")
    raw = bytearray(_path(cid, op).read_bytes())
    # versions 7 .. 5 (llama.cpp before July 2024) are another layout, which needs the model (test_legacy_v7.py);
    # older versions are refused on their version
    for v in (7, 6, 5):
        with pytest.raises(FormatError) as e:
            state.load(bytes(raw[:4]) + struct.pack("<I", v) + bytes(raw[8:]))
        assert e.value.field == "version"
        assert f"session file of version {v}" in str(e.value) and "needs the model" in str(e.value)
    v4 = bytes(raw[:4]) + struct.pack("<I", 4) + bytes(raw[8:])
    with pytest.raises(FormatError) as e:
        state.load(v4)
    assert e.value.field == "version"
    assert "older than kvref reads (5, given the model: llama-cpp-python 0.2.67)" in str(e.value)
    # the same bytes called version 9 do not parse: the rng string is no output block
    with pytest.raises(FormatError):
        state.load(bytes(raw[:4]) + struct.pack("<I", 9) + bytes(raw[8:]))
    # a damaged rng string is named
    obj = state.load(bytes(raw))
    at = obj.offsets["rng"] + 4
    bad = bytes(raw[:at]) + b"x" + bytes(raw[at + 1 :])
    with pytest.raises(FormatError) as e:
        state.load(bad, "session")
    assert e.value.field == "rng"
    # a v9 session never carries an rng string, so writing one refuses
    obj.version = 9  # type: ignore[attr-defined]
    with pytest.raises(FormatError) as e:
        obj.to_bytes()
    assert e.value.field == "rng"


def test_state_blob_without_rng_is_not_2024() -> None:
    """Detection of a blob's rng looks at the bytes: the same blob with the rng string cut out reads as 0.3.0's
    (and 0.3.12's: a state blob of one stream is the same bytes in both)."""
    cid = CASES[0]
    op = next(op for _, op in _saves(cid) if op["kind"] == "state_data")
    obj = state.load(_path(cid, op))
    assert matching_eras(obj) == ["2024-08"]
    obj.rng = None  # type: ignore[attr-defined]
    again = state.load(obj.to_bytes())
    assert again.rng is None  # type: ignore[attr-defined]
    assert matching_eras(again) == ["2024-09", "2025-07"]


def test_empty_current_state_cannot_go_back() -> None:
    """An empty attention section of 2024 carries the cache's layer headers; a current empty one does not."""
    cid = CASES[0]
    op = next(op for _, op in _saves(cid) if op["kind"] == "session")
    obj = to_era(state.load(_path(cid, op)), CURRENT)
    for sec in obj.memory.kv_sections:
        sec.streams = [state.KVStream(None, None)]
    with pytest.raises(ConversionError):
        to_era(obj, "2024-08")


# ------------------------------------------------------------------------------------------- live (0.3.36)


def _live() -> Any:
    try:
        import llama_cpp
    except Exception as exc:  # not installed, or broken
        pytest.skip(f"llama_cpp cannot be imported ({type(exc).__name__}: {exc}): the live tests need it")
    return llama_cpp


LIVE = [
    pytest.param(cid, i, op, id=f"{cid}/{op['file']}", marks=pytest.mark.live)
    for cid in CASES
    for i, op in _saves(cid)
    if op["kind"] in ("session", "seq")
]


@pytest.mark.parametrize(("cid", "i", "op"), LIVE)
def test_upgraded_file_loads_in_current_llama_cpp(cid: str, i: int, op: dict[str, Any], tmp_path: Path) -> None:
    """llama.cpp 0.3.36 loads the upgraded file, holds the positions the 2024 llama.cpp reported, and saves it
    again byte for byte as kvref wrote it."""
    L = _live()
    from _llama_live import Ctx

    case = _case(cid)
    c = case["context"]
    up, again = tmp_path / "up", tmp_path / "again"
    if op["kind"] == "session":
        kvref.convert(_path(cid, op), up)
    else:  # the KV cells get the id of the sequence restored into (2024 wrote none; llama.cpp ignores its value)
        state.save(to_era(state.load(_path(cid, op)), CURRENT, seq_id=op["seq_id"]), up)
    with Ctx(ROOT / case["model"]["path"], n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], kv_unified=True,
             flash_attn=c["flash_attn"]) as ctx:  # fmt: skip
        arr = (L.llama_token * max(len(op["tokens"]), 1))(*op["tokens"])
        if op["kind"] == "session":
            assert ctx.load_session(up) == op["tokens"]
            assert {s: ctx.pos_max(s) for s in observed_ranges(op)} == {
                s: hi for s, (_, hi) in observed_ranges(op).items()
            }
            assert L.llama_state_save_file(ctx.ctx, str(again).encode(), arr, len(op["tokens"]))
        else:
            dest = op["seq_id"]
            assert ctx.load_seq(up, dest) == op["tokens"]
            assert ctx.pos_max(dest) == observed_ranges(op)[dest][1]
            assert L.llama_state_seq_save_file(ctx.ctx, str(again).encode(), dest, arr, len(op["tokens"])) > 0
    assert again.read_bytes() == up.read_bytes()
