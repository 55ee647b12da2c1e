"""deepseek4's memory (llama_kv_cache_dsv4, kvref.memory.kv_cache_dsv4) and its draft context's iSWA cache.

Expected values come from the goldens llama.cpp 0.3.36 wrote (conformance/golden/deepseek4-*: its memory log, its
hyper-parameters, its state files) or from reading llama_kv_cache_dsv4 (src/llama-kv-cache-dsv4.cpp), never from
the code under test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from golden import ROOT, load_case

import kvref
from kvref import state
from kvref.errors import ArgumentError, FormatError, SequenceError
from kvref.jobs import conformance as C
from kvref.memory.factory import create_memory
from kvref.memory.kv_cache_dsv4 import KVCacheDSV4
from kvref.memory.kv_cache_iswa import KVCacheISWA

DSV4_CASES = ["deepseek4-dsv4-single-seq", "deepseek4-dsv4-multiseq", "deepseek4-dsv4-rollback"]
pytestmark = pytest.mark.skipif(not (ROOT / "golden" / DSV4_CASES[0]).is_dir(), reason="no deepseek4 goldens")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deepseek4-tiny.gguf written by conformance/tinymodels.py (too large to commit; the same bytes every time)."""
    sys.path.insert(0, str(ROOT))
    import tinymodels  # type: ignore[import-not-found]

    m = tinymodels.build_deepseek4(tmp_path_factory.mktemp("dsv4"))
    assert m.sha256 == load_case(DSV4_CASES[0])["model"]["sha256"]  # the model the goldens were written with
    assert m.path is not None
    return m.path


def _hp(model: Path) -> kvref.HParams:
    return kvref.HParams.from_gguf(model)


def test_from_gguf_reads_what_llama_cpp_loaded(model: Path) -> None:
    case = load_case(DSV4_CASES[0])
    hp, rec, om = _hp(model), case["model"]["hparams"], case["observed_model"]
    assert hp.dsv4_compress_ratios == tuple(rec["dsv4_compress_ratios"]) == (0, 4, 128, 0)
    assert hp.indexer_head_size == rec["indexer_head_size"]
    assert hp.n_layer_trunk() == om["n_layer"]  # llama_model_n_layer: the trunk
    assert int(hp.rope_type) == om["rope_type"]
    assert [hp.is_swa(il) for il in range(hp.n_layer)] == rec["swa_layers"]  # MTP blocks too
    assert hp.is_hybrid_arch() == om["is_hybrid"]


@pytest.mark.parametrize("cid", [*DSV4_CASES, "deepseek4-mtp-iswa"])
def test_create_memory_builds_llama_cpps_caches(model: Path, cid: str) -> None:
    """Kinds, streams, sizes and attention-rotation flags of every cache, as llama.cpp logged them."""
    case = load_case(cid)
    mem = C.create_memory_for(case, _hp(model))
    C.check_memory_shape(case, mem)
    caches = case["observed_context"]["memory_log"]["caches"]
    if cid.endswith("mtp-iswa"):
        assert isinstance(mem, KVCacheISWA)
        parts = [mem.base, mem.swa]
    else:
        assert isinstance(mem, KVCacheDSV4)
        parts = [mem.raw.base, mem.raw.swa, *mem.comp_caches]
    assert [len(p.layers) for p in parts] == [c["layers"] for c in caches]
    assert [p.get_size() for p in parts] == [c["cells"] for c in caches]
    assert [p.get_n_stream() for p in parts] == [c.get("n_stream", 1) for c in caches]
    assert [p.attn_rot_k for p in parts] == [c["attn_rot_k"] for c in caches]
    assert mem.get_can_shift() == case["observed_context"]["memory_can_shift"]


def _mem(model: Path, **kw: object) -> KVCacheDSV4:
    args: dict = {"n_ctx": 256, "n_seq_max": 2, "flash_attn": True, **kw}
    mem = create_memory(_hp(model), **args)
    assert isinstance(mem, KVCacheDSV4)
    return mem


def _decode(mem: KVCacheDSV4, seq: int, n: int) -> None:
    p = mem.seq_pos_max(seq) + 1
    mem.decode(kvref.Batch(tokens=list(range(5, 5 + n)), pos=list(range(p, p + n)), seq_ids=[[seq]] * n))


