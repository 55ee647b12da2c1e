"""Session versions 7, 6 and 5 and sequence version 1 (llama.cpp before July 2024, llama-cpp-python 0.2.83, 0.2.82
and 0.2.67): read (a session given the model), written back byte for byte, upgraded.

The goldens ``conformance/golden-v7/legacy-0.2.83-*`` (session v7), ``legacy-0.2.82-*`` (v6) and ``legacy-0.2.67-*``
(v5; both on stablelm-rot32-tiny: those releases load neither tiny llama) were written by those releases built from
source (conformance/generate_legacy.py); every expected value here comes from those files and the case.json llama.cpp's
run wrote beside them, never from kvref. The live tests load the upgraded sessions and
sequence files into the installed llama-cpp-python (0.3.36) and compare what it saves again with kvref's bytes.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from golden import observed_ranges, sequence_ranges

import kvref
from kvref import state
from kvref.compat import CompatWarning, for_llama_cpp_python
from kvref.errors import ArgumentError, ConversionError, FormatError
from kvref.hparams import HParams
from kvref.jobs.cli import main as cli_main
from kvref.state.eras import CURRENT, era, matching_eras, to_era
from kvref.state.legacy import HPARAMS_SIZES

ROOT = Path(__file__).resolve().parent.parent / "conformance"
# not golden/: `kvref conformance` and the tests that walk golden/ read artefacts without a model, which version 7
# needs; the conformance checks run on them here, given the model
GOLDEN = ROOT / "golden-v7"
KINDS = {"session": "session", "state_data": "state"}
CASE_FILE = "case.json"
CASES = sorted(p.name for p in GOLDEN.glob("legacy-*") if (p / CASE_FILE).exists())
# the raw-KV releases of the goldens, their session version and era
RELEASES = {"0.2.67": (5, "2024-05"), "0.2.82": (6, "2024-06"), "0.2.83": (7, "2024-07")}
# a blob or sequence save names no session version: 6 and 7 write the same blobs, 5 its own (no v_trans field), and
# all three the same sequence saves (V transposed)
RAW_KV_ERAS = ["2024-05", "2024-06", "2024-07"]


def _case(cid: str) -> dict[str, Any]:
    return json.loads((GOLDEN / cid / CASE_FILE).read_text())


def _model(cid: str) -> Path:
    return ROOT / _case(cid)["model"]["path"]


def _release(cid: str) -> str:
    return str(_case(cid)["producer"]["llama_cpp_python"])


def _version(cid: str) -> int:
    return RELEASES[_release(cid)][0]


def _eras(cid: str, kind: str) -> list[str]:
    """The eras an artefact of the case matches: its release's for a session, as the comment on RAW_KV_ERAS says
    otherwise."""
    if kind == "session":
        return [RELEASES[_release(cid)][1]]
    if kind == "state_data":
        return ["2024-05"] if _version(cid) == 5 else ["2024-06", "2024-07"]
    return RAW_KV_ERAS


def _first(release: str) -> str:
    """The first case of a release's goldens."""
    return next(c for c in CASES if _release(c) == release)


def _saves(cid: str) -> list[dict[str, Any]]:
    """The session files and state blobs the case saved (the v7 context states)."""
    return [op for op in _case(cid)["trace"] if op["op"] == "save" and op["ret"] and op["kind"] in KINDS]


ARTEFACTS = [pytest.param(cid, op, id=f"{cid}/{op['file']}") for cid in CASES for op in _saves(cid)]
SEQ_SAVES = [
    pytest.param(cid, op, id=f"{cid}/{op['file']}")
    for cid in CASES
    for op in _case(cid)["trace"]
    if op["op"] == "save" and op["ret"] and op["kind"] in ("seq", "seq_data")
]
SESSIONS = [p for p in ARTEFACTS if p.values[1]["kind"] == "session"]  # type: ignore[index]


def _path(cid: str, op: dict[str, Any]) -> Path:
    return GOLDEN / cid / op["file"]


def _session(cid: str) -> tuple[dict[str, Any], bytes]:
    op = next(op for op in _saves(cid) if op["kind"] == "session")
    return op, _path(cid, op).read_bytes()


def test_goldens_exist_and_name_their_producer() -> None:
    assert {_release(c) for c in CASES} == set(RELEASES), "a release's legacy goldens are missing"
    for cid in CASES:
        prod = _case(cid)["producer"]
        assert cid.startswith(f"legacy-{prod['llama_cpp_python']}-")
        assert (prod["session_version"], prod["seq_version"]) == (_version(cid), 1)
        _, raw = _session(cid)
        assert struct.unpack_from("<II", raw) == (0x6767736E, _version(cid))


@pytest.mark.parametrize(("cid", "op"), ARTEFACTS)
def test_without_the_model_the_error_says_what_to_pass(cid: str, op: dict[str, Any]) -> None:
    with pytest.raises(FormatError) as e:
        state.load(_path(cid, op))
    msg = str(e.value)
    assert "needs the model" in msg and "model=" in msg and "--model" in msg
    if op["kind"] == "session":
        assert f"session file of version {_version(cid)}" in msg and _release(cid) in msg
    else:
        assert "state blob of session version 5, 6 or 7" in msg


@pytest.mark.parametrize(("cid", "op"), ARTEFACTS)
def test_reads_with_the_model_and_writes_back(cid: str, op: dict[str, Any]) -> None:
    path = _path(cid, op)
    raw = path.read_bytes()
    assert len(raw) == op["size"]
    obj = state.load(path, model=_model(cid))
    assert obj.kind == KINDS[op["kind"]]
    assert obj.to_bytes() == raw
    assert obj.arch == op["arch"]  # type: ignore[attr-defined]
    assert obj.rng is not None and obj.outputs is not None  # type: ignore[attr-defined]
    if op["kind"] == "session":
        assert obj.version == _version(cid)  # type: ignore[attr-defined]
        assert len(obj.hparams_raw) == HPARAMS_SIZES[_version(cid)]  # type: ignore[attr-defined]
        assert [int(t) for t in obj.tokens] == op["tokens"]  # type: ignore[attr-defined]
    assert sequence_ranges(obj) == observed_ranges(op)
    assert matching_eras(obj) == _eras(cid, op["kind"])
    assert obj.raw_kv.v_trans_field == (_version(cid) > 5)  # type: ignore[attr-defined]
    raw_kv = obj.raw_kv  # type: ignore[attr-defined]
    mem = _case(cid)["memory"]
    assert (raw_kv.kv_size, bool(raw_kv.v_trans)) == (mem["kv_size"], mem["v_trans"])
    ctx = _case(cid)["context"]
    (st,) = obj.memory.kv_sections[0].streams
    assert st.data is not None
    assert {x.type_name for x in st.data.k} == {ctx["type_k"]} and {x.type_name for x in st.data.v} == {ctx["type_v"]}
    # the hparams object reads the same bytes
    again = state.load(raw, model=HParams.from_gguf(_model(cid)))
    assert again.to_bytes() == raw


@pytest.mark.parametrize(("cid", "op"), ARTEFACTS)
def test_upgrade(cid: str, op: dict[str, Any], tmp_path: Path) -> None:
    """The upgraded state holds the same cells (those with a sequence) and rows; it reads back without a model."""
    up = tmp_path / "up"
    obj = state.load(_path(cid, op), model=_model(cid))
    out = kvref.convert(_path(cid, op), up, model=_model(cid))
    # a blob carries no version: the later layouts without the output block read alike
    assert matching_eras(out) == [CURRENT] if op["kind"] == "session" else CURRENT in matching_eras(out)
    back = state.load(up)
    assert back.to_bytes() == up.read_bytes() == out.to_bytes()
    assert sequence_ranges(back) == observed_ranges(op)
    raw = obj.raw_kv  # type: ignore[attr-defined]
    used = np.flatnonzero(raw.cells.n_seq_id > 0)
    (st,) = back.memory.kv_sections[0].streams
    assert st.cells is not None and st.data is not None
    assert list(st.cells.pos) == [int(raw.cells.pos[i]) for i in used]
    for mine, theirs in zip(st.data.k, raw.k, strict=True):
        assert np.array_equal(mine.data, theirs.data[used])
    for mine, theirs in zip(st.data.v, raw.v, strict=True):
        cols = theirs.data.reshape(theirs.n_embd, raw.kv_head, theirs.el_size)[:, used, :]
        assert np.array_equal(mine.data.reshape(cols.shape), cols)