def test_sequence_ops_follow_llama_kv_cache_dsv4(model: Path) -> None:
    mem = _mem(model)
    _decode(mem, 0, 10)
    # seq_pos_min reports the last position: nothing before it can be rolled back to
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (9, 9)
    assert (mem.seq_pos_min(1), mem.seq_pos_min(7)) == (-1, -1)
    assert mem.seq_rm(0, 2, 5) is False  # a bounded range
    assert mem.seq_rm(0, 20, -1) is True  # past the end: nothing to remove
    assert mem.seq_rm(0, 5, -1) is False  # inside the sequence, no rollback room (n_rs_seq 0)
    assert mem.seq_pos_max(0) == 9
    before = mem.state_write()
    with pytest.raises(ArgumentError, match="full sequence"):
        mem.seq_cp(0, 1, 0, 4)  # GGML_ASSERT(p0 <= 0 && p1 < 0)
    with pytest.raises(SequenceError):
        mem.seq_keep(2)  # GGML_ASSERT(seq_id < n_seq_max)
    assert mem.state_write() == before
    assert mem.seq_rm(0, -1, -1) is True
    assert mem.seq_pos_max(0) == -1


def test_rollback_is_armed_once(model: Path) -> None:
    mem = _mem(model, n_rs_seq=2)
    _decode(mem, 0, 14)
    assert mem.seq_rm(0, 11, -1) is False  # 3 positions: more than n_rs_seq
    assert mem.seq_rm(0, 13, -1) is True  # the last one: rollback 1
    assert mem.seq_rm(0, 12, -1) is False  # a pending rollback does not stack
    assert mem.seq_pos_max(0) == 12
    assert mem.rs_idx == [1, 0]
    _decode(mem, 0, 1)  # the decode consumes it
    assert mem.rs_idx == [0, 0]


def test_seq_cp_copies_the_states_at_the_next_update(model: Path) -> None:
    mem = _mem(model)
    _decode(mem, 0, 9)
    mem.csa_state.kv[1][0] = 1.5  # stream 0's state (a graph output in llama.cpp)
    mem.csa_state.kv[1][1] = 7.0
    mem.seq_cp(0, 1, -1, -1)
    assert (mem.csa_state.kv[1][1] == 0).all()  # the destination is cleared at once
    mem.update()
    assert (mem.csa_state.kv[1][1] == 1.5).all()


@pytest.mark.parametrize("cid", DSV4_CASES)
def test_goldens_read_back_byte_for_byte_and_restore(cid: str, model: Path) -> None:
    case = load_case(cid)
    for op in C.save_ops(case).values():
        f = ROOT / "golden" / cid / op["file"]
        obj = state.load(f)
        assert obj.memory.layout == "dsv4"
        assert obj.to_bytes() == f.read_bytes()
        if op["kind"] != "seq_data":
            continue
        mem = C.create_memory_for(case, _hp(model))
        assert isinstance(mem, KVCacheDSV4)
        blob = state.section_bytes(*obj.memory.sections)
        mem.state_read(blob, op["seq_id"], op["flags"])
        assert mem.state_write(op["seq_id"], op["flags"]) == blob


def test_a_restore_with_the_wrong_flags_or_magic_changes_nothing(model: Path) -> None:
    case = load_case("deepseek4-dsv4-single-seq")
    op = next(o for o in C.save_ops(case).values() if o["kind"] == "seq_data" and o["flags"] == 1)
    blob = state.section_bytes(*state.load(ROOT / "golden" / case["id"] / op["file"]).memory.sections)
    mem = _mem(model, n_seq_max=1)
    _decode(mem, 0, 6)
    before = mem.state_write()
    with pytest.raises(FormatError) as e:
        mem.state_read(blob, 0, 0)  # a PARTIAL_ONLY section read without the flag: "DSV4 state flags mismatch"
    assert e.value.field == "dsv4_mode"
    bad = bytearray(blob)
    bad[0] ^= 0xFF
    with pytest.raises(FormatError) as e:
        mem.state_read(bytes(bad), 0, 1)
    assert e.value.field == "dsv4_magic"
    assert mem.state_write() == before