@pytest.mark.parametrize("release", RELEASES)
def test_cli_needs_and_takes_the_model(release: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cid = _first(release)
    op, _ = _session(cid)
    src, up = str(_path(cid, op)), str(tmp_path / "up.ggsn")
    assert cli_main(["convert", src, up]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli_main(["convert", src, up, "--model", str(_model(cid))]) == 0
    assert "2026-10" in capsys.readouterr().out
    assert state.load(up).version == 10  # type: ignore[attr-defined]
    assert cli_main(["inspect", src, "--model", str(_model(cid)), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    name = RELEASES[release][1]
    assert summary["eras"] == [{"era": name, "llama_cpp_python": era(name).releases}]
    # kvref check reads it with the model it is given, and its fix passes the model on
    assert cli_main(["check", src, "--model", str(_model(cid))]) == 1
    out = capsys.readouterr().out
    assert f"session file version {_version(cid)}" in out and "kvref convert FILE OUT --model MODEL --to-era" in out
    # diff and export read it with the model too (without it: the error that asks for it)
    assert cli_main(["diff", src, src]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli_main(["diff", src, up, "--model", str(_model(cid))]) == 1  # the upgrade dropped the output block
    capsys.readouterr()
    from kvref.jobs.export import export_arrays

    arrays, _meta = export_arrays(src, model=_model(cid))
    assert arrays and all(a.size for a in arrays.values())


@pytest.mark.parametrize("cid", CASES)
def test_conformance_checks_with_the_model(cid: str) -> None:
    """`kvref conformance`'s checks on the version-5 .. 7 goldens, their artefacts read with the model: parse (byte for
    byte), replay (cells at every save), graph (llama.cpp's captured masks and positions: rows padded to 32 from
    0.2.82, not in 0.2.67) and restore; under the profile of 2025 (sequence saves with seq ids) the replay fails."""
    import kvref.jobs.conformance as C

    case = _case(cid)
    assert C.has_graph_inputs(case)
    assert C.kq_mask_pad(case) == (1 if _release(cid) == "0.2.67" else 32)  # their ggml.h's GGML_KQ_MASK_PAD
    for check in (C.check_parse, C.check_replay, C.check_graph, C.check_restore):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)
            check(ROOT, case, C.Artefacts(ROOT, case, "golden-v7", C.hparams_from_case(case)))
    later = {**case, "producer": {**case["producer"], "llama_cpp_python": "0.3.12"}}
    with pytest.raises(C.CheckFailed, match="seq ids"):
        C.check_replay(ROOT, later, C.Artefacts(ROOT, later, "golden-v7", C.hparams_from_case(case)))


@pytest.mark.parametrize("release", RELEASES)
def test_era_and_compat(release: str) -> None:
    version, name = RELEASES[release]
    assert era(release).session_version == version and era(release).name == name
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        prof = for_llama_cpp_python(release)
    assert prof.kv_seq_save_ids is False  # 2024's sequence saves (the goldens replay with it, below)
    assert any(issubclass(x.category, CompatWarning) and f"version {version}" in str(x.message) for x in w)
    cid = _first(release)
    obj = state.load(_path(cid, _session(cid)[0]), model=_model(cid))
    with pytest.raises(ConversionError, match=f"does not write the {name} layout"):
        to_era(obj, release)
    v8 = to_era(obj, "2024-08")  # the 2024-08 layout holds the same state, with the same rng string
    assert state.load(v8.to_bytes()).rng == obj.rng  # type: ignore[attr-defined]


def test_raw_kv_releases() -> None:
    """0.2.58 .. 0.2.67 vendor session version 5, 0.2.68 .. 0.2.82 version 6, 0.2.83 version 7 (read in their
    llama.h: 0.2.57 has 4, 0.2.67 5, 0.2.68 6)."""
    names = [era(r).name for r in ("0.2.58", "0.2.62", "0.2.67", "0.2.68", "0.2.75", "0.2.82", "0.2.83")]
    assert names == ["2024-05"] * 3 + ["2024-06"] * 3 + ["2024-07"]
    for unchecked in ("0.2.62", "0.2.75"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert for_llama_cpp_python(unchecked).kv_seq_save_ids is False
        assert any("no golden checks it" in str(x.message) for x in w)
    with pytest.warns(CompatWarning, match="older than"):
        assert for_llama_cpp_python("0.2.57").kv_seq_save_ids is True  # version 4: not read


@pytest.mark.parametrize("release", RELEASES)
def test_wrong_model_is_named(release: str) -> None:
    """A model of other widths: a clear error naming the mismatching hparams (session) or the KV size (blob)."""
    cid = _first(release)
    op, _ = _session(cid)
    wrong = ROOT / "models" / "qwen3-tiny.gguf"
    with pytest.raises(FormatError) as e:
        state.load(_path(cid, op), model=wrong)
    assert e.value.field == "hparams" and "wrong model" in str(e.value)
    blob = next(o for o in _saves(cid) if o["kind"] == "state_data")
    with pytest.raises(FormatError) as e:
        state.load(_path(cid, blob), model=wrong)
    assert e.value.field == "kv_buf_size" and "wrong model?" in str(e.value)
    # a recurrent model's 2024 states (in K and V) are not read: no golden pins them
    with pytest.raises(FormatError, match="'recurrent'"):
        state.load(_path(cid, op), model=ROOT / "models" / "mamba-tiny.gguf")
    with pytest.raises(ArgumentError, match="GGUF path or an HParams"):
        state.load(_path(cid, op), model=3)


@pytest.mark.parametrize("release", RELEASES)
def test_hostile_headers(release: str) -> None:
    """Lying counts and cut files: a FormatError naming the field and its offset, before any allocation."""
    cid = _first(release)
    version = _version(cid)
    op, raw = _session(cid)
    model = HParams.from_gguf(_model(cid))
    at_ntok = 8 + HPARAMS_SIZES[version]
    n_tok = struct.unpack_from("<I", raw, at_ntok)[0]
    assert n_tok == len(op["tokens"])  # the hparams struct: 6308 bytes in 0.2.83, 3236 in 0.2.82

    def err(b: bytes) -> FormatError:
        with pytest.raises(FormatError) as e:
            state.load(b, model=model)
        return e.value

    e = err(raw[:at_ntok] + struct.pack("<I", 0xFFFFFFF0) + raw[at_ntok + 4 :])
    assert (e.field, e.offset) == ("n_token_count", at_ntok + 4) and "count 4294967280" in str(e)
    obj = state.load(raw, model=model)
    kv_at = len(raw) - _kv_tail(obj)
    e = err(raw[:kv_at] + struct.pack("<Q", 1 << 60) + raw[kv_at + 8 :])
    assert (e.field, e.offset) == ("kv_buf_size", kv_at)
    e = err(raw[: kv_at + 8] + struct.pack("<I", 1 << 30) + raw[kv_at + 12 :])
    assert (e.field, e.offset) == ("kv_head", kv_at + 8)
    for cut in (len(raw) - 1, kv_at + 3, 40):
        e = err(raw[:cut])
        assert e.field is not None and e.offset is not None
    e = err(raw + b"\0")
    assert (e.field, e.offset) == ("trailing", len(raw))
    with pytest.raises(FormatError, match=r"version 4 is older than kvref reads \(5, given the model"):
        state.load(raw[:4] + struct.pack("<I", 4) + raw[8:], model=model)
    # another raw-KV version: its hparams size puts the token count elsewhere
    for other in {5, 6, 7} - {version}:
        e = err(raw[:4] + struct.pack("<I", other) + raw[8:])
        assert e.field in ("rng_size", "n_token_count", "tokens", "hparams") and e.offset is not None
    e = err(raw[:at_ntok] + struct.pack("<I", n_tok - 1) + raw[at_ntok + 4 :])  # the rng is then 4 bytes later
    assert (e.field, e.offset) == ("rng_size", at_ntok + 4 * n_tok)


def test_blob_without_v_trans_is_version_5s() -> None:
    """A 0.2.82 state blob (V transposed) without its v_trans field is what 0.2.67 writes for the same cache: it reads
    as version 5's, with the same cells and rows; with a v_trans of 2 it is nothing llama.cpp writes."""
    cid = _first("0.2.82")
    op = next(o for o in _saves(cid) if o["kind"] == "state_data")
    raw = _path(cid, op).read_bytes()
    obj = state.load(raw, model=_model(cid))
    at = len(raw) - _kv_tail(obj) + 20  # the u32 v_trans after kv_buf_size, kv_head, kv_size, kv_used
    assert struct.unpack_from("<I", raw, at)[0] == 1
    v5 = state.load(raw[:at] + raw[at + 4 :], model=_model(cid))
    assert matching_eras(v5) == ["2024-05"] and matching_eras(obj) == ["2024-06", "2024-07"]
    assert v5.to_bytes() == raw[:at] + raw[at + 4 :]
    (a,), (b,) = obj.memory.kv_sections[0].streams, v5.memory.kv_sections[0].streams
    assert a.cells is not None and b.cells is not None and a.data is not None and b.data is not None
    assert list(a.cells.pos) == list(b.cells.pos)
    assert all(
        np.array_equal(x.data, y.data) for x, y in zip([*a.data.k, *a.data.v], [*b.data.k, *b.data.v], strict=True)
    )
    with pytest.raises(FormatError):
        state.load(raw[:at] + struct.pack("<I", 2) + raw[at + 4 :], model=_model(cid))


def _kv_tail(obj: state.StateObject) -> int:
    """Bytes from kv_buf_size to the end of a v7 state (its KV header, rows and cells)."""
    raw = obj.raw_kv  # type: ignore[attr-defined]
    cells = 12 * raw.cells.n + 4 * len(raw.cells.seq_id)
    return (24 if raw.v_trans_field else 20) + raw.kv_buf_size + cells


@pytest.mark.parametrize(("cid", "op"), SEQ_SAVES)
def test_sequence_v1_reads_without_the_model_and_writes_back(cid: str, op: dict[str, Any]) -> None:
    """Sequence version 1 names its layer types and row sizes: no model needed. Its cells carry no seq id."""
    path = _path(cid, op)
    raw = path.read_bytes()
    obj = state.load(path)
    assert obj.kind == ("seq" if op["kind"] == "seq" else "seq_state")
    assert obj.to_bytes() == raw
    assert matching_eras(obj) == RAW_KV_ERAS
    if op["kind"] == "seq":
        assert obj.version == 1  # type: ignore[attr-defined]
        assert [int(t) for t in obj.tokens] == op["tokens"]  # type: ignore[attr-defined]
    (st,) = obj.memory.kv_sections[0].streams
    assert st.cells is not None and len(st.cells.seq_id) == 0
    assert (int(st.cells.pos.min()), int(st.cells.pos.max())) == observed_ranges(op)[op["seq_id"]]
    assert st.data is not None and bool(st.data.v_trans) == _case(cid)["memory"]["v_trans"]
    # the same cells and rows as the session saved beside it holds for the sequence
    trace = _case(cid)["trace"]
    ctx_op = next(o for o in reversed(trace[: trace.index(op)]) if o["op"] == "save" and o["kind"] == "session")
    whole = state.load(_path(cid, ctx_op), model=_model(cid))
    one = kvref.convert(whole, seq=op["seq_id"])
    (mine,) = one.memory.kv_sections[0].streams
    assert mine.cells is not None and mine.data is not None
    assert list(mine.cells.pos) == list(st.cells.pos)
    for a, b in zip([*mine.data.k, *mine.data.v], [*st.data.k, *st.data.v], strict=True):
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize("release", RELEASES)
def test_sequence_v1_hostile(release: str) -> None:
    cid = _first(release)
    op = next(o for o in _case(cid)["trace"] if o["op"] == "save" and o["kind"] == "seq")
    raw = _path(cid, op).read_bytes()
    at = 12 + 4 * len(op["tokens"])  # size_t_size
    with pytest.raises(FormatError) as e:
        state.load(raw[:at] + struct.pack("<I", 4) + raw[at + 4 :])
    assert (e.value.field, e.value.offset) == ("size_t_size", at)
    with pytest.raises(FormatError) as e:
        state.load(raw[: at + 4] + struct.pack("<I", 1 << 31) + raw[at + 8 :])
    assert e.value.field == "cell_count"
    with pytest.raises(FormatError) as e:
        state.load(raw[:-1])
    assert e.value.field is not None and e.value.offset is not None


# ------------------------------------------------------------------------------------------- live (0.3.36)


def _live() -> Any:
    try:
        import llama_cpp
    except Exception as exc:  # not installed, or broken
        pytest.skip(f"llama_cpp cannot be imported ({type(exc).__name__}: {exc}): the live tests need it")
    return llama_cpp


LIVE = [pytest.param(*p.values, id=p.id, marks=pytest.mark.live) for p in SESSIONS]


@pytest.mark.parametrize(("cid", "op"), LIVE)
def test_upgraded_session_loads_in_current_llama_cpp(cid: str, op: dict[str, Any], tmp_path: Path) -> None:
    """llama.cpp 0.3.36 loads the upgraded session, holds the positions 0.2.67 .. 0.2.83 reported, and saves it again
    byte for byte as kvref wrote it."""
    L = _live()
    from _llama_live import Ctx

    case = _case(cid)
    c = case["context"]
    up, again = tmp_path / "up", tmp_path / "again"
    assert cli_main(["convert", str(_path(cid, op)), str(up), "--model", str(_model(cid))]) == 0
    with Ctx(_model(cid), n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], kv_unified=True,
             flash_attn=c["flash_attn"]) as ctx:  # fmt: skip
        arr = (L.llama_token * max(len(op["tokens"]), 1))(*op["tokens"])
        assert ctx.load_session(up) == op["tokens"]
        assert {s: ctx.pos_max(s) for s in observed_ranges(op)} == {s: hi for s, (_, hi) in observed_ranges(op).items()}
        assert L.llama_state_save_file(ctx.ctx, str(again).encode(), arr, len(op["tokens"]))
    assert again.read_bytes() == up.read_bytes()


@pytest.mark.live
@pytest.mark.parametrize("cid", [c for c in CASES if c.endswith("f16-single-seq")])
def test_upgraded_cache_computes_what_the_writer_computed(cid: str, tmp_path: Path) -> None:
    """The rows, not only the layout: llama.cpp 0.3.36 decodes the next token on the upgraded cache and gets the
    logits 0.2.83 / 0.2.82 / 0.2.67 got for it (the output block of the session it saved next); on an empty cache it
    does not."""
    _live()
    from _llama_live import Ctx

    case = _case(cid)
    c = case["context"]
    first, last = (op for op in _saves(cid) if op["kind"] == "session")
    assert last["tokens"][:-1] == first["tokens"]  # one more token decoded between the two saves
    then = state.load(_path(cid, last), model=_model(cid)).outputs  # type: ignore[attr-defined]
    assert then is not None and len(then.output_pos) == 1
    up = tmp_path / "up"
    kvref.convert(_path(cid, first), up, model=_model(cid))
    n = len(first["tokens"])
    with Ctx(_model(cid), n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], flash_attn=c["flash_attn"]) as ctx:
        ctx.load_session(up)
        got = ctx.decode([last["tokens"][-1]], seq=0, start=n)
    np.testing.assert_allclose(got, then.logits, rtol=1e-3, atol=1e-3)
    with Ctx(_model(cid), n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], flash_attn=c["flash_attn"]) as ctx:
        alone = ctx.decode([last["tokens"][-1]], seq=0, start=n)
    assert not np.allclose(alone, then.logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("cid", "op"), [pytest.param(*p.values, id=p.id, marks=pytest.mark.live) for p in SEQ_SAVES if "seq-" in p.id]
)
def test_upgraded_sequence_file_loads_in_current_llama_cpp(cid: str, op: dict[str, Any], tmp_path: Path) -> None:
    """llama.cpp 0.3.36 restores the upgraded sequence file (its cells get the id restored into), holds the
    positions 0.2.67 .. 0.2.83 reported, and saves it again byte for byte as kvref wrote it."""
    L = _live()
    from _llama_live import Ctx

    c = _case(cid)["context"]
    up, again = tmp_path / "up", tmp_path / "again"
    state.save(to_era(state.load(_path(cid, op)), CURRENT, seq_id=op["seq_id"]), up)
    with Ctx(_model(cid), n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], kv_unified=True,
             flash_attn=c["flash_attn"]) as ctx:  # fmt: skip
        dest = op["seq_id"]
        assert ctx.load_seq(up, dest) == op["tokens"]
        assert ctx.pos_max(dest) == observed_ranges(op)[dest][1]
        arr = (L.llama_token * max(len(op["tokens"]), 1))(*op["tokens"])
        assert L.llama_state_seq_save_file(ctx.ctx, str(again).encode(), dest, arr, len(op["tokens"])) > 0
    assert again.read_bytes() == up.read_bytes()