def test_inspect_labels_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.cli import main

    f = ROOT / "golden" / "deepseek4-dsv4-multiseq" / "04-seqdata-seq0.bin"
    assert main(["inspect", "--json", str(f)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == "dsv4"
    assert [s["label"] for s in doc["sections"]] == [
        "DSV4 raw base attention KV (no layer)",
        "DSV4 raw SWA attention KV",
        "DSV4 CSA (ratio 4) compressed K",
        "DSV4 HCA (ratio 128) compressed K",
        "DSV4 lightning-indexer (ratio 4) compressed K",
        "DSV4 CSA (ratio 4) compressor state",
        "DSV4 HCA (ratio 128) compressor state",
        "DSV4 lightning-indexer (ratio 4) compressor state",
    ]
    # seq 0 at position 21 when saved: (21 + 1) // 4 = 5 CSA / indexer rows, no HCA row yet
    assert [s["n_rows"] for s in doc["sections"][2:5]] == [5, 0, 5]
    assert np.all([s["n_stream"] == 1 for s in doc["sections"][2:]])


@pytest.mark.parametrize("pos", [1027, 2000, 2**31 - 1])
def test_positions_past_the_compressed_rows_are_refused(model: Path, pos: int) -> None:
    """llama.cpp 0.3.36 dies decoding them (fuzz campaign, n_ctx 256: 256 CSA / indexer rows): 1027 and 2000 see more
    than 256 rows (GGML_ASSERT(n_lid <= indexer_k->ne[2]) in src/models/deepseek4.cpp), INT32_MAX completes row
    536870911 (GGML_ASSERT(i1 >= 0 && i1 < ne1) in ggml-cpu's set_rows); 1023 (row 255) decodes."""
    mem = _mem(model)
    _decode(mem, 1, 3)
    before = mem.state_write()
    with pytest.raises(kvref.errors.KVRefError, match="asserts"):
        mem.decode(kvref.Batch(tokens=[5], pos=[pos], seq_ids=[[0]]))
    assert mem.state_write() == before
    mem.seq_rm(0, -1, -1)
    mem.decode(kvref.Batch(tokens=[5], pos=[1023], seq_ids=[[0]]))
    assert mem.seq_pos_max(0) == 1023


def test_a_restore_into_a_sequence_past_n_seq_max_is_refused(model: Path) -> None:
    """n_seq_max 1: the section reads, then GGML_ASSERT((uint32_t) seq_id < n_seq_max) kills llama.cpp (fuzz)."""
    mem = _mem(model, n_seq_max=1)
    _decode(mem, 0, 5)
    blob = mem.state_write(0, 1)
    before = mem.state_write()
    with pytest.raises(SequenceError, match="asserts"):
        mem.state_read(blob, 255, 1, atomic=False)
    assert mem.state_write() == before


def test_jobs_restore_check_and_tensors_read_a_dsv4_state_and_convert_refuses(model: Path) -> None:
    from kvref.errors import NotYetImplemented
    from kvref.jobs import check, convert, tensors

    f = ROOT / "golden" / "deepseek4-dsv4-multiseq" / "04-seqdata-seq0.bin"
    r = kvref.restore(f, model=model)
    assert isinstance(r.memory, KVCacheDSV4)
    assert r.memory.seq_pos_max(0) == 21  # what llama.cpp observed when it saved (case.json)
    ok = check.check_file(f, model, n_seq_max=2, flash_attn=True)
    assert ok.ok, ok.reason
    with pytest.raises(NotYetImplemented):
        convert.convert(f, seq_map={0: 1})
    ts = tensors.state_tensors(f, model=model)  # tensors / export read it (tests/test_tensors_dsv4.py)
    assert [t.part for t in ts.compressed] == ["csa", "hca", "lid"] and len(ts.comp_states) == 3


def test_inspect_and_export_with_the_model_label_every_part(model: Path, capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:  # fmt: skip
    """``kvref inspect --model``: the raw SWA layers get their model layer, the compressed parts keep the layers the
    file records (no note: the model fits); ``kvref export --model`` names every part."""
    from kvref.jobs.cli import main

    f = ROOT / "golden" / "deepseek4-dsv4-multiseq" / "02-state.bin"
    assert main(["inspect", "--json", "--model", str(model), str(f)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert "note" not in s
    swa = s["sections"][1]
    assert [layer["il"] for st in swa["streams"] for layer in st.get("layers", [])][:4] == [0, 1, 2, 3]
    assert main(["export", "--model", str(model), str(f), str(tmp_path / "x.npz")]) == 0
    with np.load(tmp_path / "x.npz") as z:
        assert list(z["kv.1.s0.layer"]) == [0, 1, 2, 3]
        assert {"dsv4.csa.2.s1.l0.k", "dsv4.hca.3.s1.l0.k", "dsv4.lid.4.s1.l0.k"} <= set(z.files)
        assert list(z["dsv4.hca.3.layer"]) == [2] and list(z["dsv4.lid_state.7.layer"]) == [1]


def test_save_memory_writes_the_sequence_file_llama_cpp_wrote(model: Path, tmp_path: Path) -> None:
    case = load_case("deepseek4-dsv4-single-seq")
    op = next(o for o in C.save_ops(case).values() if o["kind"] == "seq")
    f = ROOT / "golden" / case["id"] / op["file"]
    mem = C.create_memory_for(case, _hp(model))
    assert isinstance(mem, KVCacheDSV4)
    sec = state.load(f).memory.sections
    mem.state_read(state.section_bytes(*sec), 0)
    out = tmp_path / "seq0.ggsq"
    kvref.save_memory(mem, out, kind="seq", seq_id=0, tokens=op["tokens"])
    assert out.read_bytes() == f.read_bytes()
    n = mem.state_size(0)
    buf = bytearray(n)
    assert mem.state_write_into(buf, 0) == n and bytes(buf) == mem.state_write(0)


def test_the_loaders_sniff_confirms_a_dsv4_sections_cell_tables() -> None:
    """`kvref.state.load` checks the cell tables its sniff assumed uniform against where the parser read them: a
    DSV4 section's are its raw KV sections' (a fuzz trace of deepseek4-rs met it)."""
    import importlib

    load_mod = importlib.import_module("kvref.state.load")
    obj = state.load(ROOT / "golden" / "deepseek4-dsv4-multiseq" / "04-seqdata-seq0.bin")
    tables = load_mod._tables_read([obj])
    n_cells = sorted(t[2] for t in tables)
    assert n_cells == [8, 22]  # seq 0 at position 21: 22 base cells, the last 8 in the SWA cache (window 8)


def test_the_first_decode_after_a_shift_is_refused(model: Path) -> None:
    """llama.cpp 0.3.36 dies in it (GGML_ASSERT(buffer) in ggml-backend.cpp: the K-shift input of the raw iSWA's base
    cache, which has no layer, gets no buffer; seen with the tiny model: 10 tokens, seq_add(0, 0, -1, 2), 1 token)."""
    mem = _mem(model, n_seq_max=1)
    _decode(mem, 0, 10)
    mem.seq_add(0, 0, -1, 2)
    before = mem.state_write()
    with pytest.raises(kvref.errors.KShiftError):
        _decode(mem, 0, 1)
    assert mem.state_write() == before


def test_diff_names_the_compressed_part_that_differs():
    # a DSV4 section's compressed K rows and compressor states have no cells: diff compares each as a whole
    from kvref.jobs.diff import diff

    path = ROOT / "golden" / "deepseek4-dsv4-single-seq" / "01-session.ggsn"
    raw = bytearray(path.read_bytes())
    obj = state.load(bytes(raw))
    hca = obj.memory.sections[0].k_caches[1]
    assert hca.name == "hca"
    t = hca.layers[0][1]
    assert t.rows * t.row_size > 0
    # the block: i32 type, u64 ne0, u64 rows, u64 row size (28 bytes), then the rows (docs/state-format.md)
    raw[t.offset + 28] ^= 0x01
    got = diff(path.read_bytes(), bytes(raw))
    assert [(d.what, d.section) for d in got.differences] == [("hca K rows", 0)]
    assert got.first_byte == t.offset + 28
    assert diff(path, path).differences == []
